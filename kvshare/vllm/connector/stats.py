"""The connector's transfer counters as vLLM connector stats and Prometheus metrics.

vLLM asks the worker-role connector for :class:`KVShareStats` after every step
(``get_kv_connector_stats``), sums them across workers and steps (:meth:`KVShareStats.aggregate`)
and hands them to its stat loggers; :class:`KVSharePromMetrics` turns them into counters on the
server's ``/metrics``, next to vLLM's own:

- ``vllm:kvshare_loaded_bytes_total{transport}``: KV bytes the connector loaded into vLLM's
  pages, per transport (``shm`` from this node's pool, ``nixl`` / ``objstore`` from another
  node's);
- ``vllm:kvshare_stored_bytes_total``: KV bytes it saved to this node's pool;
- ``vllm:kvshare_load_failed_blocks_total``: share blocks a load planned that did not arrive
  (their holder's host cut off or gone, or too slow for ``load_deadline_s``): vLLM recomputed
  them;
- ``vllm:kvshare_load_seconds_total{where}`` and ``vllm:kvshare_loads_total{where}``: how long
  requests waited for their loads (submitted until vLLM was told they are done) and how
  many, ``where`` = ``local`` (this node's pool) or ``remote`` (a block from another node):
  what a router needs to price a load (:mod:`kvshare.vllm.server.load`);
  ``vllm:kvshare_load_transfer_seconds_total``: the part of those seconds the loads spent
  fetching and copying (the rest waited for engine steps), and
  ``vllm:kvshare_load_stage_seconds_total{stage}`` its parts: ``stage`` a transport (fetching
  over it, the pool's pin round trip included) or ``copy`` (staged blocks into vLLM's pages);
- ``vllm:kvshare_lookup_seconds_total`` and ``vllm:kvshare_lookups_total`` (scheduler role):
  how long requests were held for the connector's lookup (vLLM first asked until it had the
  answer, or gave up on it: :mod:`kvshare.vllm.connector.lookup`) and how many holds ended: what the
  connector adds to a request that vLLM's own
  prefix cache serves; ``vllm:kvshare_lookup_index_seconds_total`` /
  ``vllm:kvshare_lookups_started_total``: the seconds lookups spent in the index call and how
  many started (a hold longer than its index call waited for the engine's next step), and
  ``vllm:kvshare_lookups_abandoned_total``: holds given up as costing more than they could
  save; ``vllm:kvshare_lookups_skipped_total{why}``: requests scheduled with no lookup,
  ``why`` = ``own_cache`` (vLLM's own hit leaves the cluster less than a block to add) or
  ``router`` (the router's hint says the cluster holds no more: :mod:`kvshare.vllm.router_hint`);
  ``vllm:kvshare_router_hints_ignored_total{why}``: hints the connector did not trust,
  ``why`` = ``malformed``, ``expired`` (the request queued ``router_hint_max_age_s`` or more)
  or ``mismatched`` (the router hashed the prompt otherwise);
  ``vllm:kvshare_lookups_from_router_total``: requests planned from the index answer their
  router sent with them (no index call, no hold); ``vllm:kvshare_router_hints_expired_used_total``:
  requests whose hint had expired and whose lookup was not back at once, answered from the
  hint instead of being held for a step;
- ``vllm:kvshare_backlog_tokens_added_total`` / ``_removed_total`` and
  ``vllm:kvshare_backlog_waiting_added_total`` / ``_removed_total`` (scheduler role): the
  prompt tokens the engine still has to compute before first tokens, and the requests the
  scheduler has looked at and not yet scheduled, each as added less removed, as of the step
  scheduled at ``vllm:kvshare_backlog_as_of_seconds_total`` (wall clock) (:mod:`kvshare.vllm.
  backlog`; gauges as counters, since vLLM's stats path sums deltas), and how fast it drains:
  ``vllm:kvshare_backlog_drained_tokens_total`` over ``vllm:kvshare_backlog_drain_seconds_total``
  (backlog tokens the engine's steps computed, and those steps' seconds);
- ``vllm:kvshare_sync_saves_total``, ``vllm:kvshare_sync_save_seconds_total`` and
  ``vllm:kvshare_sync_saves_late_total``: finishing requests that had saves and were held
  until those ended before their last output left the engine (scheduler role; worker role:
  steps of requests with stop strings, held for their saves) (``sync_save_mib``:
  read-after-write, :mod:`kvshare.vllm.connector.save_marks`), the seconds they were held (0 for a
  request whose saves had ended during its decode), and those whose store outlasted the wait
  (finished in the background); ``vllm:kvshare_sync_saves_unmarked_total``: finishing requests
  not held because no worker process maps the marks (a worker on another host: its saves
  finish in the background).

Names start with ``vllm:`` as vLLM's own connector metrics do, so vLLM's re-registration
(``unregister_vllm_metrics``, once per engine in a process) clears them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvshare.vllm.connector.backlog import COUNTERS as BACKLOG_KEYS
from kvshare.vllm.connector.scheduler_side import LOOKUP_WAIT, LOOKUPS_ANSWERED
from kvshare.vllm.connector.worker_side import LOAD_STAGE

STORED = "bytes_stored"


WAITS = ("local", "remote")
LOAD_TRANSFER = "load_seconds"
"""The worker side's seconds spent in loads themselves (fetch and copy)."""
_WAIT_KEYS = tuple(f"{p}{w}" for w in WAITS
                   for p in ("load_reported_seconds_", "loads_")) + (LOAD_TRANSFER, "failed_blocks")
LOOKUP_KEYS = (LOOKUP_WAIT, LOOKUPS_ANSWERED, "lookup_seconds", "lookups", "lookups_abandoned",
               "lookups_skipped", "lookups_skipped_router", "router_hints_malformed",
               "router_hints_expired", "router_hints_mismatched", "lookups_from_router",
               "router_hints_expired_used")
SAVE_KEYS = ("sync_saves", "sync_save_s", "sync_saves_late", "sync_saves_unmarked")
"""The scheduler side's read-after-write counters (finishing requests held for their saves)."""
SKIPPED = {"lookups_skipped": "own_cache", "lookups_skipped_router": "router"}
HINTS_IGNORED = {"router_hints_malformed": "malformed", "router_hints_expired": "expired",
                 "router_hints_mismatched": "mismatched"}


def byte_counters(counters: Mapping[str, float]) -> dict[str, float]:
    """The ``bytes_*`` entries of a :class:`kvshare.client.sdk.KVShareClient`'s counters
    (``bytes_<transport>`` loaded, ``bytes_stored`` saved)."""
    return {k: float(v) for k, v in counters.items() if k.startswith("bytes_")}


def wait_counters(counters: Mapping[str, float]) -> dict[str, float]:
    """The load waits of a :class:`~kvshare.vllm.connector.worker_side.WorkerSide`'s counters
    (``load_reported_seconds_<where>``, ``loads_<where>``, ``load_seconds`` and its stages
    ``load_stage_seconds_<stage>``)."""
    return {k: float(v) for k, v in counters.items()
            if k in _WAIT_KEYS or k.startswith(LOAD_STAGE)}


def save_counters(counters: Mapping[str, float]) -> dict[str, float]:
    """The read-after-write holds of a :class:`~kvshare.vllm.connector.scheduler_side.SchedulerSide`'s
    counters."""
    return {k: float(counters[k]) for k in SAVE_KEYS if k in counters}


def backlog_counters(counters: Mapping[str, float]) -> dict[str, float]:
    """The prefill backlog's cumulative counters (:class:`~kvshare.vllm.connector.backlog.PrefillBacklog`)."""
    return {k: float(counters[k]) for k in BACKLOG_KEYS if k in counters}


def lookup_counters(counters: Mapping[str, float]) -> dict[str, float]:
    """The lookup waits of a :class:`~kvshare.vllm.connector.scheduler_side.SchedulerSide`'s counters."""
    return {k: float(counters[k]) for k in LOOKUP_KEYS if k in counters}


class CounterDelta:
    """What grew in a cumulative counter dict since the last call (the first call: all)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, now: Mapping[str, float]) -> dict[str, float]:
        out = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last = dict(now)
        return {k: v for k, v in out.items() if v > 0}


@dataclass
class KVShareStats(KVConnectorStats):
    """``data``: bytes moved and load waits since the last report, keyed as in
    :func:`byte_counters` and :func:`wait_counters`."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVShareStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0.0) + float(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: int(v) if float(v).is_integer() else round(float(v), 3)
                for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVSharePromMetrics(KVConnectorPromMetrics):
    """The counters of the module docstring."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, documentation: str, *labels: str) -> Counter:
            """``vllm:kvshare_<name>``, labelled by engine and ``labels``."""
            return cast(Counter, self._counter_cls(name=f"vllm:kvshare_{name}",
                                                   documentation=documentation,
                                                   labelnames=[*labelnames, *labels]))

        self.loaded = counter(
            "loaded_bytes", "KV bytes the kvshare connector loaded into vLLM's cache, per "
            "transport.", "transport")
        self.stored = counter(
            "stored_bytes", "KV bytes the kvshare connector saved to this node's pool.")
        self.load_seconds = counter(
            "load_seconds", "Seconds requests waited for kvshare loads, from this node's pool "
            "(local) or with blocks from another node (remote).", "where")
        self.loads = counter("loads", "kvshare loads completed, local or remote.", "where")
        self.load_failed = counter(
            "load_failed_blocks", "Share blocks kvshare loads planned that did not arrive (their "
            "source gone or too slow for the load deadline): vLLM recomputed them.")
        self.load_transfer = counter(
            "load_transfer_seconds", "Seconds kvshare loads spent fetching and copying (the "
            "rest of load_seconds: the engine steps until vLLM learnt they were done).")
        self.load_stage = counter(
            "load_stage_seconds", "Seconds kvshare loads spent per stage: fetching over a "
            "transport (shm, nixl, objstore; the pool's pin round trip included) or copying "
            "staged blocks into vLLM's pages (copy).", "stage")
        self.lookup_seconds = counter(
            "lookup_seconds", "Seconds requests were held for kvshare lookups.")
        self.lookups = counter("lookups", "kvshare lookups answered.")
        self._lookup_extra = {
            "lookup_seconds": counter("lookup_index_seconds",
                                      "Seconds kvshare lookups spent in the index call."),
            "lookups": counter("lookups_started", "kvshare lookups started."),
            "lookups_from_router": counter(
                "lookups_from_router", "Requests planned from the index answer their router "
                "sent with them (no kvshare lookup)."),
            "router_hints_expired_used": counter(
                "router_hints_expired_used", "Requests whose router hint had expired, "
                "answered from it because their kvshare lookup was not back at once."),
            "lookups_abandoned": counter(
                "lookups_abandoned", "kvshare lookup holds given up (could save less than "
                "they cost): scheduled as misses."),
        }
        self._saves = {
            "sync_saves": counter("sync_saves", "Finishing requests held until their kvshare "
                                  "saves ended, before their last output (read-after-write)."),
            "sync_save_s": counter("sync_save_seconds",
                                   "Seconds finishing requests were held for their kvshare saves."),
            "sync_saves_late": counter("sync_saves_late", "Finishing requests whose kvshare "
                                       "saves outlasted the wait and finished in the background."),
            "sync_saves_unmarked": counter(
                "sync_saves_unmarked", "Finishing requests with saves running that were not held: "
                "no worker process maps the save marks (a worker on another host)."),
        }
        self._backlog = {
            "backlog_tokens_added": counter(
                "backlog_tokens_added", "Prompt tokens the engine came to owe before first "
                "tokens (less backlog_tokens_removed: still to compute)."),
            "backlog_tokens_removed": counter(
                "backlog_tokens_removed", "Prompt tokens of the backlog scheduled, or dropped "
                "with their request (finished, aborted, preempted)."),
            "backlog_waiting_added": counter(
                "backlog_waiting_added", "Requests the scheduler looked at, not yet scheduled "
                "(less backlog_waiting_removed: still waiting)."),
            "backlog_waiting_removed": counter(
                "backlog_waiting_removed", "Waiting requests of the backlog scheduled, or "
                "dropped with their request."),
            "backlog_as_of_seconds": counter(
                "backlog_as_of_seconds", "When the step the backlog counts describe was "
                "scheduled (Unix seconds; a counter whose value is the time)."),
            "backlog_drained_tokens": counter(
                "backlog_drained_tokens", "Backlog tokens computed by engine steps with a "
                "request still there at the next step (over backlog_drain_seconds: how fast "
                "the backlog drains)."),
            "backlog_drain_seconds": counter(
                "backlog_drain_seconds", "Seconds those engine steps ran (each from its "
                "scheduling to the next step's)."),
        }
        self.skipped = counter(
            "lookups_skipped", "Requests scheduled with no kvshare lookup: vLLM's own cache "
            "(own_cache) or the router's hint (router) left the cluster nothing to add.", "why")
        self.hints_ignored = counter(
            "router_hints_ignored", "Router hints the kvshare connector did not trust "
            "(malformed; expired: the request queued longer than router_hint_max_age_s; "
            "mismatched: the router hashed the prompt otherwise).",
            "why")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key == LOAD_TRANSFER:
                self.load_transfer.labels(*labels).inc(value)
            elif key.startswith(LOAD_STAGE):
                self.load_stage.labels(*labels, key.removeprefix(LOAD_STAGE)).inc(value)
            elif key.startswith("load_reported_seconds_"):
                self.load_seconds.labels(*labels, key.rsplit("_", 1)[1]).inc(value)
            elif key == "failed_blocks":
                self.load_failed.labels(*labels).inc(value)
            elif key.startswith("loads_"):
                self.loads.labels(*labels, key.removeprefix("loads_")).inc(value)
            elif key == LOOKUP_KEYS[0]:
                self.lookup_seconds.labels(*labels).inc(value)
            elif key == LOOKUP_KEYS[1]:
                self.lookups.labels(*labels).inc(value)
            elif key in self._lookup_extra:
                self._lookup_extra[key].labels(*labels).inc(value)
            elif key in self._saves:
                self._saves[key].labels(*labels).inc(value)
            elif key in self._backlog:
                self._backlog[key].labels(*labels).inc(value)
            elif key in SKIPPED:
                self.skipped.labels(*labels, SKIPPED[key]).inc(value)
            elif key in HINTS_IGNORED:
                self.hints_ignored.labels(*labels, HINTS_IGNORED[key]).inc(value)
            elif not key.startswith("bytes_"):
                continue
            elif key == STORED:
                self.stored.labels(*labels).inc(value)
            else:
                self.loaded.labels(*labels, key.removeprefix("bytes_")).inc(value)
