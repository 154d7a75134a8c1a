#!/usr/bin/env bash
# Installs Mooncake (the remote KV tier's multi-machine backend) into .venv: the Debian verbs/RDMA-CM
# runtime libraries its shared objects link against, and the CPU-only wheel, which ships both the
# `mooncake.store` Python client and the `mooncake_master` binary (as a .venv/bin entry point).
# Idempotent: installs only what is missing. Run scripts/setup.sh first (it creates .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: the version oasiskv/disagg was written and tested against (API and error codes).
MOONCAKE_VERSION=${MOONCAKE_VERSION:-0.3.13.post1}

missing=()
for pkg in libibverbs1 librdmacm1; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    # apt's debconf notes go to stderr; its exit status still stops this script on failure.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null 2>/tmp/setup_mooncake.apt.log \
      || { cat /tmp/setup_mooncake.apt.log >&2; exit 1; }
  else
    echo "error: install ${missing[*]} (sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

[ -x .venv/bin/python ] || { echo "error: no .venv; run scripts/setup.sh first" >&2; exit 1; }
have=$(.venv/bin/python -c "import importlib.metadata as m
try: print(m.version('mooncake-transfer-engine-non-cuda'))
except m.PackageNotFoundError: print('')")
if [ "$have" != "$MOONCAKE_VERSION" ]; then
  .venv/bin/pip install -q "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" 2>&1 \
    | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "from mooncake.store import MooncakeDistributedStore" \
  || { echo "error: mooncake.store does not import" >&2; exit 1; }
[ -x .venv/bin/mooncake_master ] || { echo "error: .venv/bin/mooncake_master missing" >&2; exit 1; }
echo "mooncake-transfer-engine-non-cuda $MOONCAKE_VERSION ready (.venv/bin/mooncake_master)"
