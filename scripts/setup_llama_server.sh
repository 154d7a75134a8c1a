#!/usr/bin/env bash
# Builds llama.cpp's own C++ HTTP server, `llama-server` (the peer of `oasiskv bench serve
# --servers llama-server`), from the llama.cpp sources vendored in llama-cpp-python's source
# distribution (the same llama.cpp as scripts/setup_llamacpp.sh's library), into
# .venv/llama-server/bin/llama-server. Not the Python wrapper's `llama_cpp.server`, which serves
# one request at a time: this one has parallel slots and continuous batching (-np N -cb).
# Native (-march=native) without ggml's AMX code, as scripts/setup_llamacpp.sh explains
# (llama.cpp's AMX matmul segfaults on AMX CPUs, ggml-org/llama.cpp#20824). Static, no web UI,
# no OpenSSL: a loopback benchmark needs neither. Only the llama-server target is built.
# About 20 minutes on 2 shared cores, so scripts/setup.sh does not run it. Idempotent: the marker
# .venv/llama-server/build.txt records the version and flags of the binary beside it.
# VENV=/path/to/venv puts it in another venv (the one whose python runs `oasiskv`).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || { echo "error: no $VENV; run scripts/setup.sh first" >&2; exit 1; }
PY=$VENV/bin/python
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama-server" >&2
                                     exit 1; }
done

cmake_args="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"
no_amx=""
case "$(uname -m)" in
  x86_64|amd64|i?86)  # only x86 compilers know these; one too old to know them emits no AMX
    if echo 'int main(void){return 0;}' | ${CC:-cc} -x c -mno-amx-tile -mno-amx-int8 \
        -mno-amx-bf16 -o /dev/null - 2>/dev/null; then
      no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi ;;
esac
dest=$VENV/llama-server
marker=$dest/build.txt
want="llama-cpp-python==$LLAMA_CPP_VERSION vendor/llama.cpp llama-server CMAKE_ARGS=$cmake_args \
C/CXX flags=$no_amx"

if [ -x "$dest/bin/llama-server" ] && [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
  exit 0
fi
rm -f "$marker"
work=$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "downloading llama-cpp-python $LLAMA_CPP_VERSION's source distribution" >&2
"$PY" -m pip download -q --no-binary :all: --no-deps -d "$work" \
  "llama-cpp-python==$LLAMA_CPP_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
tar -xzf "$work"/llama_cpp_python-"$LLAMA_CPP_VERSION".tar.gz -C "$work"
src=$work/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp
[ -f "$src/tools/server/CMakeLists.txt" ] || { echo "error: no tools/server in $src" >&2; exit 1; }
echo "building llama-server (native, no AMX; about 20 minutes on 2 cores)" >&2
# shellcheck disable=SC2086  # cmake_args is a list of flags
CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx" \
  cmake -S "$src" -B "$work/build" $cmake_args >"$work/configure.log" 2>&1 \
  || { tail -30 "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log" >&2; exit 1; }
if command -v objdump >/dev/null && objdump -d "$work/build/bin/llama-server" \
    | grep -qE "\s(tdpb[a-z]*|tileloadd|ldtilecfg)\s"; then  # AMX tile instructions
  echo "error: the llama-server build has AMX code" >&2; exit 1
fi
mkdir -p "$dest/bin"
install -m 755 "$work/build/bin/llama-server" "$dest/bin/llama-server"
echo "$want" > "$marker"
"$dest/bin/llama-server" --version 2>&1 | head -2
echo "installed $dest/bin/llama-server" >&2
