"""The recall tool's figures, on per-KV-head sets of block ids and attention masses."""

import torch

from oasiskv.kv.select import block_mass

__all__ = ["block_mass", "captured_mass", "churn", "membership", "paired_bootstrap_ci",
           "recall"]


def membership(sets: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[Hkv, k] block ids -> [Hkv, num_blocks] bool membership."""
    out = torch.zeros(sets.shape[0], num_blocks, dtype=torch.bool)
    return out.scatter_(1, sets, True)


def recall(pred: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|P ∩ E| / |E| per KV head: pred [Hkv, k], exact [Hkv, e] block ids -> [Hkv]."""
    n = int(max(pred.max(), exact.max())) + 1 if exact.numel() else 1
    return membership(exact, n).gather(1, pred).sum(1).double() / max(exact.shape[1], 1)


def churn(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """|E_new \\ E_old| / |E_new| per KV head -> [Hkv]."""
    n = int(max(new.max(), old.max())) + 1 if new.numel() else 1
    kept = membership(old, n).gather(1, new).sum(1).double()
    return (new.shape[1] - kept) / max(new.shape[1], 1)


def captured_mass(mass: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """Share of each query head's block mass [H, n] inside its KV head's set pred [Hkv, k]
    -> [H]."""
    idx = pred.repeat_interleave(mass.shape[0] // pred.shape[0], dim=0)
    return mass.gather(1, idx).sum(1).double()


def paired_bootstrap_ci(a: list[float], b: list[float], stat, level: float = 0.95,
                        resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of stat(a[idx], b[idx]) over samples drawn with replacement, the
    same indices for both (a and b are paired: the same prompts under two settings). `stat`
    maps two [resamples, n] tensors to [resamples]."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(x), (resamples, len(x)), generator=gen)
    values = stat(x[idx], y[idx])
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(values, q).tolist()
    return lo, hi
