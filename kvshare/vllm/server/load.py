"""A vLLM server's load, read from its Prometheus ``/metrics``.

vLLM exports ``vllm:num_requests_running``/``_waiting``, ``vllm:kv_cache_usage_perc``, token
counters and per-request latency histograms. :class:`MetricsLoad` turns them into a
:class:`~kvshare.workers.WorkerLoad`:

- **Prefill work ahead of a new request** (``queued_prefill_tokens``). With the kvshare
  connector: its exact count of the tokens still to compute of every request the scheduler
  has looked at (:mod:`kvshare.vllm.connector.backlog`), plus the waiting requests it has not reached
  yet, each at the mean tokens below; the report's ``as_of`` is then the time the engine's
  last step was scheduled, which those counts describe (vLLM's steps can last seconds: a
  request sent after it is not in them). Without it, estimated: vLLM does not export
  the prompt tokens still to compute, and with chunked prefill a request leaves ``waiting``
  as soon as part of its prompt fits a step's budget: most of the prefill work in a busy
  engine is in *running* requests that have not produced their first token. So the requests
  still in prefill are counted: running + waiting, less those decoding (first token seen,
  not finished: ``time_to_first_token_seconds_count`` less ``e2e_request_latency_seconds_count``,
  re-based whenever the engine is seen idle, so a request aborted before its first token does
  not skew it for good). A waiting one costs the mean tokens a request has had to compute
  (its prompt less what vLLM's cache and the KV connector supplied; a turn of a long
  conversation costs its new suffix, not its whole prompt), a running one half that (on
  average half its prefill is done). An estimate; the router adds its own in-flight work.
- **Prefill speed** (``prefill_tokens_per_s``): with the kvshare connector, how fast the
  engine's steps computed its backlog (exact per step: :class:`DrainSpeed`), the rate the
  backlog above drains at; without it (or before a second of draining was seen), estimated
  from when requests finished (:class:`PrefillSpeed`).
- **What a load costs** (``local_load_s``, ``remote_load_s``): the mean seconds a request
  waited for the kvshare connector to load its KV, from this node's pool or with blocks from
  another node (``vllm:kvshare_load_seconds_total{where}`` over ``vllm:kvshare_loads_total``,
  :mod:`kvshare.vllm.connector.stats`), smoothed over reports: the setup, transfer and engine steps a
  load really takes on this server, which a bandwidth probe does not see.
- **What its own cache served** (``prompt_tokens``, ``engine_cached_tokens``): vLLM's
  ``prompt_tokens_total`` and ``prefix_cache_hits_total`` as they stand (cumulative), from
  which the index tells what the engine's own prefix cache, the gpu tier, is worth.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Collection

import httpx

from kvshare.types import WorkerId
from kvshare.vllm.connector.backlog import COUNTERS as BACKLOG_KEYS
from kvshare.workers import WorkerLoad

_LINE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$", re.MULTILINE)
_WAIT = re.compile(r'^vllm:kvshare_load(s|_seconds)_total\{[^}]*where="(local|remote)"[^}]*\}'
                   r"\s+([0-9.eE+-]+)$", re.MULTILINE)
_WANTED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
           "vllm:external_prefix_cache_hits_total",
           "vllm:request_prefill_kv_computed_tokens_sum",
           "vllm:request_prefill_kv_computed_tokens_count",
           "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
           "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count",
           *(f"vllm:kvshare_{k}_total" for k in BACKLOG_KEYS))


AS_OF = "vllm:kvshare_backlog_as_of_seconds_total"


def parse_metrics(text: str, wanted: Collection[str] = _WANTED) -> dict[str, float]:
    """The vLLM gauges and counters this module uses (or those named in ``wanted``), summed
    over engines (label sets); the connector's load waits as ``loads:<where>`` and
    ``load_seconds:<where>``."""
    out: dict[str, float] = {}
    for name, value in _LINE.findall(text):
        if name == AS_OF and value != "NaN":  # a time: the latest engine's
            out[name] = max(out.get(name, 0.0), float(value))
        elif name in wanted and value != "NaN":
            out[name] = out.get(name, 0.0) + float(value)
    for kind, where, value in _WAIT.findall(text):
        key = f"load{kind}:{where}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _smoothed(old: float, new: float, alpha: float) -> float:
    """An exponential moving average's next value (weight ``alpha`` on ``new``; the first
    sample, while ``old`` is 0, is taken as it is)."""
    return new if old == 0 else (1 - alpha) * old + alpha * new


HORIZON_SPANS = 4.0
""":class:`PrefillSpeed` averages over this many of the longest recent prefill spans: finishes
arrive in bursts a span apart, and a few spans' worth of them average out (with 1 span the
estimate swung 0.3-2.6x the true speed on bursts of long prefills, with 4 within 0.75-1.5x)."""


class LoadWait:
    """Mean seconds per load from cumulative ``(seconds, loads)`` counters, smoothed over
    the samples in which loads finished (weight ``alpha`` on the newest)."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.seconds = 0.0
        self._prev: tuple[float, float] | None = None

    def update(self, seconds: float, loads: float) -> float:
        prev, self._prev = self._prev, (seconds, loads)
        if prev is not None and loads > prev[1] and seconds >= prev[0]:
            mean = (seconds - prev[0]) / (loads - prev[1])
            self.seconds = _smoothed(self.seconds, mean, self.alpha)
        return self.seconds


class PrefillSpeed:
    """Prefill tokens per second from a server's cumulative counters, sampled over time.

    vLLM's ``request_prefill_time_seconds`` is each request's own span from first scheduled
    to first token: requests prefilled in the same steps each count the whole span, so under
    concurrency the sum of spans exceeds the time the engine spent (tokens / summed spans
    undercounts the speed by the mean concurrency). The engine's busy time (wall time between
    samples while it had requests) bounds the spent time from the other side (it includes
    decode steps and idle gaps between samples). Both are upper bounds of the time the
    prefills took, so the tighter one is used: over a window of at least ``window_s`` busy
    seconds in which some prefill finished, ``spent = min(busy, summed spans)``. The computed
    tokens and the spans must come from the same finished requests (vLLM observes
    ``request_prefill_kv_computed_tokens`` and ``request_prefill_time_seconds`` together).

    Tokens count in the window in which their request's prefill *finished*, but they were
    computed over the request's whole span, most of it before that window on a slow engine (a
    2,000-token prompt prefilled over 40 s beside others). Windows much shorter than those
    spans read a burst of finishes as a burst of speed (a loaded CPU engine's estimate ran
    10x high) and the windows between them as a lull. So the speed is the ratio of the
    windows' tokens to their spent time, summed with weights that decay over a horizon of
    :data:`HORIZON_SPANS` times the longest recent mean prefill span (at least
    ``window_s / alpha`` busy seconds), and given the finished count (``finished``) a window
    stays open until its busy time reaches the mean span of the requests that finished in it.
    """

    def __init__(self, window_s: float = 1.0, alpha: float = 0.3) -> None:
        if window_s <= 0 or not 0 < alpha <= 1:
            raise ValueError("window_s must be positive and alpha in (0, 1]")
        self.window_s = window_s
        self.alpha = alpha
        self.tokens_per_s = 0.0
        # the last sample: t, tokens, spans, busy, finished
        self._prev: tuple[float, float, float, bool, float | None] | None = None
        self._busy = self._tokens = self._spans = self._finished = 0.0
        self._sum_tokens = self._sum_spent = self._long_span = 0.0  # decayed over the horizon

    def update(self, t: float, computed_tokens: float, prefill_spans_s: float,
               busy: bool, finished: float | None = None) -> float:
        """One sample at time ``t`` (seconds): cumulative computed prompt tokens and summed
        prefill spans, whether the engine has requests now, and (optional) the cumulative
        count of requests those tokens and spans came from. Returns the speed (0 until the
        first window closes)."""
        prev, self._prev = self._prev, (t, computed_tokens, prefill_spans_s, busy, finished)
        if prev is None:
            return self.tokens_per_s
        dt, dn, ds = t - prev[0], computed_tokens - prev[1], prefill_spans_s - prev[2]
        df = finished - prev[4] if finished is not None and prev[4] is not None else 0.0
        if dt < 0 or dn < 0 or ds < 0 or df < 0:  # a restarted server: counters start again
            self._busy = self._tokens = self._spans = self._finished = 0.0
            return self.tokens_per_s
        if busy or prev[3]:
            self._busy += dt
        self._tokens += dn
        self._spans += ds
        self._finished += df
        mean_span = self._spans / self._finished if self._finished else 0.0
        if self._busy >= max(self.window_s, mean_span) and self._tokens > 0:
            spent = min(self._busy, self._spans) if self._spans > 0 else self._busy
            horizon = max(self.window_s / self.alpha,
                          HORIZON_SPANS * max(self._long_span, mean_span))
            keep = math.exp(-self._busy / horizon)
            self._long_span = max(self._long_span * keep, mean_span)
            self._sum_tokens = self._sum_tokens * keep + self._tokens
            self._sum_spent = self._sum_spent * keep + spent
            self.tokens_per_s = self._sum_tokens / self._sum_spent
            self._busy = self._tokens = self._spans = self._finished = 0.0
        return self.tokens_per_s


class DrainSpeed:
    """Backlog tokens an engine computes per second of its steps, from the connector's
    cumulative ``backlog_drained_tokens`` and ``backlog_drain_seconds``
    (:mod:`kvshare.vllm.connector.backlog`: exact per step, decode tokens in the same steps included).

    Each sample's tokens and seconds join sums that decay by ``exp(-seconds / horizon_s)``,
    so the rate is the last ~``horizon_s`` seconds of draining steps (one step's mix of
    prefill and decode does not swing it); 0 until ``min_s`` seconds were seen. An
    engine restarted (a counter went back) starts the sums again from its own counters, and
    keeps the last rate until its own steps add up to ``min_s`` seconds."""

    def __init__(self, horizon_s: float = 10.0, min_s: float = 1.0) -> None:
        if horizon_s <= 0 or min_s < 0:
            raise ValueError("horizon_s must be positive and min_s >= 0 seconds")
        self.horizon_s = horizon_s
        self.min_s = min_s
        self.tokens_per_s = 0.0
        self._prev: tuple[float, float] | None = None
        self._tokens = self._seconds = 0.0  # decayed sums
        self._seen = 0.0  # seconds of draining summed since the engine (re)started

    def update(self, drained_tokens: float, drain_seconds: float) -> float:
        """One sample of the cumulative counters; returns the rate (0: not enough seen)."""
        prev, self._prev = self._prev, (drained_tokens, drain_seconds)
        dn, ds = ((drained_tokens - prev[0], drain_seconds - prev[1]) if prev is not None
                  else (drained_tokens, drain_seconds))
        if dn < 0 or ds < 0:  # a restarted engine: its counters start again (the rate
            self._tokens = self._seconds = self._seen = 0.0  # stays until its steps say)
            dn, ds = drained_tokens, drain_seconds
        if ds > 0:
            keep = math.exp(-ds / self.horizon_s)
            self._tokens = self._tokens * keep + dn
            self._seconds = self._seconds * keep + ds
            self._seen += ds
            if self._seen >= self.min_s and self._tokens > 0:
                self.tokens_per_s = self._tokens / self._seconds
        return self.tokens_per_s


class InPrefill:
    """How many of a server's requests have not produced their first token yet (module
    docstring): from its running and waiting gauges and the first-token and finished counts;
    never fewer than the waiting ones."""

    def __init__(self) -> None:
        self._offset = 0.0  # first tokens less finished while idle: requests that never decode

    def count(self, m: dict[str, float]) -> int:
        active = int(m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0))
        started = (m.get("vllm:time_to_first_token_seconds_count", 0.0)
                   - m.get("vllm:e2e_request_latency_seconds_count", 0.0))
        if active == 0:
            self._offset = started
            return 0
        decoding = started - self._offset
        # a waiting request has no first token (or, preempted, must compute again): the counts
        # can say otherwise after an abort they did not see end (no idle moment re-based them)
        waiting = int(m.get("vllm:num_requests_waiting", 0))
        return max(waiting, min(active, active - int(round(decoding))))


class MetricsLoad:
    """``load()`` -> the server's current :class:`WorkerLoad`, or None if it does not answer."""

    def __init__(self, worker_id: WorkerId, endpoint: str, timeout_s: float = 0.5) -> None:
        self.worker_id = worker_id
        self.url = endpoint.rstrip("/") + "/metrics"
        self._http = httpx.Client(timeout=timeout_s)
        self.speed = PrefillSpeed()
        self.drain = DrainSpeed()
        self.in_prefill = InPrefill()
        self.waits = {w: LoadWait() for w in ("local", "remote")}

    @property
    def prefill_tokens_per_s(self) -> float:
        """The drain rate where the connector reports one (module docstring), else the
        estimate from finished requests."""
        return self.drain.tokens_per_s or self.speed.tokens_per_s

    def load(self) -> WorkerLoad | None:
        try:
            resp = self._http.get(self.url)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return self.from_metrics(parse_metrics(resp.text), time.monotonic())

    def from_metrics(self, m: dict[str, float], now: float) -> WorkerLoad:
        """The load report for one scrape ``m`` (:func:`parse_metrics`) taken at ``now``
        (monotonic seconds), updating the speed estimate."""
        waiting = int(m.get("vllm:num_requests_waiting", 0))
        running = int(m.get("vllm:num_requests_running", 0))
        tokens, count = _computed(m)
        self.speed.update(now, tokens, m.get("vllm:request_prefill_time_seconds_sum", 0.0),
                          running + waiting > 0, count)
        mean_new = tokens / count if count else 0.0
        prefilling = self.in_prefill.count(m)
        drained = m.get("vllm:kvshare_backlog_drained_tokens_total")
        if drained is not None:
            self.drain.update(drained, m.get("vllm:kvshare_backlog_drain_seconds_total", 0.0))
        backlog = _backlog(m)
        if backlog is not None:  # the connector's exact count, and the requests it has not seen
            queued = backlog[0] + max(0, waiting - backlog[1]) * mean_new
        else:
            queued_waiting = min(waiting, prefilling)
            queued = queued_waiting * mean_new + (prefilling - queued_waiting) * mean_new / 2
        wait = {w: lw.update(m.get(f"load_seconds:{w}", 0.0), m.get(f"loads:{w}", 0.0))
                for w, lw in self.waits.items()}
        now_wall = time.time()
        # the connector's counts describe the engine as its last step was scheduled: a request
        # that arrived after is not in them (a router adds its own sent after ``as_of``)
        as_of = m.get(AS_OF, 0.0) if backlog is not None else 0.0
        return WorkerLoad(self.worker_id, int(queued), running + waiting,
                          self.prefill_tokens_per_s, now_wall, waiting=waiting,
                          as_of=as_of if 0 < as_of < now_wall else 0.0,
                          kv_usage=float(m.get("vllm:kv_cache_usage_perc", 0.0)),
                          local_load_s=wait["local"], remote_load_s=wait["remote"],
                          prompt_tokens=int(m.get("vllm:prompt_tokens_total", 0.0)),
                          engine_cached_tokens=int(m.get("vllm:prefix_cache_hits_total", 0.0)))

    def close(self) -> None:
        self._http.close()


def _backlog(m: dict[str, float]) -> tuple[float, int] | None:
    """The kvshare connector's prefill backlog (tokens still to compute, requests looked at and
    not yet scheduled), or None when the server does not export it (no kvshare connector)."""
    added = m.get("vllm:kvshare_backlog_tokens_added_total")
    if added is None:
        return None
    tokens = added - m.get("vllm:kvshare_backlog_tokens_removed_total", 0.0)
    waiting = (m.get("vllm:kvshare_backlog_waiting_added_total", 0.0)
               - m.get("vllm:kvshare_backlog_waiting_removed_total", 0.0))
    return max(0.0, tokens), max(0, int(round(waiting)))


def _computed(m: dict[str, float]) -> tuple[float, float]:
    """Prompt tokens vLLM computed for finished requests (less its own and the connector's
    hits) and how many requests: its per-request histogram, else the token counters with
    the prefill-time count."""
    if "vllm:request_prefill_kv_computed_tokens_count" in m:
        return (m.get("vllm:request_prefill_kv_computed_tokens_sum", 0.0),
                m["vllm:request_prefill_kv_computed_tokens_count"])
    tokens = max(0.0, m.get("vllm:prompt_tokens_total", 0.0) - m.get("vllm:prefix_cache_hits_total", 0.0)
                 - m.get("vllm:external_prefix_cache_hits_total", 0.0))
    return tokens, m.get("vllm:request_prefill_time_seconds_count", 0.0)
