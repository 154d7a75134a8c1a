"""`oasiskv train-drafter`: trains an EAGLE-style head (`spec/eagle.py`) for a target model.

1. Features: the target runs over chunks of text (Austen novels, one held out) and, per
   position, its aux-layer outputs, its greedy next token and (held-out only) its top
   log-probabilities at T=0.7 are written to safetensors shards under OUT/features. Shards
   that exist are reused, so an interrupted run resumes where it stopped.
2. Training: row p of a chunk reads x_p and the features at p-1 and learns the target's greedy
   token at p (its guess of x_{p+1}), cross-entropy over a draft vocabulary (the target's
   most frequent greedy tokens in the training text; others are ignored in the loss and count
   as misses in the accuracy).
3. Held-out accuracy: greedy (draft == target's greedy token) and sampled (the target's
   T=0.7 probability of the draft: the expected acceptance of sampled decoding), next to the
   unigram baseline (always the most frequent greedy token); on the held-out novel's text and
   on the target's own continuations of its passages (greedy and T=0.7): the text the head
   drafts for at run time.

Own text (`self_tokens`, EAGLE's regenerated data): a training chunk's first `self_prompt`
tokens continued by the target itself to a whole chunk, greedy and T=0.7 in turn, so the head
also learns the distribution it meets when the engine generates.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.spec.eagle import EagleConfig, EagleHead
from oasiskv.train.features import (
    OWN_TEMPERATURES,
    collect,
    load_shards,
    own_continuations,
    text_chunks,
)
from oasiskv.train.spec import TrainSpec

# ---- training ---------------------------------------------------------------------------------

def draft_vocabulary(greedy: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target greedy tokens, most frequent first."""
    ids, counts = greedy.flatten().long().unique(return_counts=True)
    return ids[counts.argsort(descending=True)[:size]]


def head_inputs(data: dict[str, torch.Tensor], index: torch.Tensor,
                device: torch.device | str = "cpu"):
    """Row p = 1..S-1 of each chunk: token x_p, features at p-1, target's greedy token at p;
    on `device` (the head's: the feature shards stay on the CPU)."""
    tokens = data["tokens"][index, 1:].long().to(device)
    features = data["features"][index, :-1].to(device).float()
    return tokens, features, data["greedy"][index, 1:].long().to(device)


def target_to_draft(head: EagleHead) -> torch.Tensor:
    """[V] target token id -> the head's draft index, -100 (ignored) outside its vocabulary."""
    t2d = torch.full((head.config.vocab_size,), -100, dtype=torch.long, device=head.d2t.device)
    t2d[head.d2t] = torch.arange(len(head.d2t), device=head.d2t.device)
    return t2d


def labels_in_draft_vocab(greedy: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    return t2d[greedy]  # -100 where the target token is outside the draft vocabulary


def target_hidden(target: LlamaForCausalLM, features: torch.Tensor) -> torch.Tensor:
    """[..., F] features whose last part is the target's last layer -> the target's final
    hidden state [..., D] at the same position: what its LM head reads."""
    return target.model.norm(features[..., -target.config.hidden_size:].float())


def head_loss(head: EagleHead, logits: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor,
              t2d: torch.Tensor, spec: TrainSpec, goal: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy to the target's greedy token, plus, with `goal` (the target's final hidden
    states of the same rows, [b, S, D]), spec.soft_weight x KL(target || head) over the draft
    vocabulary and spec.feature_weight x smooth L1 between the hidden states: the whole
    distribution and the state it comes from say more per row than its argmax alone."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels_in_draft_vocab(greedy, t2d)
                           .flatten())
    if goal is None:
        return loss
    if spec.soft_weight:
        want = torch.log_softmax(head.logits(goal), dim=-1).flatten(0, 1)  # [b*S, Vd]
        have = torch.log_softmax(logits.float(), dim=-1).flatten(0, 1)
        loss = loss + spec.soft_weight * F.kl_div(have, want, log_target=True,
                                                  reduction="batchmean")
    if spec.feature_weight:
        loss = loss + spec.feature_weight * F.smooth_l1_loss(hidden.float(), goal)
    return loss


def noisy(features: torch.Tensor, scale: float, hidden: int,
          gen: torch.Generator) -> torch.Tensor:
    """[b, S, F] features + U(-scale, scale) x each aux layer's RMS at that row, so that the
    head cannot lean on exact feature values (held-out vs training accuracy was 0.60 vs 0.74;
    with this at 0.2 and weight decay 0.1 the held-out accuracy stayed 0.60 on SmolLM2)."""
    parts = features.unflatten(-1, (-1, hidden))  # [b, S, layers, D]
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()
    # drawn on the CPU (`gen`'s device): the same noise whatever device trains
    noise = torch.rand(parts.shape, generator=gen).to(parts.device).mul_(2).sub_(1).mul_(scale)
    return (parts + noise * rms).flatten(-2)


def train_head(head: EagleHead, data: dict[str, torch.Tensor], spec: TrainSpec,
               heldout: dict[str, torch.Tensor] | None = None,
               target: LlamaForCausalLM | None = None) -> tuple[list[float], list[dict]]:
    """AdamW, linear warm-up then cosine decay; returns the loss of every step and, with
    `heldout`, its `evaluate` figures after every epoch (the learning curve: it shows when
    more epochs stop helping; the last entry is the trained head's). The soft and feature
    losses need `target`, whose last layer must be the last of the head's aux layers."""
    distill = bool(spec.soft_weight or spec.feature_weight)
    if distill and (target is None or head.config.aux_layers[-1] != target.config.num_layers
                    - 1):
        raise ValueError(f"soft_weight / feature_weight need the target's last layer "
                         f"({'?' if target is None else target.config.num_layers - 1}) as the "
                         f"last aux layer; the head reads {head.config.aux_layers}")
    t2d = target_to_draft(head)
    params = [p for p in head.parameters() if p.requires_grad]
    # decay the matrices only: a norm's gains decayed towards 0 would scale its input away
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                             {"params": [p for p in params if p.dim() <= 1],
                              "weight_decay": 0.0}], lr=spec.lr, weight_decay=spec.weight_decay)
    n = len(data["tokens"])
    steps_per_epoch = math.ceil(n / spec.batch)
    total = steps_per_epoch * spec.epochs
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
    gen = torch.Generator().manual_seed(spec.seed)
    device = head.d2t.device  # the target's: the head trains where its buffers live
    positions = torch.arange(1, data["tokens"].shape[1], device=device)
    losses, curve = [], []
    dtype = spec.autocast_dtype
    bar = tqdm(total=total, desc="train", disable=spec.quiet or None)
    for _ in range(spec.epochs):
        head.train()
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, spec.batch):
            index = order[i:i + spec.batch]
            tokens, features, greedy = head_inputs(data, index, device)
            if spec.feature_noise:
                features = noisy(features, spec.feature_noise, head.config.hidden_size, gen)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                hidden = head(tokens, features, positions)[0]
                logits = head.logits(hidden)
            with torch.no_grad():  # row p learns the target's state at p: features[p]
                goal = (target_hidden(target, data["features"][index, 1:].to(device))
                        if distill else None)
            loss = head_loss(head, logits, hidden, greedy, t2d, spec, goal)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        head.eval()
        if heldout is not None:
            curve.append(evaluate(head, heldout))
            if not spec.quiet:
                bar.write(f"epoch {len(curve)}: held-out greedy draft accuracy "
                          f"{curve[-1]['greedy_accuracy']:.3f}")
    bar.close()
    return losses, curve


LOOP_NGRAM = 4
# held-out rows by the target's own T=0.7 probability of its greedy token: where the head misses
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def in_loop(tokens: torch.Tensor, n: int = LOOP_NGRAM) -> torch.Tensor:
    """[b, S] -> [b, S] bool: the n tokens ending at p occurred earlier in the chunk, so the
    text repeats itself there (greedy decoding of a small model falls into such loops, where
    any drafter that copies is right)."""
    out = torch.zeros(tokens.shape, dtype=torch.bool)
    for row, ids in enumerate(tokens.tolist()):
        seen: set[tuple[int, ...]] = set()
        for p in range(n - 1, len(ids)):
            gram = tuple(ids[p - n + 1:p + 1])
            out[row, p] = gram in seen
            seen.add(gram)
    return out


@torch.inference_mode()
def evaluate(head: EagleHead, data: dict[str, torch.Tensor], batch: int = 4,
             start: int = 1) -> dict:
    """Held-out figures over rows p >= start (x_p known, x_{p+1} drafted): greedy accuracy
    (also over the rows outside loops, see `in_loop`), sampled (T=0.7) acceptance, the
    unigram baseline's greedy accuracy and, with the target's log-probabilities, the greedy
    accuracy by the target's confidence (`by_confidence`: its T=0.7 probability of its own
    greedy token, bins of CONFIDENCE_EDGES)."""
    device = head.d2t.device
    positions = torch.arange(1, data["tokens"].shape[1], device=device)
    right = sampled = rows = fresh_right = fresh = 0.0
    bins = len(CONFIDENCE_EDGES) - 1
    bin_rows, bin_right = torch.zeros(bins), torch.zeros(bins)
    for i in range(0, len(data["tokens"]), batch):
        index = torch.arange(i, min(i + batch, len(data["tokens"])))
        tokens, features, greedy = head_inputs(data, index, device)
        hidden, _ = head(tokens, features, positions)
        draft = head.d2t[head.logits(hidden).argmax(-1)][:, start - 1:].cpu()  # [b, rows] ids
        correct = draft == greedy[:, start - 1:].cpu()
        right += correct.sum().item()
        outside = ~in_loop(data["tokens"][index])[:, start:]  # [b, rows]
        fresh_right += (correct & outside).sum().item()
        fresh += outside.sum().item()
        if "top_ids" in data:
            hit = data["top_ids"][index, start:].long() == draft[..., None]  # [b, rows, T]
            sampled += (data["top_logp"][index, start:].exp() * hit).sum().item()
            confidence = data["top_logp"][index, start:, 0].exp()  # [b, rows]
            which = torch.bucketize(confidence, torch.tensor(CONFIDENCE_EDGES[1:-1]),
                                    right=True).flatten()
            bin_rows += torch.bincount(which, minlength=bins)
            bin_right += torch.bincount(which, weights=correct.flatten().float(),
                                        minlength=bins)
        rows += draft.numel()
    greedy = data["greedy"][:, start:].flatten().long()
    top = greedy.mode().values
    return {"greedy_accuracy": right / rows,
            "sampled_accuracy": sampled / rows if "top_ids" in data else None,
            "unigram_accuracy": (greedy == top).float().mean().item(), "rows": int(rows),
            "outside_loops_accuracy": fresh_right / fresh if fresh else None,
            "in_loops_fraction": 1 - fresh / rows,
            "by_confidence": [
                {"target_p": f"[{lo}, {hi}{']' if hi == 1 else ')'}",
                 "share": (n / rows).item(), "greedy_accuracy": (k / n).item() if n else None}
                for lo, hi, n, k in zip(CONFIDENCE_EDGES[:-1], CONFIDENCE_EDGES[1:], bin_rows,
                                        bin_right, strict=True)] if "top_ids" in data else None}


def run(engine, spec: TrainSpec, aux_layers: list[int] | None = None,
        chunks: tuple[list[list[int]], list[list[int]]] | None = None) -> dict:
    """The whole job on an engine holding the target; saves the head to spec.out.
    `chunks` (training, held-out token ids) replaces the text of `spec.data`."""
    torch.manual_seed(spec.seed)
    t0 = time.perf_counter()
    train_chunks, heldout_chunks = chunks or text_chunks(spec, engine.tokenizer)
    mc = engine.model_config
    probe = EagleConfig.for_target(spec.model, mc, spec.draft_vocab, aux_layers, spec.chunk)
    layers = tuple(probe.aux_layers)
    train_paths = collect(engine, spec, "train", train_chunks, layers)
    heldout_paths = collect(engine, spec, "heldout", heldout_chunks, layers)
    own_prompts = [train_chunks[i % len(train_chunks)][:spec.self_prompt]
                   for i in range(math.ceil(spec.self_tokens / spec.chunk))]
    own_paths = collect(engine, spec, "own", own_continuations(engine, spec, "own",
                                                                own_prompts), layers)
    heldout_own_paths = collect(engine, spec, "heldout_own", own_continuations(
        engine, spec, "heldout_own", [c[:spec.self_prompt] for c in heldout_chunks]), layers)
    t_features = time.perf_counter() - t0
    data = load_shards(train_paths + own_paths)
    d2t = draft_vocabulary(data["greedy"], spec.draft_vocab)
    cfg = EagleConfig.for_target(spec.model, mc, len(d2t), list(layers), spec.chunk)
    target = engine.model
    head = EagleHead(cfg, target.model.embed_tokens.weight, target.lm_head.weight, d2t).to(
        target.lm_head.weight.device)  # trains on the target's device
    losses, curve = train_head(head, data, spec, load_shards(heldout_paths), target)
    t_train = time.perf_counter() - t0 - t_features
    own = load_shards(heldout_own_paths)
    result = {"heldout": curve[-1],
              "heldout_by_epoch": [epoch["greedy_accuracy"] for epoch in curve],
              **{f"heldout_own_{kind}": evaluate(
                  head, {k: v[i::len(OWN_TEMPERATURES)] for k, v in own.items()},
                  start=spec.self_prompt) for i, kind in enumerate(("greedy", "sampled"))},
              "train_last": evaluate(head, {k: v[-len(heldout_chunks):] for k, v in
                                            data.items()}),
              "loss_first": losses[0], "loss_last": sum(losses[-10:]) / len(losses[-10:]),
              "steps": len(losses), "train_tokens": len(train_chunks) * spec.chunk,
              "own_tokens": len(own_prompts) * spec.chunk,
              "heldout_tokens": len(heldout_chunks) * spec.chunk, "draft_vocab": len(d2t),
              "aux_layers": list(layers), "features_s": t_features, "train_s": t_train,
              "spec": {k: str(v) for k, v in asdict(spec).items()}}
    head.save(spec.out)
    (spec.out / "train_result.json").write_text(json.dumps(result, indent=1))
    return result
