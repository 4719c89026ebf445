"""An SGLang server's load and cache report, read from its Prometheus ``/metrics``.

SGLang (``--enable-metrics``) exports ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:token_usage`` (its device KV pool in use, 0..1) and, per ``cache_source``
(``device``, ``host``, ``storage``), ``sglang:cached_tokens_total``: the prompt tokens its
radix cache (L1), its HiCache host pool (L2) and its storage tier (L3, kvshare) supplied.
:class:`SglangLoad` turns the first three into a :class:`~kvshare.workers.WorkerLoad` (the
lease renewal routers read) and keeps the cache counters for :meth:`SglangLoad.cached_tokens`.
SGLang exports no count of prompt tokens still to prefill: ``queued_prefill_tokens`` stays 0
and routers count what they sent.
"""

from __future__ import annotations

import re
import time

import httpx

from kvshare.types import WorkerId
from kvshare.workers import WorkerLoad

_LINE = re.compile(r"^(sglang:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$", re.MULTILINE)
_SOURCE = re.compile(r'cache_source="([a-z_]+)"')
CACHED = "sglang:cached_tokens_total"


def parse_sglang_metrics(text: str) -> dict[str, float]:
    """SGLang's gauges and counters summed over label sets; ``cached_tokens_total`` per
    source as ``cached:<source>``."""
    out: dict[str, float] = {}
    for name, labels, value in _LINE.findall(text):
        if value == "NaN":
            continue
        key = name
        if name == CACHED:
            source = _SOURCE.search(labels or "")
            key = f"cached:{source.group(1) if source else 'unknown'}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


class SglangLoad:
    """Polls one SGLang server's ``/metrics``, at most every ``min_interval_s``: a call sooner
    answers the last load, whose ``ts`` says when it was read (routers count what they sent
    since then on top of it). SGLang renders ``/metrics`` in its HTTP process from every
    process's multiprocess files, a cost the lease's 10 Hz renewal would pay ten times a
    second beside the scheduler. None when the server does not answer."""

    def __init__(self, worker_id: WorkerId, endpoint: str, timeout_s: float = 1.0,
                 min_interval_s: float = 0.5) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.worker_id = worker_id
        self.url = f"{endpoint}/metrics"
        self.http = httpx.Client(timeout=timeout_s)
        self.min_interval_s = min_interval_s
        self.last: dict[str, float] = {}
        self._last_load: WorkerLoad | None = None
        self._read_at = -float("inf")

    def load(self) -> WorkerLoad | None:
        now = time.monotonic()
        if self._last_load is not None and now - self._read_at < self.min_interval_s:
            return self._last_load
        try:
            r = self.http.get(self.url)
            r.raise_for_status()
        except httpx.HTTPError:
            self._last_load = None
            return None
        self._read_at = now
        self.last = m = parse_sglang_metrics(r.text)
        self._last_load = WorkerLoad(
            self.worker_id, running=int(m.get("sglang:num_running_reqs", 0)),
            waiting=int(m.get("sglang:num_queue_reqs", 0)),
            kv_usage=min(1.0, max(0.0, m.get("sglang:token_usage", 0.0))), ts=time.time())
        return self._last_load

    def cached_tokens(self) -> dict[str, int]:
        """Prompt tokens served from each cache source so far (``device``, ``host``,
        ``storage``: kvshare's pools), as of the last poll."""
        return {k.split(":", 1)[1]: int(v) for k, v in self.last.items()
                if k.startswith("cached:")}

    def close(self) -> None:
        self.http.close()
