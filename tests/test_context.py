"""The per-step context's `LayerHooks` protocol: it names exactly what attention calls on
`ctx.sparse` per layer, and both implementations (SparseKV, the recall tool's probe) satisfy it,
signatures included."""

import inspect

import pytest
import torch

from oasiskv.context import LayerHooks, SeqAttention, StepContext, set_context
from oasiskv.eval.recall_probe import RecallProbe
from oasiskv.kv.residency import SparseKV
from oasiskv.layers.attention import Attention

MEMBERS = ("wait_layer", "prepare_layer", "after_attention")


def satisfies(cls: type) -> bool:
    """cls has every LayerHooks method, with the protocol's parameters (names, in order)."""
    if not issubclass(cls, LayerHooks):
        return False
    for name in MEMBERS:
        want = list(inspect.signature(getattr(LayerHooks, name)).parameters)
        if list(inspect.signature(getattr(cls, name)).parameters) != want:
            return False
    return True


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def wait_layer(self, layer: int) -> None:
        self.calls.append(("wait_layer", layer))

    def prepare_layer(self, layer: int, q: torch.Tensor) -> None:
        self.calls.append(("prepare_layer", layer))

    def after_attention(self, layer: int, q: torch.Tensor) -> None:
        self.calls.append(("after_attention", layer))


class NoAfterAttention:
    def wait_layer(self, layer: int) -> None: ...

    def prepare_layer(self, layer: int, q: torch.Tensor) -> None: ...


class WrongParameters(Recorder):
    def prepare_layer(self, layer: int) -> None: ...


def test_the_protocol_names_the_three_per_layer_hooks():
    names = {n for n in vars(LayerHooks) if not n.startswith("_")}
    assert names == set(MEMBERS)


@pytest.mark.parametrize("cls", [SparseKV, RecallProbe, Recorder])
def test_both_implementations_satisfy_the_protocol(cls):
    assert satisfies(cls)


@pytest.mark.parametrize("cls", [NoAfterAttention, WrongParameters, object])
def test_hooks_missing_a_method_or_its_parameters_do_not(cls):
    assert not satisfies(cls)


@pytest.mark.parametrize("dense_layers", [0, 2])
def test_attention_calls_exactly_the_protocol_in_order(dense_layers):
    """One decode row through an attention layer with a recording hooks object: wait, prepare,
    after, with the layer counted from the first sparse layer."""
    hkv, group, d, t = 2, 2, 8, 5
    attn = Attention(hkv * group, hkv, d, d ** -0.5)
    attn.layer_idx = dense_layers + 1
    attn.pools = {"device": (torch.randn(hkv, 16, d), torch.randn(hkv, 16, d))}
    hooks = Recorder()
    seq = SeqAttention(0, 1, t, 0, None)
    ctx = StepContext(seqs=[seq], sparse=hooks, dense=StepContext(), dense_layers=dense_layers)
    set_context(ctx)
    try:
        attn(torch.randn(1, hkv * group, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d))
    finally:
        set_context(None)
    assert hooks.calls == [(name, 1) for name in MEMBERS]
