"""Request traces the simulator replays: one in-memory form, two file formats.

A :class:`Trace` is a sequence of :class:`TraceRequest` in arrival order, stored as flat
numpy columns (a 685,767-request Mooncake trace takes ~150 MB, not the ~5 GB of Python
objects). Block ids follow Mooncake's convention: one id per ``block_tokens`` block, and an id
stands for its block *and every block before it* (equal ids mean an equal prefix). The
simulator turns ids into real chained :class:`~kvshare.types.BlockHash` es with
:class:`~kvshare.hasher.Hasher`, treating each id as one "token" of a one-token block:
``h_i = H(h_{i-1}, id_i)``; because an id names its whole prefix, hashes are memoised per id.

Formats (:func:`read_trace` detects them, or pass ``fmt``):

- ``mooncake``: JSONL, one request a line (:mod:`kvshare.router.sim.trace_mooncake`).
- ``agentic``: kv-cache-tester's per-conversation JSON files (:mod:`kvshare.router.sim.trace_agentic`).

Every reader validates each row (:func:`validate`) and refuses bad input with a ValueError
that names the row and what to change; nothing is replayed from a trace that fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt

from kvshare.hasher import Hasher
from kvshare.types import BlockHash

MAX_ID = 2**32 - 1  # ids are hashed as u32 "tokens"
_MEMO_LIMIT = 1 << 19  # memoised ids before the memo starts over (~70 MB; bounds memory, not results)
I64 = npt.NDArray[np.int64]
U32 = npt.NDArray[np.uint32]
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: ``index`` is its row in the source (file line, or request number for the
    agentic format); ``user`` the concurrent user (conversation or sub-agent) that sent it."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: Sequence[int]
    user: int = 0


@dataclass(frozen=True, eq=False)
class Trace(Sequence[TraceRequest]):
    """Requests in arrival order (ties in source order) as flat columns.

    ``starts[i]:ends[i]`` slices request ``i``'s ids out of ``ids`` (uint32: ids are < 2^32,
    4 bytes each). ``warnings``: things the reader accepted but a user should know (e.g.
    timestamps that look like seconds).
    """

    name: str
    block_tokens: int
    rows: I64
    arrival_s: F64
    input_tokens: I64
    output_tokens: I64
    ids: U32
    starts: I64
    ends: I64
    users: I64
    warnings: tuple[str, ...] = ()
    meta: dict[str, float | int | str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> TraceRequest: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[TraceRequest]: ...
    def __getitem__(self, i: int | slice) -> TraceRequest | Sequence[TraceRequest]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return TraceRequest(
            int(self.rows[i]), float(self.arrival_s[i]), int(self.input_tokens[i]),
            int(self.output_tokens[i]), self.ids[self.starts[i]:self.ends[i]].tolist(),
            int(self.users[i]),
        )

    def __iter__(self) -> Iterator[TraceRequest]:
        ids, starts, ends = self.ids, self.starts.tolist(), self.ends.tolist()
        for i, (row, t, n, out, user) in enumerate(zip(
            self.rows.tolist(), self.arrival_s.tolist(), self.input_tokens.tolist(),
            self.output_tokens.tolist(), self.users.tolist(), strict=True,
        )):
            yield TraceRequest(row, t, n, out, ids[starts[i]:ends[i]].tolist(), user)

    @property
    def total_tokens(self) -> int:
        return int(self.input_tokens.sum())


def build_trace(
    name: str, block_tokens: int, rows: I64, arrival_s: F64, input_tokens: I64,
    output_tokens: I64, ids: U32, offsets: I64, users: I64 | None = None,
    warnings: Sequence[str] = (), meta: dict[str, float | int | str] | None = None,
) -> Trace:
    """A :class:`Trace` from per-request columns in source order (``offsets``: n+1 bounds of
    each request's ids in ``ids``); sorts by arrival, keeping source order for ties."""
    order = np.argsort(arrival_s, kind="stable")
    users = users if users is not None else np.zeros(len(rows), np.int64)
    return Trace(
        name, block_tokens, rows[order], arrival_s[order], input_tokens[order],
        output_tokens[order], ids, offsets[:-1][order], offsets[1:][order], users[order],
        tuple(warnings), dict(meta or {}),
    )


def _fail(
    source: str, what: str, rows: I64, mask: npt.NDArray[np.bool_], problem: Callable[[int], str],
    fix: str,
) -> None:
    """ValueError naming the first row where ``mask`` is set (and how many more), if any."""
    bad = np.flatnonzero(mask)
    if bad.size:
        i = int(bad[0])
        more = f" (and {bad.size - 1} more)" if bad.size > 1 else ""
        raise ValueError(f"trace {source} {what} {int(rows[i]) + 1}{more}: {problem(i)}; {fix}")


def hash_ids(source: str, rows: I64, ids: F64, offsets: I64, what: str = "line") -> U32:
    """``ids`` (float64, as parsed) as uint32 once each is a whole number in [0, 2^32), else a
    ValueError naming the first row (of ``rows``, whose ids ``offsets`` bound) that breaks it.
    Readers call it per chunk, so the float copy of a big trace's ids never exists whole."""
    bad_id = ~((ids >= 0) & (ids <= MAX_ID) & (ids == np.floor(ids)))
    if bad_id.any():
        owner = np.searchsorted(offsets, np.flatnonzero(bad_id), side="right") - 1
        mask = np.zeros(len(rows), bool)
        mask[owner] = True
        _fail(source, what, rows, mask, lambda i: "a hash id is not a whole number in [0, 2^32)",
              "hash ids are non-negative integers")
    return ids.astype(np.uint32)


def validate(
    source: str, rows: I64, arrival_s: F64, input_tokens: F64, output_tokens: F64,
    offsets: I64, block_tokens: int, full_blocks_only: bool, what: str = "line",
) -> None:
    """Refuse the first bad row with a ValueError naming it and the fix.

    Checks: timestamps present, finite, >= 0; ``input_length`` a whole number > 0;
    ``output_length`` a whole number >= 0; one id per block (``offsets`` bound each row's
    ids): ``len(hash_ids) == ceil(input_length / block_tokens)`` (``floor`` with
    ``full_blocks_only``: formats that give ids for full blocks only). Values arrive as float64
    with NaN for missing ones so that fractions and nulls are seen, not truncated. The ids
    themselves are checked by :func:`hash_ids`.
    """

    def fail(mask: npt.NDArray[np.bool_], problem: Callable[[int], str], fix: str) -> None:
        _fail(source, what, rows, mask, problem, fix)

    fail(~np.isfinite(arrival_s), lambda i: f"timestamp is {_show(arrival_s[i])}",
         "every request needs a finite timestamp (ms from trace start)")
    fail(arrival_s < 0, lambda i: f"timestamp {arrival_s[i]:g} is negative",
         "timestamps count from the trace's start (>= 0)")
    fail(~(input_tokens > 0) | (input_tokens != np.floor(input_tokens)),
         lambda i: f"input_length is {_show(input_tokens[i])}",
         "it must be a whole number of tokens > 0")
    fail(~(output_tokens >= 0) | (output_tokens != np.floor(output_tokens)),
         lambda i: f"output_length is {_show(output_tokens[i])}",
         "it must be a whole number of tokens >= 0 (or absent)")
    n_ids = np.diff(offsets)
    need = input_tokens // block_tokens if full_blocks_only else -(-input_tokens // block_tokens)
    rule = "floor" if full_blocks_only else "ceil"
    fits = _block_sizes(input_tokens, n_ids, full_blocks_only)
    hint = (f"the ids fit --block-tokens {fits}" if fits
            else "check that the ids belong to these prompts")
    fail(n_ids != need,
         lambda i: (f"{n_ids[i]} hash ids but input_length {int(input_tokens[i])} needs "
                    f"{rule}({int(input_tokens[i])}/{block_tokens}) = {int(need[i])} at "
                    f"{block_tokens}-token blocks"),
         f"replay with the trace's block size ({hint})")


def check_prefix_semantics(source: str, rows: I64, ids: U32, offsets: I64, what: str = "line") -> None:
    """Refuse ids that break prefix semantics: one id must always follow the same id (or
    always start a prompt), since an id stands for its whole prefix.

    Memory: the sort order (8 bytes an id) plus a few 4- and 1-byte columns, one at a time."""
    if not ids.size:
        return
    starts = np.zeros(ids.size, bool)  # the id starts a prompt (it has no parent)
    starts[offsets[:-1][np.diff(offsets) > 0]] = True
    order = np.argsort(ids, kind="stable")
    sid = ids[order]
    same = sid[1:] == sid[:-1]
    del sid
    parent = np.empty_like(ids)
    parent[0] = 0
    parent[1:] = ids[:-1]
    parent[starts] = 0
    spar = parent[order]
    del parent
    differ = spar[1:] != spar[:-1]
    del spar
    sstart = starts[order]
    differ |= sstart[1:] != sstart[:-1]
    del sstart, starts
    clash = np.flatnonzero(same & differ)
    del same, differ
    if clash.size:
        k = int(clash[0])
        first, second = int(order[k]), int(order[k + 1])
        row_a, row_b = (int(rows[np.searchsorted(offsets, x, side="right") - 1]) for x in (first, second))
        raise ValueError(
            f"trace {source} {what} {row_b + 1}: hash id {int(ids[second])} follows a different "
            f"prefix than at {what} {row_a + 1} (an id stands for its block and every block "
            "before it); give distinct prefixes distinct ids"
        )


def _block_sizes(input_tokens: F64, n_ids: I64, full_blocks_only: bool) -> int | None:
    """A power-of-two block size every row agrees with, if there is one."""
    for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        need = input_tokens // b if full_blocks_only else -(-input_tokens // b)
        if np.array_equal(need, n_ids):
            return b
    return None


def _show(x: float) -> str:
    return "missing (null)" if np.isnan(x) else f"{x:g}"


class TraceHasher:
    """Memoised chained hashes of trace hash ids under one namespace root.

    The memo holds at most ~0.5M ids and starts over when full: a hash is a pure function of
    the id's prefix, so forgetting costs a recomputation, never a different answer.
    """

    def __init__(self, model_id: str, layout_fingerprint: str, tenant_salt: str = "") -> None:
        self._hasher = Hasher(model_id, layout_fingerprint, 1, salt=tenant_salt)  # one id a block
        self.root = self._hasher.root
        self._memo: dict[int, BlockHash] = {}

    def hashes(self, ids: Sequence[int]) -> list[BlockHash]:
        memo = self._memo
        j = 0
        n = len(ids)
        while j < n and ids[j] in memo:
            j += 1
        out = [memo[x] for x in ids[:j]]
        if j < n:
            if len(memo) > _MEMO_LIMIT:
                memo.clear()
            parent = out[-1] if out else self.root
            new = self._hasher.hashes(ids[j:], parent=parent)
            for x, h in zip(ids[j:], new, strict=True):
                memo.setdefault(x, h)
            out.extend(new)
        return out
