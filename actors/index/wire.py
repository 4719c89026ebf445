"""The index's wire format for matches: one bytes argument in, one bytes result out.

A Ray actor call's fixed cost grows with every argument (each is serialized and deserialized
on its own) and with a result that is not ``bytes`` (bytes pass through as they are; anything
else goes through Ray's generic serializer; the call rates are on the results page). So a
match travels as:

- query: ``u8 hash_len | u16 len(namespace) | namespace (utf-8) | hashes`` (the hashes
  concatenated, ``hash_len`` bytes each);
- reply: the ``(num_blocks, runs)`` of :meth:`kvshare.actors.index.global_index.GlobalIndex.match_runs`, pickled
  by the index itself (the same pickle Ray would use, minus Ray's per-object overhead).

Several queries can share one call (:func:`encode_queries`: each query prefixed by its u32
length; the reply pickles the list of answers), which spreads the call's fixed cost over them.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, cast

from kvshare.actors.index.runs import Runs

_HEAD = struct.Struct("<BH")
_LEN = struct.Struct("<I")


def encode_query(namespace: str, blob: bytes, hash_len: int) -> bytes:
    """One match query as bytes (``blob``: the hashes concatenated, ``hash_len`` bytes each)."""
    ns = namespace.encode("utf-8")
    if not 0 < hash_len < 256 or len(ns) >= 1 << 16:
        raise ValueError(f"hash_len must be in 1..255 and the namespace short, got {hash_len}")
    return _HEAD.pack(hash_len, len(ns)) + ns + blob


def decode_query(query: bytes) -> tuple[str, bytes, int]:
    """``(namespace, hashes blob, hash_len)`` of :func:`encode_query`; ValueError if malformed."""
    if not isinstance(query, bytes) or len(query) < _HEAD.size:
        raise ValueError("a match query is bytes from kvshare.actors.index.wire.encode_query")
    hash_len, n = _HEAD.unpack_from(query)
    end = _HEAD.size + n
    if len(query) < end:
        raise ValueError("truncated match query: its namespace runs past the end")
    try:
        namespace = query[_HEAD.size:end].decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("match query namespace is not utf-8") from None
    return namespace, query[end:], hash_len


def encode_runs(num_blocks: int, runs: Runs) -> bytes:
    """A match reply (see the module docstring)."""
    return pickle.dumps((num_blocks, runs), protocol=pickle.HIGHEST_PROTOCOL)


def decode_runs(reply: bytes) -> tuple[int, Runs]:
    """``(num_blocks, runs)`` of :func:`encode_runs` (a reply of this cluster's own index)."""
    out: Any = pickle.loads(reply)  # noqa: S301 - our index actor's reply, like any Ray result
    return cast(tuple[int, Runs], out)


def encode_queries(queries: list[bytes]) -> bytes:
    """Several :func:`encode_query` queries as one bytes argument."""
    return b"".join(_LEN.pack(len(q)) + q for q in queries)


def decode_queries(blob: bytes) -> list[bytes]:
    """The queries of :func:`encode_queries`; ValueError if the framing is broken."""
    if not isinstance(blob, bytes):
        raise ValueError("a batch of match queries is bytes from kvshare.actors.index.wire.encode_queries")
    out, pos = [], 0
    while pos < len(blob):
        if pos + _LEN.size > len(blob):
            raise ValueError("truncated batch of match queries")
        (n,) = _LEN.unpack_from(blob, pos)
        pos += _LEN.size
        if pos + n > len(blob):
            raise ValueError("truncated batch of match queries")
        out.append(blob[pos:pos + n])
        pos += n
    return out


def encode_answers(answers: list[tuple[int, Runs]]) -> bytes:
    return pickle.dumps(answers, protocol=pickle.HIGHEST_PROTOCOL)


def decode_answers(reply: bytes) -> list[tuple[int, Runs]]:
    out: Any = pickle.loads(reply)  # noqa: S301 - our index actor's reply, like any Ray result
    return cast(list[tuple[int, Runs]], out)
