"""Which holders will still hold a plan's blocks when a job queued now starts.

A tier that evicts its least recently used block (an engine's prefix cache, a node's pool)
holds ``capacity`` blocks. A block it holds now is still there later only if fewer than
``capacity`` other blocks entered it in between, unless a job used it meanwhile: whatever the
block's rank now, once ``capacity`` blocks have been written there every block not used since
is gone. Nothing in that is tuned: it is the capacity the tier reports
(:data:`~kvshare.workers.META_GPU_CACHE_BLOCKS`, :data:`~kvshare.workers.META_POOL_BLOCKS`)
and the work queued in front of the job.

The jobs queued at a worker write at least the blocks they compute (their queued prefill
tokens, in blocks) into its engine's cache and into its node's pool, spread over its queue
wait. So by ``t`` seconds from now worker ``j`` has written ``queued_j * min(1, t / wait_j)``
blocks there: a lower bound (requests routed later write too, and a job's loaded blocks enter
its engine's cache as well), so a location this marks lost is lost, and a plan for a job that
starts in ``t`` seconds must not count its blocks, except the ones a job ahead uses again (the
router's pending and ready blocks, which :class:`~kvshare.router.core.sources.SourceMap` and
:class:`~kvshare.router.core.ready.ReadyBlocks` keep apart from the index's holdings).

Under deep queues (hundreds of seconds, many times a tier's turnover) that is most of the reuse
a plan would otherwise count, and the queue estimates built from such plans run low: the
requests sent where queues look short wait longest.

The cost policy uses this only when asked (``CostPolicy(survival=True)``, ``sim_sweep.py
--survival``): measured on the sweep's overloaded cells it did not make ``cost`` win more
(README). What it lacks is each block's rank: a bound that holds for any rank leaves counted
most of what is evicted, and one that assumes a rank drops the recently used prefixes that
do survive. :mod:`kvshare.router.core.recency` keeps that rank (a shadow LRU per tier; also off).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshare.types import WorkerId, node_location, worker_location
from kvshare.workers import META_GPU_CACHE_BLOCKS, META_POOL_BLOCKS, WorkerInfo, WorkerLoad

_NOTHING: frozenset[str] = frozenset()


def capacity(info: WorkerInfo, key: str) -> int:
    """A capacity the worker reports in its meta (blocks); 0 when it reports none (no limit
    assumed: nothing is ever lost there). ValueError naming the key for a malformed one."""
    raw = info.meta.get(key)
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"worker {info.worker_id}: meta[{key!r}] must be a whole number of "
                         f"blocks, got {raw!r}") from None
    return max(0, value)


def _turned_over(written: float, cap: int) -> bool:
    """Whether a tier of ``cap`` blocks has evicted every block it held and nobody used once
    ``written`` blocks have entered it (module docstring); never without a capacity."""
    return 0 < cap <= written


class Capacities:
    """The workers' reported capacities, per candidate (the order of ``infos``): their engine
    cache's location and size, and their node pool's (one pool a node: any worker on it may
    report its size). Depends on the workers alone: keep it while they are the same."""

    def __init__(self, infos: Sequence[WorkerInfo]) -> None:
        self.infos = list(infos)
        self.index = {info.worker_id: j for j, info in enumerate(infos)}
        self.gpu_loc = [worker_location(i.worker_id) for i in infos]
        self.gpu_cap = [capacity(i, META_GPU_CACHE_BLOCKS) for i in infos]
        nodes: dict[str, int] = {}  # node location -> its slot in node_loc
        self.node_loc: list[str] = []
        self.node_cap: list[int] = []
        self.node_of: list[int] = []
        for info in infos:
            loc = node_location(info.node)
            k = nodes.get(loc)
            if k is None:
                k = nodes[loc] = len(self.node_loc)
                self.node_loc.append(loc)
                self.node_cap.append(0)
            self.node_cap[k] = max(self.node_cap[k], capacity(info, META_POOL_BLOCKS))
            self.node_of.append(k)
        self.reported = any(self.gpu_cap) or any(self.node_cap)


class Turnover:
    """For one decision: the workers' queued writes, and per candidate and start time the
    locations whose tier will have turned over by then (module docstring).

    ``loads`` and ``waits`` are per candidate (the order of ``caps``); ``waits`` their queue
    waits in seconds; ``block_tokens`` the tokens of one block."""

    def __init__(self, caps: Capacities, loads: Sequence[WorkerLoad], waits: Sequence[float],
                 block_tokens: int) -> None:
        assert len(caps.infos) == len(loads) == len(waits)
        self._caps = caps
        self._waits = waits
        self._blocks = [ld.queued_prefill_tokens / block_tokens for ld in loads]
        full = [0.0] * len(caps.node_loc)  # every queue drained
        for k, b in zip(caps.node_of, self._blocks, strict=True):
            full[k] += b
        # can anything turn over at all? else no location is ever lost
        self.possible = caps.reported and (
            any(_turned_over(b, c) for c, b in zip(caps.gpu_cap, self._blocks, strict=True))
            or any(_turned_over(w, c) for c, w in zip(caps.node_cap, full, strict=True)))

    def lost(self, t: float) -> frozenset[str]:
        """The locations (``worker:<id>`` engine caches, ``node:<id>`` pools) that will have
        written at least their capacity in blocks ``t`` seconds from now: what they hold now
        and no job ahead uses again is gone for a job starting then."""
        if not self.possible:
            return _NOTHING
        caps, waits, blocks = self._caps, self._waits, self._blocks
        out: list[str] = []
        written = [0.0] * len(caps.node_loc)
        for j, (k, b, w) in enumerate(zip(caps.node_of, blocks, waits, strict=True)):
            if b:
                b = b if w <= t else b * t / w  # its writes by then
                written[k] += b
                if _turned_over(b, caps.gpu_cap[j]):
                    out.append(caps.gpu_loc[j])
        for loc, c, n in zip(caps.node_loc, caps.node_cap, written, strict=True):
            if _turned_over(n, c):
                out.append(loc)
        return frozenset(out) if out else _NOTHING

    def _written(self, j: int, t0: float, t1: float) -> float:
        """Blocks worker ``j``'s queue writes between ``t0`` and ``t1`` seconds from now."""
        b, w = self._blocks[j], self._waits[j]
        if not b or w <= 0 or t1 <= t0:
            return 0.0
        return b * (min(t1, w) - min(t0, w)) / w

    def keeps(self, worker: WorkerId, engine: bool, t0: float, t1: float) -> bool:
        """Whether a block ``worker``'s job puts ``t0`` seconds from now into its engine's
        cache (``engine``) or its node's pool is still there ``t1`` seconds from now: fewer
        blocks than the capacity are written there in between (a worker it does not know, or
        no capacity reported: kept)."""
        if not self.possible:
            return True
        caps = self._caps
        j = caps.index.get(worker)
        if j is None:
            return True
        if engine:
            cap = caps.gpu_cap[j]
            return not _turned_over(self._written(j, t0, t1), cap)
        k = caps.node_of[j]
        n = 0.0
        for jj, kk in enumerate(caps.node_of):
            if kk == k:
                n += self._written(jj, t0, t1)
        return not _turned_over(n, caps.node_cap[k])
