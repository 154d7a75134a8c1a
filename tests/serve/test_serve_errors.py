"""Every error status as OpenAI error JSON: 400 (pydantic, parameters the engine cannot honour,
the engine's own ValueError), 401, 404, 413, 503 + Retry-After (a full waiting queue, a full
remote store), 500 before the response starts, an SSE error event after it started (the
others go on), 504 past the timeout."""

from __future__ import annotations

import threading
import uuid

import httpx
import openai
import pytest
import torch

from oasiskv import SamplingParams
from oasiskv.kv.remote_tier import open_store
from oasiskv.serve.server import ServeOptions
from oasiskv.store.remote_store import BlockKey

pytest_plugins = ["live"]


def post(live, path: str, body: dict, **kw) -> httpx.Response:
    return live.http().post(path, json=body, **kw)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("body, param, words", [
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"min_p": 0.1}, "min_p", "unsupported parameter 'min_p'"),
    ({"n": 2}, "n", "one sequence per prompt"),
    ({"best_of": 3}, "best_of", "one sequence"),
    ({"echo": True}, "echo", "not echoed"),
    ({"suffix": "end"}, "suffix", "insertion"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "penalties"),
    ({"presence_penalty": -1}, "presence_penalty", "penalties"),
    ({"repetition_penalty": 1.2}, "repetition_penalty", "penalties"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "logit bias"),
    ({"logprobs": 3}, "logprobs", "logprobs=0"),
    ({"temperature": -1}, None, "temperature must be >= 0"),  # SamplingParams' own check
    ({"max_tokens": 600}, "prompt", "max_tokens is too large: 600"),  # the engine's
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": [5, 99999]}, "prompt", "outside the vocabulary"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only for stream=true"),
])
def test_completion_400s_name_the_problem(live, body, param, words):
    full = {"model": live.state.model_name, "prompt": "hello", **body}
    err = error_of(post(live, "/v1/completions", full), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]
    # the official client sees the same as a BadRequestError
    rest = {k: v for k, v in full.items() if k not in ("model", "prompt")}
    with pytest.raises(openai.BadRequestError, match=words.split(":")[0]):
        live.client().completions.create(model=full["model"], prompt=full["prompt"],
                                         extra_body=rest)


@pytest.mark.parametrize("body, param, words", [
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs", "sampled token"),
    ({"response_format": {"type": "json_object"}}, "response_format", "guided"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
    ({"tool_choice": "auto"}, "tool_choice", "tool calling"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "role 'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "only text"),
    ({"messages": []}, "messages", "non-empty"),
    ({"max_completion_tokens": 0}, None, "max_tokens must be a positive integer"),
])
def test_chat_400s_name_the_problem(live, body, param, words):
    full = {"model": live.state.model_name,
            "messages": [{"role": "user", "content": "hi"}], **body}
    err = error_of(post(live, "/v1/chat/completions", full), 400)
    assert err["param"] == param and words in err["message"]


def test_bad_json_unknown_model_and_route(live):
    err = error_of(live.http().post("/v1/completions", content=b"{not json",
                                    headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    err = error_of(post(live, "/v1/completions", {"model": "gpt-4", "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "gpt-4" in err["message"]
    with pytest.raises(openai.NotFoundError):
        live.client().chat.completions.create(model="gpt-4", messages=[
            {"role": "user", "content": "hi"}])
    error_of(live.http().get("/v1/nothing"), 404)


def test_api_key(start_server):
    with start_server(ServeOptions(api_key="s3cret")) as live:
        body = {"model": live.state.model_name, "prompt": "hi", "max_tokens": 2}
        err = error_of(post(live, "/v1/completions", body), 401)
        assert err["type"] == "authentication_error"
        error_of(post(live, "/v1/completions", body,
                      headers={"Authorization": "Bearer wrong"}), 401)
        error_of(post(live, "/tokenize", {"prompt": "hi"}), 401)
        error_of(live.http().get("/v1/models"), 401)
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").completions.create(**body)
        r = live.client(api_key="s3cret").completions.create(**body)
        assert r.usage.completion_tokens == 2
        assert live.http().get("/health").status_code == 200  # open, as /metrics
        assert live.http().get("/metrics").status_code == 200


def test_body_over_the_limit_is_413(start_server):
    with start_server(ServeOptions(max_body_bytes="2KiB")) as live:
        body = {"model": live.state.model_name, "prompt": "x" * 3000}
        err = error_of(post(live, "/v1/completions", body), 413)
        assert "2048 bytes" in err["message"]

        def chunked():  # no Content-Length: counted as it arrives
            yield b'{"model": "m", "prompt": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}'
        error_of(live.http().post("/v1/completions", content=chunked()), 413)
        small = {"model": live.state.model_name, "prompt": "x" * 100, "max_tokens": 1}
        assert post(live, "/v1/completions", small).status_code == 200


def test_full_waiting_queue_is_503_with_retry_after(start_server):
    with start_server(ServeOptions(max_waiting=1), max_num_seqs=1) as live:
        live.slow_steps(0.02)
        body = {"model": live.state.model_name, "prompt": "hi", "max_tokens": 100,
                "stream": True, "ignore_eos": True}
        with live.http() as h, h.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: dropping it would close the response
            next(lines)  # running: the batch holds 1
            waiter = threading.Thread(target=post, args=(live, "/v1/completions",
                                                         {**body, "stream": False}))
            waiter.start()
            live.wait_for(lambda m: m["oasiskv:num_requests_waiting"] == 1)
            resp = post(live, "/v1/completions", body)
            err = error_of(resp, 503)
            assert resp.headers["retry-after"] == "1" and "--max-waiting 1" in err["message"]
            with pytest.raises(openai.InternalServerError):  # the client's name for 5xx
                live.client().completions.create(model=body["model"], prompt="hi")
        waiter.join()
        live.wait_idle()


def test_a_full_remote_store_is_503_with_retry_after(start_server):
    """The prompt's blocks find no room in the store (its capacity taken by someone else's):
    the request is refused with 503 + Retry-After naming the capacity, nothing of it stays;
    once there is room the same request goes through."""
    name = f"inprocess://serve-full-{uuid.uuid4().hex[:8]}"
    store = open_store(name, (2, 2, 16, 16), torch.float32)  # the tiny model's blocks
    store.capacity_bytes = 4 * store.block_bytes  # a 40-token prompt's 2 blocks x 2 layers
    junk = BlockKey("someone-else", 0, 0)
    store.put_blocks([junk], torch.zeros(1, *store.block_shape))
    with start_server(kv_mode="sparse", top_k=2, remote_store=name,
                      prefix_cache_bytes=0) as live:
        body = {"model": live.state.model_name, "prompt": list(range(3, 43)), "max_tokens": 4}
        resp = post(live, "/v1/completions", body)
        err = error_of(resp, 503)
        assert resp.headers["retry-after"] == "2"
        assert f"capacity {4 * store.block_bytes} bytes" in err["message"]
        assert store.namespaces() == {"someone-else"}
        store.remove("someone-else")
        assert post(live, "/v1/completions", body).status_code == 200
        live.wait_idle()
        assert not store.namespaces()


@pytest.fixture
def culprit(live):
    """A prompt whose requests the engine fails (an injected fault in its forward pass) once
    it has `after` output tokens; its neighbours in the batch are unaffected."""
    prompt = [7, 8, 9, 10, 11]
    after = {"n": 0}

    def hook(batch):
        for seq, _ in batch:
            if seq.token_ids[:5] == prompt and seq.num_output_tokens >= after["n"]:
                raise RuntimeError("injected fault")

    live.llm.engine.step_hooks.append(hook)
    yield prompt, after
    live.llm.engine.step_hooks.remove(hook)
    live.wait_idle()


def test_failure_before_the_response_starts_is_500(live, culprit):
    prompt, _ = culprit
    for stream in (False, True):
        body = {"model": live.state.model_name, "prompt": prompt, "max_tokens": 4,
                "stream": stream}
        err = error_of(post(live, "/v1/completions", body), 500)
        assert err["type"] == "server_error" and "injected fault" in err["message"]


def test_failure_mid_stream_is_an_sse_error_event_and_the_others_go_on(live, ref, culprit):
    prompt, after = culprit
    after["n"] = 3
    other = [20, 21, 22, 23]
    want = ref.generate(other, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0]
    result = {}

    def neighbour():
        r = live.client().completions.create(model=live.state.model_name, prompt=other,
                                             max_tokens=30, temperature=0,
                                             extra_body={"ignore_eos": True})
        result["text"] = r.choices[0].text

    t = threading.Thread(target=neighbour)
    t.start()
    body = {"model": live.state.model_name, "prompt": prompt, "max_tokens": 30,
            "stream": True, "ignore_eos": True}
    with live.http().stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200  # it had started
        events = [e for e in resp.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "injected fault" in events[-2]
    assert any('"text_completion"' in e for e in events[:-2])  # tokens came first
    with pytest.raises(openai.APIError, match="injected fault"):  # the client raises it
        for _ in live.client().completions.create(
                model=live.state.model_name, prompt=prompt, max_tokens=30, stream=True,
                extra_body={"ignore_eos": True}):
            pass
    t.join()
    assert result["text"] == want.text


def test_request_past_its_timeout_is_504_and_aborted(start_server):
    with start_server(ServeOptions(request_timeout=0.3)) as live:
        live.slow_steps(0.05)
        body = {"model": live.state.model_name, "prompt": "hi", "max_tokens": 200,
                "ignore_eos": True}
        err = error_of(post(live, "/v1/completions", body), 504)
        assert err["type"] == "timeout_error" and "0.3 s" in err["message"]
        with live.http().stream("POST", "/v1/completions",
                                json={**body, "stream": True}) as resp:
            events = [e for e in resp.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and "timeout_error" in events[-2]
        m = live.wait_idle()
        assert m["oasiskv:request_finished_total{finished_reason=abort}"] == 2
        assert m["oasiskv:kv_device_bytes_used"] == 0
