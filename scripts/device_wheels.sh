#!/usr/bin/env bash
# Fetches, on a machine with network, the wheels `scripts/device_check.sh` installs on the GPU
# machine (which has no network and lacks only these among what the checked paths import), into
# .device-wheels/ (git-ignored; carry it with the working tree: well under its 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p .device-wheels
# gguf: the model loader imports it (pure Python; the version setup.sh installs here)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .device-wheels \
  "gguf==$("$PY" -c 'from importlib.metadata import version; print(version("gguf"))')"
du -sh .device-wheels
