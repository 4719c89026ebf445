"""Trace replay through the real policy code, the real GlobalIndex and real pool bookkeeping.

Model (see :mod:`kvshare.router.sim.cluster_model` for the numbers):

- One prefill worker per node; each node runs a :class:`~kvshare.pool.tiered.TieredBlockPool` in
  null mode (no bytes) over host (+ disk) with the configured capacity. Its events feed the
  real :class:`kvshare.actors.index.global_index.GlobalIndex` through ``apply(events)``; routers and workers read
  it with ``match``.
- A request arrives at its trace timestamp. The policy sees the index's match plus the
  router's own pending blocks (:class:`~kvshare.router.core.pending.PendingBlocks`) and each worker's load
  report (queued prefill tokens, requests in flight, measured tokens/s) and picks a worker.
- Each worker serves its queue in order, one request at a time. When a request starts, the
  worker matches again and picks its cut point with the same cost model: blocks on its node
  (``--sharing local``) or on any node (``--sharing global``). It pins the blocks it loads
  (an LRU touch at their holders), reserves slots for the blocks it computes, and commits them
  when prefill ends (events then reach the index). Loaded remote blocks are not copied into
  the node's pool: each pooled block lives where it was computed, so the cluster's capacity
  adds up.
- Each worker also has its engine's own prefix cache (vLLM's, in its GPUs; ``gpu_cache_tokens``,
  LRU): every block it computes *or loads* stays there, published as the worker's gpu tier
  and private to it (:data:`~kvshare.workers.META_GPU_PRIVATE`: no other worker reads it),
  free to reuse. So the worker that served a conversation's turn holds its whole prompt for
  the next turn, as a real engine does; the router's pending blocks are that gpu tier.
- TTFT = queue wait + fetch time + prefill time of the rest (no decode; prefill nodes).
- Hit rate = cached input tokens / input tokens (the last token of a prompt is always
  computed). ``global_lru`` replays the trace in arrival order through one pool holding the
  whole cluster's capacity: the upper bound at that capacity.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvshare.cost import CutPlan, PrefillModel, Source
from kvshare.events import Event
from kvshare.match import MatchResult
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, Reserved, TierSpec
from kvshare.router.core.pending import PendingBlocks
from kvshare.router.core.policy import Candidate, Policy, RouteRequest
from kvshare.router.core.sources import Sharing, SourceMap
from kvshare.router.sim.cluster_model import ClusterConfig
from kvshare.router.sim.trace import TraceHasher, TraceRequest
from kvshare.types import BlockHash, NodeId, Tier, WorkerId, node_location, worker_location
from kvshare.workers import META_GPU_PRIVATE, WorkerInfo, WorkerLoad

_FOREVER = 1e12  # lease TTL in sim seconds: the simulator ends every lease itself
RESULT_COLUMNS = (
    "request", "arrival_s", "worker", "input_tokens", "cached_tokens", "gpu_tokens",
    "host_tokens", "disk_tokens", "remote_tokens", "queue_s", "fetch_s", "prefill_s", "ttft_s",
    "recompute_s", "reason", "est_ttft_s",
)
_INT_COLUMNS = frozenset(
    ("request", "input_tokens", "cached_tokens", "gpu_tokens", "host_tokens", "disk_tokens",
     "remote_tokens"))
_TEXT_COLUMNS = frozenset(("worker", "reason"))


def result_columns() -> dict[str, Any]:
    """Empty per-request result columns: compact arrays for numbers (8 bytes a value), lists
    of shared strings for the worker and the reason."""
    return {
        c: [] if c in _TEXT_COLUMNS else array("q" if c in _INT_COLUMNS else "d")
        for c in RESULT_COLUMNS
    }


class SimIndex:
    """What the simulator needs from the index: GlobalIndex's apply/match (+ namespaces)."""

    def __init__(self, index: Any) -> None:
        self._index = index

    def declare(self, namespace: str) -> None:
        self._index.declare_namespace(namespace, 32)

    def apply(self, events: Sequence[Event]) -> None:
        if events:
            self._index.apply(events)

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        result: MatchResult = self._index.match(namespace, hashes)
        return result


def default_index() -> SimIndex:
    from kvshare.actors.index.global_index import GlobalIndex

    return SimIndex(GlobalIndex())


@dataclass
class _Job:
    req: TraceRequest
    hashes: list[BlockHash]
    worker: int
    reason: str
    est_ttft: float
    est_uncached: int
    est_service: float
    start: float = 0.0
    end: float = 0.0
    uncached: int = 0
    pins: list[tuple[TieredBlockPool, list[int]]] | None = None
    reserved: list[tuple[TieredBlockPool, list[int]]] | None = None


class _Worker:
    def __init__(self, i: int, namespace: str, kv_blocks: int, capacities: dict[str, str]
                 ) -> None:
        self.info = WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (namespace,),
                               meta={META_GPU_PRIVATE: "1", **capacities})
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.kv_blocks = kv_blocks  # blocks of KV its GPUs hold next to the weights
        self.busy_s = 0.0
        self.tps = 0.0  # measured prefill tokens/s (EWMA), 0 = not measured yet

    def load(self, now: float) -> tuple[WorkerLoad, int]:
        """The worker's load report and its active blocks.

        ``queued_prefill_tokens``: uncached tokens still to prefill (queued requests as
        planned when routed, plus the rest of the running one); ``prefill_tokens_per_s``: the
        rate at which the worker expects to drain them (its own plans), else its measured
        average rate, so ``queued / rate`` is the worker's own estimate of its queue wait;
        ``running``: requests queued or running; ``waiting``: queued ones; ``kv_usage``: the
        share of its GPUs' KV room its requests in flight take (capped at 1), as vLLM's
        ``kv_cache_usage_perc`` reads once it has admitted its backlog into the running batch.
        """
        queued = sum(j.est_uncached for j in self.queue)
        drain = sum(j.est_service for j in self.queue)
        active = sum(len(j.hashes) for j in self.queue)
        r = self.running
        if r is not None:
            span = r.end - r.start
            left = max(0.0, r.end - now)
            queued += int(r.uncached * (left / span if span > 0 else 0.0))
            drain += left
            active += len(r.hashes)
        rate = queued / drain if queued > 0 and drain > 0 else self.tps
        n = len(self.queue) + (r is not None)
        usage = min(1.0, active / self.kv_blocks) if self.kv_blocks > 0 else 0.0
        return WorkerLoad(self.info.worker_id, queued, n, rate, now, len(self.queue),
                          kv_usage=usage), active


class Simulator:
    """One policy on one modelled cluster; :meth:`run` replays a trace once."""

    def __init__(
        self,
        config: ClusterConfig,
        policy: Policy,
        sharing: Sharing | str = Sharing.GLOBAL,
        index: SimIndex | None = None,
    ) -> None:
        self.cfg = config
        self.policy = policy
        policy.clock = self._clock  # policies that keep time (ReadyBlocks) keep the sim's
        self.sharing = Sharing(sharing)
        self.cost = policy.cost
        self.true_prefill: PrefillModel = config.worker_prefill()
        self.index = index or default_index()
        self.now = 0.0
        ns = config.namespace
        self.index.declare(ns)
        layout = config.layout
        bpt = layout.bytes_per_token
        tiers = [TierSpec(Tier.HOST, config.host_tokens * bpt)]
        if config.disk_tokens:
            tiers.append(TierSpec(Tier.DISK, config.disk_tokens * bpt))
        kv_blocks = config.kv_capacity_tokens // config.block_tokens
        self.workers = [_Worker(i, ns, kv_blocks, config.capacity_meta())
                        for i in range(config.workers)]
        self.pools = [
            TieredBlockPool(
                PoolConfig(ns, layout, tuple(tiers), location=node_location(w.info.node),
                           lease_ttl_s=_FOREVER),
                None, clock=self._clock,
            )
            for w in self.workers
        ]
        gpu_bytes = config.gpu_cache_capacity_tokens * bpt
        self.gpus = [  # each engine's own prefix cache (module docstring)
            TieredBlockPool(
                PoolConfig(ns, layout, (TierSpec(Tier.GPU, gpu_bytes),),
                           location=worker_location(w.info.worker_id), lease_ttl_s=_FOREVER),
                None, clock=self._clock,
            )
            for w in self.workers
        ] if config.gpu_cache_capacity_tokens >= config.block_tokens else None
        self._private = frozenset(worker_location(w.info.worker_id) for w in self.workers)
        self._node_idx = {node_location(w.info.node): i for i, w in enumerate(self.workers)}
        self._nodes = {w.info.worker_id: w.info.node for w in self.workers}
        self.pending = PendingBlocks(config.pending_ttl_s, clock=self._clock)
        self.hasher = TraceHasher(config.model, layout.fingerprint())
        self.rows: dict[str, Any] = result_columns()
        self.unfit: list[int] = []  # requests whose KV does not fit a worker's GPUs
        self.kv_capacity = config.kv_capacity_tokens
        self._events: list[tuple[float, int, int]] = []
        self._jobs = 0

    def _clock(self) -> float:
        return self.now

    # ------------------------------------------------------------------ replay
    def run(
        self, requests: Iterable[TraceRequest], progress: Callable[[int], None] | None = None
    ) -> dict[str, list[Any]]:
        """Replay ``requests`` (arrival order); returns the per-request result columns."""
        for req in requests:
            self._advance(req.arrival_s)
            self.now = max(self.now, req.arrival_s)
            if req.input_tokens > self.kv_capacity:
                self.unfit.append(req.index)
            else:
                self._route(req)
            if progress is not None:
                progress(1)
        self._advance(math.inf)
        return self.rows

    def _advance(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            t, _, wi = heapq.heappop(self._events)
            self.now = t
            self._complete(wi)

    def _route(self, req: TraceRequest) -> None:
        ns = self.cfg.namespace
        hashes = self.hasher.hashes(req.hash_ids)
        match = self.index.match(ns, hashes)
        pending = self.pending.match(ns, hashes)
        cands = []
        for w in self.workers:
            load, active = w.load(self.now)
            cands.append(Candidate(w.info, load, active))
        d = self.policy.choose(RouteRequest(ns, hashes, req.input_tokens), match, cands, pending)
        wi = int(d.worker[1:])
        w = self.workers[wi]
        if self.gpus is not None:  # the engine will hold every block of it (loaded or computed)
            self.pending.add(ns, worker_location(w.info.worker_id), hashes, Tier.GPU)
        else:
            self.pending.add(ns, node_location(w.info.node), hashes, Tier.HOST)
        plan = d.plan
        cached = plan.cached_tokens if plan is not None else 0
        service = plan.total_s if plan is not None else self.cost.recompute_s(req.input_tokens)
        job = _Job(req, hashes, wi, d.reason, d.est_ttft_s, req.input_tokens - cached, service)
        w.queue.append(job)
        if w.running is None:
            self._start(wi)

    def _start(self, wi: int) -> None:
        w = self.workers[wi]
        job = w.queue.popleft()
        w.running = job
        ns, hashes, total = self.cfg.namespace, job.hashes, job.req.input_tokens
        match = self.index.match(ns, hashes)
        view = SourceMap(match, self._nodes, private=self._private)
        srcs = view.sources_for(w.info.worker_id, w.info.node, self.sharing, self.cost.block_fetch_s)
        plan = self.cost.plan(total, srcs)
        holder = f"job{self._jobs}"
        self._jobs += 1
        job.pins = self._pin(match, srcs[: plan.cut], hashes, wi, holder)
        job.reserved = [self._reserve(self.pools[wi], hashes[plan.cut:], holder)]
        if self.gpus is not None:  # the engine keeps what it loads and computes
            job.reserved.append(self._reserve(self.gpus[wi], hashes, holder))
        c = plan.cached_tokens
        job.uncached = total - c
        prefill_s = self.true_prefill.time(total - c, c)
        job.start, job.end = self.now, self.now + plan.fetch_s + prefill_s
        self._record(job, plan, srcs[: plan.cut], prefill_s)
        heapq.heappush(self._events, (job.end, self._jobs, wi))

    def _reserve(self, pool: TieredBlockPool, hashes: Sequence[BlockHash], holder: str
                 ) -> tuple[TieredBlockPool, list[int]]:
        res = pool.reserve(hashes, holder)
        self.index.apply(pool.take_events())
        return pool, [r.lease_id for r in res if isinstance(r, Reserved)]

    def _pin(
        self, match: MatchResult, srcs: Sequence[Source], hashes: Sequence[BlockHash], wi: int,
        holder: str,
    ) -> list[tuple[TieredBlockPool, list[int]]]:
        per_pool: dict[int, list[BlockHash]] = {}  # -1: the worker's own gpu cache
        for i, src in enumerate(srcs):
            if not src.remote:
                per_pool.setdefault(-1 if src == Source.LOCAL_GPU else wi, []).append(hashes[i])
                continue
            tier_rank = src - Source.REMOTE_GPU
            for loc, m in match.locations.items():
                t = m.tiers[i]
                pi = self._node_idx.get(loc)
                if t is not None and t.rank == tier_rank and pi is not None and pi != wi:
                    per_pool.setdefault(pi, []).append(hashes[i])
                    break
        out = []
        for pi, hs in per_pool.items():
            pool = self.pools[pi] if pi >= 0 else self._gpu(wi)
            leases = pool.pin(hs, holder)
            out.append((pool, [lease.lease_id for lease in leases if lease is not None]))
        return out

    def _gpu(self, wi: int) -> TieredBlockPool:
        assert self.gpus is not None, "a gpu source without a gpu cache"
        return self.gpus[wi]

    def _complete(self, wi: int) -> None:
        w = self.workers[wi]
        job = w.running
        assert job is not None
        for pool, leases in job.pins or []:
            pool.unpin(leases)
        for pool, leases in job.reserved or []:
            if leases:
                pool.commit(leases)
            self.index.apply(pool.take_events())
        span = job.end - job.start
        w.busy_s += span
        if span > 0 and job.uncached > 0:
            rate = job.uncached / span
            w.tps = rate if w.tps == 0 else 0.8 * w.tps + 0.2 * rate
        w.running = None
        if w.queue:
            self._start(wi)

    def _record(self, job: _Job, plan: CutPlan, srcs: Sequence[Source], prefill_s: float) -> None:
        bt = self.cfg.block_tokens
        by = {"gpu": 0, "host": 0, "disk": 0, "remote": 0}
        left = plan.cached_tokens
        for src in srcs:
            n = min(bt, left)
            left -= n
            by["remote" if src.remote else ("gpu", "host", "disk")[src]] += n
        r = self.rows
        total = job.req.input_tokens
        for key, val in (
            ("request", job.req.index), ("arrival_s", job.req.arrival_s),
            ("worker", self.workers[job.worker].info.worker_id), ("input_tokens", total),
            ("cached_tokens", plan.cached_tokens), ("gpu_tokens", by["gpu"]),
            ("host_tokens", by["host"]), ("disk_tokens", by["disk"]),
            ("remote_tokens", by["remote"]), ("queue_s", job.start - job.req.arrival_s),
            ("fetch_s", plan.fetch_s), ("prefill_s", prefill_s),
            ("ttft_s", job.end - job.req.arrival_s),
            ("recompute_s", self.true_prefill.time(total, 0)), ("reason", job.reason),
            ("est_ttft_s", job.est_ttft),
        ):
            r[key].append(val)

    def busy_seconds(self) -> list[float]:
        return [w.busy_s for w in self.workers]


def global_lru(
    requests: Sequence[TraceRequest], config: ClusterConfig, capacity_tokens: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> float:
    """Hit rate of one LRU pool with the whole cluster's capacity (node pools and engines'
    own caches), in arrival order (requests that do not fit a worker are left out, as the
    replay leaves them out)."""
    layout = config.layout
    cap = capacity_tokens if capacity_tokens is not None else config.workers * (
        config.host_tokens + config.disk_tokens + config.gpu_cache_capacity_tokens)
    pool = TieredBlockPool(
        PoolConfig("lru", layout, (TierSpec(Tier.HOST, cap * layout.bytes_per_token),),
                   lease_ttl_s=_FOREVER),
        None,
    )
    hasher = TraceHasher(config.model, layout.fingerprint())
    hit = total = 0
    bt = config.block_tokens
    fits = config.kv_capacity_tokens
    for req in requests:
        if progress is not None:
            progress(1)
        if req.input_tokens > fits:
            continue
        hashes = hasher.hashes(req.hash_ids)
        k = pool.prefix_len(hashes)
        leases = [x.lease_id for x in pool.pin(hashes[:k], "lru") if x is not None]
        pool.unpin(leases)
        res = pool.reserve(hashes[k:], "lru")
        pool.commit([r.lease_id for r in res if isinstance(r, Reserved)])
        pool.take_events()
        hit += max(0, min(k * bt, req.input_tokens - 1))
        total += req.input_tokens
    return hit / total if total else 0.0


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` returns: the reference hit rate (``global_lru``; None when not
    asked for) and, per policy, the per-request rows, each worker's busy seconds and the
    requests that did not fit a worker (not replayed)."""

    reference: float | None
    rows: dict[str, dict[str, Any]]
    busy: dict[str, list[float]]
    unfit: dict[str, list[int]]


def simulate(
    requests: Sequence[TraceRequest],
    config: ClusterConfig,
    policies: Sequence[str],
    sharing: Sharing | str = Sharing.GLOBAL,
    progress: Callable[[int], None] | None = None,
    *,
    reference: bool = True,
    **policy_options: Any,
) -> SimResult:
    """Run each policy on a fresh cluster (and ``global_lru`` first unless ``reference`` is
    False); ``progress(n)`` ticks once per request of each pass."""
    from kvshare.router.core.registry import make_policy

    ref = global_lru(requests, config, progress=progress) if reference else None
    rows: dict[str, dict[str, Any]] = {}
    busy: dict[str, list[float]] = {}
    unfit: dict[str, list[int]] = {}
    cost = config.cost_model()
    for name in policies:
        sim = Simulator(config, make_policy(name, cost, sharing, **policy_options.get(name, {})),
                        sharing)
        rows[name] = sim.run(requests, progress)
        busy[name] = sim.busy_seconds()
        unfit[name] = sim.unfit
    return SimResult(ref, rows, busy, unfit)
