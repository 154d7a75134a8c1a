"""The fetch cap (`kv/fetch_cap.py`): f_hbm=auto's retune against hand-computed caps, the
bytes of a block-head, and the bandwidth measurement's copy."""

import torch

from oasiskv.kv.fetch_cap import FetchCap, block_bytes_per_head, measure_fetch_bandwidth


def test_a_fixed_cap_never_moves():
    cap = FetchCap(top_k=32, value=2)
    cap.retune(0.05, 1000)
    assert (cap.value, cap.forward_s) == (2, 0.0)


def test_auto_is_bandwidth_times_the_moving_forward_time_over_a_unit():
    cap = FetchCap(top_k=128, value=7, auto=True, bandwidth=1e6)
    cap.retune(0.0505, 1000)  # first step: its forward time; 1e6 * 0.0505 / 1000 = 50.5
    assert (cap.value, cap.forward_s) == (50, 0.0505)
    cap.retune(0.0105, 1000)  # 0.8 * 0.0505 + 0.2 * 0.0105 = 0.0425 -> 42.5
    assert abs(cap.forward_s - 0.0425) < 1e-12 and cap.value == 42
    cap.retune(0.0425, 4000)  # a unit 4x larger (4 requests): 10.625
    assert cap.value == 10


def test_auto_is_clamped_to_one_and_top_k():
    cap = FetchCap(top_k=32, value=2, auto=True, bandwidth=1e6)
    cap.retune(0.05, 1000)  # 50 -> top_k
    assert cap.value == 32
    slow = FetchCap(top_k=32, value=2, auto=True, bandwidth=10.0)
    slow.retune(0.05, 1000)  # 0.0005 -> at least one block a step
    assert slow.value == 1


def test_block_bytes_per_head():
    assert block_bytes_per_head(torch.empty(3, 2, 4, 100, 64), 16) == 2 * 16 * 64 * 4
    assert block_bytes_per_head(torch.empty(3, 2, 4, 100, 64, dtype=torch.bfloat16), 16) == 4096


def test_the_measurement_copies_the_first_blocks_of_the_first_layer():
    """Two KV heads, pools of 3 (device) and 5 (host) blocks of 2 tokens: the gather moves
    3 blocks x 2 heads of layer 0 (host -> device, same slots); nothing else changes."""
    host = torch.randn(2, 2, 2, 10, 4)
    device = torch.zeros(2, 2, 2, 6, 4)
    assert measure_fetch_bandwidth(device, host, 2, repeats=2) > 0
    assert torch.equal(device[0], host[0, :, :, :6])
    assert not device[1].any()
