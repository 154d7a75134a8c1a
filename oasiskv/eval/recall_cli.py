"""`oasiskv eval recall`'s command line: its flags beside the run (`eval/recall.py`)."""

from __future__ import annotations

import argparse

from oasiskv.engine_args import add_device_flag

COMMANDS = {"recall": ("per-layer recall of next-step top-K block "
                       "predictors (previous query, lookahead drafts) on dense decode")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`eval recall`'s flags."""
    p.add_argument("--model", default="smollm2-135m",
                   help="model alias, HF directory or .gguf file")
    p.add_argument("--context", type=int, default=7000, help="prompt length in tokens")
    p.add_argument("--prompts", type=int, default=3,
                   help="how many of the 12 fixed Austen prompts to run (the study protocol: 3)")
    p.add_argument("--steps", type=int, default=48, help="scored step transitions")
    p.add_argument("--top-k", default="32,128", help="K values (blocks per KV head)")
    p.add_argument("--predictor", default="lookahead,previous",
                   help="comma-separated: lookahead, previous")
    p.add_argument("--drafter", default="self,ngram,resync,oracle",
                   help="lookahead drafters: self, ngram, resync, oracle (true next token), "
                   "eagle:DIR (a head from train-drafter), resync-eagle:DIR (the self chain "
                   "while right, the head after a miss)")
    p.add_argument("--draft-context", choices=("sparse", "dense"), default="sparse",
                   help="what a draft attends to: the step's exact top-K + active block "
                   "(sparse, the engine's working set) or everything (dense: upper bound)")
    p.add_argument("--sync-start", action="store_true",
                   help="step 0's drafts are the true next token (draft chains start in "
                   "sync); default: each drafter's own cold-start guess")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: follow a trajectory sampled at this temperature (seeded)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the trajectory")
    p.add_argument("--rerank", type=float, default=0.0,
                   help="c >= 1: also lookahead rows whose best c*K blocks by summary score "
                   "are re-ranked by the draft query's attention over their keys")
    p.add_argument("--num-drafts", type=int, default=1,
                   help="draft rows per K and drafter (its best guesses), mixed as the engine "
                   "mixes them (greedy: the first predicts; sampled: the mean weighted by "
                   "each one's chance of being sampled); the next step's draft chain goes on "
                   "from the row that was right (the engine's num_drafts)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (B)")
    p.add_argument("--dtype", default="float32")
    add_device_flag(p)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--plot", help="write a per-layer recall plot (PNG) to this file")


def run(args: argparse.Namespace) -> int:
    from oasiskv.eval.recall import run_recall_eval  # the engine and models: only to run

    run_recall_eval(args)
    return 0
