"""Routing policies behind one interface: the base, the cost policy and the cache-blind baselines.

A policy gets a request (namespace, block hashes, token count), the index's
:class:`~kvshare.match.MatchResult` and every candidate worker's info and load, and returns a
:class:`Ranking` (:meth:`Policy.rank`): the :class:`Decision` (the worker, the reason, the cost
model's estimate for it) and every candidate's :class:`Estimate`, best first.
:meth:`Policy.choose` returns the decision alone.

- ``round_robin``, ``least_loaded``: baselines that ignore the cache.
- peers' rules as they ship today, one module each: ``ray_prefix`` (Ray Serve LLM's
  PrefixCacheAffinityRouter, :mod:`kvshare.router.core.baselines.ray_prefix`), ``dynamo_kv`` (NVIDIA Dynamo's KV
  router cost, :mod:`kvshare.router.core.baselines.dynamo`), ``llmd_precise`` (llm-d's precise prefix scorer,
  :mod:`kvshare.router.core.baselines.llmd`). The older names ``prefix_affinity`` and ``kv_overlap`` are
  aliases of ``ray_prefix`` and ``dynamo_kv`` (:data:`kvshare.router.core.registry.ALIASES`).
- ``cost`` (default): estimated TTFT = queue wait + the cost model's best plan (fetch from
  the worker's gpu/node/other nodes + prefill of the rest, see :mod:`kvshare.cost`).

All policies are namespace- and tenant-aware: only workers that serve the request's namespace
(and, if a worker lists ``meta["tenants"]``, that tenant) are candidates; tenants' blocks
already differ by hash root, so one tenant never matches another's blocks.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter, is_, is_not
from typing import Any, ClassVar, TypeVar

from kvshare.cost import CostModel, CutPlan
from kvshare.quick_init import quick_init
from kvshare.router.core.ready import ReadyBlocks
from kvshare.router.core.recency import RecencyBook, TimedHoldings
from kvshare.router.core.sources import Match, Sharing, SourceMap, SourceRuns, holder_runs
from kvshare.types import BlockHash, NodeId, WorkerId, node_location, worker_location
from kvshare.workers import META_GPU_PRIVATE, WorkerInfo, WorkerLoad

_Best = TypeVar("_Best", bound=tuple[Any, ...])  # a cheapest candidate: (index, ..., estimate)


@quick_init
@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows about a request: its namespace, block hashes and token count."""

    namespace: str
    hashes: Sequence[BlockHash]
    num_tokens: int
    tenant: str = ""
    request_id: str = ""

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"a request needs at least one token, got num_tokens={self.num_tokens}")


@quick_init
@dataclass(frozen=True)
class Candidate:
    """A worker the request may go to. ``active_blocks``: blocks of requests in flight there
    (tracked by the router, as Dynamo does); used by ``dynamo_kv``."""

    info: WorkerInfo
    load: WorkerLoad
    active_blocks: int = 0


@quick_init
@dataclass(frozen=True)
class Decision:
    """Where a request goes and why, with the cost model's estimate for that worker."""

    worker: WorkerId
    endpoint: str
    policy: str
    reason: str
    est_ttft_s: float
    est_ttft_saved_s: float
    cached_blocks: int
    remote_blocks: int
    plan: CutPlan | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker, "endpoint": self.endpoint, "policy": self.policy,
            "reason": self.reason, "est_ttft_s": self.est_ttft_s,
            "est_ttft_saved_s": self.est_ttft_saved_s, "cached_blocks": self.cached_blocks,
            "remote_blocks": self.remote_blocks,
        }


@quick_init
@dataclass(frozen=True)
class Estimate:
    """One candidate's estimate: queue wait plus its best plan, and why it ranks there
    (the policy's reason for the chosen worker; the plan's kind for the others)."""

    worker: WorkerId
    endpoint: str
    est_ttft_s: float
    queue_s: float
    plan: CutPlan = field(compare=False)
    reason: str


def plan_reason(plan: CutPlan) -> str:
    """``load`` (no cached prefix used), ``cache_remote`` or ``cache_local``."""
    if plan.cut == 0:
        return "load"
    return "cache_remote" if plan.remote_blocks else "cache_local"


class Ranking:
    """A policy's answer: the :class:`Decision` and every eligible candidate's
    :class:`Estimate`, the chosen worker first, then by increasing estimate (candidate order
    among equals).

    ``held_blocks``: the longest prefix of the request's blocks the cluster held in the view it
    was ranked on (the index's answer and the router's pending blocks), None when the index did
    not answer; ``index_match``: that answer (both set by
    :meth:`kvshare.router.core.routing.RoutingCore.rank`; what a router tells a vLLM engine: :meth:`hint`)."""

    def __init__(self, request: RouteRequest, decision: Decision,
                 estimator: _Estimator | None = None, held_blocks: int | None = None,
                 index_match: Match | None = None) -> None:
        self.request = request
        self.decision = decision
        self._estimator = estimator
        self._estimates: list[Estimate] | None = None
        self.held_blocks = held_blocks
        self.index_match = index_match

    def estimates(self) -> list[Estimate]:
        """Every eligible candidate ranked (computed on first use, from the decision's view)."""
        if self._estimates is None:
            est = self._estimator.estimates(self.decision) if self._estimator is not None else []
            self._estimates = est
        return self._estimates

    def order(self) -> list[WorkerId]:
        return [e.worker for e in self.estimates()]

    def plan_of(self, worker: WorkerId) -> CutPlan | None:
        """The plan estimated for ``worker`` (None if it was not a candidate)."""
        if worker == self.decision.worker:
            return self.decision.plan
        return next((e.plan for e in self.estimates() if e.worker == worker), None)

    def with_decision(self, decision: Decision) -> Ranking:
        """The same ranking with ``decision`` (same worker and plan, e.g. another reason)."""
        assert decision.worker == self.decision.worker
        return Ranking(self.request, decision, self._estimator, self.held_blocks,
                       self.index_match)


class _Estimator:
    """What a ranking needs to estimate every candidate later: the policy's cost model and
    sharing as they were when it decided, the view and the plans already made."""

    def __init__(self, policy: Policy, request: RouteRequest, view: SourceMap,
                 cands: list[Candidate], planned: dict[WorkerId, CutPlan]) -> None:
        self.cost, self.sharing, self.queue_s = policy.cost, policy.sharing, policy.queue_s
        self.request, self.view, self.cands, self.planned = request, view, cands, planned

    def estimates(self, decision: Decision) -> list[Estimate]:
        view, n = self.view, self.request.num_tokens
        by_runs: dict[tuple[SourceRuns, float], CutPlan] = {}
        out = []
        for c in self.cands:
            wid = c.info.worker_id
            plan = decision.plan if wid == decision.worker else self.planned.get(wid)
            if plan is None:
                cost = cost_at(self.cost, view, c.info.node)
                runs = view.source_runs(wid, c.info.node, self.sharing, cost.block_fetch_s)
                key = (runs, cost.bandwidths.remote)
                plan = by_runs.get(key)
                if plan is None:
                    plan = by_runs[key] = cost.plan_runs(n, runs)
            assert plan is not None
            q = self.queue_s(c.load)
            reason = decision.reason if wid == decision.worker else plan_reason(plan)
            out.append(Estimate(wid, c.info.endpoint, q + plan.total_s, q, plan, reason))
        out.sort(key=lambda e: (e.worker != decision.worker, e.est_ttft_s))
        return out


def cost_at(cost: CostModel, view: SourceMap, node: NodeId) -> CostModel:
    """``cost`` for a reader on ``node``: its remote blocks priced at the probed links from the
    nodes it would pull them from (:meth:`~kvshare.cost.CostModel.for_pull`); ``cost`` itself
    where no link was probed."""
    if not cost.bandwidths.links:
        return cost
    return cost.for_pull(view.pull_nodes(node), node)


class NoEligibleWorker(ValueError):
    """No registered worker serves this namespace/tenant."""


def eligible(candidates: Sequence[Candidate], namespace: str, tenant: str = "") -> list[Candidate]:
    """Workers serving ``namespace`` (and ``tenant`` where a worker restricts tenants)."""
    out = []
    for c in candidates:
        if c.info.namespaces and namespace not in c.info.namespaces:
            continue
        allowed = c.info.meta.get("tenants", "")
        if allowed and tenant not in allowed.split(","):
            continue
        out.append(c)
    return out


class Policy(ABC):
    """Chooses a worker for a request. Stateful policies (round robin) are not thread-safe:
    one instance per router, called from one event loop.

    Per-candidate work that depends only on the candidate list (eligibility, the worker ->
    node map, queue waits) is kept from the previous call when the caller passes the same
    :class:`Candidate` objects again (compared by identity; candidates are frozen), as a
    router does between two load reports.
    """

    name: ClassVar[str]

    def __init__(self, cost: CostModel, sharing: Sharing = Sharing.GLOBAL) -> None:
        self.cost = cost
        self.sharing = Sharing(sharing)
        self.clock: Callable[[], float] = time.monotonic  # the simulator sets its own
        self._last: tuple[Sequence[Candidate], str, str] | None = None
        self._last_out: tuple[list[Candidate], dict[WorkerId, NodeId]] = ([], {})
        # the workers behind _last_out (by identity) and the positions of the eligible ones
        # among them (None: all): a new load changes candidates, never who is eligible
        self._last_infos: list[WorkerInfo] = []
        self._keep: list[int] | None = None
        self._private: frozenset[str] = frozenset()  # their gpu tier: theirs only (SourceMap)
        self._queues_for: tuple[list[Candidate], CostModel] | None = None
        self._queues: tuple[list[float], list[int]] = ([], [])

    def forget(self, worker: WorkerId) -> None:
        """``worker``'s own cache was emptied and its queue is gone (its engine restarted, or
        its prefix cache was reset while it was idle): forget what this policy expected it to
        hold. Stateless policies keep nothing."""

    def choose(
        self,
        request: RouteRequest,
        match: Match,
        candidates: Sequence[Candidate],
        pending: Match | None = None,
    ) -> Decision:
        """:meth:`rank`'s decision alone (the simulator's call)."""
        return self.rank(request, match, candidates, pending).decision

    def rank(
        self,
        request: RouteRequest,
        match: Match,
        candidates: Sequence[Candidate],
        pending: Match | None = None,
    ) -> Ranking:
        """Pick a worker and rank the others; NoEligibleWorker if none serves the request's
        namespace/tenant.

        ``match``: the index's answer; ``pending``: blocks the router's own recent decisions
        are about to create (:class:`~kvshare.router.core.pending.PendingBlocks`), local to their workers.
        Either may be a :class:`~kvshare.match.MatchResult` or the same in run form
        (:class:`~kvshare.actors.index.runs.HolderRuns`). The decision is made (and :meth:`observe`
        d) here; the other candidates' estimates are computed when
        :meth:`Ranking.estimates` is first read, from the same view.
        """
        cands, nodes = self._eligible(candidates, request.namespace, request.tenant)
        if not cands:
            raise NoEligibleWorker(
                f"no worker serves namespace {request.namespace!r}"
                + (f" for tenant {request.tenant!r}" if request.tenant else "")
                + ": register one with that namespace"
            )
        self._prepare(request, match, pending)
        view = SourceMap(match, nodes, pending, self._private)
        idx, reason = self._select(request, view, cands)
        chosen = cands[idx]
        plan = self.plan_for(request, view, chosen)
        queue = self.queue_s(chosen.load)
        est = queue + plan.total_s
        saved = max(0.0, self.cost.recompute_s(request.num_tokens) - plan.total_s)
        decision = Decision(
            chosen.info.worker_id, chosen.info.endpoint, self.name, reason, est, saved,
            plan.cut, plan.remote_blocks, plan,
        )
        self.observe(request, decision)
        return Ranking(request, decision, _Estimator(self, request, view, cands,
                                                     self._planned()))

    def _planned(self) -> dict[WorkerId, CutPlan]:
        """Plans :meth:`_select` computed for this request (reused by the ranking)."""
        return {}

    def _prepare(self, request: RouteRequest, match: Match, pending: Match | None) -> None:
        """Per-request state a policy's selection reads, set once the eligible workers are
        known (nothing by default)."""

    def _roster(self, candidates: Sequence[Candidate]) -> None:
        """The workers offered changed (another list of :class:`~kvshare.workers.WorkerInfo`
        objects than the last call's); nothing by default."""

    def _eligible(
        self, candidates: Sequence[Candidate], namespace: str, tenant: str
    ) -> tuple[list[Candidate], dict[WorkerId, NodeId]]:
        """:func:`eligible` and their worker -> node map (kept while the inputs are the same)."""
        last = self._last
        same_request = last is not None and last[1] == namespace and last[2] == tenant
        if (same_request and last is not None and len(last[0]) == len(candidates)
                and all(map(is_, last[0], candidates))):
            return self._last_out
        infos = list(map(_INFO, candidates))
        same_workers = len(infos) == len(self._last_infos) and all(
            map(is_, self._last_infos, infos))
        if same_request and same_workers:
            # the same workers with other loads: who is eligible, their nodes and private
            # locations are the same (they depend on the workers alone)
            keep = self._keep
            cands = list(candidates) if keep is None else [candidates[i] for i in keep]
            self._last = (tuple(candidates), namespace, tenant)
            self._last_out = (cands, self._last_out[1])
            return self._last_out
        if not same_workers:
            self._roster(candidates)
        cands = eligible(candidates, namespace, tenant)
        self._last = (tuple(candidates), namespace, tenant)
        self._last_out = (cands, {c.info.worker_id: c.info.node for c in cands})
        self._last_infos = infos
        if len(cands) == len(candidates):
            self._keep = None
        else:
            kept = {id(c) for c in cands}
            self._keep = [i for i, c in enumerate(candidates) if id(c) in kept]
        self._private = frozenset(worker_location(c.info.worker_id) for c in cands
                                  if c.info.meta.get(META_GPU_PRIVATE) == "1")
        return self._last_out

    def queues(self, cands: list[Candidate]) -> tuple[list[float], list[int]]:
        """Queue wait per candidate and the candidates' indices by increasing wait (kept while
        ``cands`` and the cost model are the same objects)."""
        last = self._queues_for
        if last is not None and last[0] is cands and last[1] is self.cost:
            return self._queues
        if last is not None and last[1] is self.cost and len(last[0]) == len(cands):
            # (a router's next decision: mostly the same candidates, one or two new loads)
            queue_s, (pw, po) = self.queue_s, self._queues
            waits = list(pw)
            for i in compress(range(len(cands)), map(is_not, cands, last[0])):
                waits[i] = queue_s(cands[i].load)
            if waits == pw:  # (the same waits: the same stable sort)
                self._queues, self._queues_for = (waits, po), (cands, self.cost)
                return self._queues
        else:
            waits = [self.queue_s(c.load) for c in cands]
        self._queues = (waits, sorted(range(len(cands)), key=waits.__getitem__))
        self._queues_for = (cands, self.cost)
        return self._queues

    def plan_for(self, request: RouteRequest, view: SourceMap, cand: Candidate) -> CutPlan:
        """The cost model's best plan for this request on ``cand`` (:func:`cost_at`)."""
        cost = cost_at(self.cost, view, cand.info.node)
        runs = view.source_runs(cand.info.worker_id, cand.info.node, self.sharing,
                                cost.block_fetch_s)
        return cost.plan_runs(request.num_tokens, runs)

    def queue_s(self, load: WorkerLoad) -> float:
        """Queue wait: queued prefill tokens at the worker's measured speed (else the model's)."""
        tps = load.prefill_tokens_per_s if load.prefill_tokens_per_s > 0 else self.cost.prefill.tokens_per_s
        return load.queued_prefill_tokens / tps

    def observe(self, request: RouteRequest, decision: Decision) -> None:
        """Hook for stateful policies; called with every decision this policy made."""

    @abstractmethod
    def _select(
        self, request: RouteRequest, view: SourceMap, cands: list[Candidate]
    ) -> tuple[int, str]:
        """Index into ``cands`` and the reason."""


class _Rotation:
    """Tie-breaking: least queued tokens, then fewest running, then the worker after the one
    this rotation picked last (so ties do not always land on the first worker)."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, ties: Sequence[int], cands: Sequence[Candidate]) -> int:
        self._turn += 1
        if len(ties) == 1:  # (the common case: nothing to break)
            return ties[0]
        key = [(cands[i].load.queued_prefill_tokens, cands[i].load.running) for i in ties]
        low = min(key)
        best = [i for i, k in zip(ties, key, strict=True) if k == low]
        return best[self._turn % len(best)]


def _least_loaded_index(cands: Sequence[Candidate], rotation: _Rotation) -> int:
    return rotation.pick(range(len(cands)), cands)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, cost: CostModel, sharing: Sharing = Sharing.GLOBAL) -> None:
        super().__init__(cost, sharing)
        self._next = 0

    def _select(self, request: RouteRequest, view: SourceMap, cands: list[Candidate]) -> tuple[int, str]:
        i = self._next % len(cands)
        self._next += 1
        return i, "round_robin"


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self, cost: CostModel, sharing: Sharing = Sharing.GLOBAL) -> None:
        super().__init__(cost, sharing)
        self._rotate = _Rotation()

    def _select(self, request: RouteRequest, view: SourceMap, cands: list[Candidate]) -> tuple[int, str]:
        return _least_loaded_index(cands, self._rotate), "least_loaded"


class CostPolicy(Policy):
    """Lowest estimated TTFT: queue wait + fetch + prefill of the rest (kvshare's default),
    with the work a plan adds priced for the requests that will wait behind it.

    A candidate's score is ``queue_s + (1 + waiting + backlog) * plan.total_s``, ``waiting``
    the fewest requests waiting (queued, not started: :attr:`WorkerLoad.waiting`) at any
    candidate. The first term is the request's own TTFT; the second adds, to first order, what
    its service time costs the requests that will wait behind it. Extra work delays others
    only when no worker has slack to absorb it: then every worker has at least ``waiting``
    requests queued, about as many arrive at each during the current wait (Little's law), and
    with requests joining the shortest waits the work's delay reaches them all. With an idle
    worker (or nothing waiting) the score is the lowest estimated TTFT; when every worker is
    behind, the cheaper plan (a local copy over a remote one, a cached prefix over a
    recompute) wins over a shorter queue, since total work then decides everyone's wait. The
    decision's ``est_ttft_s`` stays the TTFT estimate (queue wait + plan).

    Little's law counts only the requests that arrive during the current wait. A worker that
    is behind stays behind for its whole busy period, and every request that reaches it before
    the period ends waits for the plan too: under overload that is every later request it gets
    until the burst is over, many times ``waiting``. How long a burst will last is unknown; the
    estimate taken (no constant) is that it lasts as long again as it has: ``backlog`` is the
    requests this policy routed in the namespace since the moment every candidate last had
    requests waiting, per candidate. It is 0 the moment any worker has nothing waiting, so a
    worker that ran dry takes traffic again at once; in a long overload it grows, and plans that
    save work (reuse over recompute, a worker's own queued prompts over a pull) outweigh
    longer queues more and more, as they do for every request behind them.

    That spread assumes the router can steer later requests around the work. It cannot steer
    the requests bound to a worker (the ones its cache serves best): a worker with
    ``waiting_i`` queued against the emptiest's ``waiting`` receives about
    ``(waiting_i - waiting) / queue_i`` of them a second beyond the common rate (Little's law
    at its queue wait), and each one arriving while the plan runs waits for it instead of for
    a request of that worker's typical size (``queue_i / waiting_i``). So with every worker
    behind, a plan longer than that typical size adds ``(waiting_i - waiting) / queue_i *
    (plan - queue_i / waiting_i) * plan``: a long prompt costs more at a worker crowded with
    short ones than at one holding a few long ones, which lowers the mean wait (short requests
    stop queuing behind long prompts they do not share); a plan of the worker's typical size
    adds nothing.

    With a worker idle (nothing queued or running) the score is the TTFT estimate, and a
    request whose estimate is lowest at a worker where requests already wait (one whose cache
    serves it best) would start a convoy: the requests that join that worker behind it, about
    ``waiting / queue`` a second (Little's law at its queue) for as long as it stays busy
    (``queue + plan``), each wait for its plan, or go to an idle worker instead at about the
    ``saved`` seconds this request gains by not going there (the best idle worker's estimate
    minus its own). So it goes to the best idle worker when ``waiting / queue * (queue +
    plan) * min(plan, saved) > saved``: its own TTFT grows by at most ``saved``, and a hot
    prefix gets a second holder instead of a queue at its first. Nothing waiting at the
    worker, or no worker idle: the lowest estimate, as before.

    Under global sharing a worker's plan also counts the blocks this policy's earlier
    decisions are creating on other workers that will be stored before it starts (its queue
    wait outlasts their job's estimate): it will pull them (:class:`~kvshare.router.core.ready.ReadyBlocks`);
    the creator's own plan counts them as its local gpu blocks, with its wait at least until
    their job's estimated end (it cannot start before).

    With ``recency`` (on by default), the index's and pending holdings of each engine
    cache and node pool whose capacity the workers report are cut, per candidate, to the
    leading blocks still held there when that candidate would start, from a shadow LRU per
    tier that replays this policy's decisions at their estimated times (:mod:`kvshare.router.core.recency`):
    a block's own LRU position, not a bound for any position. Where no worker reports a
    capacity (kvshare's vLLM and reference workers do not: a router's shadow sees only its own
    traffic, so a deployment with several routers or a restarted one would count other blocks
    as gone) there is nothing to shadow, and the policy is the plain one; the simulator's
    workers report theirs (one router sees all of the cluster's traffic there).
    """

    name = "cost"

    def __init__(
        self, cost: CostModel, sharing: Sharing = Sharing.GLOBAL, tie_s: float = 0.001,
        recency: bool = True,
    ) -> None:
        super().__init__(cost, sharing)
        self.tie_s = tie_s
        self._recency = RecencyBook() if recency else None
        self._shadowed: dict[WorkerId, NodeId] = {}  # workers whose tiers the book keeps
        self._timed: TimedHoldings | None = None  # this request's holdings by time (recency)
        self._waits: dict[WorkerId, float] = {}  # the last decision's candidates' waits
        self._last_end: dict[WorkerId, float] = {}  # per worker: its last job's replay end
        self._plans: dict[WorkerId, CutPlan] = {}
        self._rotate = _Rotation()
        self._ready = ReadyBlocks()
        self._behind: dict[str, int] = {}  # per namespace: decisions since every worker fell behind

    def forget(self, worker: WorkerId) -> None:
        """The blocks ``worker``'s queued jobs were creating (its ready blocks) go."""
        self._ready.forget(worker)

    def _prepare(self, request: RouteRequest, match: Match, pending: Match | None) -> None:
        """With ``recency``, price this request on the holdings each tier will still have
        (class docstring); no worker reports a capacity: nothing to shadow, the plain path."""
        book = self._recency  # (None without recency; empty, so false, with nothing to shadow)
        self._timed = TimedHoldings(book, request.hashes, match, pending) if book else None

    def _roster(self, candidates: Sequence[Candidate]) -> None:
        """The recency book starts shadowing the workers it has not seen."""
        book = self._recency
        if book is None:
            return
        new = [c.info for c in candidates if c.info.worker_id not in self._shadowed]
        if new:
            book.add_workers(new)
            self._shadowed.update((i.worker_id, i.node) for i in new)

    def _select(self, request: RouteRequest, view: SourceMap, cands: list[Candidate]) -> tuple[int, str]:
        i, reason, est = self._cheapest(request, view, cands)
        plan_s = self._plans[cands[i].info.worker_id].total_s
        moved = self._idle_instead(cands, i, plan_s, est,
                                   lambda idle: self._cheapest(request, view, idle))
        return (moved[0], moved[1][1]) if moved is not None else (i, reason)

    def _cheapest(self, request: RouteRequest, view: SourceMap, cands: list[Candidate]
                  ) -> tuple[int, str, float]:
        """The candidate with the lowest score (class docstring), the reason and the score."""
        plans: dict[WorkerId, CutPlan] = {}
        self._plans = plans
        # workers with equal views (and links) share a plan and a bound
        by_runs: dict[SourceRuns | tuple[SourceRuns, float], CutPlan] = {}
        bounds: dict[SourceRuns | tuple[SourceRuns, float], float] = {}
        cost, tie = self.cost, self.tie_s
        fetch = cost.block_fetch_s
        links = bool(cost.bandwidths.links)
        n = request.num_tokens
        ns, hashes, now = request.namespace, request.hashes, self.clock()
        ready = self._ready if self._ready and self.sharing is Sharing.GLOBAL else None
        reach = view.combined + (ready.run_from(ns, hashes, view.combined) if ready else 0)
        c_max = cost.cached_tokens(reach, n)
        floor = cost.prefill.time(n - c_max, c_max)  # no plan beats this (free fetch)
        queues, order = self.queues(cands)
        timed = self._timed
        waits = self._waits = {}
        fewest, work, bound, typical = self._pressure(ns, cands, queues)
        self._note_behind(ns, fewest)
        ests = [math.inf] * len(cands)
        best = math.inf
        pos, end = 0, len(order)
        while pos < end:
            q = queues[order[pos]]
            if q + work * floor > best + tie:
                break  # exact pruning: this worker (and every later one) cannot win or tie
            group = []  # the workers with this queue wait, most promising first
            while pos < end and queues[order[pos]] == q:
                i = order[pos]
                info = cands[i].info
                seen = view if timed is None else timed.view(
                    view, max(now + q, self._last_end.get(info.worker_id, now)))
                c_i = cost_at(cost, seen, info.node) if links else cost
                runs = seen.source_runs(info.worker_id, info.node, self.sharing,
                                        c_i.block_fetch_s if links else fetch)
                wait = q
                if ready is not None:
                    runs, start = ready.extend(runs, ns, hashes, info.worker_id, now, now + q)
                    wait = start - now
                key: SourceRuns | tuple[SourceRuns, float] = (
                    (runs, c_i.bandwidths.remote) if links else runs)
                t = bounds.get(key)
                if t is None:
                    t = bounds[key] = self._bound(n, runs, c_i)
                low_s = wait + _work_s(t, work, bound, typical, i)
                group.append((low_s, pos, i, runs, wait, key, c_i))
                pos += 1
            group.sort(key=lambda g: (g[0], g[1]))
            for low, _, i, runs, wait, key, c_i in group:
                if low > best + tie:
                    break  # exact pruning: its plan (and the rest's) cannot win or tie
                plan = by_runs.get(key)
                if plan is None:
                    plan = by_runs[key] = c_i.plan_runs(n, runs)
                plans[cands[i].info.worker_id] = plan
                waits[cands[i].info.worker_id] = wait
                t = plan.total_s
                ests[i] = wait + _work_s(t, work, bound, typical, i)
                best = min(best, ests[i])
        best_i, reason = self._pick(ests, plans, cands)
        return best_i, reason, ests[best_i]

    def _pressure(self, ns: str, cands: list[Candidate], queues: list[float]
                  ) -> tuple[int, float, list[float] | None, list[float]]:
        """The fewest requests waiting at any candidate, what a second of plan costs, and per
        candidate the rate of requests bound to it and a queued request's service time (None
        and [] with a worker idle); class docstring. Changes nothing (:meth:`_note_behind`)."""
        waiting = list(map(_WAITING, cands))
        fewest = min(waiting)
        work = 1.0 + fewest  # what a second of plan costs (class docstring)
        if not fewest:  # a worker idle: no busy period, no bound requests (class docstring)
            return fewest, work, None, []
        work += self._behind.get(ns, 0) / len(cands)  # every worker behind: a busy period
        # per candidate: the rate of requests bound to it and the service time of one queued there
        bound = [(w - fewest) / q if q > 0 else 0.0 for w, q in zip(waiting, queues, strict=True)]
        typical = [q / w if w else 0.0 for w, q in zip(waiting, queues, strict=True)]
        return fewest, work, bound, typical

    def _note_behind(self, ns: str, fewest: int) -> None:
        """Count this decision in the namespace's busy period (none with a worker idle)."""
        if fewest:
            self._behind[ns] = self._behind.get(ns, 0) + 1
        else:
            self._behind.pop(ns, None)

    def _idle_instead(self, cands: list[Candidate], i: int, plan_s: float, est: float,
                      cheapest: Callable[[list[Candidate]], _Best | None]
                      ) -> tuple[int, _Best] | None:
        """Where a request goes instead of joining candidate ``i``'s queue (its plan there
        ``plan_s`` seconds, its estimate ``est``): the best idle candidate (nothing queued or
        running; ``cheapest`` of them, whose last item is its estimate) and that choice, if
        requests wait at ``i`` and the ones expected to join behind it would lose more than it
        saves there (class docstring, :func:`_convoy`); else None. The idle candidates' plans
        are kept beside the others' for the ranking."""
        load = cands[i].load
        if not load.waiting:
            return None
        queues, _ = self.queues(cands)
        queue = queues[i]
        idle = [k for k, q in enumerate(queues) if q <= 0 and not cands[k].load.waiting]
        if queue <= 0 or not idle:
            return None
        plans, waits = self._plans, self._waits
        best = cheapest([cands[k] for k in idle])
        if best is not None and _convoy(load.waiting, queue, plan_s, best[-1] - est):
            self._plans, self._waits = {**plans, **self._plans}, {**waits, **self._waits}
            return idle[best[0]], best
        self._plans, self._waits = plans, waits
        return None

    def _pick(self, ests: list[float], plans: dict[WorkerId, CutPlan],
              cands: list[Candidate]) -> tuple[int, str]:
        """The chosen candidate among the estimates and the reason (ties: fewest remote
        blocks, then the rotation)."""
        best = min(ests)
        # Near-ties (e.g. a new prefix on idle workers) rotate, so new blocks spread over nodes;
        # a near-tie between pulling a prefix and reading it where it is goes to the fewest
        # remote blocks (the same TTFT for less network, and no router's rotation in it).
        ties = [i for i, e in enumerate(ests) if e <= best + self.tie_s]
        if len(ties) > 1:
            remote = [plans[cands[i].info.worker_id].remote_blocks for i in ties]
            least = min(remote)
            ties = [i for i, r in zip(ties, remote, strict=True) if r == least]
        best_i = self._rotate.pick(ties, cands)
        return best_i, plan_reason(plans[cands[best_i].info.worker_id])

    def _bound(self, n: int, runs: SourceRuns, cost: CostModel) -> float:
        """A lower bound of ``plan_runs(n, runs).total_s``, from the runs' first source and
        length: any cut pays the first block's fetch and latency and prefills at least the
        tokens past the runs (or there is no cut: recompute all). Shrunk by 1e-9 so float
        rounding never lifts it above the plan."""
        pm = cost.prefill
        full = pm.a * n + pm.b * n * n / 2
        if not runs:
            return full * _SHRINK
        src = runs[0][0]
        bw = cost.bandwidths
        lat = bw.remote_latency_s if src >= 3 else (bw.local_latency_s if src else 0.0)
        c = cost.cached_tokens(sum(ln for _, ln in runs), n)
        m = n - c
        cut = cost.block_fetch_s[src] + lat + pm.a * m + pm.b * m * (c + m / 2)
        return min(full, cut) * _SHRINK

    def plan_for(self, request: RouteRequest, view: SourceMap, cand: Candidate) -> CutPlan:
        return self._plans.get(cand.info.worker_id) or super().plan_for(request, view, cand)

    def observe(self, request: RouteRequest, decision: Decision) -> None:
        """Record the blocks the chosen worker will hold and when: all of them in its engine,
        the ones it computes also in its node's pool."""
        plan = decision.plan
        if plan is not None and self.sharing is Sharing.GLOBAL:
            now = self.clock()
            self._ready.add(request.namespace, decision.worker, request.hashes,
                            now + decision.est_ttft_s, now, stored_from=plan.cut)
        timed = self._timed
        if plan is not None and timed is not None:
            now = self.clock()
            w = decision.worker
            start = now + self._waits.get(w, 0.0)
            read = max(start, self._last_end.get(w, now))  # (the time it was priced at)
            end = self._last_end[w] = max(read, start + plan.total_s)
            self._replay(request.hashes, w, plan.cut, timed.match_at(read), read, end, now)

    def _replay(self, hashes: Sequence[BlockHash], worker: WorkerId, cut: int,
                match: Match, start: float, end: float, now: float) -> None:
        """Replay a decision's job into the tiers' shadows (:mod:`kvshare.router.core.recency`): at its
        start, the blocks it loads from pools (its node's, else the first other node named);
        at its end, what it computes into its node's pool and the whole prompt into its
        engine cache."""
        book = self._recency
        assert book is not None
        w_loc = worker_location(worker)
        n_loc = node_location(self._shadowed[worker]) if worker in self._shadowed else None
        reads: dict[str, list[BlockHash]] = {}
        pos = 0
        for holders, n in holder_runs(match):
            if pos >= cut:
                break
            locs = [loc for loc, _ in holders]
            if w_loc not in locs:  # (its engine's own copy is read there: used below)
                src = n_loc if n_loc in locs else next(
                    (loc for loc in locs if loc.startswith("node:")), None)
                if src is not None:
                    reads.setdefault(src, []).extend(hashes[pos:min(pos + n, cut)])
            pos += n
        for loc, hs in reads.items():
            book.use(loc, hs, start, now)
        if n_loc is not None:
            book.use(n_loc, hashes[cut:], end, now)
        book.use(w_loc, hashes, end, now)

    def _planned(self) -> dict[WorkerId, CutPlan]:
        return self._plans


_SHRINK = 1.0 - 1e-9
_INFO = attrgetter("info")  # (C-level reads over the candidates)
_WAITING = attrgetter("load.waiting")


def _convoy(waiting: int, queue: float, plan_s: float, saved: float) -> bool:
    """Whether the requests expected to join a queue of ``queue`` seconds holding ``waiting``
    requests behind a plan of ``plan_s`` seconds (Little's law at that queue, over its busy
    period) lose more than the ``saved`` seconds the request gains there (:class:`CostPolicy`)."""
    if saved <= 0:
        return False
    later = waiting / queue * (queue + plan_s)
    return later * min(plan_s, saved) > saved


def _work_s(t: float, work: float, bound: list[float] | None, typical: list[float],
            i: int) -> float:
    """What ``t`` seconds of plan at candidate ``i`` cost everyone (:class:`CostPolicy`);
    increasing in ``t``, so a lower bound of ``t`` gives a lower bound of it."""
    if bound is None:
        return work * t
    return (work + bound[i] * max(0.0, t - typical[i])) * t
