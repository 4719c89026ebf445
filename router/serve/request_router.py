"""kvshare routing as a Ray Serve request router.

A Serve user switches a deployment to kvshare routing with one config line::

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class="kvshare.router.serve:KVShareRequestRouter"))

Each replica registers with the kvshare index as a worker whose id is
:func:`replica_worker_id` of its Serve replica id, on its Ray node (``router/serve_app.py``
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
   later passes offer every replica ("spill"). From the ranking on, the request's prefill
   counts as queued at its first choice (``RoutingCore.expect``), so a burst of requests
   ranked before Serve placed any of them is not all sent to one replica; once placed it
   counts where it went.

Steps 1-3 are :class:`~kvshare.router.core.routing.RoutingCore`'s, the same core the asyncio gateway uses
(hashing, the index deadline and its fallback, in-flight load, pending blocks, the cost model
and the full ranking); this module only translates Serve's replicas and requests to it and
its ranking back to Serve's shortlists; the replicas' workers and their registrations and
load reports come from its workers view (:class:`~kvshare.router.serve.workers_view.ReplicaWorkers`).
If the index is not connected yet, the workers' registrations cannot be read in time, or
the request carries no prompt, the router uses Serve's own power-of-two choice and counts the fallback (Ray metric
``kvshare_serve_routing_total{reason}``); an index slower than its deadline gives the core's
fallback ranking. Replicas added, removed or dead reach it through ``update_replicas`` /
``on_replica_actor_died``. Request parsing and settings live in :mod:`kvshare.router.serve.request`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

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

from kvshare.cost import Bandwidths
from kvshare.router.core.index import RouterIndex
from kvshare.router.core.policy import Ranking, RouteRequest
from kvshare.router.core.routing import CostInputs, IndexAnswer, RoutingCore
from kvshare.router.core.sources import Sharing
from kvshare.router.core.workers_view import WorkerRegistry
from kvshare.router.gateway.forward import vllm_hint
from kvshare.router.serve.request import (
    PromptInput,
    ServeRouterSettings,
    WorkerHashing,
    extract_prompt,
)
from kvshare.router.serve.workers_view import ReplicaWorkers
from kvshare.types import BlockHash, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad

log = logging.getLogger("ray.serve")
BANDWIDTH_REFRESH_S = 30.0  # how often measured transport bandwidths are re-read


class ServeIndex(RouterIndex, WorkerRegistry, Protocol):
    """What the Serve router reads of the index: matches (the core's) and the worker registry
    (its workers view's): an :class:`~kvshare.actors.index.client.IndexClient`, an
    :class:`~kvshare.router.core.embed.InProcessIndex`."""


class _Routing(NamedTuple):
    """A request's routing so far: its ranking, passes made, its shortlist."""

    ranking: Ranking
    passes: int
    shortlist: tuple[WorkerId, ...]


class KVShareRequestRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve request router ranking replicas with kvshare's cost policy (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with ``request_router_kwargs`` (see :class:`ServeRouterSettings`).

        Runs on Serve's event loop: nothing here blocks; the index is connected lazily.
        """
        self.settings = ServeRouterSettings.from_kwargs(kwargs)
        self._client: ServeIndex | None = None
        self._connect_task: asyncio.Task[ServeIndex] | None = None
        self._next_connect = 0.0
        self.workers = ReplicaWorkers(self.settings, self._learn)
        self._replica: RouterIndex | None = None  # settings.index_replica: the router's copy
        self._hashing: dict[str, WorkerHashing] = {}
        st = self.settings
        self.core = RoutingCore(
            None, CostInputs(256, st.bytes_per_token or 1, Bandwidths.from_measured(st.bandwidths or {}),
                             st.prefill_tokens_per_s),
            policy=st.policy, index_timeout_s=st.index_timeout_s, pending_ttl_s=st.pending_ttl_s)
        self._measured: dict[str, float] = {}
        self._bw_at = -1e9
        self._bw_task: asyncio.Task[None] | None = None
        self._refresh_bandwidth = True  # False when the index was handed in (use_index)
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
        return {"counters": dict(self.counters), "workers": len(self.workers.registered),
                "replicas": len(self._replicas), "index_connected": self._client is not None}

    # the workers view's state, under the names it had here (tests read them)
    @property
    def _workers(self) -> dict[WorkerId, WorkerInfo]:
        return self.workers.registered

    @property
    def _workers_task(self) -> asyncio.Task[None] | None:
        return self.workers.workers_task

    @property
    def _loads_at(self) -> float:
        return self.workers.loads_at

    # ------------------------------------------------------------------ index access
    def use_index(self, client: ServeIndex) -> None:
        """Route with this index (an :class:`~kvshare.actors.index.client.IndexClient`, an
        :class:`~kvshare.router.core.embed.InProcessIndex`) instead of connecting to the
        deployment's; the transports' bandwidths then come from ``settings.bandwidths`` only."""
        self._client = client
        self.core.index = client
        self.workers.registry = client
        self._refresh_bandwidth = False

    def _start_connect(self) -> None:
        """Look the index up on a thread (``ray.get_actor`` blocks), once per retry period."""
        if self._client is not None or self._connect_task is not None:
            return
        if time.monotonic() < self._next_connect:
            return
        from kvshare.actors.index.client import IndexClient

        def connect() -> ServeIndex:
            client = IndexClient.connect(self.settings.ray_namespace, self.settings.index_timeout_s)
            client.timeout_s = max(1.0, self.settings.index_timeout_s)
            client.loads()  # warm the connection to the index actor (first calls are slow)
            client.timeout_s = self.settings.index_timeout_s
            if self.settings.index_replica:
                from kvshare.actors.index.replica import IndexReplica

                replica = IndexReplica.follow(client, poll_s=self.settings.replica_poll_s)
                weakref.finalize(self, replica.close)  # a deleted router stops polling
                self._replica = replica
            return client

        self._connect_task = self._event_loop.create_task(asyncio.to_thread(connect))

    async def _index(self) -> ServeIndex | None:
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
            self.core.index = self._replica or self._client
            self.workers.registry = self._client
            self._connect_task = None
        except TimeoutError:
            return None
        except Exception as exc:  # not deployed yet, or restarting: retry later
            log.info("kvshare index not reachable (%s); retrying in %.1f s", exc,
                     self.settings.connect_retry_s)
            self._connect_task = None
            self._next_connect = now + self.settings.connect_retry_s
        return self._client

    def _learn(self, infos: list[WorkerInfo]) -> None:
        """Registrations were read: the namespaces' hashing, and the transports' measured
        bandwidths when they are older than :data:`BANDWIDTH_REFRESH_S`."""
        now = time.monotonic()
        for w in infos:
            for ns in w.namespaces:
                if ns not in self._hashing and (h := WorkerHashing.from_meta(w.meta)) is not None:
                    self._hashing[ns] = h
        if self._refresh_bandwidth and now - self._bw_at > BANDWIDTH_REFRESH_S and self._bw_task is None:
            self._bw_task = asyncio.get_running_loop().create_task(self._refresh_bandwidths())

    async def _refresh_bandwidths(self) -> None:
        """The transports' measured bytes/s (the pools probe them at start), off the loop."""
        from kvshare.actors.deploy import measured_bandwidths

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
        mine = self.workers.namespaces(self._replica_id_set)
        return next(iter(mine)) if len(mine) == 1 else None

    def _use_cost(self, hashing: WorkerHashing) -> None:
        """The core's cost model from the workers' hashing, the measured bandwidths and the
        settings' prefill speed (the core prices with what the workers' reports measure
        instead, where they do: :meth:`kvshare.router.core.routing.CostInputs.measured`)."""
        bpt = hashing.bytes_per_token or self.settings.bytes_per_token or 1
        sharing = Sharing(self.settings.sharing or hashing.sharing)
        measured = {**self._measured, **(self.settings.bandwidths or {})}  # settings win
        self.core.use_cost(CostInputs(hashing.block_tokens, bpt, Bandwidths.from_measured(measured),
                                      self.settings.prefill_tokens_per_s, sharing))

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
            await asyncio.wait_for(self.workers.refresh(self._replica_id_set),
                                   self.settings.index_timeout_s)
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
        answer, loads = await asyncio.gather(
            self.core.query(namespace, hashes), self.workers.loads(deadline))
        return self._order(replicas, RouteRequest(namespace, hashes, num_tokens,
                                                  request_id=pr.metadata.internal_request_id),
                           answer, loads, hashing, pr)

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
        live = {self.workers.worker_of(r): r for r in replicas}
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
            hashes = tuple(self.core.hashes(hashing.hasher, tokens))
        num_tokens = len(tokens) if tokens is not None else len(hashes) * hashing.block_tokens
        return namespace, hashing, hashes, max(1, num_tokens)

    def _order(
        self, replicas: list[RunningReplica], request: RouteRequest, answer: IndexAnswer,
        reported: Mapping[WorkerId, WorkerLoad], hashing: WorkerHashing, pr: PendingRequest,
    ) -> list[list[RunningReplica]]:
        by_worker = {self.workers.worker_of(r): r for r in replicas}
        rid = request.request_id
        prev = self._last.pop(rid, None)
        passes = prev.passes + 1 if prev is not None else 1
        pr.routing_context.should_backoff = passes > 1
        if answer.fallback:
            self._count(f"fallback_{answer.fallback}")
        infos = self.workers.infos(by_worker, request.namespace)
        loads = self.workers.with_queue_lengths(by_worker, reported, self._replica_queue_len_cache)
        self._use_cost(hashing)
        ranking = self.core.rank(request, answer, self.core.candidates(infos, loads))
        decision = ranking.decision
        est = {e.worker: e.est_ttft_s for e in ranking.estimates()}
        order = ranking.order()
        if self.settings.log_decisions:
            log.info("kvshare route %s pass %d: %d/%d blocks held, est %s -> %s (%s)",
                     rid, passes, answer.match.combined_prefix, answer.match.num_blocks,
                     {e.worker: (round(e.est_ttft_s, 3), f"q {e.queue_s:.3f}",
                                 f"cached {e.plan.cached_tokens} fetch {e.plan.fetch_s:.3f} "
                                 f"prefill {e.plan.prefill_s:.3f}",
                                 _load_text(loads.get(e.worker)))
                      for e in ranking.estimates()}, decision.worker, decision.reason)
        if passes == 1:
            self._count(f"decision_{decision.reason}")
            # Replicas estimated much slower than the best are held back at first.
            limit = est[decision.worker] * (1 + self.settings.spill_ratio) + 0.005
            order = [w for w in order if w == decision.worker or est[w] <= limit]
        else:
            self._count("spilled")
        self._remember(rid, _Routing(ranking, passes, tuple(order)))
        hint = vllm_hint(ranking, hashing.block_tokens) if self.settings.hint_kwarg else None
        if hint is not None:
            # sent with the request (Serve sends ``pr`` as ranked): the engine need not ask
            pr.kwargs[self.settings.hint_kwarg] = hint
        # Serve places it some time later (queue probes, backoff): until then the requests
        # ranked meanwhile must see it queued at its first choice.
        self.core.expect(rid, ranking)
        return [[by_worker[w]] for w in order]

    def _remember(self, rid: str, routing: _Routing) -> None:
        while len(self._last) >= 4096:  # requests cancelled before being routed
            gone = next(iter(self._last))
            del self._last[gone]
            self.core.finished(gone)
        self._last[rid] = routing

    # ------------------------------------------------------------------ lifecycle hooks
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        """The request went to ``replica_id``: its blocks are pending there, its work in flight."""
        rid = pending_request.metadata.internal_request_id
        last = self._last.pop(rid, None)
        if last is not None:
            self.core.routed(rid, last.ranking, self.workers.worker_of_id(replica_id))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request left the replica: its queued tokens no longer count there."""
        self.core.finished(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's replica set changed: forget removed replicas' queued work."""
        super().update_replicas(replicas)
        self._start_connect()  # connect before the first request needs the index
        live = {self.workers.worker_of(r) for r in replicas}
        self.core.inflight.keep_only(live)
        self.workers.replicas_changed()  # re-read registrations on the next request

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A replica died: never route to it again, drop its queued work."""
        super().on_replica_actor_died(replica_id)
        self.core.inflight.drop(self.workers.died(replica_id))
        self._count("replica_died")


def _load_text(load: WorkerLoad | None) -> str:
    """A load report in a decision log line (``log_decisions``)."""
    if load is None:
        return "no report"
    return (f"queued {load.queued_prefill_tokens} tok, {load.running} running, {load.waiting} "
            f"waiting, {load.prefill_tokens_per_s:.0f} tok/s, {time.time() - load.ts:.2f}s old"
            + (f" (state {time.time() - load.as_of:.2f}s old)" if load.as_of else ""))
