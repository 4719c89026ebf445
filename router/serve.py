"""kvshare routing as a Ray Serve request router.

A Serve user switches a deployment to kvshare routing with one config line::

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class="router.serve:KVShareRequestRouter"))

Each replica registers with the kvshare index as a worker whose id is
:func:`replica_worker_id` of its Serve replica id, on its Ray node (``examples/serve_app.py``
does it). For every request the router

1. reads the prompt from the request arguments (:func:`extract_prompt`): block hashes if the
   caller already computed them, else token ids, else text (tokenized with the tokenizer the
   workers registered, so the router hashes exactly what the workers store);
2. asks the index which locations hold the prefix (``match_async``, bounded by
   ``index_timeout_s``; never a blocking ``ray.get`` on the event loop) and the workers' load
   reports, and adds the blocks its own recent decisions are about to create;
3. maps ``worker:<id>`` (a replica's own cache) and ``node:<node id>`` (that node's pool) to
   replicas, ranks them with kvshare's ``cost`` policy (estimated TTFT: queue + fetch +
   prefill of the rest) and returns one replica per rank, so Serve still skips a full replica.
   The first passes offer only replicas close to the best (Serve retries them with backoff);
   later passes offer every replica ("spill").

If the index is not deployed or unreachable, the request carries no prompt, or the index is
slower than the deadline and the router's own recent decisions know nothing of this prefix,
the router uses Serve's own power-of-two choice and counts the fallback (Ray metric
``kvshare_serve_routing_total{reason}``). Replicas added, removed or dead reach it through
``update_replicas`` / ``on_replica_actor_died``. Request parsing and settings live in
:mod:`router.serve_request`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from ray.exceptions import RayError
from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import (
    LocalityMixin,
    MultiplexMixin,
    RequestRouter,
)
from ray.util import metrics

from kvshare.cost import Bandwidths, CostModel, PrefillModel
from kvshare.hashing import block_hashes
from kvshare.match import MatchResult
from kvshare.types import BlockHash, NodeId, Tier, WorkerId, node_location
from kvshare.workers import WorkerInfo, WorkerLoad
from router.pending import PendingBlocks
from router.policy import Candidate, Policy, RouteRequest, make_policy
from router.serve_request import (
    PromptInput,
    ServeRouterSettings,
    WorkerHashing,
    extract_prompt,
    replica_worker_id,
)
from router.sources import Sharing, SourceMap

log = logging.getLogger("ray.serve")
BANDWIDTH_REFRESH_S = 30.0  # how often measured transport bandwidths are re-read

class _Routing(NamedTuple):
    """A request's routing so far: what it will compute, passes made, its shortlist."""

    namespace: str
    hashes: tuple[BlockHash, ...]
    compute: int
    passes: int
    shortlist: tuple[WorkerId, ...]
    tokens: int = 0


class KVShareRequestRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve request router ranking replicas with kvshare's cost policy (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with ``request_router_kwargs`` (see :class:`ServeRouterSettings`).

        Runs on Serve's event loop: nothing here blocks; the index is connected lazily.
        """
        self.settings = ServeRouterSettings.from_kwargs(kwargs)
        self._client: Any = None
        self._connect_task: asyncio.Task[Any] | None = None
        self._next_connect = 0.0
        self._workers: dict[WorkerId, WorkerInfo] = {}
        self._workers_at = -1e9
        self._loads: dict[WorkerId, WorkerLoad] = {}
        self._hashing: dict[str, WorkerHashing] = {}
        self._pending = PendingBlocks(self.settings.pending_ttl_s)
        self._policy: Policy | None = None
        self._cost_key: tuple[Any, ...] | None = None
        self._measured: dict[str, float] = {}
        self._bw_at = -1e9
        self._bw_task: asyncio.Task[None] | None = None
        # replica -> [(routed at, tokens it will compute)] not yet visible in its load reports
        self._routed: dict[WorkerId, list[tuple[float, int]]] = {}
        self._inflight: dict[str, tuple[WorkerId, int, int]] = {}  # id -> (replica, blocks, tokens)
        # replica -> [(completed at, prompt tokens)]: work its last load report may still show
        self._done: dict[WorkerId, list[tuple[float, int]]] = {}
        self._last: dict[str, _Routing] = {}
        self.counters: dict[str, int] = {}
        # Serve pickles this module by value into each handle's process, so counters go out
        # as Ray metrics (Prometheus), not through a module-level registry.
        self._metric = metrics.Counter(
            "kvshare_serve_routing_total", description="kvshare Serve routing outcomes by reason",
            tag_keys=("deployment", "application", "reason"),
        ).set_default_tags({"deployment": self._deployment_id.name,
                            "application": self._deployment_id.app_name})
        log.info("kvshare request router for %s: %s", self._deployment_id, self.settings)

    # ------------------------------------------------------------------ stats
    def _count(self, key: str) -> None:
        n = self.counters[key] = self.counters.get(key, 0) + 1
        self._metric.inc(tags={"reason": key})
        if key.startswith(("fallback", "spilled", "repass", "index_slow")) and n % 100 == 1:
            log.info("kvshare routing: %s (%d times)", key, n)

    def stats(self) -> dict[str, Any]:
        """Decisions by reason, fallbacks by cause, known workers and replicas."""
        return {"counters": dict(self.counters), "workers": len(self._workers),
                "replicas": len(self._replicas), "index_connected": self._client is not None}

    # ------------------------------------------------------------------ index access
    def _start_connect(self) -> None:
        """Look the index up on a thread (``ray.get_actor`` blocks), once per retry period."""
        if self._client is not None or self._connect_task is not None:
            return
        if time.monotonic() < self._next_connect:
            return
        from actors.index.client import IndexClient

        def connect() -> Any:
            client = IndexClient.connect(self.settings.ray_namespace, self.settings.index_timeout_s)
            client.timeout_s = max(1.0, self.settings.index_timeout_s)
            client.loads()  # warm the connection to the index actor (first calls are slow)
            client.timeout_s = self.settings.index_timeout_s
            return client

        self._connect_task = self._event_loop.create_task(asyncio.to_thread(connect))

    async def _index(self) -> Any:
        """The index client, or None while it is not (yet) reachable; never blocks."""
        if self._client is not None:
            return self._client
        now = time.monotonic()
        self._start_connect()
        task = self._connect_task
        if task is None:
            return None
        try:
            self._client = await asyncio.wait_for(asyncio.shield(task), self.settings.index_timeout_s)
            self._connect_task = None
        except TimeoutError:
            return None
        except Exception as exc:  # not deployed yet, or restarting: retry later
            log.info("kvshare index not reachable (%s); retrying in %.1f s", exc,
                     self.settings.connect_retry_s)
            self._connect_task = None
            self._next_connect = now + self.settings.connect_retry_s
        return self._client

    async def _refresh_workers(self, client: Any) -> None:
        now = time.monotonic()
        known = all(replica_worker_id(r) in self._workers for r in self._replica_id_set)
        age = now - self._workers_at
        if age < (self.settings.workers_refresh_s if known else 0.25):
            return
        infos = await client.workers_async()
        self._workers = {w.worker_id: w for w in infos}
        self._workers_at = now
        for w in infos:
            for ns in w.namespaces:
                if ns not in self._hashing and (h := WorkerHashing.from_meta(w.meta)) is not None:
                    self._hashing[ns] = h
        if now - self._bw_at > BANDWIDTH_REFRESH_S and self._bw_task is None:
            self._bw_task = asyncio.get_running_loop().create_task(self._refresh_bandwidths())

    async def _refresh_bandwidths(self) -> None:
        """The transports' measured bytes/s (the pools probe them at start), off the loop."""
        from actors.deploy import measured_bandwidths

        try:
            self._measured = await asyncio.to_thread(measured_bandwidths,
                                                     self.settings.ray_namespace, 0.0, 2.0)
        except Exception as exc:  # advisory: keep the previous figures
            log.info("kvshare bandwidths unavailable: %s", exc)
        finally:
            self._bw_at = time.monotonic()
            self._bw_task = None

    def _namespace(self, prompt: PromptInput) -> str | None:
        if prompt.namespace:
            return prompt.namespace
        if self.settings.namespace:
            return self.settings.namespace
        mine = {ns for r in self._replica_id_set
                if (w := self._workers.get(replica_worker_id(r))) is not None for ns in w.namespaces}
        return next(iter(mine)) if len(mine) == 1 else None

    def _policy_for(self, hashing: WorkerHashing, loads: Mapping[WorkerId, WorkerLoad]) -> Policy:
        speeds = sorted(ld.prefill_tokens_per_s for ld in loads.values() if ld.prefill_tokens_per_s > 0)
        tps = speeds[len(speeds) // 2] if speeds else self.settings.prefill_tokens_per_s
        bpt = hashing.bytes_per_token or self.settings.bytes_per_token or 1
        sharing = Sharing(self.settings.sharing or hashing.sharing)
        measured = {**self._measured, **(self.settings.bandwidths or {})}  # settings win
        key = (hashing.block_tokens, bpt, round(tps, -1), sharing, tuple(sorted(measured.items())))
        if self._policy is None or key != self._cost_key:
            bw = Bandwidths.from_measured(measured)
            cost = CostModel(PrefillModel.from_tokens_per_s(tps), bw, hashing.block_tokens, bpt)
            if self._policy is None:
                self._policy = make_policy(self.settings.policy, cost, sharing)
            else:
                self._policy.cost = cost
                self._policy.sharing = sharing
            self._cost_key = key
        return self._policy

    # ------------------------------------------------------------------ choosing
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Replicas ranked by kvshare's policy (one per rank), or power of two as fallback."""
        ranked = None
        if pending_request is not None and candidate_replicas:
            try:
                ranked = await self._rank(candidate_replicas, pending_request)
            except Exception as exc:  # routing is advisory: never fail a request over it
                log.warning("kvshare routing failed, using power of two: %r", exc)
                self._count("fallback_error")
        if ranked:
            return ranked
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,  # type: ignore[arg-type]  # same mixins, Serve's own pattern
            candidate_replicas=candidate_replicas, pending_request=pending_request)

    async def _rank(
        self, replicas: list[RunningReplica], pr: PendingRequest
    ) -> list[list[RunningReplica]] | None:
        if pr.metadata.multiplexed_model_id:
            allowed = self.apply_multiplex_routing(pending_request=pr)
            replicas = [r for r in replicas if r.replica_id in allowed]
            if not replicas:
                return None
        repass = self._repass(replicas, pr)
        if repass:
            return repass
        prompt = extract_prompt(pr.args, pr.kwargs)
        if prompt is None:  # e.g. a control method: nothing to match
            self._count("no_prompt")
            return None
        client = await self._index()
        if client is None:
            self._count("fallback_index_unreachable")
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.index_timeout_s
        try:
            await asyncio.wait_for(self._refresh_workers(client), self.settings.index_timeout_s)
        except TimeoutError:
            self._count("fallback_index_slow")
            return None
        except RayError as exc:
            log.info("kvshare index unavailable, using power of two: %s", exc)
            self._count("fallback_index_unavailable")
            return None
        key = self._prompt_key(prompt)
        if key is None:
            return None
        namespace, hashing, hashes, num_tokens = key
        before = client.unavailable
        try:
            match, loads = await asyncio.wait_for(
                asyncio.gather(client.match_async(namespace, list(hashes)), client.loads_async()),
                max(0.001, deadline - loop.time()))
            ok = client.unavailable == before
        except (TimeoutError, RayError):
            ok = False
        if ok:
            self._loads = dict(loads)
        else:
            # Index slow or down: the router's own recent decisions (pending blocks) still
            # say where this prefix went; without them, power of two.
            match, loads = MatchResult(len(hashes), 0, {}), self._loads
            if self._pending.match(namespace, hashes).combined_prefix == 0:
                self._count("fallback_index_slow")
                # remember where power of two sends it: the next request may need to know
                rid = pr.metadata.internal_request_id
                if rid not in self._last:
                    self._remember(rid, _Routing(namespace, hashes, num_tokens, 0, (), num_tokens))
                return None
            self._count("index_slow_pending_only")
        return self._order(replicas, namespace, hashes, num_tokens, match, loads, hashing, pr)

    def _repass(
        self, replicas: list[RunningReplica], pr: PendingRequest
    ) -> list[list[RunningReplica]] | None:
        """A request Serve could not place on its shortlist (full, rejected, slow to answer
        the queue probe) gets the same shortlist again, with Serve's backoff in between, until
        pass ``spill_after_passes``; then it is ranked afresh over every replica."""
        rid = pr.metadata.internal_request_id
        prev = self._last.get(rid)
        if prev is None or not prev.shortlist or prev.passes + 1 >= self.settings.spill_after_passes:
            return None
        live = {replica_worker_id(r.replica_id): r for r in replicas}
        shortlist = [[live[w]] for w in prev.shortlist if w in live]
        if shortlist:
            self._count("repass")
            self._last[rid] = prev._replace(passes=prev.passes + 1)
            pr.routing_context.should_backoff = True
        return shortlist or None

    def _prompt_key(
        self, prompt: PromptInput
    ) -> tuple[str, WorkerHashing, tuple[BlockHash, ...], int] | None:
        """Namespace, hashing scheme, block hashes and token count of a prompt."""
        namespace = self._namespace(prompt)
        hashing = self._hashing.get(namespace) if namespace else None
        if namespace is None or hashing is None:
            self._count("fallback_unknown_namespace")
            return None
        tokens = hashing.tokens_of(prompt)
        hashes = prompt.hashes
        if hashes is None:
            if tokens is None:
                self._count("no_prompt")
                return None
            hashes = tuple(block_hashes(hashing.root, tokens, hashing.block_tokens))
        num_tokens = len(tokens) if tokens is not None else len(hashes) * hashing.block_tokens
        return namespace, hashing, hashes, max(1, num_tokens)

    def _order(
        self, replicas: list[RunningReplica], namespace: str, hashes: tuple[BlockHash, ...],
        num_tokens: int, match: MatchResult, loads: Mapping[WorkerId, WorkerLoad],
        hashing: WorkerHashing, pr: PendingRequest,
    ) -> list[list[RunningReplica]]:
        by_worker = {replica_worker_id(r.replica_id): r for r in replicas}
        rid = pr.metadata.internal_request_id
        prev = self._last.pop(rid, None)
        passes = prev.passes + 1 if prev is not None else 1
        pr.routing_context.should_backoff = passes > 1
        # pending blocks help only the worker about to create them: never a remote source
        pending = self._pending.match(namespace, hashes)
        cands = [self._candidate(w, r, namespace, loads.get(w)) for w, r in by_worker.items()]
        policy = self._policy_for(hashing, loads)
        request = RouteRequest(namespace, hashes, num_tokens, request_id=rid)
        decision = policy.choose(request, match, cands, pending)
        view = SourceMap(match, {c.info.worker_id: c.info.node for c in cands}, pending)
        est = {c.info.worker_id: policy.queue_s(c.load) + policy.plan_for(request, view, c).total_s
               for c in cands}
        order = sorted(by_worker, key=lambda w: (w != decision.worker, est[w]))
        if self.settings.log_decisions:
            log.info("kvshare route %s pass %d: %d/%d blocks held, est %s, load %s -> %s (%s)",
                     rid, passes, match.combined_prefix, match.num_blocks,
                     {w: round(e, 4) for w, e in est.items()},
                     {c.info.worker_id: (c.load.queued_prefill_tokens,
                                         round(c.load.prefill_tokens_per_s)) for c in cands},
                     decision.worker, decision.reason)
        if passes == 1:
            self._count(f"decision_{decision.reason}")
            # Replicas estimated much slower than the best are held back at first.
            limit = est[decision.worker] * (1 + self.settings.spill_ratio) + 0.005
            order = [w for w in order if w == decision.worker or est[w] <= limit]
        else:
            self._count("spilled")
        compute = num_tokens - decision.cached_blocks * hashing.block_tokens
        self._remember(rid, _Routing(namespace, hashes, compute, passes, tuple(order), num_tokens))
        return [[by_worker[w]] for w in order]

    def _remember(self, rid: str, routing: _Routing) -> None:
        while len(self._last) >= 4096:  # requests cancelled before being routed
            del self._last[next(iter(self._last))]
        self._last[rid] = routing

    def _candidate(
        self, wid: WorkerId, replica: RunningReplica, namespace: str, reported: WorkerLoad | None
    ) -> Candidate:
        info = self._workers.get(wid) or WorkerInfo(wid, NodeId(replica.node_id), (namespace,))
        now = time.time()
        since = reported.ts if reported is not None else 0.0
        recent = [(t, n) for t, n in self._routed.get(wid, []) if now - t < 2.0]
        self._routed[wid] = recent
        extra = sum(n for t, n in recent if t > since)
        done = [(t, n) for t, n in self._done.get(wid, []) if now - t < 2.0]
        self._done[wid] = done
        finished = sum(n for t, n in done if t > since)  # still in a stale report
        reported_q = reported.queued_prefill_tokens if reported else 0
        queued = max(0, reported_q - finished) + extra
        queue_len = self._replica_queue_len_cache.get(replica.replica_id) or 0
        running = max(reported.running if reported else 0, queue_len)
        tps = reported.prefill_tokens_per_s if reported else 0.0
        active = sum(v[1] for v in self._inflight.values() if v[0] == wid)
        return Candidate(info, WorkerLoad(wid, queued, running, tps, now), active)

    # ------------------------------------------------------------------ lifecycle hooks
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        """Remember where this prompt's blocks are about to be (pending) and the queued work."""
        rid = pending_request.metadata.internal_request_id
        last = self._last.pop(rid, None)
        if last is None:
            return
        namespace, hashes, compute = last.namespace, last.hashes, last.compute
        wid = replica_worker_id(replica_id)
        node = self._node_of(replica_id)
        if node is not None:
            self._pending.add(namespace, node_location(node), hashes, Tier.HOST)
        self._routed.setdefault(wid, []).append((time.time(), max(0, compute)))
        self._inflight[rid] = (wid, len(hashes), last.tokens)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request left the replica: its queued tokens no longer count there."""
        done = self._inflight.pop(internal_request_id, None)
        if done is not None:
            self._done.setdefault(done[0], []).append((time.time(), done[2]))

    def _node_of(self, replica_id: ReplicaID) -> str | None:
        r = self._replicas.get(replica_id)
        return r.node_id if r is not None else None

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's replica set changed: forget removed replicas' queued work."""
        super().update_replicas(replicas)
        self._start_connect()  # connect before the first request needs the index
        live = {replica_worker_id(r.replica_id) for r in replicas}
        for table in (self._routed, self._done):
            for wid in [w for w in table if w not in live]:
                del table[wid]
        self._inflight = {k: v for k, v in self._inflight.items() if v[0] in live}
        self._workers_at = -1e9  # re-read registrations on the next request

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A replica died: never route to it again, drop its queued work."""
        super().on_replica_actor_died(replica_id)
        wid = replica_worker_id(replica_id)
        self._routed.pop(wid, None)
        self._done.pop(wid, None)
        self._workers.pop(wid, None)
        self._inflight = {k: v for k, v in self._inflight.items() if v[0] != wid}
        self._count("replica_died")
