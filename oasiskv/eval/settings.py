"""The settings an evaluation compares on the same prompts: the dense baseline and sparse
configurations (`Setting`), the flags that ask for them (`eval passkey|needle|ppl|all|ruler`),
and one engine per setting on one shared copy of the weights."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oasiskv.config import FORCED_DRAFTS, CacheConfig
from oasiskv.engine_args import add_device_flag
from oasiskv.models.random_model import refuse_random
from oasiskv.report import parse_f_hbms, parse_list

DEFAULT_F_HBM = CacheConfig.f_hbm
DEFAULT_BLOCK_SIZE = CacheConfig.block_size
DEFAULT_AGGREGATION = CacheConfig.score_aggregation
DEFAULT_RERANK, DEFAULT_RERANK_SOURCE = CacheConfig.rerank, CacheConfig.rerank_source

@dataclass(frozen=True)
class Setting:
    """One column of the comparison: the dense baseline or a sparse configuration."""

    kv_mode: str
    predictor: str | None = None
    top_k: int | None = None
    sink_blocks: int = 0
    recent_blocks: int = 0
    f_hbm: float | str = DEFAULT_F_HBM
    block_size: int = DEFAULT_BLOCK_SIZE
    rerank: float = DEFAULT_RERANK
    forced_drafts: str = "known"  # ppl with lookahead: the text's next token, or a guess
    summary_dtype: str = "auto"
    score_aggregation: str = DEFAULT_AGGREGATION
    rerank_source: str = DEFAULT_RERANK_SOURCE
    # any other CacheConfig fields, (name, value) pairs; named `name=value` where not default
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        if self.kv_mode == "dense":
            return "dense"
        pins = "".join(f" +{n} {what}" for n, what in ((self.sink_blocks, "sink"),
                                                       (self.recent_blocks, "recent")) if n)
        cap = "" if self.f_hbm == DEFAULT_F_HBM else f" f_hbm={self.f_hbm}"
        block = "" if self.block_size == DEFAULT_BLOCK_SIZE else f" B={self.block_size}"
        # named where not the default (rerank=inf from the int8 copy)
        source = "" if self.rerank_source == DEFAULT_RERANK_SOURCE else f" {self.rerank_source}"
        rerank = ("" if (self.rerank, source) == (DEFAULT_RERANK, "") or self.predictor == "oracle"
                  else f" rerank={self.rerank:g}{source if self.rerank else ''}")
        scoring = ("" if self.score_aggregation == DEFAULT_AGGREGATION
                   else f" {self.score_aggregation}")
        guessed = " guessed drafts" if self.forced_drafts == "guessed" else ""
        summaries = "" if self.summary_dtype == "auto" else f" {self.summary_dtype} summaries"
        options = "".join(f" {k}={v}" for k, v in self.options
                          if v != getattr(CacheConfig, k, None))
        return (f"sparse K={self.top_k}{block} {self.predictor}{scoring}{rerank}{guessed}{pins}"
                f"{cap}{summaries}{options}")

    def engine_kwargs(self) -> dict:
        if self.kv_mode == "dense":
            return {"kv_mode": "dense"}
        return {"kv_mode": "sparse", "predictor": self.predictor, "top_k": self.top_k,
                "sink_blocks": self.sink_blocks, "recent_blocks": self.recent_blocks,
                "f_hbm": self.f_hbm, "block_size": self.block_size, "rerank": self.rerank,
                "forced_drafts": self.forced_drafts, "summary_dtype": self.summary_dtype,
                "score_aggregation": self.score_aggregation, "rerank_source": self.rerank_source,
                **dict(self.options)}


def settings_from(kv_modes: list[str], predictors: list[str], top_ks: list[int],
                  sinks: tuple[int, ...] = (0,), recents: tuple[int, ...] = (0,),
                  f_hbms: tuple[float | str, ...] = (DEFAULT_F_HBM,),
                  block_sizes: tuple[int, ...] = (DEFAULT_BLOCK_SIZE,),
                  token_budgets: tuple[int, ...] = (),
                  reranks: tuple[float, ...] = (DEFAULT_RERANK,),
                  forced_drafts: tuple[str, ...] = ("known",),
                  summary_dtypes: tuple[str, ...] = ("auto",),
                  aggregations: tuple[str, ...] = (DEFAULT_AGGREGATION,),
                  rerank_sources: tuple[str, ...] = (DEFAULT_RERANK_SOURCE,),
                  extra: dict[str, tuple] | None = None) -> list[Setting]:
    """dense, then every sparse combination. With token budgets, K = budget / B for each block
    size B instead of top_ks: finer blocks at the same resident tokens. Only lookahead drafts,
    so the other predictors take one forced_drafts value; only a rerank reads keys, so
    rerank=0 takes one source (none is read). `extra`: other CacheConfig fields and the values
    to compare (each combination a setting; a default value stays out of its name)."""
    bad = [m for m in kv_modes if m not in ("dense", "sparse")]
    if bad or not kv_modes:
        raise ValueError(f"--kv-mode takes dense and/or sparse, got {kv_modes}")
    if not forced_drafts or any(d not in FORCED_DRAFTS for d in forced_drafts):
        raise ValueError(f"--forced-drafts takes known and/or guessed, got {forced_drafts}")
    for budget in token_budgets:
        uneven = [b for b in block_sizes if budget % b]
        if uneven:
            raise ValueError(f"--token-budget {budget} is not a whole number of blocks of "
                             f"{uneven[0]} tokens")
    out = [Setting("dense")] if "dense" in kv_modes else []
    if "sparse" in kv_modes:
        sparse = [Setting("sparse", p, k, s, r, f, b, c, d, u, a, src) for b in block_sizes
                  for k in ([t // b for t in token_budgets] or top_ks)
                  for s in sinks for r in recents for f in f_hbms for p in predictors
                  for a in aggregations
                  for c in reranks
                  for src in (rerank_sources if c else rerank_sources[:1])
                  for d in (forced_drafts if p == "lookahead" else forced_drafts[:1])
                  for u in summary_dtypes]
        fields = list(extra or {})
        defaults = {f: getattr(CacheConfig, f) for f in fields}
        out += [dataclasses.replace(x, options=tuple((f, v) for f, v in zip(fields, values,
                                                                            strict=True)
                                                     if v != defaults[f]))
                for x in sparse for values in itertools.product(*(extra or {}).values())]
    return out


def add_setting_arguments(p: argparse.ArgumentParser) -> None:
    """`eval passkey|needle|ppl|all|ruler`: the dense and sparse settings to compare on the
    same prompts, and how they run."""
    p.add_argument("--kv-mode", default="dense,sparse", help="dense and/or sparse")
    p.add_argument("--predictor", default="lookahead,previous,exact",
                   help="sparse predictors to compare")
    p.add_argument("--top-k", default="32,128", help="sparse K values")
    p.add_argument("--block-size", default=str(CacheConfig.block_size),
                   help="sparse: tokens per KV block (values to compare)")
    p.add_argument("--token-budget", default=None,
                   help="sparse: resident tokens per KV head instead of --top-k: K = "
                   "budget / B for each --block-size (e.g. 512,2048 with --block-size "
                   "16,8 compares finer blocks at K=32's and K=128's budgets)")
    p.add_argument("--rerank", default=f"{CacheConfig.rerank:g}",
                   help="sparse: re-rank the best c*K blocks by attention over their keys "
                   "(values of c to compare, e.g. 0,2; 0 = off)")
    p.add_argument("--summary-dtype", default="auto",
                   help="sparse: block summaries' dtype, values to compare (auto = "
                   "bfloat16 for float32 K/V, else the KV dtype; float32, float16, "
                   "bfloat16)")
    p.add_argument("--score-aggregation", default=CacheConfig.score_aggregation,
                   help="sparse: how a KV head's query heads combine block scores (values to "
                   "compare: sum, softmax-sum, softmax-max)")
    p.add_argument("--rerank-source", default=CacheConfig.rerank_source,
                   help="sparse, with --rerank: where the re-ranking reads keys (values to "
                   "compare: host, int8, int4)")
    p.add_argument("--dense-layers", default="0",
                   help="sparse: first layers kept dense (values to compare, e.g. 0,1,2)")
    p.add_argument("--summary-splits", default="1",
                   help="sparse: min/max summaries per block (values to compare, e.g. 1,2)")
    p.add_argument("--sink-blocks", default="0",
                   help="sparse: first blocks always kept (values to compare, e.g. 0,4)")
    p.add_argument("--recent-blocks", default="0",
                   help="sparse: last complete blocks always kept (values to compare)")
    p.add_argument("--drafter", default="resync",
                   help="lookahead's drafter: self, ngram, resync, eagle:DIR, "
                   "resync-eagle:DIR")
    p.add_argument("--f-hbm", default=str(CacheConfig.f_hbm),
                   help="sparse: admission caps to compare (e.g. 0.05,1.0,auto)")
    p.add_argument("--group", type=int, default=2,
                   help="prompts prefilled together and decoded as one batch (every "
                   "setting's engine holds the group's K/V: memory grows with it)")
    p.add_argument("--no-chat", action="store_true",
                   help="plain prompts even when the model has a chat template")
    p.add_argument("--dtype", default="float32")
    add_device_flag(p)
    p.add_argument("--num-threads", type=int, default=None)


def settings_from_args(args: argparse.Namespace) -> list[Setting]:
    """The settings that `eval passkey|needle|ppl|all|ruler`'s flags ask for."""
    return settings_from(parse_list(args.kv_mode, str), parse_list(args.predictor, str),
                         parse_list(args.top_k), parse_list(args.sink_blocks),
                         parse_list(args.recent_blocks), parse_f_hbms(args.f_hbm),
                         parse_list(args.block_size),
                         parse_list(args.token_budget) if args.token_budget else (),
                         parse_list(args.rerank, float),
                         parse_list(getattr(args, "forced_drafts", "known"), str),
                         parse_list(args.summary_dtype, str),
                         parse_list(args.score_aggregation, str),
                         parse_list(args.rerank_source, str),
                         {"dense_layers": parse_list(args.dense_layers),
                          "summary_splits": parse_list(args.summary_splits)})


def setting_engines(args: argparse.Namespace, settings: list[Setting],
                    extra: dict | None = None) -> tuple[list[str], Callable[[str], Any]]:
    """(setting names, engine_for(name)): the first setting's engine, built here, and the
    others' on its weights. `extra`: engine options every setting shares (a device budget)."""
    from oasiskv.config import EngineConfig
    from oasiskv.engine.engine import LLMEngine

    refuse_random(args.model, "this evaluation")
    base = {"model": args.model, "dtype": args.dtype, "drafter": args.drafter,
            "device": args.device, **(extra or {})}
    if args.num_threads:
        base["num_threads"] = args.num_threads
    configs = {s.name: EngineConfig.from_kwargs(**base, **s.engine_kwargs()) for s in settings}
    names = list(configs)
    first = LLMEngine(configs[names[0]])

    def engine_for(name: str) -> LLMEngine:
        # Built when its turn comes and dropped after it, on the first engine's weights: one
        # setting's KV pools in memory at a time (13 settings of two 7,168-token prompts each
        # did not fit in 24 GiB side by side).
        return first if name == names[0] else LLMEngine(configs[name], share_weights=first)

    return names, engine_for
