"""OasisKV: long-context LLM inference with a sparse, prefetched, tiered KV cache."""

from oasiskv.llm import LLM
from oasiskv.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
