"""CacheAwareRouter: cache-aware routing for any asyncio gateway, in a few lines.

::

    router = CacheAwareRouter(index, StaticWorkers(workers), RouterConfig(namespace="llama"))
    routed = await router.route(messages=body["messages"], tenant=Tenant("acme", salt="s1"))
    url = routed.decision.endpoint          # forward there, with routed.kvshare_field()
    ...
    router.finished(routed.request_id)      # when the response is complete

Per request the adapter tokenizes once (pluggable tokenizer, byte-level by default) and
hands the rest to :class:`~kvshare.router.core.routing.RoutingCore`: hashing under the tenant's namespace root
(so tenants never match each other's blocks), the index query under its deadline with the
load-only fallback, in-flight load, pending blocks and the policy's ranking. What stays here
is the gateway's own: tenants, workers marked down or excluded, Prometheus metrics. Nothing
here blocks the event loop. One router per event loop (policies and pending state are not
thread-safe).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshare.actors.index.runs import HolderRuns
from kvshare.cost import Bandwidths, Windows
from kvshare.hasher import Hasher
from kvshare.hashing import DEFAULT_HASH_FN, HashFn, PackedIds, fast_ids
from kvshare.match import MatchResult
from kvshare.pool.types import check_namespace
from kvshare.quick_init import quick_init
from kvshare.router.core.index import RouterIndex
from kvshare.router.core.metrics import RouterMetrics
from kvshare.router.core.policy import Decision, Policy, Ranking, RouteRequest
from kvshare.router.core.recent import RecentDecisions
from kvshare.router.core.registry import DEFAULT_POLICY
from kvshare.router.core.routing import CostInputs, RoutingCore
from kvshare.router.core.sources import Sharing
from kvshare.router.core.workers_view import WorkerSource
from kvshare.tokenizer import ByteTokenizer, Tokenizer
from kvshare.types import BlockHash, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad


@dataclass(frozen=True)
class Tenant:
    """A tenant and its cache salt ("" = the shared default root). ``admin`` lets the
    tenant's key call the gateway's pin/unpin/prefetch operations; ``max_inflight`` bounds
    its requests in flight (None: the gateway's default; :mod:`kvshare.router.gateway.admission`). Neither is
    part of equality."""

    name: str = "default"
    salt: str = ""
    admin: bool = field(default=False, compare=False)
    max_inflight: int | None = field(default=None, compare=False)


_DEFAULT_TENANT = Tenant()


@dataclass(frozen=True)
class RouterConfig:
    """Everything a router needs besides the index and the workers.

    ``model_id``/``layout_fingerprint``/``block_tokens``/``hash_fn`` must be the workers' (they
    make the hash root); ``prefill_tokens_per_s`` seeds the prefill model until
    :meth:`CacheAwareRouter.observe_prefill` timings refit it; ``bandwidths`` in bytes/s
    (:meth:`~kvshare.cost.Bandwidths.from_measured` takes the transports' probes);
    ``bytes_per_token`` defaults to a Llama-3.1-8B bf16 KV cache (128 KiB/token) — use
    :meth:`from_model_keys` to take the workers' layout (of a sliding-window layout, the bytes
    every block moves, with ``kv_windows`` the groups only a hit's last window moves).
    """

    namespace: str = "default"
    model_id: str = "model"
    layout_fingerprint: str = ""
    block_tokens: int = 256
    hash_fn: HashFn = DEFAULT_HASH_FN
    bytes_per_token: int = 131_072
    kv_windows: Windows = ()
    policy: str = DEFAULT_POLICY
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    sharing: Sharing = Sharing.GLOBAL
    index_timeout_s: float = 0.05
    pending_ttl_s: float = 10.0
    prefill_tokens_per_s: float = 5_000.0
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    refit_every: int = 32
    hash_memo_blocks: int = 8192
    """Recent blocks whose hashes the router keeps, verified (a next turn or a shared system
    prompt is not rehashed: :class:`~kvshare.hasher.Hasher`); ~(4 x block_tokens + 120) bytes
    each; 0 turns it off. Decisions are the same either way."""

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if self.block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if self.index_timeout_s <= 0 or self.pending_ttl_s <= 0:
            raise ValueError("index_timeout_s and pending_ttl_s must be positive seconds")
        if self.hash_memo_blocks < 0:
            raise ValueError("hash_memo_blocks must be >= 0 (0: no memo)")

    @classmethod
    def from_model_keys(cls, keys: Any, **options: Any) -> RouterConfig:
        """Hashing settings from a worker's ``kvshare.engines.hf.ModelKeys`` (same root)."""
        layout = keys.layout
        every, windows = layout.fetch_terms()
        return cls(model_id=keys.identity, layout_fingerprint=layout.fingerprint(),
                   block_tokens=layout.block_tokens, bytes_per_token=every, kv_windows=windows,
                   **options)

    def cost_inputs(self) -> CostInputs:
        """What the router's cost model is assembled from (:class:`~kvshare.router.core.routing.RoutingCore`)."""
        return CostInputs(self.block_tokens, self.bytes_per_token, self.bandwidths,
                          self.prefill_tokens_per_s, self.sharing, self.kv_windows)


@quick_init
@dataclass(frozen=True)
class Routed:
    """A routing decision plus what the worker needs so it never re-tokenizes."""

    request_id: str
    decision: Decision
    tenant: Tenant
    namespace: str
    token_ids: list[int] | PackedIds
    """The prompt's ids as routed: the caller's list, or its packed ids as they were given
    (:func:`~kvshare.hashing.packed_u32`); :meth:`token_list` is always a list."""
    hashes: list[BlockHash]
    index_s: float
    fallback: str = ""
    ranking: Ranking | None = field(default=None, compare=False, repr=False)
    """The full ranking behind the decision (every candidate's estimate, best first)."""
    timings: dict[str, float] = field(default_factory=dict, compare=False, repr=False)
    """Seconds of this decision's stages: ``tokenize``, ``hash``, ``index``, ``score``
    (:mod:`kvshare.breakdown`)."""
    block_tokens: int = field(default=0, compare=False)
    """The router's block size (what :attr:`hashes` cover each)."""
    info: WorkerInfo | None = field(default=None, compare=False, repr=False)
    """The chosen worker's registration as the router saw it when deciding (its engine and
    model say what body to send): a later snapshot may no longer list it (its lease lapsed
    for a moment), and the request must still go to it in its engine's form."""

    def token_list(self) -> list[int]:
        """:attr:`token_ids` as a list of ints (JSON bodies need one; a list is not copied)."""
        ids = self.token_ids
        return ids if isinstance(ids, list) else ids.tolist()

    def kvshare_field(self) -> dict[str, Any]:
        """The ``kvshare`` JSON field forwarded to the worker."""
        out: dict[str, Any] = {
            "token_ids": self.token_list(), "namespace": self.namespace,
            "hashes_hex": [h.hex() for h in self.hashes], "tenant": self.tenant.name,
        }
        if self.tenant.salt:
            out["cache_salt"] = self.tenant.salt
        return out


def _token_ids(prompt: Sequence[Any]) -> bool:
    """Whether every item is an int in [0, 2**32) and not a bool (C-level passes when every
    item is exactly an int, as parsed JSON is; item by item otherwise)."""
    if set(map(type, prompt)) == {int}:
        return bool(min(prompt) >= 0 and max(prompt) < 2**32)
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt)


class InProcessIndex:
    """:class:`~kvshare.workers.IndexQuery` and :class:`~kvshare.router.core.index.RouterIndex`
    over an in-process ``GlobalIndex`` (embedding a router next to its own index, tests,
    benchmarks), with the worker registry reads of ``IndexClient`` too
    (:class:`~kvshare.router.core.workers_view.WorkerRegistry`). It answers inline: an
    in-process match takes microseconds and must not hop threads."""

    inline = True

    def __init__(self, index: Any) -> None:
        self.index = index

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        result: MatchResult = self.index.match(namespace, hashes)
        return result

    async def match_async(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        return self.match(namespace, hashes)

    def match_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> HolderRuns:
        """The match in run form (:class:`~kvshare.actors.index.runs.HolderRuns`)."""
        result: HolderRuns = self.index.match_runs(namespace, hashes)
        return result

    async def match_runs_async(self, namespace: str, hashes: Sequence[BlockHash]) -> HolderRuns:
        return self.match_runs(namespace, hashes)

    async def workers_async(self) -> list[WorkerInfo]:
        """The registered workers (as ``IndexClient.workers_async``)."""
        return list(self.index.workers())

    async def loads_async(self) -> dict[WorkerId, WorkerLoad]:
        """Their latest load reports (as ``IndexClient.loads_async``)."""
        return dict(self.index.loads())


class CacheAwareRouter:
    """The asyncio gateway's adapter over :class:`~kvshare.router.core.routing.RoutingCore`: tokenizing,
    tenants, workers marked down, metrics; see the module docstring."""

    def __init__(
        self,
        index: RouterIndex | None,
        workers: WorkerSource,
        config: RouterConfig | None = None,
        tokenizer: Tokenizer | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = cfg = config or RouterConfig()
        self.workers = workers
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.metrics = metrics or RouterMetrics()
        self.hasher = Hasher(cfg.model_id, cfg.layout_fingerprint, cfg.block_tokens, fn=cfg.hash_fn,
                             memo_blocks=cfg.hash_memo_blocks)
        self.core = RoutingCore(
            index, cfg.cost_inputs(), policy=cfg.policy, policy_options=cfg.policy_options,
            index_timeout_s=cfg.index_timeout_s, pending_ttl_s=cfg.pending_ttl_s,
            refit_every=cfg.refit_every)
        self.pending = self.core.pending
        self.inflight = self.core.inflight
        self._ids = itertools.count(1)
        self._down: dict[WorkerId, float] = {}
        self.decisions = 0
        self.fallbacks = 0
        self.recent = RecentDecisions()  # for the live page (router/web)

    @property
    def index(self) -> RouterIndex | None:
        return self.core.index

    @property
    def policy(self) -> Policy:
        return self.core.policy

    # ------------------------------------------------------------------ inputs
    def tokenize(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a completion prompt (text or ids) or a chat; ValueError if malformed."""
        if messages is not None:
            if not isinstance(messages, list | tuple) or not messages:
                raise ValueError("'messages' must be a non-empty list of {role, content}")
            for m in messages:
                if not isinstance(m, Mapping):
                    raise ValueError("each chat message must be an object {role, content}")
            return list(self.tokenizer.apply_chat_template(messages))
        if isinstance(prompt, str) and prompt:
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list | tuple) and prompt and _token_ids(prompt):
            return list(prompt)
        raise ValueError("'prompt' must be a non-empty string or a list of token ids (ints >= 0)")

    def root(self, tenant: Tenant) -> BlockHash:
        return self.hasher.root_for(tenant.salt)

    def hashes(self, token_ids: Sequence[int] | PackedIds, tenant: Tenant) -> list[BlockHash]:
        return self.core.hashes(self.hasher, token_ids, tenant.salt)

    # ------------------------------------------------------------------ routing
    async def route(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tenant: Tenant | None = None,
        request_id: str | None = None,
        token_ids: Sequence[int] | PackedIds | None = None,
        exclude: Collection[WorkerId] = (),
    ) -> Routed:
        """Decide where a request goes. ValueError for a malformed prompt;
        :class:`~kvshare.router.core.policy.NoEligibleWorker` if no worker serves the namespace.

        ``exclude``: workers not to use for this request (e.g. one that just refused the
        connection); workers marked down (:meth:`mark_down`) are avoided while any other
        worker is eligible. ``token_ids``: an already tokenized prompt; a ``list`` is kept
        as :attr:`Routed.token_ids` without a copy (copying 8k ids costs as much as scoring
        all workers), so do not change it afterwards; so are ids already packed as u32 (a
        numpy ``uint32`` array or ``array.array("I")``, :func:`~kvshare.hashing.packed_u32`),
        which are hashed from their bytes (no int objects to read, none for the garbage
        collector to walk while the request is in flight); another numpy integer array (a
        tokenizer's int64 ids) is packed first (:func:`~kvshare.hashing.fast_ids`).
        """
        t0 = time.perf_counter()
        tenant = tenant or _DEFAULT_TENANT
        ids: list[int] | PackedIds
        if token_ids is None:
            ids = self.tokenize(prompt, messages)
        else:
            ids = token_ids if type(token_ids) is list else fast_ids(token_ids)
        t1 = time.perf_counter()
        hashes = self.hashes(ids, tenant)
        t2 = time.perf_counter()
        ns = self.config.namespace
        core = self.core
        answer = core.query_inline(ns, hashes) or await core.query(ns, hashes)
        t3 = time.perf_counter()
        if answer.timed:
            self.metrics.tally.index_latency(answer.index_s)
        infos, loads = await self.workers.snapshot()
        cands = core.candidates(self._usable(infos, exclude), loads)
        req = RouteRequest(ns, hashes, len(ids), tenant.name, request_id or "")
        ranking = core.rank(req, answer, cands)
        d = ranking.decision
        rid = request_id or f"r{next(self._ids)}"
        cached = d.plan.cached_tokens if d.plan is not None else 0
        core.routed(rid, ranking)
        t4 = time.perf_counter()
        self._count(d, tenant, len(ids), cached, answer.fallback, t4 - t0)
        self.recent.add(rid, d, tenant.name, len(ids), answer.fallback)
        timings = {"tokenize": t1 - t0, "hash": t2 - t1, "index": t3 - t2, "score": t4 - t3}
        info = next((i for i in infos if i.worker_id == d.worker), None)
        return Routed(rid, d, tenant, ns, ids, hashes, answer.index_s, answer.fallback, ranking,
                      timings, self.config.block_tokens, info)

    def mark_down(self, worker: WorkerId, for_s: float = 5.0) -> None:
        """Avoid ``worker`` for ``for_s`` seconds (it refused a connection)."""
        self._down[worker] = time.monotonic() + for_s

    def mark_up(self, worker: WorkerId) -> None:
        """Route to ``worker`` again now (e.g. a health check saw it answer), ending a
        :meth:`mark_down`; a worker not marked down is left as it is."""
        self._down.pop(worker, None)

    def _usable(self, infos: Sequence[WorkerInfo], exclude: Collection[WorkerId]) -> Sequence[WorkerInfo]:
        if not self._down and not exclude:
            return infos
        now = time.monotonic()
        down = {w for w, until in self._down.items() if until > now}
        if len(down) != len(self._down):
            self._down = {w: u for w, u in self._down.items() if u > now}
        out = [i for i in infos if i.worker_id not in exclude and i.worker_id not in down]
        if out or not down:
            return out
        return [i for i in infos if i.worker_id not in exclude]  # all marked down: try anyway

    def _count(self, d: Decision, tenant: Tenant, tokens: int, cached: int, fallback: str,
               dt: float) -> None:
        self.decisions += 1
        if fallback:
            self.fallbacks += 1
        self.metrics.tally.decision(d.policy, d.reason, tenant.name, tokens, cached,
                                    d.est_ttft_saved_s, dt, fallback)

    # ------------------------------------------------------------------ feedback
    def prefilled(self, request_id: str) -> None:
        """The worker produced the first token: its prefill no longer loads the queue."""
        self.core.prefilled(request_id)

    def finished(self, request_id: str) -> None:
        """The request is complete (or failed): stop counting it as load."""
        self.core.finished(request_id)

    def report_load(self, load: WorkerLoad) -> None:
        """Hand a worker's load report to the worker source (:meth:`~kvshare.router.core.workers_view.WorkerSource.report`)."""
        self.workers.report(load)

    @property
    def prefill_samples(self) -> int:
        """Measured prefill timings seen so far (:meth:`observe_prefill`)."""
        return self.core.prefill_samples

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A measured prefill; every ``refit_every`` samples the prefill model is refitted."""
        self.core.observe_prefill(new_tokens, cached_tokens, seconds)
