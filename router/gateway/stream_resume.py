"""Resuming a stream whose worker died after the client was sent part of it.

A greedy request (``temperature`` 0, or a worker that only decodes greedily) gives the same
tokens on any worker serving the same model, so the gateway sends it again to another worker
and relays that stream from where the client is: :class:`Delivered` records the text of each
choice the client was sent, :class:`Skip` drops the resumed stream's events up to that point
(cutting the one that straddles it) and passes the rest through. If the resumed text does not
begin with what was delivered (another model, a sampling difference), :class:`Diverged` is
raised and the gateway ends the stream with its in-band error: a resumed stream is never
spliced into a wrong answer. A sampled request is not resumed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_SEP = b"\n\n"


class Diverged(Exception):
    """The resumed stream's text does not begin with what the client was sent."""


def resumable(body: Mapping[str, Any], greedy_worker: bool) -> bool:
    """Whether a stream of ``body`` can be resumed on another worker: one greedy choice
    (``temperature`` 0, or absent where the worker decodes greedily) and no logprobs (their
    events carry more than text)."""
    temperature = body.get("temperature")
    greedy = temperature == 0 or (temperature is None and greedy_worker)
    return greedy and int(body.get("n") or 1) == 1 and not body.get("logprobs") \
        and not body.get("top_logprobs")


def _events(data: bytes) -> list[bytes]:
    return [e for e in data.split(_SEP) if e]


def _payload(event: bytes) -> dict[str, Any] | None:
    """An event's JSON object (``data: {...}``), or None (``[DONE]``, a comment)."""
    if not event.startswith(b"data: {"):
        return None
    try:
        obj = json.loads(event[6:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _text(choice: Mapping[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


def _with_text(choice: dict[str, Any], text: str) -> dict[str, Any]:
    if isinstance(choice.get("delta"), Mapping):
        return {**choice, "delta": {**choice["delta"], "content": text}}
    return {**choice, "text": text}


class Delivered:
    """What the client was sent: the text of each choice, and whether a chat role event went."""

    def __init__(self) -> None:
        self.text: dict[int, str] = {}
        self.role = False

    def sent(self, data: bytes) -> None:
        """Record ``data``: complete events the gateway yielded to the client."""
        for event in _events(data):
            obj = _payload(event)
            for choice in (obj or {}).get("choices") or []:
                i = int(choice.get("index") or 0)
                self.text[i] = self.text.get(i, "") + _text(choice)
                delta = choice.get("delta")
                if isinstance(delta, Mapping) and delta.get("role"):
                    self.role = True


class Skip:
    """Filters a resumed stream's raw chunks: :meth:`feed` returns the complete events to relay
    (those past what was delivered), keeping a partial event for the next chunk."""

    def __init__(self, delivered: Delivered) -> None:
        self.left = dict(delivered.text)  # text still to skip, per choice
        self.role = delivered.role
        self.buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """The events of ``chunk`` (with what was buffered) to relay; raises :class:`Diverged`."""
        self.buf += chunk
        cut = self.buf.rfind(_SEP)
        if cut < 0:
            return b""
        complete, self.buf = self.buf[:cut + 2], self.buf[cut + 2:]
        return b"".join(self._event(e) for e in _events(complete))

    def flush(self) -> bytes:
        """What is left at the stream's end (an event with no separator)."""
        rest, self.buf = self.buf, b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        obj = _payload(event)
        choices = (obj or {}).get("choices")
        if obj is None or not choices or not any(self.left.values()):
            return self._role_dropped(event, obj)
        out = []
        for choice in choices:
            i = int(choice.get("index") or 0)
            text, skip = _text(choice), self.left.get(i, "")
            n = min(len(text), len(skip))
            if text[:n] != skip[:n]:
                raise Diverged(f"choice {i}: resumed {text[:n]!r}, delivered {skip[:n]!r}")
            self.left[i] = skip[n:]
            if text[n:] or choice.get("finish_reason"):
                out.append(_with_text(choice, text[n:]))
        if not out:
            return b""
        return self._role_dropped(b"data: " + json.dumps({**obj, "choices": out}).encode()
                                  + _SEP, {**obj, "choices": out})

    def _role_dropped(self, event: bytes, obj: Mapping[str, Any] | None) -> bytes:
        """``event``, unless it is a chat role event with no text the client already had."""
        if self.role and obj is not None:
            choices = obj.get("choices") or []
            if choices and all(isinstance(c.get("delta"), Mapping) and c["delta"].get("role")
                               and not c["delta"].get("content") and not c.get("finish_reason")
                               for c in choices):
                return b""
        return event if event.endswith(_SEP) else event + _SEP
