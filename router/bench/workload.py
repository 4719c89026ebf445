"""What ``kvshare bench`` sends: a trace or a log of chat requests as :class:`BenchRequest` s.

Traces are read by the simulator's readers (:func:`kvshare.router.sim.trace_read.read_trace`,
with their input checks: a bad row is a ValueError naming it, and nothing is sent). A hash id
stands for its block and every block before it; the agentic reader already scopes ids per
conversation. Each id becomes one block of token ids (:func:`token_block`), a pure function of
the id and the position in the block, so equal ids give equal blocks and different ids
different ones (two blocks agree only if all ``block_tokens`` draws collide).

A log of chat requests is JSONL, one ``{"messages": [...], "timestamp": s}`` a line
(``max_tokens`` optional): sent to ``/v1/chat/completions`` as logged, at the logged times
(seconds, counted from the first request).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvshare.router.sim.trace import Trace
from kvshare.router.sim.trace_read import read_trace

TOKEN_SCHEME = "splitmix64-v1"
"""Versioned: a change to :func:`token_block` changes every prompt (and its hit rate)."""
LOWEST_TOKEN = 100  # ids below are often special tokens
U64 = npt.NDArray[np.uint64]
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: ``row`` of its source; ``arrival_s`` from the workload's start (unscaled);
    ``prompt`` token ids (``/v1/completions``) or ``messages`` (``/v1/chat/completions``)."""

    row: int
    arrival_s: float
    max_tokens: int
    prompt: tuple[int, ...] = ()
    messages: tuple[dict[str, Any], ...] = ()
    user: int = 0


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    block_tokens: int
    truncated: int = 0  # prompts cut to fit the model's context
    warnings: tuple[str, ...] = ()


def _splitmix64(x: U64) -> U64:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def token_block(hash_id: int, block_tokens: int, vocab: int) -> list[int]:
    """The ``block_tokens`` token ids of hash id ``hash_id``, each in [100, vocab)."""
    if vocab <= LOWEST_TOKEN + 1:
        raise ValueError(f"vocab must be > {LOWEST_TOKEN + 1}, got {vocab} (--vocab)")
    pos = np.arange(block_tokens, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64(hash_id) * np.uint64(1 << 32) + pos  # (id < 2^32, pos < 2^32): unique
    z = _splitmix64(x)
    ids: list[int] = (z % np.uint64(vocab - LOWEST_TOKEN) + np.uint64(LOWEST_TOKEN)).tolist()
    return ids


def from_trace(trace: Trace, vocab: int, max_tokens: int | None = None,
               max_model_len: int | None = None, limit: int | None = None) -> Workload:
    """The requests of ``trace`` (its first ``limit``): prompt = the blocks of its ids, cut to
    ``input_tokens`` (ids given for full blocks only are padded with a block private to the
    request); ``max_tokens`` = the trace's output length (at least 1) capped at ``max_tokens``;
    a prompt longer than ``max_model_len - max_tokens`` keeps its first tokens (counted)."""
    b = trace.block_tokens
    memo: dict[int, list[int]] = {}
    out: list[BenchRequest] = []
    truncated = 0
    for i, r in enumerate(trace):
        if limit is not None and i >= limit:
            break
        tokens: list[int] = []
        for h in r.hash_ids:
            blk = memo.get(h)
            if blk is None:
                blk = memo[h] = token_block(h, b, vocab)
            tokens.extend(blk)
        if len(tokens) < r.input_tokens:  # agentic: ids for full blocks only; the tail is new
            tail = token_block((1 << 32) + i, r.input_tokens - len(tokens), vocab)
            tokens.extend(tail)
        tokens = tokens[:r.input_tokens]
        n_out = max(1, r.output_tokens)
        if max_tokens is not None:
            n_out = min(n_out, max_tokens)
        if max_model_len is not None and len(tokens) + n_out > max_model_len:
            tokens = tokens[:max(1, max_model_len - n_out)]
            truncated += 1
        out.append(BenchRequest(r.index, r.arrival_s, n_out, tuple(tokens), user=r.user))
    return Workload(trace.name, out, b, truncated, trace.warnings)


def read_chat_log(path: Path, max_tokens: int | None = None, limit: int | None = None,
                  default_max_tokens: int = 128) -> Workload:
    """A JSONL log of chat requests, checked whole before anything is sent: every line a JSON
    object with ``messages`` (a non-empty list of ``{role: str, content: str}``) and a finite
    ``timestamp`` (s); ``max_tokens`` optional (a whole number >= 1)."""
    rows: list[tuple[int, float, int, tuple[dict[str, Any], ...]]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) >= limit:
                break
            rows.append(_chat_row(path.name, n, line, max_tokens, default_max_tokens))
    if not rows:
        raise ValueError(f"chat log {path.name} has no requests")
    t0 = min(t for _, t, _, _ in rows)
    reqs = sorted((BenchRequest(n - 1, t - t0, m, messages=msgs) for n, t, m, msgs in rows),
                  key=lambda r: r.arrival_s)
    return Workload(path.name, reqs, 0)


def _chat_row(name: str, n: int, line: str, cap: int | None, default: int
              ) -> tuple[int, float, int, tuple[dict[str, Any], ...]]:
    def bad(field: str, problem: str) -> ValueError:
        return ValueError(f"chat log {name} line {n}: {field} {problem}")

    try:
        obj = json.loads(line)
    except ValueError as e:
        raise bad("the line", f"is not JSON ({e}); one request object a line") from None
    if not isinstance(obj, dict):
        raise bad("the line", "is not a JSON object")
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "is missing or empty; give a list of {role, content}")
    for k, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise bad(f"messages[{k}]", "needs a string role and a string content")
    t = obj.get("timestamp")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise bad("timestamp", f"is {t!r}; give seconds as a finite number")
    m_out = obj.get("max_tokens", default)
    if isinstance(m_out, bool) or not isinstance(m_out, int) or m_out < 1:
        raise bad("max_tokens", f"is {m_out!r}; give a whole number >= 1 (or leave it out)")
    if cap is not None:
        m_out = min(m_out, cap)
    return n, float(t), m_out, tuple(msgs)


def detect_chat_log(path: Path) -> bool:
    """Whether ``path`` is a file whose first line is an object with ``messages``."""
    if path.is_dir():
        return False
    with open(path, "rb") as f:
        first = f.readline(1 << 26)
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and "messages" in obj


def read_source(paths: Sequence[Path], fmt: str = "auto", *, block_tokens: int | None = None,
                max_tokens: int | None = None, limit: int | None = None,
                users: int | None = None, warm_prefix_pct: float | None = None,
                max_delay_s: float | None = None) -> Trace | Workload:
    """The checked requests of ``paths`` (``fmt``: auto, mooncake, agentic or chat): a trace
    (made into requests per endpoint by :func:`from_trace`) or a chat log's workload. Nothing
    is sent before this returns: a bad row is a ValueError naming it. ``users``,
    ``warm_prefix_pct``, ``max_delay_s``: the agentic replay's knobs
    (:func:`kvshare.router.sim.trace_agentic.read_agentic`; None: its default)."""
    agentic = {"users": users, "warm_prefix_pct": warm_prefix_pct, "max_delay_s": max_delay_s}
    if fmt == "chat" or (fmt == "auto" and len(paths) == 1 and paths[0].is_file()
                         and detect_chat_log(paths[0])):
        if len(paths) != 1:
            raise ValueError("replay one chat log at a time")
        knobs = [k for k, v in agentic.items() if v is not None]
        if block_tokens is not None or knobs:
            raise ValueError(f"{['block_tokens', *knobs] if block_tokens else knobs} apply to "
                             "traces, not to a chat log")
        return read_chat_log(paths[0], max_tokens, limit)
    return read_trace(list(paths), limit, fmt=None if fmt == "auto" else fmt,
                      block_tokens=block_tokens, users=users,
                      warm_prefix_pct=warm_prefix_pct, max_delay_s=max_delay_s)
