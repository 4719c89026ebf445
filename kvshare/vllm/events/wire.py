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



class MalformedEvents(ValueError):
    """A payload that is not a vLLM ``KVEventBatch``."""


@dataclass(frozen=True, slots=True)
class PagesStored:
    """vLLM cached full pages ``block_hashes`` (a chain continuing ``parent``).

    ``token_ids`` holds ``len(block_hashes) * block_size`` ids; ``extra_keys`` one entry per
    page (vLLM's untagged keys: LoRA name, ``(mm_id, offset)`` pairs, the cache salt on the
    first page, prompt-embeds digests) or None. ``group_idx``: the KV-cache group the pages
    are in; ``spec_kind`` / ``sliding_window``: that group's kind (vLLM's
    ``kv_cache_spec_kind``: ``full_attention``, ``sliding_window``, ...) and window (None:
    not sent, or full attention). ``cache_salt``: the tenant salt as SGLang sends it (a field
    of its own, not a page key); None from vLLM, whose salt is in ``extra_keys``.
    """

    block_hashes: tuple[VllmHash, ...]
    parent: VllmHash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int = 0
    spec_kind: str | None = None
    sliding_window: int | None = None
    cache_salt: str | None = None


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


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]


# vLLM's event structs as this consumer reads them: typed decoding checks every field in C.
# Tagged maps (vLLM 0.3x) and tagged arrays (older: same field order, tag first).
class _StoredM(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    cache_salt: str | None = None  # SGLang's: the storing request's salt, a field of its own


class _RemovedM(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedM(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _StoredA(_StoredM, array_like=True, tag="BlockStored"):
    pass


class _RemovedA(_RemovedM, array_like=True, tag="BlockRemoved"):
    pass


class _ClearedA(_ClearedM, array_like=True, tag="AllBlocksCleared"):
    pass


class _BatchA(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredA | _RemovedA | _ClearedA]


class _BatchM(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredM | _RemovedM | _ClearedM]


_batch = msgspec.msgpack.Decoder(_Batch)
# a whole batch of known events in one encoding, decoded in one C call (the common case);
# the encoding that decoded last is tried first
_whole: list[msgspec.msgpack.Decoder[Any]] = [msgspec.msgpack.Decoder(_BatchM),
                                            msgspec.msgpack.Decoder(_BatchA)]
_as_map = msgspec.msgpack.Decoder(_StoredM | _RemovedM | _ClearedM)
_as_array = msgspec.msgpack.Decoder(_StoredA | _RemovedA | _ClearedA)
_untyped = msgspec.msgpack.Decoder()
_KNOWN = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def decode_seq(frame: bytes) -> int:
    """The publisher's sequence number from its 8-byte big-endian frame."""
    if len(frame) != 8:
        raise MalformedEvents(f"sequence frame is {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> tuple[float, list[PageEvent | None]]:
    """``(ts, events)`` of one ``KVEventBatch``; unknown event types are None."""
    for i, whole in enumerate(_whole):
        try:
            fast = whole.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue  # unknown or bad events, or not a batch: event by event below
        if i:
            _whole.reverse()
        return fast.ts, [_known(ev) for ev in fast.events]
    try:
        batch = _batch.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedEvents(f"payload is not a KVEventBatch [ts, events, ...]: {exc}") from exc
    return batch.ts, [decode_event(raw) for raw in batch.events]


def decode_event(raw: bytes | msgspec.Raw) -> PageEvent | None:
    """One msgpack-encoded event in either encoding; None for a type this consumer does not
    know; MalformedEvents for a known type with bad fields."""
    view = memoryview(raw)
    first = view[0] if len(view) else 0
    is_map = 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)
    try:
        ev = (_as_map if is_map else _as_array).decode(raw)
    except msgspec.ValidationError as exc:
        try:
            loose = _untyped.decode(raw)
        except msgspec.DecodeError:
            loose = None
        tag = loose.get("type") if isinstance(loose, dict) else (
            loose[0] if isinstance(loose, list) and loose else None)
        if isinstance(tag, str) and tag not in _KNOWN:
            return None
        raise MalformedEvents(f"bad event: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise MalformedEvents(f"event is not msgpack: {exc}") from exc
    return _known(ev)


def _known(ev: _StoredM | _RemovedM | _ClearedM) -> PageEvent:
    if isinstance(ev, _StoredM):
        return _stored(ev)
    if isinstance(ev, _RemovedM):
        return PagesRemoved(tuple(ev.block_hashes), ev.medium or "GPU", _group(ev.group_idx))
    return AllPagesCleared()


def _stored(ev: _StoredM) -> PagesStored:
    n = len(ev.block_hashes)
    if ev.block_size <= 0:
        raise MalformedEvents(f"BlockStored.block_size must be positive, got {ev.block_size}")
    extra = ev.extra_keys
    keys: tuple[tuple[Any, ...] | None, ...] | None = None
    if extra is not None:
        if len(extra) != n:
            raise MalformedEvents("BlockStored.extra_keys must hold one entry per block hash")
        keys = tuple(None if k is None else tuple(k) for k in extra)
    return PagesStored(tuple(ev.block_hashes), ev.parent_block_hash, ev.token_ids,
                       ev.block_size, ev.medium or "GPU", ev.lora_name, keys,
                       _group(ev.group_idx), ev.kv_cache_spec_kind,
                       ev.kv_cache_spec_sliding_window, ev.cache_salt or None)


def _group(value: int | None) -> int:
    if value is None:
        return 0
    if value < 0:
        raise MalformedEvents(f"group_idx must be non-negative, got {value}")
    return value
