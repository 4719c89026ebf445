"""kv-cache-tester's agentic traces (callanjfox/kv-cache-tester ``traces/``), replayed open-loop.

Format: one JSON object per conversation: ``block_size`` (tokens per id, 64), ``hash_id_scope``
(``local``: ids are unique within one file only), ``tool_tokens``/``system_tokens``, and
``requests``: each ``t`` (s from the conversation's start), ``in``/``out`` tokens,
``hash_ids`` (one id per *full* block: ``floor(in / block_size)``, chained like Mooncake's),
or a ``type: "subagent"`` entry with its own ``requests`` (its ``t`` counts from the entry's).

The replay follows upstream ``trace_replay_tester.py`` where an open-loop replay can:

- Timing: upstream's ``original`` strategy: a request arrives at its conversation's start plus
  its ``t``, with every gap between consecutive requests capped at ``max_delay_s`` (upstream
  ``--max-delay``, 60 s) and scaled by ``time_scale`` (upstream ``--time-scale``). Upstream's
  default ``think-only`` strategy waits for each response, a closed loop on real response
  times, which a replay of modelled prefill (no decode) cannot do.
- Users: ``users`` concurrent users (default: one per conversation). Conversations are dealt
  to users in file order; a user starts its next conversation when its previous one's last
  request arrives (upstream ``--recycle``).
- Sub-agents replay as their own concurrent users, starting at the parent's marker.
- ``warm_prefix_pct`` (upstream ``--warm-prefix-pct``, default 0.5): every conversation and
  sub-agent starts with the same canonical prefix of ``warm_prefix_pct * max(tool_tokens +
  system_tokens)`` tokens (whole blocks), so conversations share it; the rest stays private.
- File-local ids are renumbered densely per file, so two files never share a block by
  accident; ``block_tokens`` may be a multiple of the files' block size (coarser blocks: every
  m-th id, which names its whole prefix, as Mooncake's ids do).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvshare.router.sim.trace import Trace, build_trace, check_prefix_semantics, hash_ids, validate


@dataclass
class _Stream:
    """The requests of one user (a conversation's main line or one sub-agent)."""

    file: int
    requests: list[dict[str, Any]]
    start_s: float = 0.0
    user: int = 0
    times: list[float] = field(default_factory=list)  # arrival of each entry (s)


def read_agentic(
    path: Path | Sequence[Path], limit: int | None, block_tokens: int | None,
    users: int | None = None, warm_prefix_pct: float = 0.5, max_delay_s: float = 60.0,
    time_scale: float = 1.0,
) -> Trace:
    """The requests of kv-cache-tester trace files (a directory or files), replayed as above."""
    if users is not None and users < 1:
        raise ValueError(f"users must be >= 1, got {users} (--users)")
    if not 0.0 <= warm_prefix_pct <= 1.0:
        raise ValueError(f"warm_prefix_pct must be in [0, 1], got {warm_prefix_pct} (--warm-prefix-pct)")
    if not (max_delay_s > 0 and time_scale > 0):
        raise ValueError("max_delay_s and time_scale must be > 0 (--max-delay, --time-scale)")
    files = _files(path)
    docs = [_load(f) for f in files]
    sizes = {int(d.get("block_size", 0)) for d in docs}
    if len(sizes) != 1 or min(sizes) < 1:
        raise ValueError(f"the traces declare block sizes {sorted(sizes)}: replay files of one block size")
    file_block = sizes.pop()
    bt = block_tokens or file_block
    if bt % file_block:
        raise ValueError(
            f"--block-tokens {bt} is not a multiple of the traces' {file_block}-token blocks: "
            f"use {file_block} or a multiple of it"
        )
    step = bt // file_block
    prefix_tokens = warm_prefix_pct * max(
        int(d.get("tool_tokens", 0)) + int(d.get("system_tokens", 0)) for d in docs)
    shared = int(prefix_tokens // bt)
    streams = _schedule([_Stream(i, d["requests"]) for i, d in enumerate(docs)], users,
                        max_delay_s, time_scale)
    rows: list[int] = []
    ts: list[float] = []
    ins: list[float] = []
    outs: list[float] = []
    user_ids: list[int] = []
    chunks: list[list[int]] = []
    counts: list[int] = []
    next_id = shared  # ids 0..shared-1: the canonical warm prefix
    remap: dict[int, dict[int, int]] = {}
    for s in streams:
        ids_of = remap.setdefault(s.file, {})
        for t, r in zip(s.times, s.requests, strict=True):
            if r.get("type") == "subagent":
                continue
            raw = r.get("hash_ids") or []
            full = raw[step - 1::step]
            new = []
            for x in full:
                y = ids_of.get(x)
                if y is None:
                    y = ids_of[x] = next_id
                    next_id += 1
                new.append(y)
            new[:shared] = range(min(shared, len(new)))
            rows.append(len(rows))
            ts.append(t)
            ins.append(r.get("in", np.nan))
            outs.append(r.get("out", 0) or 0)
            user_ids.append(s.user)
            chunks.append(new)
            counts.append(len(new))
            if limit is not None and len(rows) >= limit:
                break
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"no requests in {len(files)} agentic trace file(s)")
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.fromiter((x for c in chunks for x in c), np.float64, int(offsets[-1]))
    name = files[0].parent.name + "/" if len(files) > 1 else files[0].name
    r64 = np.asarray(rows, np.int64)
    arr = [np.asarray(v, np.float64) for v in (ts, ins, outs)]
    ids = hash_ids(name, r64, flat, offsets, what="request")
    del flat
    validate(name, r64, arr[0], arr[1], arr[2], offsets, bt, full_blocks_only=True,
             what="request")
    check_prefix_semantics(name, r64, ids, offsets, what="request")
    return build_trace(
        name, bt, r64, arr[0], arr[1].astype(np.int64), arr[2].astype(np.int64), ids, offsets,
        np.asarray(user_ids, np.int64),
        meta={"format": "agentic", "conversations": len(docs), "users": max(user_ids) + 1,
              "warm_prefix_tokens": shared * bt},
    )


def _files(path: Path | Sequence[Path]) -> list[Path]:
    paths = [path] if isinstance(path, Path) else list(path)
    out: list[Path] = []
    for p in paths:
        out.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    if not out:
        raise ValueError(f"no *.json trace files in {[str(p) for p in paths]}")
    return out


def _load(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"trace {path.name}: not a kv-cache-tester JSON trace ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise ValueError(
            f"trace {path.name}: expected one JSON object with a 'requests' list "
            "(kv-cache-tester format); for Mooncake JSONL pass --format mooncake"
        )
    return doc


def _schedule(
    convs: list[_Stream], users: int | None, max_delay_s: float, time_scale: float
) -> list[_Stream]:
    """Start times and user ids: conversations dealt to ``users`` users back to back, each
    sub-agent a user of its own from its marker's arrival."""
    n_users = len(convs) if users is None else users
    free_at = [0.0] * n_users
    out: list[_Stream] = []
    next_user = n_users
    for i, conv in enumerate(convs):
        u = i % n_users
        conv.user, conv.start_s = u, free_at[u]
        end = conv.start_s
        pending = [conv]
        while pending:
            s = pending.pop()
            out.append(s)
            t, prev = s.start_s, None
            for r in s.requests:
                t_rel = float(r.get("t", 0.0))
                if prev is not None:
                    t += min(max(0.0, t_rel - prev), max_delay_s) * time_scale
                prev = t_rel
                s.times.append(t)
                if r.get("type") == "subagent":
                    child = _Stream(s.file, r.get("requests") or [], t, next_user)
                    next_user += 1
                    pending.append(child)
                end = max(end, t)
        free_at[u] = end
    return out
