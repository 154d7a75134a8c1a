"""`oasiskv pd`: prefill and decode workers started here for one prompt (partial KV transfer
over a remote store), or `--serve`: the whole disaggregated deployment on this machine."""

from __future__ import annotations

import argparse
import sys

from oasiskv.cli_input import add_prompt_arguments, read_prompt
from oasiskv.engine_args import add_engine_flags, engine_kwargs
from oasiskv.kv.handoff import TRANSFERS

COMMANDS = {"pd": "prefill and decode workers (partial KV transfer over a "
                  "remote store) for one prompt"}
_MiB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pd`'s flags: the prompt, the hand-over, `--serve`'s deployment, every engine flag."""
    add_prompt_arguments(p)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--transfer", default="partial", choices=TRANSFERS,
                   help="partial: the union of the first step's blocks; slab: its per-head "
                   "slices (the slab); full: the whole prompt")
    p.add_argument("--mooncake", action="store_true",
                   help="start a Mooncake master here (private network namespace) and run "
                   "the prefill worker in its own process over it")
    p.add_argument("--serve", action="store_true",
                   help="serve instead of one prompt: a Mooncake master, a storage node, "
                   "prefill and decode workers and a router on this machine")
    p.add_argument("--prefill-workers", type=int, default=1, help="with --serve")
    p.add_argument("--decode-workers", type=int, default=1, help="with --serve")
    p.add_argument("--host", default="127.0.0.1", help="with --serve: the router's address")
    p.add_argument("--port", type=int, default=8000, help="with --serve: the router's port")
    p.add_argument("--store-bytes", default="1GiB",
                   help="with --serve: memory the storage node lends the store")
    add_engine_flags(p)


def run(args: argparse.Namespace) -> int:
    """Prefill and decode workers started here for a demo; prints the answer and what the
    hand-over moved."""
    import contextlib

    from oasiskv import SamplingParams
    from oasiskv.disagg.pd import DisaggregatedLLM
    from oasiskv.store.mooncake import local_master

    kwargs = {"kv_mode": "sparse", **engine_kwargs(args)}
    decode = {"f_host": kwargs.pop("f_host", 1.0)}
    if args.serve:
        from oasiskv.config import parse_bytes
        from oasiskv.serve.pd_launch import serve_local

        return serve_local(kwargs, args.prefill_workers, args.decode_workers,
                           parse_bytes(args.store_bytes), args.host, args.port, args.transfer,
                           decode)
    prompt = read_prompt(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    with contextlib.ExitStack() as stack:
        if args.mooncake:  # a master of our own, its ports hidden in a private namespace
            kwargs["remote_store"] = f"mooncake://{stack.enter_context(local_master()).address}"
        pd = DisaggregatedLLM(transfer=args.transfer, decode=decode, **kwargs)
        stack.callback(pd.close)
        if args.chat:
            tok = pd.decode.tokenizer
            prompt = list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
        out = pd.generate([prompt], params)[0]
        stats = pd.decode.stats()
        h = pd.handoffs.get(out.request_id)
    print(out.text)
    m = out.metrics
    line = (f"[oasiskv pd] prompt {m.num_prompt_tokens} tok | generated "
            f"{m.num_generated_tokens} tok ({out.finish_reason}) | TTFT {m.ttft or 0:.2f} s")
    if h is not None:
        full = h.num_prompt_blocks * len(h.kept) * h.block_bytes
        what = "slot blocks (the slab)" if h.slab_namespace else "prompt blocks"
        line += (f"\n[oasiskv pd] {args.transfer} transfer: {h.kept_blocks} {what} of "
                 f"{h.num_prompt_blocks * len(h.kept)} prompt blocks (all layers), "
                 f"{h.admission_bytes / _MiB:.1f} MiB at admission (the whole prompt: "
                 f"{full / _MiB:.1f} MiB) | decode-time store reads "
                 f"{stats['remote_bytes'] / _MiB:.1f} MiB | decode-host KV peak "
                 f"{stats['host_cache_peak_blocks']} blocks per layer")
    print(line, file=sys.stderr)
    if out.error:
        print(f"oasiskv: error: {out.error}", file=sys.stderr)
    return 0 if out.finish_reason != "error" else 1
