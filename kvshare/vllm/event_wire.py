"""vLLM's KV-event wire format, decoded without importing vLLM.

vLLM's ZMQ publisher (``--kv-events-config``, ``vllm/distributed/kv_events.py``) sends
multipart messages ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0 per
publisher, ``payload`` a msgpack ``KVEventBatch`` encoded as an array ``[ts, events,
data_parallel_rank]``. Events are tagged unions in one of two shapes, both decoded here:

- **tagged arrays** (vLLM before mid-2026): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, ...]``;
- **tagged maps** (vLLM 0.3x): ``{"type": "BlockStored", "block_hashes": [...], ...}``.

Block hashes are vLLM's (u64 ints, which may exceed 2**63, or bytes): opaque keys here.
Unknown event types decode to None (the caller counts and skips them); a payload that is not
a batch, or an event of a known type with fields of the wrong kind, raises
:class:`MalformedEvents` naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

VllmHash = int | bytes
"""A vLLM block hash as published (``ExternalBlockHash``)."""

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedEvents(ValueError):
    """A payload that is not a vLLM ``KVEventBatch``."""


@dataclass(frozen=True, slots=True)
class PagesStored:
    """vLLM cached full pages ``block_hashes`` (a chain continuing ``parent``).

    ``token_ids`` holds ``len(block_hashes) * block_size`` ids; ``extra_keys`` one entry per
    page (vLLM's untagged keys: LoRA name, ``(mm_id, offset)`` pairs, the cache salt on the
    first page, prompt-embeds digests) or None.
    """

    block_hashes: tuple[VllmHash, ...]
    parent: VllmHash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """vLLM evicted pages ``block_hashes`` from ``medium``."""

    block_hashes: tuple[VllmHash, ...]
    medium: str
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllPagesCleared:
    """vLLM dropped its whole prefix cache (``reset_prefix_cache``)."""


PageEvent = PagesStored | PagesRemoved | AllPagesCleared

_decoder = msgspec.msgpack.Decoder()


def decode_seq(frame: bytes) -> int:
    """The publisher's sequence number from its 8-byte big-endian frame."""
    if len(frame) != 8:
        raise MalformedEvents(f"sequence frame is {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> tuple[float, list[PageEvent | None]]:
    """``(ts, events)`` of one ``KVEventBatch``; unknown event types are None."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedEvents(f"payload is not msgpack: {exc}") from exc
    if isinstance(raw, dict):  # a batch encoded as a map (not what vLLM sends, but harmless)
        raw = [raw.get("ts"), raw.get("events")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedEvents("payload is not a KVEventBatch [ts, events, ...]")
    ts = raw[0]
    if not isinstance(ts, int | float):
        raise MalformedEvents(f"KVEventBatch.ts is {type(ts).__name__}, expected a number")
    return float(ts), [decode_event(ev) for ev in raw[1]]


def decode_event(ev: Any) -> PageEvent | None:
    """One event in either encoding; None for a type this consumer does not know."""
    if isinstance(ev, dict):
        tag = ev.get("type")
        fields = ev
    elif isinstance(ev, list) and ev and isinstance(ev[0], str):
        tag = ev[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, ev[1:], strict=False))
    else:
        raise MalformedEvents(f"event is a {type(ev).__name__}, expected a tagged map or array")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return PagesRemoved(_hashes(fields.get("block_hashes")), _medium(fields.get("medium")),
                            _group(fields.get("group_idx")))
    if tag == "AllBlocksCleared":
        return AllPagesCleared()
    return None


def _stored(f: dict[str, Any]) -> PagesStored:
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    if parent is not None and not isinstance(parent, int | bytes):
        raise MalformedEvents("BlockStored.parent_block_hash must be an int, bytes or null")
    tokens = f.get("token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise MalformedEvents("BlockStored.token_ids must be a list of ints")
    size = f.get("block_size")
    if type(size) is not int or size <= 0:
        raise MalformedEvents(f"BlockStored.block_size must be a positive int, got {size!r}")
    lora = f.get("lora_name")
    if lora is not None and not isinstance(lora, str):
        raise MalformedEvents("BlockStored.lora_name must be a string or null")
    extra = f.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(hashes):
            raise MalformedEvents("BlockStored.extra_keys must hold one entry per block hash")
        extra = tuple(None if k is None else tuple(k) if isinstance(k, list) else (k,)
                      for k in extra)
    return PagesStored(hashes, parent, tokens, size, _medium(f.get("medium")), lora, extra,
                       _group(f.get("group_idx")))


def _hashes(value: Any) -> tuple[VllmHash, ...]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise MalformedEvents("block_hashes must be a list of ints or bytes")
    return tuple(value)


def _medium(value: Any) -> str:
    if value is None:
        return "GPU"  # vLLM's own cache; older versions leave it out
    if not isinstance(value, str):
        raise MalformedEvents(f"medium must be a string, got {type(value).__name__}")
    return value


def _group(value: Any) -> int:
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise MalformedEvents(f"group_idx must be a non-negative int, got {value!r}")
    return value
