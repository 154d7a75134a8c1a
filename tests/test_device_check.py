"""scripts/device_check.sh, the prepared GPU check, run on the CPU at toy sizes: every step
runs under its limit and leaves its results (status, log, JSON, plot, trace) in OUTDIR, and the
throughput table holds dense and sparse at dense's maximum concurrency. Only its plumbing can
be checked here; what it measures needs a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_device_check_runs_every_step_on_a_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, DEVICE="cpu", PY=sys.executable, MODEL="random:tiny", CONTEXT="256",
               LONG_CONTEXT="", BUDGET="192KiB", OUTPUT_LEN="4", CONC="dense-max", TOP_K="4",
               TESTS="", INSTALL="0", TOTAL_S="900",
               LIMIT_SCALE="4")  # a shared 2-core CPU, not a GPU
    done = subprocess.run(["bash", "scripts/device_check.sh", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    status = {p.stem: p.read_text() for p in out.glob("*.status")}
    assert set(status) == {"environment", "throughput-256", "pipeline"}, status
    assert all("rc=0" in s for s in status.values()), status
    rows = json.loads((out / "throughput-256.json").read_text())["rows"]
    assert {r["mode"] for r in rows} == {"dense", "sparse"}, rows
    assert all(r["failed"] == 0 and r["tps"] > 0 for r in rows), rows
    assert json.loads((out / "pipeline.json").read_text())
    assert (out / "throughput-256.png").stat().st_size and (out / "pipeline-trace.json").exists()
    assert "random weights" in (out / "throughput-256.log").read_text()
