"""The Triton kernels' tests (tests/layers/test_triton_*.py), run in a child process with
TRITON_INTERPRET=1 set from its start (see `triton_interpreter` in triton_interp.py): on CPU
tensors, against their PyTorch references."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs "
                                     "triton==3.6.0, the GPU machine's)")

HERE = Path(__file__).parent
FILES = ["test_triton_decode.py", "test_triton_gather.py"]


@pytest.mark.parametrize("name", FILES)
def test_kernels_under_the_interpreter(name):
    # the interpreter runs them on CPU tensors, whatever device this run tests (on CUDA the
    # files run compiled in this process too)
    env = dict(os.environ, TRITON_INTERPRET="1", OASISKV_TEST_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(HERE / name)], env=env, capture_output=True, text=True,
                          cwd=HERE.parents[1], timeout=600)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
    assert done.returncode == 0, tail
    assert " passed" in tail and " skipped" not in tail, tail  # they ran, none skipped
