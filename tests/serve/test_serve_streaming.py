"""Streaming without a server: what TextStream lets out token by token (complete UTF-8, no
possible stop-string prefix), and the SSE framing of chunks, keep-alives and errors."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import build_tokenizer

from oasiskv.sampling_params import SamplingParams
from oasiskv.serve.errors import EngineFailure
from oasiskv.serve.protocol import Usage
from oasiskv.serve.streaming import TextStream, held_back, sse_events


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("text, stops, n", [
    ("hello wor", ["world"], 3), ("hello w", ["world", "wx"], 1), ("hello", ["world"], 0),
    ("abcab", ["abcabd"], 5), ("xx", ["x"], 0), ("ab", ["b", "bc"], 1), ("", ["ab"], 0),
    ("say EN", ["END", "N!"], 2),
])
def test_held_back_is_the_longest_stop_prefix_at_the_end(text, stops, n):
    assert held_back(text, stops) == n


def test_multibyte_characters_come_out_whole(tok):
    text = "café ☕ naïve – 日本"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # the tiny vocabulary splits these characters into bytes
    stream = TextStream(tok, SamplingParams())
    deltas = [stream.push([t]) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") >= 4  # a character's first bytes alone: nothing to send yet
    assert stream.finish(text) == ""


def test_stop_prefix_is_held_until_it_cannot_be_a_stop(tok):
    def run(text, final):
        stream = TextStream(tok, SamplingParams(stop=["xyz", "q!"]))
        sent = "".join(stream.push([t]) for t in tok.encode(text, add_special_tokens=False))
        return sent, stream.finish(final)

    # "xy" might still become "xyz": held back; the engine's final text (stop cut) ends it
    assert run("abc xy", "abc ") == ("abc ", "")
    # "xyw" can no longer become a stop string: all of it goes out
    assert run("abc xyw", "abc xyw") == ("abc xyw", "")
    assert run("abc q", "abc q") == ("abc ", "q")  # held, then released by the final text
    # include_stop_str_in_output: the final text carries the stop string; it goes out last
    assert run("abc xy", "abc xyz") == ("abc ", "xyz")


def _collect(chunks):
    async def go():
        return [e async for e in sse_events(chunks())]
    return asyncio.run(go())


def test_sse_events_frame_chunks_keepalives_and_done():
    async def chunks():
        yield Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
        yield None
    events = _collect(chunks)
    assert events[0] == 'data: {"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}\n\n'
    assert events[1] == ": keep-alive\n\n"
    assert events[2:] == ["data: [DONE]\n\n"]


def test_an_error_mid_stream_is_an_error_event_then_done():
    async def chunks():
        yield Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        raise EngineFailure("boom")
    events = _collect(chunks)
    assert len(events) == 3 and events[-1] == "data: [DONE]\n\n"
    body = json.loads(events[1].removeprefix("data: "))
    assert body == {"error": {"message": "boom", "type": "server_error", "param": None,
                              "code": 500}}
