"""The CPU executor: stages wait for every handle they depend on; workers run torch ops on
one intra-op thread and leave the count of every other thread alone."""

import threading
import time

import torch

from oasiskv.prefetch.executor import ThreadExecutor


def test_a_stage_waits_for_every_handle_it_depends_on():
    ex = ThreadExecutor()
    order = []
    slow = ex.submit("local", lambda: (time.sleep(0.1), order.append("slow")))
    fast = ex.submit("fill", lambda: order.append("fast"))
    ex.submit("predict", lambda: order.append("after"), [fast, slow]).wait()
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
