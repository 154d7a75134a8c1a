"""`oasiskv train-drafter`: trains an EAGLE-style draft head for a model (`train/drafter.py`) and
prints its held-out draft accuracy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from oasiskv.config import EngineConfig
from oasiskv.engine_args import add_device_flag
from oasiskv.report import markdown_table
from oasiskv.train.spec import TrainSpec

COMMANDS = {"train-drafter": "train an EAGLE-style draft head for a model "
                             "(use it with --drafter eagle:OUT)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`train-drafter`'s flags: the data, the head and its training (TrainSpec's defaults)."""
    p.add_argument("--model", default="smollm2-135m",
                   help="model alias, HF directory or .gguf file")
    p.add_argument("--data", default="austen", help="training text: austen (the six novels)")
    p.add_argument("--heldout", default="persuasion", help="novel kept out for evaluation")
    p.add_argument("--out", required=True, help="directory for the head and feature cache")
    p.add_argument("--tokens", type=int, default=TrainSpec.tokens, help="training tokens")
    p.add_argument("--heldout-tokens", type=int, default=TrainSpec.heldout_tokens)
    p.add_argument("--epochs", type=int, default=TrainSpec.epochs)
    p.add_argument("--chunk", type=int, default=TrainSpec.chunk,
                   help="tokens per training sequence = the head's attention window")
    p.add_argument("--batch", type=int, default=TrainSpec.batch, help="chunks per step")
    p.add_argument("--lr", type=float, default=TrainSpec.lr)
    p.add_argument("--draft-vocab", type=int, default=TrainSpec.draft_vocab,
                   help="the head predicts over the target's most frequent greedy tokens")
    p.add_argument("--self-tokens", type=int, default=TrainSpec.self_tokens,
                   help="training tokens of the target's own continuations of training "
                   "passages (greedy and T=0.7 in turn), beside the novels' text")
    p.add_argument("--self-prompt", type=int, default=TrainSpec.self_prompt,
                   help="tokens of a passage the target continues to a whole chunk")
    p.add_argument("--train-dtype", default=TrainSpec.train_dtype,
                   choices=["auto", "float32", "bfloat16"],
                   help="autocast dtype of training (auto: bfloat16 where the CPU has native "
                   "bf16 matmuls, 1.7x faster here)")
    p.add_argument("--soft-weight", type=float, default=TrainSpec.soft_weight,
                   help="weight of the KL divergence to the target's whole next-token "
                   "distribution (from its last-layer features), beside the greedy token")
    p.add_argument("--feature-weight", type=float, default=TrainSpec.feature_weight,
                   help="weight of the smooth L1 loss to the target's final hidden state "
                   "(EAGLE-1's feature regression)")
    p.add_argument("--weight-decay", type=float, default=TrainSpec.weight_decay,
                   help="AdamW weight decay of the head's weights")
    p.add_argument("--feature-noise", type=float, default=TrainSpec.feature_noise,
                   help="uniform noise added to the input features in training, as a "
                   "fraction of their RMS (a regulariser, EAGLE-1's augmentation)")
    p.add_argument("--aux-layers", default=None,
                   help="target layers fused as features (default: 2, L/2, L-1)")
    p.add_argument("--seed", type=int, default=TrainSpec.seed)
    add_device_flag(p)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", help="write the figures to this file")


def run(args: argparse.Namespace) -> int:
    from oasiskv.engine.engine import LLMEngine
    from oasiskv.train import drafter as train

    spec = TrainSpec(model=args.model, out=args.out, data=args.data, heldout=args.heldout,
                     tokens=args.tokens, heldout_tokens=args.heldout_tokens, chunk=args.chunk,
                     epochs=args.epochs, batch=args.batch, lr=args.lr,
                     draft_vocab=args.draft_vocab, self_tokens=args.self_tokens,
                     self_prompt=args.self_prompt, train_dtype=args.train_dtype,
                     soft_weight=args.soft_weight, feature_weight=args.feature_weight,
                     weight_decay=args.weight_decay, feature_noise=args.feature_noise,
                     seed=args.seed)
    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
    # room for GENERATE_BATCH whole chunks: the own continuations are generated together
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=args.model, num_threads=args.num_threads, device_kv_budget="2GiB",
        device=args.device))
    result = train.run(engine, spec, aux)
    held = result["heldout"]
    print(f"trained {args.out}: {result['steps']} steps on {result['train_tokens']} tokens "
          f"(features {result['features_s']:.0f} s, training {result['train_s']:.0f} s), "
          f"loss {result['loss_first']:.3f} -> {result['loss_last']:.3f}")
    print(f"held-out {spec.heldout} text ({held['rows']} rows): draft accuracy greedy "
          f"{held['greedy_accuracy']:.3f}, sampled T=0.7 {held['sampled_accuracy']:.3f} "
          f"(unigram baseline {held['unigram_accuracy']:.3f}); "
          f"last training chunks: {result['train_last']['greedy_accuracy']:.3f}")
    print(markdown_table(held["by_confidence"], [
        ("target_p", "target's T=0.7 p of its greedy token"), ("share", "share of rows"),
        ("greedy_accuracy", "draft right")]))
    own_greedy, own_sampled = result["heldout_own_greedy"], result["heldout_own_sampled"]
    print(f"the target's own continuations of {spec.heldout} passages (what it drafts for at "
          f"run time): greedy decoding {own_greedy['greedy_accuracy']:.3f} "
          f"({own_greedy['rows']} rows; outside loops {own_greedy['outside_loops_accuracy']:.3f}"
          f", {own_greedy['in_loops_fraction']:.0%} of rows in loops); T=0.7 decoding: "
          f"acceptance {own_sampled['sampled_accuracy']:.3f}, argmax match "
          f"{own_sampled['greedy_accuracy']:.3f} ({own_sampled['in_loops_fraction']:.0%} of "
          f"rows in loops)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
