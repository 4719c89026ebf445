"""Mooncake-format request traces, read with ``pyarrow.json``.

Each line: ``timestamp`` (ms from trace start), ``input_length``, ``output_length`` (tokens),
``hash_ids`` (one id per ``block_tokens`` block; an id stands for its block *and every block
before it*). The simulator turns ids into real chained :class:`~kvshare.types.BlockHash` es
with a :class:`~kvshare.hasher.Hasher`, treating each id as one "token" of a one-token block:
``h_i = H(h_{i-1}, id_i)``. Because an id already names its whole prefix, the same id
always gets the same hash, so hashes are memoised per id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.json as pj

from kvshare.hasher import Hasher
from kvshare.types import BlockHash

_REQUIRED = ("timestamp", "input_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Requests of a Mooncake-format JSONL trace, in arrival order.

    ValueError naming the problem if a required column is missing or a row is inconsistent.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace {str(p)!r} not found (see ../shared/traces/SOURCES.md)")
    table = pj.read_json(p)
    missing = [c for c in _REQUIRED if c not in table.column_names]
    if missing:
        raise ValueError(f"trace {p.name} lacks column(s) {missing}: expected Mooncake format")
    ts = table.column("timestamp").to_pylist()
    lens = table.column("input_length").to_pylist()
    outs = (
        table.column("output_length").to_pylist()
        if "output_length" in table.column_names else [0] * len(ts)
    )
    ids = table.column("hash_ids").to_pylist()
    n = len(ts) if limit is None else min(limit, len(ts))
    out = []
    for i in range(n):
        if lens[i] is None or lens[i] <= 0 or not ids[i]:
            raise ValueError(f"trace {p.name} row {i}: needs input_length > 0 and hash_ids")
        out.append(TraceRequest(i, float(ts[i]) / 1000.0, int(lens[i]), int(outs[i] or 0),
                                tuple(int(x) for x in ids[i])))
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return out


class TraceHasher:
    """Memoised chained hashes of trace hash ids under one namespace root."""

    def __init__(self, model_id: str, layout_fingerprint: str, tenant_salt: str = "") -> None:
        self._hasher = Hasher(model_id, layout_fingerprint, 1, salt=tenant_salt)  # one id a block
        self.root = self._hasher.root
        self._memo: dict[int, BlockHash] = {}

    def hashes(self, ids: tuple[int, ...]) -> list[BlockHash]:
        memo = self._memo
        j = 0
        while j < len(ids) and ids[j] in memo:
            j += 1
        out = [memo[x] for x in ids[:j]]
        if j < len(ids):
            parent = out[-1] if out else self.root
            new = self._hasher.hashes(ids[j:], parent=parent)
            for x, h in zip(ids[j:], new, strict=True):
                memo.setdefault(x, h)
            out.extend(new)
        return out
