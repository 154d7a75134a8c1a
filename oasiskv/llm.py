"""The Python API, vLLM-style: `LLM(model=..., **config).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.outputs import RequestOutput
from oasiskv.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine plus the conveniences of a batch API.

    Every field of EngineConfig, CacheConfig and SchedulerConfig is a keyword here
    (`LLM(model="smollm2-135m", max_num_seqs=8, device_kv_budget="1GiB")`).
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for all prompts (text or token ids) as one continuous batch; outputs come
        back in prompt order. Invalid prompts raise ValueError before any request is queued."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params, strict=True)]
        ids = [self.engine.add_sequence(seq) for seq in seqs]
        finished: dict[str, RequestOutput] = {}
        total_prompt = sum(s.num_prompt_tokens for s in seqs)
        bar = tqdm(total=total_prompt, desc="prefill", unit="tok", disable=not use_tqdm or None,
                   dynamic_ncols=True)
        while len(finished) < len(ids):
            outputs = self.engine.step()
            done_prefill = sum(min(s.num_computed_tokens, s.num_prompt_tokens) if not s.is_finished
                               else s.num_prompt_tokens for s in seqs)
            bar.update(max(0, done_prefill - bar.n))
            if bar.n >= total_prompt and bar.desc == "prefill":
                bar.set_description("decode")
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
            if len(finished) < len(ids) and not self.engine.has_unfinished():  # never spin
                lost = sorted(set(ids) - set(finished))
                raise RuntimeError(f"internal error: the engine lost requests {lost}")
        bar.close()
        return [finished[i] for i in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yields the request's output after every step that added a token (cumulative text).
        The request is validated and queued here, before the first `next()`."""
        return self._follow(self.engine.add_request(prompt, sampling_params))

    def _follow(self, request_id: str) -> Iterator[RequestOutput]:
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
                if request_id not in self.engine.requests:  # never spin
                    raise RuntimeError(f"internal error: the engine lost request {request_id}")
        finally:
            self.engine.abort(request_id)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        _check_messages(messages)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Stops background workers (sparse prefetch); the LLM cannot be used afterwards."""
        self.engine.close()


# The roles every chat template we serve knows; a template renders an unknown one as plain
# text (or fails deep inside jinja), so it is refused here.
CHAT_ROLES = ("system", "user", "assistant")


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"a conversation must be a non-empty list of messages, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {i} must be a dict with a string 'content', got {m!r}")
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(f"chat message {i} has role {m.get('role')!r}; the chat template "
                             f"knows {', '.join(CHAT_ROLES)}")


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    try:
        prompts = list(prompts)
    except TypeError:
        raise ValueError(f"prompts must be a string, a list of token ids or a list of those, "
                         f"got {type(prompts).__name__}") from None
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if not prompts:
        raise ValueError("no prompts given")
    bad = [p for p in prompts if not isinstance(p, str | list | tuple)]
    if bad:
        raise ValueError(f"each prompt must be a string or a list of token ids, got "
                         f"{type(bad[0]).__name__}")
    return prompts


def _as_params_list(params: SamplingParams | Seq[SamplingParams] | None,
                    n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params
