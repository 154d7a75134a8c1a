"""An object in a child process (`oasiskv.bench.isolated`): its methods' results come back, its
errors come back as ValueError / RuntimeError, and a child killed by a signal (a native
library's segfault) raises ChildCrashed naming the signal while this process goes on."""

import collections
import os
import signal

import pytest

from oasiskv.bench.isolated import ChildCrashed, Isolated, crash_message


def test_calls_run_in_the_child_and_errors_come_back():
    child = Isolated("counter", collections.Counter, "abracadabra")
    try:
        assert child.pid != os.getpid()
        assert child.call("most_common", 2) == [("a", 5), ("b", 2)]
        assert child.call("update", "aaa") is None
        assert child.call("most_common", 1) == [("a", 8)]  # state kept between calls
        with pytest.raises(RuntimeError, match="counter: AttributeError: .*no_such"):
            child.call("no_such")
        assert child.call("total") == 14  # an error leaves the child serving
    finally:
        child.close()
    with pytest.raises(ValueError, match="invalid literal for int"):  # the factory's own error
        Isolated("int", int, "seven")


def test_a_killed_child_raises_the_signal_and_others_go_on(no_core_dumps):
    child = Isolated("crashy", collections.Counter, "ab")
    os.kill(child.pid, signal.SIGSEGV)  # what a segfault in native code does to the child
    with pytest.raises(ChildCrashed, match=r"^crashy crashed: signal 11 \(SIGSEGV\)$"):
        child.call("most_common")
    with pytest.raises(ChildCrashed, match=r"signal 11 \(SIGSEGV\)"):  # and later calls
        child.call("most_common")
    child.close()  # nothing left to end: no error
    other = Isolated("counter", collections.Counter, "ab")
    try:
        assert other.call("total") == 2
    finally:
        other.close()


def test_crash_message():
    assert crash_message("peer", -signal.SIGABRT) == "peer crashed: signal 6 (SIGABRT)"
    assert crash_message("peer", 3) == "peer exited unexpectedly (exit status 3)"
