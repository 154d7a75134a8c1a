"""The sparse KV's counters (`kv/counters.py`): adding counters field by field, and the tally
that prefetch jobs count into from worker threads."""

import threading

import pytest
import torch

from oasiskv.kv.counters import CounterTally, SparseCounters


def test_add_sums_every_field():
    a = SparseCounters(hits=2, h2d_bytes=10, stall_s=0.5)
    a.add(SparseCounters(hits=3, wanted=1, stall_s=0.25))
    assert a == SparseCounters(hits=5, wanted=1, h2d_bytes=10, stall_s=0.75)


def test_the_tally_counts_from_threads_and_starts_again_when_taken():
    tally = CounterTally()

    def work():
        for _ in range(1000):
            tally.count(hits=1, h2d_bytes=3)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tally.take() == SparseCounters(hits=4000, h2d_bytes=12000)
    assert tally.take() == SparseCounters()


def test_an_unknown_counter_is_an_error():
    with pytest.raises(AttributeError):
        CounterTally().count(hitz=1)


def test_device_counts_are_read_back_when_taken():
    """Jobs count 0-d tensors (no read-back in a stage); take sums them as Python numbers."""
    tally = CounterTally()
    tally.count(hits=torch.tensor(3), h2d_bytes=5)
    tally.count(hits=torch.tensor(4), admitted=torch.tensor(2))
    got = tally.take()
    assert got == SparseCounters(hits=7, admitted=2, h2d_bytes=5)
    assert type(got.hits) is int and type(got.admitted) is int
    assert tally.take() == SparseCounters()
