"""A vLLM server's load, read from its Prometheus ``/metrics``.

vLLM exports ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:prompt_tokens_total``, ``vllm:prefix_cache_hits_total``
and ``vllm:request_prefill_time_seconds_sum``. :class:`MetricsLoad` turns them into a
:class:`~kvshare.workers.WorkerLoad`: running and waiting requests, KV usage, and the prefill
speed over the last reports (computed prompt tokens per second of prefill). vLLM does not
export the prompt tokens still queued, so ``queued_prefill_tokens`` is the waiting requests
times the mean tokens a request has had to compute so far: its prompt less what vLLM's own
cache and the KV connector supplied (``vllm:external_prefix_cache_hits_total``). A waiting
turn of a long conversation costs its new suffix, not its whole prompt; counting whole
prompts made a worker holding a conversation look busiest exactly when its next turn was
cheapest there. An estimate; the router adds its own in-flight work.
"""

from __future__ import annotations

import re
import time

import httpx

from kvshare.types import WorkerId
from kvshare.workers import WorkerLoad

_LINE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$", re.MULTILINE)
_WANTED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
           "vllm:external_prefix_cache_hits_total",
           "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count")


def parse_metrics(text: str) -> dict[str, float]:
    """The vLLM gauges and counters this module uses, summed over engines (label sets)."""
    out: dict[str, float] = {}
    for name, value in _LINE.findall(text):
        if name in _WANTED and value != "NaN":
            out[name] = out.get(name, 0.0) + float(value)
    return out


class MetricsLoad:
    """``load()`` -> the server's current :class:`WorkerLoad`, or None if it does not answer."""

    def __init__(self, worker_id: WorkerId, endpoint: str, timeout_s: float = 0.5) -> None:
        self.worker_id = worker_id
        self.url = endpoint.rstrip("/") + "/metrics"
        self._http = httpx.Client(timeout=timeout_s)
        self._prev: dict[str, float] = {}
        self.prefill_tokens_per_s = 0.0

    def load(self) -> WorkerLoad | None:
        try:
            resp = self._http.get(self.url)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        m = parse_metrics(resp.text)
        self._update_speed(m)
        waiting = int(m.get("vllm:num_requests_waiting", 0))
        count = m.get("vllm:request_prefill_time_seconds_count", 0.0)
        mean_new = _computed(m) / count if count else 0.0
        return WorkerLoad(self.worker_id, int(waiting * mean_new),
                          int(m.get("vllm:num_requests_running", 0)) + waiting,
                          self.prefill_tokens_per_s, time.time(), waiting=waiting,
                          kv_usage=float(m.get("vllm:kv_cache_usage_perc", 0.0)))

    def _update_speed(self, m: dict[str, float]) -> None:
        prev, self._prev = self._prev, m
        if not prev:
            return
        computed = _computed(m) - _computed(prev)
        spent = (m.get("vllm:request_prefill_time_seconds_sum", 0.0)
                 - prev.get("vllm:request_prefill_time_seconds_sum", 0.0))
        if computed > 0 and spent > 0:
            speed = computed / spent
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = speed if old == 0 else 0.8 * old + 0.2 * speed

    def close(self) -> None:
        self._http.close()


def _computed(m: dict[str, float]) -> float:
    """Prompt tokens vLLM computed: all prompt tokens less its own and the connector's hits."""
    return max(0.0, m.get("vllm:prompt_tokens_total", 0.0) - m.get("vllm:prefix_cache_hits_total", 0.0)
               - m.get("vllm:external_prefix_cache_hits_total", 0.0))
