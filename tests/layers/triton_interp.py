"""The device of the Triton kernel tests (tests/layers/test_triton_*.py): CUDA, compiled, when
OASISKV_TEST_DEVICE is cuda; else the CPU under Triton's interpreter. A fixture they import (a
conftest.py here would shadow tests/conftest.py, which other tests import as `conftest`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

INTERPRETER_RUNNER = "tests/layers/test_triton_interpreter.py"


def _index_fix(interpreter, mp: pytest.MonkeyPatch) -> None:
    """numpy >= 2.4 refuses int() of a 1-element array, which Triton 3.6's interpreter does for
    a loop bound read at run time (triton-lang/triton#9171, fixed upstream by #9172 after 3.6):
    its patch of tensor.__index__, applied again as upstream has it."""
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(())))

    mp.setattr(interpreter, "_patch_lang_tensor", patched)


@pytest.fixture(scope="module")
def triton_device(test_device):
    """Where the kernel tests run, by OASISKV_TEST_DEVICE (`test_device`): on CUDA, the kernels
    compiled, on CUDA tensors; on the CPU (the default), Triton's interpreter on CPU tensors.
    triton.jit reads TRITON_INTERPRET when a function is defined, triton's own library
    included, and torch imports triton early (torch._dynamo), so the variable must be set when
    the process starts: in a plain CPU run these tests skip and `test_triton_interpreter.py`
    runs them in a child process that sets it. On CUDA nothing skips (a GPU run that tested
    nothing would read as a pass): no triton, or the interpreter on, fails them."""
    device = torch.device(test_device)
    if device.type == "cuda":
        try:
            import triton.language as tl
            from triton.runtime import interpreter
        except ImportError as e:
            pytest.fail(f"OASISKV_TEST_DEVICE={test_device}: triton does not import ({e})",
                        pytrace=False)
        if isinstance(tl.zeros, interpreter.InterpretedFunction):
            pytest.fail(f"OASISKV_TEST_DEVICE={test_device} with TRITON_INTERPRET=1 would test "
                        "the interpreter, not the compiled kernels: unset TRITON_INTERPRET",
                        pytrace=False)
        yield device
        return
    if device.type != "cpu":
        pytest.fail(f"OASISKV_TEST_DEVICE={test_device}: the Triton kernels run on CUDA (or "
                    "interpreted on the CPU)", pytrace=False)
    pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs "
                                         "triton==3.6.0, the GPU machine's)")
    import triton.language as tl
    from triton.runtime import interpreter

    if not isinstance(tl.zeros, interpreter.InterpretedFunction):
        pytest.skip(f"needs TRITON_INTERPRET=1 from the process start: {INTERPRETER_RUNNER} "
                    "runs these tests so")
    with pytest.MonkeyPatch.context() as mp:
        if hasattr(interpreter, "_patch_lang_tensor"):
            _index_fix(interpreter, mp)
        yield device
