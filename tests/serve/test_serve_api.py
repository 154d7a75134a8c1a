"""The OpenAI routes through the official `openai` client against a live server, each answer
checked against the offline API (`LLM.generate` / `LLM.chat`) on the same engine config."""

from __future__ import annotations

import pytest

from oasiskv import LLM, SamplingParams

pytest_plugins = ["live"]  # the live server and the offline reference (tests/serve/live.py)

PROMPTS = ["The quick brown fox", "It is a truth universally", "Numbers like 12345 and"]


def greedy(ref: LLM, prompt, max_tokens=12, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return ref.generate(prompt, params, use_tqdm=False)[0]


def model(live) -> str:
    return live.state.model_name


def test_completion_equals_offline_greedy_streamed_or_not(live, ref):
    c = live.client()
    for prompt in PROMPTS:
        want = greedy(ref, prompt)
        r = c.completions.create(model=model(live), prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(c.completions.create(model=model(live), prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == want.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == \
            want.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage == r.usage  # include_usage
        assert all(ch.usage is None for ch in chunks[:-1])


def test_prompt_as_token_ids_and_as_a_list_of_prompts(live, ref):
    c = live.client()
    ids = ref.tokenizer.encode(PROMPTS[0])
    want = [greedy(ref, p, 8) for p in PROMPTS]
    r = c.completions.create(model=model(live), prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == want[0].text
    r = c.completions.create(model=model(live), prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [w.text for w in want]
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    id_lists = [ref.tokenizer.encode(p) for p in PROMPTS]
    texts = {i: "" for i in range(3)}
    for ch in c.completions.create(model=model(live), prompt=id_lists, max_tokens=8,
                                   temperature=0, stream=True):
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == [w.text for w in want]


def test_chat_equals_offline_chat_streamed_or_not(live, ref):
    c = live.client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Who wrote Emma?"}]
    want = ref.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    r = c.chat.completions.create(model=model(live), messages=messages, temperature=0,
                                  max_completion_tokens=10)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    r2 = c.chat.completions.create(model=model(live), messages=messages, temperature=0,
                                   max_tokens=10)  # the older name
    assert r2.choices[0].message.content == want.text
    chunks = list(c.chat.completions.create(model=model(live), messages=messages,
                                            temperature=0, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_default_max_tokens_is_the_rest_of_the_context(live, ref):
    ids = ref.apply_chat_template([{"role": "user", "content": "hi"}])
    want = greedy(ref, ids, max_tokens=ref.engine.max_model_len - len(ids), ignore_eos=True)
    r = live.client().chat.completions.create(
        model=model(live), messages=[{"role": "user", "content": "hi"}], temperature=0,
        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == len(want.token_ids) == 512 - len(ids)
    assert r.choices[0].finish_reason == "length"


def _boundary_stop(ref: LLM, out) -> str:
    """A stop string that spans two output tokens (the last character of one, the first of the
    next) and first appears there."""
    pieces = [ref.tokenizer.decode(out.token_ids[:n]) for n in range(len(out.token_ids) + 1)]
    for a, b in zip(pieces[2:], pieces[3:], strict=False):
        if not a or len(b) <= len(a) or not b.startswith(a):
            continue
        stop = a[-1] + b[len(a)]
        if stop.isprintable() and "\ufffd" not in stop and out.text.find(stop) == len(a) - 1:
            return stop
    raise AssertionError(f"no usable token boundary in {out.text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_held_back_and_cut(live, ref, include):
    prompt = "The cat sleeps"  # the tiny model goes on " h of of of ...": plain text to cut
    full = greedy(ref, prompt, 24, ignore_eos=True)
    stop = _boundary_stop(ref, full)
    cut = full.text[:full.text.find(stop) + (len(stop) if include else 0)]
    c = live.client()
    kw = dict(model=model(live), prompt=prompt, max_tokens=24, temperature=0,
              stop=[stop, "\x00never"], extra_body={"ignore_eos": True,
                                                    "include_stop_str_in_output": include})
    r = c.completions.create(**kw)
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw)]
    streamed = [ch.text for ch in chunks]
    # Without hold-back the stop string's first character would have gone out before the
    # engine saw the whole stop string, and "".join would end with it.
    assert "".join(streamed) == cut
    assert len([t for t in streamed if t]) > 1  # it did stream, not all at the end
    assert chunks[-1].finish_reason == "stop"


def test_logprobs_are_the_sampled_tokens(live, ref):
    want = greedy(ref, PROMPTS[2], 8, logprobs=True)
    c = live.client()
    r = c.completions.create(model=model(live), prompt=PROMPTS[2], max_tokens=8,
                             temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.tokens == [ref.tokenizer.decode([t]) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert lp.text_offset[0] == 0
    assert all(x <= 0 for x in lp.token_logprobs)
    streamed = []
    for ch in c.completions.create(model=model(live), prompt=PROMPTS[2], max_tokens=8,
                                   temperature=0, logprobs=0, stream=True):
        if ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(want.logprobs, abs=1e-5)
    messages = [{"role": "user", "content": "hello"}]
    want = ref.chat(messages, SamplingParams(temperature=0, max_tokens=6, logprobs=True),
                    use_tqdm=False)[0]
    r = c.chat.completions.create(model=model(live), messages=messages, max_tokens=6,
                                  temperature=0, logprobs=True)
    got = [x.logprob for x in r.choices[0].logprobs.content]
    assert got == pytest.approx(want.logprobs, abs=1e-5)
    r = c.completions.create(model=model(live), prompt=PROMPTS[2],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs is None  # not asked, not sent
    assert r.usage.completion_tokens == 16  # OpenAI's default max_tokens


def test_seeded_sampling_matches_offline(live, ref):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=10)
    want = ref.generate(PROMPTS[0], params, use_tqdm=False)[0]
    r = live.client().completions.create(model=model(live), prompt=PROMPTS[0], max_tokens=10,
                                         temperature=0.8, top_p=0.9, seed=7,
                                         extra_body={"top_k": 20})
    assert r.choices[0].text == want.text


def test_models_health_tokenize_detokenize_and_request_id(live, ref):
    c = live.client()
    models = c.models.list().data
    assert [m.id for m in models] == [model(live)]
    h = live.http()
    assert h.get("/health").json() == {"status": "ok"}
    ids = ref.tokenizer.encode(PROMPTS[0])
    r = h.post("/tokenize", json={"model": model(live), "prompt": PROMPTS[0]}).json()
    assert r == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    chat = [{"role": "user", "content": "hi"}]
    r = h.post("/tokenize", json={"messages": chat}).json()
    assert r["tokens"] == ref.apply_chat_template(chat)
    assert h.post("/detokenize", json={"tokens": ids}).json() == {
        "prompt": ref.tokenizer.decode(ids)}
    resp = h.post("/v1/completions", json={"model": model(live), "prompt": "a", "max_tokens": 1},
                  headers={"X-Request-Id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    made = h.get("/v1/models").headers["x-request-id"]
    assert len(made) == 32 and made != h.get("/v1/models").headers["x-request-id"]


def test_sse_wire_format(live):
    """The raw stream: `data: {json}` events, the last one `data: [DONE]`."""
    with live.http().stream("POST", "/v1/completions", json={
            "model": model(live), "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1]) and len(events) >= 2


def test_stop_token_ids_and_eos_stop_reasons(live, ref):
    c = live.client()
    full = greedy(ref, PROMPTS[2], 12, ignore_eos=True)
    t = full.token_ids[2]
    assert t not in full.token_ids[:2]
    r = c.completions.create(model=model(live), prompt=PROMPTS[2], max_tokens=12,
                             temperature=0, extra_body={"stop_token_ids": [t],
                                                        "ignore_eos": True})
    assert r.choices[0].text == ref.tokenizer.decode(full.token_ids[:2])
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", t)
    assert r.usage.completion_tokens == 2  # the stop token is not part of the output
    ended = greedy(ref, PROMPTS[2], 12)  # this prompt's greedy run reaches EOS
    assert ended.stop_reason == ref.tokenizer.eos_token_id
    r = c.completions.create(model=model(live), prompt=PROMPTS[2], max_tokens=12,
                             temperature=0)
    assert r.choices[0].text == ended.text
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", None)  # vLLM's
