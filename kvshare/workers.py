"""What the index knows about inference workers, and the query interface routers use.

Workers register ``WorkerInfo`` under a lease that their ``WorkerLoad`` reports renew; the
index drops an expired or dead worker together with its gpu-tier entries. The SDK and the
transfer readers talk to the index through :class:`IndexQuery`, implemented by the (sharded)
index client in ``actors`` and by the in-process ``GlobalIndex`` (simulator, unit tests); the
routing core asks for its matches through ``kvshare.router.core.index.RouterIndex``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvshare.match import MatchResult
from kvshare.quick_init import quick_init
from kvshare.types import BlockHash, NodeId, WorkerId


@dataclass(frozen=True)
class WorkerInfo:
    """A registered inference worker. ``endpoint`` is its HTTP base URL ('' if none)."""

    worker_id: WorkerId
    node: NodeId
    namespaces: tuple[str, ...]
    endpoint: str = ""
    tp: int = 1
    layout_fingerprint: str = ""
    meta: dict[str, str] = field(default_factory=dict, compare=False)


META_GPU_PRIVATE = "gpu_private"
"""``WorkerInfo.meta`` key: ``"1"`` when no other worker can read this worker's gpu tier (an
engine's own prefix cache with no kvshare serving path, such as vLLM's): routers credit those
blocks to the worker itself only, never as a remote source for another."""

META_GPU_CACHE_BLOCKS = "gpu_cache_blocks"
"""``WorkerInfo.meta`` key: how many blocks the worker's engine prefix cache holds (a whole
number; least recently used evicted first; e.g. vLLM's ``num_gpu_blocks`` x ``block_size`` /
the share's ``block_tokens``). Absent: no limit is assumed. The cost policy stops counting
the blocks there that the worker's queue will have pushed out before a job queued now starts
(:mod:`kvshare.router.core.recency`)."""

META_POOL_BLOCKS = "pool_blocks"
"""``WorkerInfo.meta`` key: how many blocks its node's pool holds over all its tiers (a whole
number; least recently used evicted first). Absent: no limit is assumed (:mod:`kvshare.router.core.recency`)."""


@quick_init
@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load report (also its liveness heartbeat).

    ``queued_prefill_tokens``: prompt tokens admitted but not yet prefilled;
    ``running``: requests in flight; ``prefill_tokens_per_s``: measured prefill speed
    (0 = unknown); ``ts``: the worker's wall clock at report time (``time.time()``);
    ``waiting``: requests queued but not yet scheduled (engines that say so, e.g. vLLM);
    ``kv_usage``: fraction of the engine's own KV cache in use (0..1, 0 = unknown);
    ``local_load_s`` / ``remote_load_s``: measured seconds a request waits for its KV to load
    from this node's pool / another node's (0 = unknown; e.g. vLLM's kvshare connector);
    ``as_of``: when the engine was in the state the queue counts describe, if earlier than
    ``ts`` (wall clock; 0 = at ``ts``): a vLLM engine's counts are from its last step's
    scheduling, and its steps can last seconds, so a request that reached it after ``as_of``
    is not in them (a router counts its own sent after ``as_of``);
    ``cache_epoch``: changes whenever the worker's own cache (its gpu tier) was emptied (its
    engine or worker process restarted, its prefix cache reset): a start value unique to the
    worker's start (:func:`epoch_base`) plus the clears seen since; when it changes, a router
    forgets the blocks it expected the worker to hold from the requests it sent it before;
    ``prompt_tokens`` / ``engine_cached_tokens``: prompt tokens the engine admitted, and those
    its own prefix cache (the gpu tier) served, since it started (cumulative; 0 = not
    reported; vLLM's ``prompt_tokens_total`` / ``prefix_cache_hits_total``): the index
    prices the gpu tier's worth from them (:mod:`kvshare.actors.index.engine_value`).
    """

    worker_id: WorkerId
    queued_prefill_tokens: int = 0
    running: int = 0
    prefill_tokens_per_s: float = 0.0
    ts: float = 0.0
    waiting: int = 0
    kv_usage: float = 0.0
    local_load_s: float = 0.0
    remote_load_s: float = 0.0
    as_of: float = 0.0
    cache_epoch: int = 0
    prompt_tokens: int = 0
    engine_cached_tokens: int = 0

    @property
    def state_ts(self) -> float:
        """When the engine was in the reported state (``as_of``, else ``ts``)."""
        return self.as_of or self.ts

    def with_queue(self, queued_prefill_tokens: int, running: int) -> WorkerLoad:
        """This report with other queued prefill tokens and running requests (a router's
        view adding its own in-flight work); every other field kept."""
        return WorkerLoad(self.worker_id, queued_prefill_tokens, running,
                          self.prefill_tokens_per_s, self.ts, self.waiting, self.kv_usage,
                          self.local_load_s, self.remote_load_s, self.as_of, self.cache_epoch,
                          self.prompt_tokens, self.engine_cached_tokens)


def known_median(values: Sequence[float]) -> float:
    """The (upper) median of the positive ``values`` (0 = none known): how every reader of
    worker reports (the router's cost model, the tier value ledger's pricing) reduces them."""
    known = sorted(v for v in values if v > 0)
    return known[len(known) // 2] if known else 0.0


def measured_prefill_tokens_per_s(reports: Sequence[WorkerLoad]) -> float:
    """The workers' median reported prefill speed, to 10 tokens/s (0 = none reported yet): the
    figure the router's cost model prices a prompt token at
    (:meth:`kvshare.router.core.routing.CostInputs.measured`)."""
    return float(round(known_median([r.prefill_tokens_per_s for r in reports]), -1))


def epoch_base() -> int:
    """A :attr:`WorkerLoad.cache_epoch` start value for a worker starting now (the wall clock
    in milliseconds): a restarted worker process counts its clears from another base, so its
    reports show the restart even before its cache is emptied again (a count from 0 would
    repeat the last incarnation's value)."""
    return time.time_ns() // 1_000_000


@runtime_checkable
class IndexQuery(Protocol):
    """Read side of the global index, as routers and workers use it."""

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Per-location holdings of the prefix ``hashes`` (see :mod:`kvshare.match`). An index
        that cannot answer returns an empty result with ``unavailable`` set to the reason."""
        ...

    async def match_async(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Same as :meth:`match`, without blocking the event loop."""
        ...


@runtime_checkable
class WorkerRegistrar(Protocol):
    """Where workers register and report load (the index client and ``GlobalIndex``)."""

    def register_worker(self, info: WorkerInfo) -> int:
        """Register (or re-register) a worker; returns the generation its gpu-tier events
        must carry."""
        ...

    def report_load(self, load: WorkerLoad) -> bool:
        """Renew the worker's lease with ``load``; False when the index does not know it
        (restarted, expired): the worker registers again."""
        ...

    def unregister_worker(self, worker_id: WorkerId | str) -> int:
        """Forget the worker and drop its gpu-tier entries; returns how many were dropped."""
        ...
