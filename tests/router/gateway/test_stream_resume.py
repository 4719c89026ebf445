"""A resumed stream relays only what the client was not sent, and never splices a different
answer onto what it was (router/stream_resume.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvshare.router.gateway.stream_resume import Delivered, Diverged, Skip, resumable


def ev(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text(i: int, t: str, finish: str | None = None) -> bytes:
    return ev({"id": "x", "choices": [{"index": i, "text": t, "finish_reason": finish}]})


def chat(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return ev({"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def texts(data: bytes) -> str:
    out = ""
    for e in data.split(b"\n\n"):
        if e.startswith(b"data: {"):
            c = json.loads(e[6:])["choices"][0]
            out += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return out


def test_only_greedy_single_choice_requests_are_resumed() -> None:
    assert resumable({"temperature": 0}, greedy_worker=False)
    assert resumable({}, greedy_worker=True)  # the reference worker only decodes greedily
    assert not resumable({}, greedy_worker=False)  # vLLM samples by default
    assert not resumable({"temperature": 0.7}, greedy_worker=True)
    assert not resumable({"temperature": 0, "n": 2}, greedy_worker=False)
    assert not resumable({"temperature": 0, "logprobs": 2}, greedy_worker=False)


def test_the_resumed_stream_skips_what_was_delivered_cutting_the_event_across_it() -> None:
    d = Delivered()
    d.sent(text(0, "Hel") + text(0, "lo"))
    skip = Skip(d)
    whole = text(0, "He") + text(0, "llo w") + text(0, "orld", "length") + b"data: [DONE]\n\n"
    out = b"".join(skip.feed(whole[i:i + 7]) for i in range(0, len(whole), 7)) + skip.flush()
    assert texts(out) == " world"  # the client gets "Hello" + " world", each byte once
    assert out.endswith(b"data: [DONE]\n\n")
    assert json.loads(out.split(b"\n\n")[-3][6:])["choices"][0]["finish_reason"] == "length"


def test_a_chat_stream_is_resumed_without_a_second_role_event() -> None:
    d = Delivered()
    d.sent(chat({"role": "assistant", "content": ""}) + chat({"content": "Hi"}))
    skip = Skip(d)
    out = skip.feed(chat({"role": "assistant", "content": ""}) + chat({"content": "Hi"})
                    + chat({"content": " there"}) + chat({}, "stop"))
    assert b'"role"' not in out
    assert texts(out) == " there" and b'"stop"' in out


def test_a_resumed_stream_that_differs_from_what_was_sent_is_refused() -> None:
    d = Delivered()
    d.sent(text(0, "Hello"))
    with pytest.raises(Diverged, match="choice 0"):
        Skip(d).feed(text(0, "Help me"))


def test_nothing_delivered_passes_the_stream_through_unchanged() -> None:
    whole = text(0, "a") + ev({"kvshare": {"cached_tokens": 4}}) + b"data: [DONE]\n\n"
    assert Skip(Delivered()).feed(whole) == whole
