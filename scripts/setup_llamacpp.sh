#!/usr/bin/env bash
# Builds llama-cpp-python (the CPU peer of `bench throughput --peer llamacpp`) from source into
# .venv: a native build (-march=native) without ggml's AMX code, since llama.cpp's AMX matmul
# segfaults on any decode on AMX CPUs such as Sapphire Rapids (ggml-org/llama.cpp#20824).
# -DGGML_AMX_*=OFF alone does not help: -march=native still defines __AMX_INT8__, which is what
# compiles the AMX backend in; explicit -mno-amx-* win over -march=native in either order.
# About 4-6 minutes on 2 cores. Idempotent: .venv/llama-cpp-build.txt records the version and
# flags of the installed build, and a build without it (or with other flags) is rebuilt, never
# taken from pip's wheel cache (which may hold a crashing build).
# Run scripts/setup.sh first (it creates .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}
[ -x .venv/bin/python ] || { echo "error: no .venv; run scripts/setup.sh first" >&2; exit 1; }
PY=.venv/bin/python

cmake_args="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
-DGGML_AMX_BF16=OFF"
no_amx=""
case "$(uname -m)" in
  x86_64|amd64|i?86)  # only x86 compilers know these; one too old to know them emits no AMX
    if echo 'int main(void){return 0;}' | ${CC:-cc} -x c -mno-amx-tile -mno-amx-int8 \
        -mno-amx-bf16 -o /dev/null - 2>/dev/null; then
      no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi ;;
esac
marker=.venv/llama-cpp-build.txt
want="llama-cpp-python==$LLAMA_CPP_VERSION CMAKE_ARGS=$cmake_args C/CXX flags=$no_amx"

installed_ok() {
  [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ] || return 1
  # the installed version, and the library's own word on what it was built with: never AMX
  "$PY" -c "import llama_cpp as l, sys; sys.exit(l.__version__ != '$LLAMA_CPP_VERSION'
or b'AMX_INT8 = 1' in l.llama_print_system_info())" 2>/dev/null
}

if installed_ok; then
  exit 0
fi
rm -f "$marker"
echo "building llama-cpp-python $LLAMA_CPP_VERSION (native, no AMX; minutes)" >&2
# CFLAGS/CXXFLAGS initialise CMake's CMAKE_C_FLAGS/CMAKE_CXX_FLAGS; appended to the caller's
CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx" \
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="$cmake_args" \
  "$PY" -m pip install -q --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==$LLAMA_CPP_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
if "$PY" -c "import importlib.metadata as m; m.version('llama-cpp-python')" 2>/dev/null; then
  # its few pure-Python dependencies, where missing (the build above is kept: it is satisfied)
  "$PY" -m pip install -q "llama-cpp-python==$LLAMA_CPP_VERSION" 2>&1 \
    | grep -v "^WARNING: Location" || true
fi
if "$PY" -c "import llama_cpp" 2>/dev/null; then
  echo "$want" > "$marker"
  installed_ok || { echo "error: the llama-cpp-python build has AMX on" >&2; exit 1; }
  "$PY" -c "import llama_cpp; print('llama.cpp:', llama_cpp.llama_print_system_info().decode())"
else
  echo "note: llama-cpp-python did not build; --peer llamacpp and its test need it" >&2
fi
