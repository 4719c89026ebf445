"""OpenAI wire format for the reference worker: parse requests, shape responses and chunks.

A request routed by the kvshare gateway carries an extra field::

    "kvshare": {"token_ids": [...], "namespace": "...", "hashes_hex": ["..", ...],
                "cache_salt": "..."}          # cache_salt: only for salted tenants

Then the worker uses those token ids as the prompt (it never re-tokenizes a routed request);
the namespace must be the worker's, and the hashes, if given, must be the worker's hashes of
those tokens under the tenant's cache salt (``cache_salt``, also accepted at the top level as in
vLLM) (a mismatch means gateway and worker disagree on the model: HTTP 400).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvshare.tokenizer import ByteTokenizer, HFTokenizer
from kvshare.types import BlockHash

MAX_TOKENS_DEFAULT = 16
MAX_STOPS = 16


class BadRequest(ValueError):
    """A request the worker cannot serve; the message says what to fix (HTTP 400)."""


@dataclass(frozen=True)
class ParsedRequest:
    """A completion or chat request reduced to what the engine needs."""

    chat: bool
    model: str
    tokens: list[int]
    max_tokens: int
    stream: bool
    hashes: list[BlockHash] | None
    routed: bool
    stop_eos: bool
    salt: str | None = None
    stop: tuple[str, ...] = ()
    deadline: float | None = None  # time.monotonic() by which generation ends (deadline_s)
    max_tokens_given: bool = True  # False: the default, lowered to fit the context
    tenant: str = "default"  # who sent it (the gateway's kvshare.tenant): fair queueing


def _routed_tokens(extra: Any, namespace: str) -> tuple[list[int], list[BlockHash] | None]:
    if not isinstance(extra, Mapping):
        raise BadRequest("'kvshare' must be an object {token_ids, namespace, hashes_hex}")
    ids = extra.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise BadRequest("kvshare.token_ids must be a non-empty list of ints")
    ns = extra.get("namespace")
    if ns is not None and ns != namespace:
        raise BadRequest(f"kvshare.namespace {ns!r} is not this worker's namespace {namespace!r}")
    hashes_hex = extra.get("hashes_hex")
    hashes = None
    if hashes_hex is not None:
        try:
            hashes = [BlockHash(bytes.fromhex(h)) for h in hashes_hex]
        except (TypeError, ValueError) as exc:
            raise BadRequest("kvshare.hashes_hex must be a list of hex strings") from exc
    return ids, hashes


def parse_request(
    body: Any, *, chat: bool, namespace: str, tokenizer: ByteTokenizer | HFTokenizer
) -> ParsedRequest:
    """Validate an OpenAI completions / chat completions body (raises :class:`BadRequest`)."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    given = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = MAX_TOKENS_DEFAULT if given is None else given
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive int, got {max_tokens!r}")
    temperature = body.get("temperature", 0)
    if temperature not in (0, 0.0, None):
        raise BadRequest("the reference worker decodes greedily: set temperature to 0")
    if body.get("n", 1) != 1:
        raise BadRequest("the reference worker returns one choice: set n to 1")
    hashes: list[BlockHash] | None = None
    extra = body.get("kvshare")
    if extra is not None:
        tokens, hashes = _routed_tokens(extra, namespace)
    elif chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        try:
            tokens = tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            tokens = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            tokens = list(prompt)
        else:
            raise BadRequest("'prompt' must be a non-empty string or list of token ids")
    # a routed request's salt is the gateway's (kvshare.cache_salt, absent for an unsalted
    # tenant): a client's own top-level cache_salt must not change its hashes
    salt = extra.get("cache_salt") if isinstance(extra, Mapping) else body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("cache_salt must be a string")
    tenant = extra.get("tenant") if isinstance(extra, Mapping) else None
    return ParsedRequest(
        chat=chat, model=str(body.get("model", "")), tokens=tokens, max_tokens=max_tokens,
        stream=bool(body.get("stream", False)), hashes=hashes, routed=extra is not None,
        stop_eos=not bool(body.get("ignore_eos", False)), salt=salt or None,
        stop=_stops(body.get("stop")), deadline=_deadline(body, extra),
        max_tokens_given=given is not None,
        tenant=tenant if isinstance(tenant, str) and tenant else "default",
    )


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and len(s) <= 1024 for s in stops)):
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOPS} strings "
                         "(each at most 1024 characters)")
    return tuple(s for s in stops if s)


def _deadline(body: Mapping[str, Any], extra: Any) -> float | None:
    """``deadline_s`` (the gateway's, in ``kvshare``, else the client's) as a monotonic time."""
    seconds = extra.get("deadline_s") if isinstance(extra, Mapping) else None
    if seconds is None:
        seconds = body.get("deadline_s")
    if seconds is None:
        return None
    if (not isinstance(seconds, int | float) or isinstance(seconds, bool)
            or not 0 < seconds < float("inf")):
        raise BadRequest(f"deadline_s must be a positive number of seconds, got {seconds!r}")
    return time.monotonic() + float(seconds)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def response_body(
    req: ParsedRequest, rid: str, model: str, text: str, token_ids: Sequence[int],
    finish: str, kv: Mapping[str, Any],
) -> dict[str, Any]:
    """A non-streaming response (``kvshare`` holds what was reused and moved)."""
    usage = {"prompt_tokens": len(req.tokens), "completion_tokens": len(token_ids),
             "total_tokens": len(req.tokens) + len(token_ids)}
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                                  "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "finish_reason": finish, "text": text, "logprobs": None}
        obj = "text_completion"
    choice["token_ids"] = list(token_ids)
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage, "kvshare": dict(kv)}


def chunk_body(
    req: ParsedRequest, rid: str, model: str, text: str, finish: str | None,
    first: bool = False, extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk (``data: {...}`` in server-sent events)."""
    if req.chat:
        delta: dict[str, Any] = {"content": text} if text or not first else {}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice]}
    if extra:
        body.update(extra)
    return body
