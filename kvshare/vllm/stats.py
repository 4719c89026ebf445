"""The connector's transfer counters as vLLM connector stats and Prometheus metrics.

vLLM asks the worker-role connector for :class:`KVShareStats` after every step
(``get_kv_connector_stats``), sums them across workers and steps (:meth:`KVShareStats.aggregate`)
and hands them to its stat loggers; :class:`KVSharePromMetrics` turns them into counters on the
server's ``/metrics``, next to vLLM's own:

- ``vllm:kvshare_loaded_bytes_total{transport}``: KV bytes the connector loaded into vLLM's
  pages, per transport (``shm`` from this node's pool, ``nixl`` / ``objstore`` from another
  node's);
- ``vllm:kvshare_stored_bytes_total``: KV bytes it saved to this node's pool.

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

STORED = "bytes_stored"


def byte_counters(counters: Mapping[str, float]) -> dict[str, float]:
    """The ``bytes_*`` entries of a :class:`kvshare.client.KVShareClient`'s counters
    (``bytes_<transport>`` loaded, ``bytes_stored`` saved)."""
    return {k: float(v) for k, v in counters.items() if k.startswith("bytes_")}


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
    """``data``: bytes moved since the last report, keyed as in :func:`byte_counters`."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVShareStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0.0) + float(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: int(v) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVSharePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvshare_loaded_bytes{transport}`` and ``vllm:kvshare_stored_bytes`` counters."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.loaded = cast(Counter, self._counter_cls(
            name="vllm:kvshare_loaded_bytes",
            documentation="KV bytes the kvshare connector loaded into vLLM's cache, per transport.",
            labelnames=[*labelnames, "transport"]))
        self.stored = cast(Counter, self._counter_cls(
            name="vllm:kvshare_stored_bytes",
            documentation="KV bytes the kvshare connector saved to this node's pool.",
            labelnames=labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if not value or not key.startswith("bytes_"):
                continue
            if key == STORED:
                self.stored.labels(*labels).inc(value)
            else:
                self.loaded.labels(*labels, key.removeprefix("bytes_")).inc(value)
