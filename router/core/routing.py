"""RoutingCore: the one place a routing decision is made; every front end is a thin adapter.

The asyncio gateway's :class:`~kvshare.router.core.embed.CacheAwareRouter` and Ray Serve's
:class:`~kvshare.router.serve.request_router.KVShareRequestRouter` translate their host's request and worker list into
the calls below and nothing more::

    hashes = core.hashes(hasher, token_ids, salt)        # one Hasher per model namespace
    answer = await core.query(namespace, hashes)         # the index, under its deadline
    cands = core.candidates(infos, loads)                # reports + this router's in-flight work
    ranking = core.rank(request, answer, cands)          # Decision + every candidate's Estimate
    core.expect(request_id, ranking)                     # ranked, to be placed (Serve)
    core.routed(request_id, ranking, worker)             # once it is sent there
    ...
    core.prefilled(request_id); core.finished(request_id)

Rules kept here, once:

- **Index deadline and fallback.** An index that is missing answers nothing and is no
  fallback (pending blocks only, like Dynamo without KV events). One that is slower than
  ``index_timeout_s``, fails, or says it is unavailable (``MatchResult.unavailable``) makes the
  decision a fallback: if this router's own pending blocks know the prompt's prefix, the
  policy ranks over those alone (reason ``fallback_<cause>_pending``), else the ranking is
  load-only (``least_loaded``, reason ``fallback_<cause>``).
- **Pending blocks** are recorded at the chosen *worker's gpu tier*: the blocks come into
  existence in that worker's own KV cache when it prefills, so until the index confirms them
  they can help only that worker (no other worker on its node can read another engine's gpu
  memory, and a node's host pool holds them only after an offload that may never happen).
- **In-flight load**: what this router sent and has not seen prefilled or finished is added
  on top of each worker's last report (:class:`~kvshare.router.core.workers_view.InFlight`).
- **Cost model**: :meth:`use_cost` assembles it from block geometry, bandwidths and a prefill
  speed; what the workers' reports measured overrides those figures for every front end alike
  (:meth:`CostInputs.measured`: their median prefill speed and the median seconds a load
  really waits, read whenever the reports handed to :meth:`candidates` change); measured
  prefill timings (:meth:`observe_prefill`) refit the prefill model.

Not thread-safe: one core per event loop (policies and pending state are plain objects).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import compress
from operator import is_, is_not
from typing import Any

from kvshare.cost import Bandwidths, CostModel, PrefillModel, PrefillTimings, Windows
from kvshare.hasher import Hasher, Tokens
from kvshare.match import EMPTY_MATCH
from kvshare.quick_init import quick_init
from kvshare.router.core.index import RouterIndex
from kvshare.router.core.pending import PendingBlocks
from kvshare.router.core.policy import (
    Candidate,
    Decision,
    Policy,
    Ranking,
    RouteRequest,
)
from kvshare.router.core.registry import make_policy
from kvshare.router.core.sources import Match, Sharing
from kvshare.router.core.workers_view import InFlight
from kvshare.types import BlockHash, Tier, WorkerId, worker_location
from kvshare.workers import WorkerInfo, WorkerLoad, known_median, measured_prefill_tokens_per_s

PENDING_TIER = Tier.GPU
"""Where pending blocks are recorded: the chosen worker's own gpu tier (module docstring)."""


@quick_init
@dataclass(frozen=True)
class IndexAnswer:
    """The index's answer for one prompt, or why there is none.

    ``fallback``: ``""`` (answered, or no index configured), ``index_timeout``,
    ``index_error`` or ``index_unavailable``. ``index_s``: time spent waiting.
    ``timed``: the call returned (its latency is a fair sample for metrics).
    ``answered``: the index said what it holds (an undeclared namespace: nothing), so
    ``match`` is the cluster's state, not a stand-in.
    """

    match: Match
    fallback: str = ""
    index_s: float = 0.0
    timed: bool = False
    answered: bool = False


@dataclass(frozen=True)
class CostInputs:
    """What the cost model is assembled from (equal inputs: the same model is kept)."""

    block_tokens: int
    bytes_per_token: int
    bandwidths: Bandwidths
    prefill_tokens_per_s: float
    sharing: Sharing = Sharing.GLOBAL
    windows: Windows = ()
    """Sliding-window groups of the workers' layout (``bytes_per_token`` is then what every
    block moves): :meth:`kvshare.layout.KVLayout.fetch_terms`, :class:`~kvshare.cost.CostModel`."""

    def measured(self, reports: Iterable[WorkerLoad]) -> CostInputs:
        """These inputs with what the workers measured, where they did: their median reported
        prefill speed (to 10 tokens/s, so jitter does not rebuild the model) and, as the
        fixed cost of a load, the median seconds they report a request waits for a load from
        their node's pool / another node (``local_load_s`` / ``remote_load_s``, to 10 ms; a
        bandwidth probe sees only the bytes/s, not the setup and engine steps a load takes)."""
        reports = tuple(reports)
        tps = measured_prefill_tokens_per_s(reports)
        local = round(known_median([r.local_load_s for r in reports]), 2)
        remote = round(known_median([r.remote_load_s for r in reports]), 2)
        bw = self.bandwidths
        if local or remote:
            bw = replace(bw, local_latency_s=local or bw.local_latency_s,
                         remote_latency_s=remote or bw.remote_latency_s)
        return replace(self, bandwidths=bw, prefill_tokens_per_s=tps or self.prefill_tokens_per_s)


class RoutingCore:
    """Hashing, index query, in-flight load, cost model, pending blocks and ranking (module
    docstring). ``index`` may be None (pending blocks only) or set later (:attr:`index`)."""

    def __init__(
        self,
        index: RouterIndex | None,
        cost: CostInputs,
        *,
        policy: str,
        policy_options: Mapping[str, Any] | None = None,
        index_timeout_s: float = 0.05,
        pending_ttl_s: float = 10.0,
        refit_every: int = 32,
    ) -> None:
        if index_timeout_s <= 0 or pending_ttl_s <= 0:
            raise ValueError("index_timeout_s and pending_ttl_s must be positive seconds")
        self.index = index
        self.index_timeout_s = index_timeout_s
        self._base = cost  # the front end's inputs; _inputs: with the reports' measurements
        self._inputs = cost
        self._reports: tuple[WorkerLoad, ...] = ()
        self._epochs: dict[WorkerId, int] = {}  # each worker's last reported cache_epoch
        self._prefill: PrefillModel | None = None  # refitted from measured timings
        self._timings = PrefillTimings(refit_every)
        model = self._model(cost)
        self.policy: Policy = make_policy(policy, model, cost.sharing, **dict(policy_options or {}))
        self._load_only = make_policy("least_loaded", model, cost.sharing)
        self.pending = PendingBlocks(pending_ttl_s)
        self.inflight = InFlight()
        self._cands: dict[WorkerId, Candidate] = {}
        self._last_key: tuple[tuple[WorkerInfo, ...], list[tuple[WorkerLoad, int]]] = ((), [])
        self._last_cands: list[Candidate] = []

    # ------------------------------------------------------------------ cost model
    @property
    def cost(self) -> CostModel:
        return self.policy.cost

    @property
    def cost_inputs(self) -> CostInputs:
        """What the cost model is assembled from now (the front end's inputs, measured)."""
        return self._inputs

    def use_cost(self, inputs: CostInputs) -> None:
        """Assemble the cost model from ``inputs`` and the last reports' measurements
        (:meth:`CostInputs.measured`; kept while neither changes)."""
        self._base = inputs
        self._use(inputs.measured(self._reports))

    def use_bandwidths(self, bandwidths: Bandwidths) -> bool:
        """Price transfers with ``bandwidths`` from now on (the front end's other inputs kept);
        False when they are the ones in use (nothing rebuilt)."""
        if bandwidths == self._base.bandwidths:
            return False
        self.use_cost(replace(self._base, bandwidths=bandwidths))
        return True

    def _use(self, inputs: CostInputs) -> None:
        if inputs == self._inputs:
            return
        self._inputs = inputs
        self._set(self._model(inputs), inputs.sharing)

    def _model(self, c: CostInputs) -> CostModel:
        prefill = self._prefill or PrefillModel.from_tokens_per_s(c.prefill_tokens_per_s)
        return CostModel(prefill, c.bandwidths, c.block_tokens, c.bytes_per_token, c.windows)

    def _set(self, model: CostModel, sharing: Sharing) -> None:
        for p in (self.policy, self._load_only):
            p.cost = model
            p.sharing = sharing

    @property
    def prefill_samples(self) -> int:
        return self._timings.seen

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A measured prefill; every ``refit_every`` samples the prefill model is refitted."""
        fitted = self._timings.add(new_tokens, cached_tokens, seconds)
        if fitted is not None:
            self._prefill = fitted
            self._set(self._model(self._inputs), self._inputs.sharing)

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def hashes(hasher: Hasher, token_ids: Tokens, salt: str | None = None) -> list[BlockHash]:
        """Block hashes of a prompt (ValueError for ids outside [0, 2**32))."""
        return hasher.hashes(token_ids, salt)  # a list is packed in one C pass, packed ids read as they are

    async def query(self, namespace: str, hashes: Sequence[BlockHash]) -> IndexAnswer:
        """The index's match under ``index_timeout_s`` (an :attr:`~kvshare.router.core.index.RouterIndex.inline`
        index answers at once, without one: :meth:`query_inline`)."""
        now = self.query_inline(namespace, hashes)
        if now is not None:
            return now
        index = self.index
        assert index is not None  # (query_inline answers for no index)
        t = time.perf_counter()
        try:
            match = await asyncio.wait_for(index.match_runs_async(namespace, hashes),
                                           self.index_timeout_s)
        except TimeoutError:
            return IndexAnswer(EMPTY_MATCH, "index_timeout", time.perf_counter() - t)
        except KeyError:  # namespace not declared yet: nothing cached anywhere
            return IndexAnswer(EMPTY_MATCH, "", time.perf_counter() - t, answered=True)
        except Exception:  # noqa: BLE001 - any index failure means load-only routing
            return IndexAnswer(EMPTY_MATCH, "index_error", time.perf_counter() - t)
        return _answered(match, time.perf_counter() - t)

    def query_inline(self, namespace: str, hashes: Sequence[BlockHash]) -> IndexAnswer | None:
        """:meth:`query`'s answer computed now, without a coroutine, where no await is needed
        (no index, no hashes, or an :attr:`~kvshare.router.core.index.RouterIndex.inline`
        index: an in-process index or a replica); None: await :meth:`query`."""
        index = self.index
        if index is None or not hashes:
            return IndexAnswer(EMPTY_MATCH)
        if not index.inline:
            return None
        t = time.perf_counter()
        try:
            match = index.match_runs(namespace, hashes)
        except KeyError:  # namespace not declared yet: nothing cached anywhere
            return IndexAnswer(EMPTY_MATCH, "", time.perf_counter() - t, answered=True)
        except Exception:  # noqa: BLE001 - any index failure means load-only routing
            return IndexAnswer(EMPTY_MATCH, "index_error", time.perf_counter() - t)
        return _answered(match, time.perf_counter() - t)

    def candidates(self, infos: Sequence[WorkerInfo],
                   loads: Mapping[WorkerId, WorkerLoad]) -> list[Candidate]:
        """One candidate per worker: its last report plus this router's in-flight work.

        A worker whose inputs did not change since the last call keeps its (frozen)
        Candidate object, so the policy's per-candidate work is reused too.
        """
        self.inflight.sweep()
        reports = tuple(loads.values())
        if reports != self._reports:  # new reports: what they measured prices the plans
            self._reports = reports
            self._use(self._base.measured(reports))
            self._forget_emptied(reports)
        key = (tuple(infos), self.inflight.loads(infos, loads))
        if key == self._last_key:  # nothing changed (compared by identity first): same list
            return self._last_cands
        cache = self._cands
        if len(cache) > 2 * len(infos) + 64:  # workers come and go: forget the departed
            cache.clear()
        last_infos, last_loads = self._last_key
        if len(key[0]) == len(last_infos) and all(map(is_, key[0], last_infos)):
            # the same workers: only those whose (load, blocks) is another object changed
            out = list(self._last_cands)
            for i in compress(range(len(out)), map(is_not, key[1], last_loads)):
                out[i] = self._candidate(cache, key[0][i], key[1][i])
        else:
            out = [self._candidate(cache, info, lb) for info, lb in zip(*key, strict=True)]
        self._last_key, self._last_cands = key, out
        return out

    def _forget_emptied(self, reports: Iterable[WorkerLoad]) -> None:
        """A worker whose ``cache_epoch`` changed since its last report here had its own cache
        emptied (its engine restarted, its prefix cache was reset): the blocks this router's
        earlier requests were to leave there are not pending there any more, and its queued
        jobs' blocks (the policy's ready blocks) will not be made."""
        seen = self._epochs
        for r in reports:
            last = seen.get(r.worker_id)
            if last != r.cache_epoch:
                if last is not None:
                    self.pending.forget(worker_location(r.worker_id))
                    self.policy.forget(r.worker_id)
                seen[r.worker_id] = r.cache_epoch

    @staticmethod
    def _candidate(cache: dict[WorkerId, Candidate], info: WorkerInfo,
                   load_blocks: tuple[WorkerLoad, int]) -> Candidate:
        """The worker's candidate: the kept one while its info, load and blocks are the same."""
        load, blocks = load_blocks
        c = cache.get(info.worker_id)
        if c is None or c.info is not info or c.load is not load or c.active_blocks != blocks:
            c = cache[info.worker_id] = Candidate(info, load, blocks)
        return c

    # ------------------------------------------------------------------ deciding
    def rank(self, request: RouteRequest, answer: IndexAnswer,
             candidates: Sequence[Candidate]) -> Ranking:
        """The policy's ranking, or the fallback's (module docstring); NoEligibleWorker if no
        candidate serves the request's namespace/tenant."""
        ns, hashes = request.namespace, request.hashes
        mine = self.pending.match_runs(ns, hashes)
        if not answer.fallback:
            ranking = self.policy.rank(request, answer.match, candidates, mine)
            if answer.answered:
                ranking.held_blocks = max(answer.match.combined_prefix, mine.combined_prefix)
                ranking.index_match = answer.match
            return ranking
        if mine.combined_prefix:
            return _relabel(self.policy.rank(request, EMPTY_MATCH, candidates, mine),
                            f"fallback_{answer.fallback}_pending", keep_estimate=True)
        return _relabel(self._load_only.rank(request, EMPTY_MATCH, candidates),
                        f"fallback_{answer.fallback}", keep_estimate=False, policy=self.policy.name)

    def routed(self, request_id: str, ranking: Ranking, worker: WorkerId | None = None) -> None:
        """The ranked request was sent to ``worker`` (default: the decision's): its blocks are
        pending there (gpu tier) and the tokens its plan there leaves to prefill load the
        worker until :meth:`prefilled` (:meth:`expect`)."""
        worker = worker or ranking.decision.worker
        req = ranking.request
        self.pending.add(req.namespace, worker_location(worker), req.hashes, PENDING_TIER)
        self.expect(request_id, ranking, worker)

    def expect(self, request_id: str, ranking: Ranking, worker: WorkerId | None = None) -> None:
        """The ranked request is about to go to ``worker`` (default: the decision's): the
        tokens its plan there leaves to prefill load that worker from now on, so requests
        ranked meanwhile (a front end that places a request some time after ranking it, as
        Serve does) see it. :meth:`routed` (or :meth:`finished`) replaces it; no pending
        blocks yet (the request may still land elsewhere)."""
        req = ranking.request
        worker = worker or ranking.decision.worker
        plan = ranking.plan_of(worker)
        cached = plan.cached_tokens if plan is not None else 0
        self.inflight.add(request_id, worker, req.num_tokens - cached, len(req.hashes),
                          counted_tokens=req.num_tokens)

    def prefilled(self, request_id: str) -> None:
        """The worker produced the first token: its prefill no longer loads the queue."""
        self.inflight.prefilled(request_id)

    def finished(self, request_id: str) -> None:
        """The request is complete (or failed): stop counting it as load."""
        self.inflight.done(request_id)


def _answered(match: Match, seconds: float) -> IndexAnswer:
    """The answer for an index that matched in ``seconds`` (a pool-less index: unavailable)."""
    if not match.available:
        return IndexAnswer(EMPTY_MATCH, "index_unavailable", seconds, True)
    return IndexAnswer(match, "", seconds, True, True)


def _relabel(ranking: Ranking, reason: str, *, keep_estimate: bool, policy: str = "") -> Ranking:
    """The ranking with its decision's reason replaced (a load-only decision also drops its
    cache estimate: nothing cached was considered)."""
    d = ranking.decision
    if keep_estimate:
        decision = Decision(d.worker, d.endpoint, d.policy, reason, d.est_ttft_s,
                            d.est_ttft_saved_s, d.cached_blocks, d.remote_blocks, d.plan)
    else:
        decision = Decision(d.worker, d.endpoint, policy or d.policy, reason, d.est_ttft_s,
                            0.0, 0, 0, d.plan)
    return ranking.with_decision(decision)
