"""Job grouping (`kv/job_groups.py`): the layers of each prefetch job, and the deferred
selections of a step submitted as one job per run of layers with the same requests."""

from types import SimpleNamespace

import pytest
import torch

from oasiskv.kv.job_groups import JobGroups


def groups(kind: str, layers: int = 5, prefetch_group: int = 2) -> JobGroups:
    g = JobGroups()
    g.device_kv = torch.empty(layers, 2, 1, 1, 1)
    g.pipeline = SimpleNamespace(executor=SimpleNamespace(kind=kind))
    g.cfg = SimpleNamespace(prefetch_group=prefetch_group)
    return g


@pytest.mark.parametrize("kind, group, want", [
    ("async", 2, [(0, 2), (2, 4), (4, 5)]),
    ("async", 0, [(0, 2), (2, 4), (4, 5)]),  # 0: half the layers (5 // 2)
    ("async", 3, [(0, 3), (3, 5)]),
    ("sync", 2, [(0, 5)]),  # sync: every layer in one job
])
def test_layer_groups(kind, group, want):
    g = groups(kind, prefetch_group=group)
    assert [(s.start, s.stop) for s in g.layer_groups()] == want
    assert g.prefetch_group == want[0][1]


def test_deferred_selections_join_runs_of_layers_with_the_same_requests():
    g = groups("sync")
    a, b = [object()], [object()]
    q = {layer: torch.full((1, 3, 2), float(layer)) for layer in range(5)}  # [R, H, d]
    g._deferred = [(0, a, q[0]), (1, a, q[1]), (2, b, q[2]), (3, b, q[3]), (4, a, q[4])]
    calls = []
    g._submit_selection = lambda layers, decodes, queries: calls.append((layers, decodes,
                                                                         queries))
    g._select_deferred()
    assert [(layers, decodes) for layers, decodes, _ in calls] == [([0, 1], a), ([2, 3], b),
                                                                   ([4], a)]
    assert torch.equal(calls[0][2], torch.stack([q[0], q[1]], 1))  # [R, layers, H, d]
    assert g._deferred == []


def test_a_selection_is_submitted_as_the_four_stages():
    g = groups("async")
    g.step = 7
    submitted = []
    g.pipeline.submit = lambda layers, label, stages, owners: submitted.append(
        (layers, label, [name for name, _ in stages], owners))
    seq = SimpleNamespace(working_set=None, host_cache=None)
    decode = SimpleNamespace(seq=seq, summary_ids=torch.tensor([], dtype=torch.long))
    g._submit_selection([2, 3], [decode], torch.zeros(1, 2, 3, 2))
    assert submitted == [([2, 3], "step 7", ["predict", "select", "remote", "local"], [seq])]
