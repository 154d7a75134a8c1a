"""The CPU executor: stages wait for every handle they depend on; workers run torch ops on
one intra-op thread and leave the count of every other thread alone."""

import threading

import torch

from oasiskv.prefetch.executor import ThreadExecutor


def test_a_stage_waits_for_every_handle_it_depends_on():
    """The slow stage is held (a gate, not a sleep) after the fast one is done: the stage
    that depends on both must not run until the gate opens."""
    ex = ThreadExecutor()
    order, gate, ran = [], threading.Event(), threading.Event()
    slow = ex.submit("local", lambda: (gate.wait(60), order.append("slow")))
    fast = ex.submit("fill", lambda: order.append("fast"))
    after = ex.submit("predict", lambda: (order.append("after"), ran.set()), [fast, slow])
    fast.wait()
    # a chance for a stage that waited on `fast` alone to run; correct code never does, so
    # how long this waits decides only how surely such a bug shows, never a pass
    assert not ran.wait(0.5)
    gate.set()
    after.wait()
    ex.close()
    assert order == ["fast", "slow", "after"]


def test_workers_use_one_thread_and_leave_the_others_theirs():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # on any machine: a count the workers' 1 differs from
    seen = {}

    def count(name):
        torch.ones(4).sum()  # a first op: torch's per-thread setup has run
        seen[name] = torch.get_num_threads()

    try:
        ex = ThreadExecutor()
        ex.submit("select", lambda: count("worker")).wait()
        later = threading.Thread(target=count, args=("later thread",))
        later.start()
        later.join()
        ex.close()
        count("caller")
    finally:
        torch.set_num_threads(before)  # process-wide: the other tests keep theirs
    assert seen == {"worker": 1, "later thread": 2, "caller": 2}
