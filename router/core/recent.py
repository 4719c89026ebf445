"""The last routing decisions a router made, for people to look at (the live page).

A bounded ring of :class:`DecisionRecord`: what was decided, why, and the cost model's
estimate of the TTFT it saves; a front end that reads the worker's reply (plain or
streamed) adds what the worker measured (:meth:`RecentDecisions.finish`: reused/computed tokens, prefill time and,
when the worker reports one, its TTFT breakdown). Appending is O(1) and never blocks routing;
nothing here feeds back into decisions.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvshare.router.core.policy import Decision

#: Worker-reported fields (the ``kvshare`` object of a worker's reply) kept per decision.
WORKER_FIELDS = ("reused_tokens", "computed_tokens", "load_s", "prefill_s", "ttft_s")
#: Per-tenant totals kept since the router started (the admin view's usage table).
TENANT_FIELDS = ("requests", "prompt_tokens", "cached_blocks", "est_ttft_saved_s")
#: Keys under which a worker may report a per-request TTFT breakdown ({phase: seconds}).
BREAKDOWN_KEYS = ("ttft_breakdown", "breakdown", "timings")


@dataclass
class DecisionRecord:
    """One decision; ``worker_stats`` fills in when the worker's answer comes back."""

    request_id: str
    at: float  # wall clock (time.time())
    tenant: str
    worker: str
    policy: str
    reason: str
    prompt_tokens: int
    cached_blocks: int
    remote_blocks: int
    est_ttft_s: float
    est_ttft_saved_s: float
    fallback: str = ""
    worker_stats: dict[str, float] = field(default_factory=dict)
    breakdown: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_Entry = tuple[str, float, str, Decision, int, str]
"""A decision as added: request id, wall clock, tenant, decision, prompt tokens, fallback."""


class RecentDecisions:
    """The last ``size`` decisions, newest last, and per-tenant totals of all of them. A
    decision is kept as it was added; its :class:`DecisionRecord` is made when first read or
    finished (most decisions are neither: the ring turns over thousands of times a second)."""

    def __init__(self, size: int = 50) -> None:
        if size < 1:
            raise ValueError(f"RecentDecisions size must be >= 1, got {size}")
        self._ring: deque[_Entry] = deque(maxlen=size)
        self._by_id: dict[str, _Entry] = {}
        self._records: dict[int, DecisionRecord] = {}  # id(entry in the ring) -> its record
        self.tenants: dict[str, dict[str, float]] = {}  # since start, all decisions

    def add(self, request_id: str, d: Decision, tenant: str, prompt_tokens: int,
            fallback: str = "") -> None:
        ring = self._ring
        if len(ring) == ring.maxlen:
            self._by_id.pop(ring[0][0], None)
            self._records.pop(id(ring[0]), None)
        entry = (request_id, time.time(), tenant, d, prompt_tokens, fallback)
        ring.append(entry)
        self._by_id[request_id] = entry
        t = self.tenants.get(tenant)
        if t is None:
            t = self.tenants[tenant] = dict.fromkeys(TENANT_FIELDS, 0.0)
        t["requests"] += 1
        t["prompt_tokens"] += prompt_tokens
        t["cached_blocks"] += d.cached_blocks
        t["est_ttft_saved_s"] += d.est_ttft_saved_s

    def _record(self, entry: _Entry) -> DecisionRecord:
        rec = self._records.get(id(entry))
        if rec is None:
            rid, at, tenant, d, tokens, fallback = entry
            rec = self._records[id(entry)] = DecisionRecord(
                rid, at, tenant, str(d.worker), d.policy, d.reason, tokens, d.cached_blocks,
                d.remote_blocks, d.est_ttft_s, d.est_ttft_saved_s, fallback)
        return rec

    def finish_stream(self, request_id: str, chunk: bytes) -> None:
        """:meth:`finish` from a streamed reply: ``chunk`` holds server-sent events, the
        last of which carries the worker's ``kvshare`` object; anything else is ignored."""
        for line in reversed(chunk.splitlines()):
            if line.startswith(b"data: {") and b'"kvshare"' in line:
                try:
                    kv = json.loads(line[6:]).get("kvshare")
                except ValueError:
                    return
                if isinstance(kv, Mapping):
                    self.finish(request_id, kv)
                return

    def finish(self, request_id: str, kvshare: Mapping[str, Any]) -> None:
        """Attach the worker's own figures (its reply's ``kvshare`` object); unknown ids and
        malformed values are ignored (the record just stays without them)."""
        entry = self._by_id.get(request_id)
        if entry is None:
            return
        rec = self._record(entry)
        for key in WORKER_FIELDS:
            value = kvshare.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                rec.worker_stats[key] = float(value)
        for key in BREAKDOWN_KEYS:
            phases = kvshare.get(key)
            if isinstance(phases, Mapping):
                rec.breakdown = {str(k): float(v) for k, v in phases.items()
                                 if isinstance(v, int | float) and not isinstance(v, bool)}
                break

    def snapshot(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Newest first; only ``tenant``'s when given (a tenant sees its own requests)."""
        return [self._record(e).to_dict() for e in reversed(self._ring)
                if tenant is None or e[2] == tenant]
