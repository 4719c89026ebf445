"""CacheAwareRouter: cache-aware routing for any asyncio gateway, in a few lines.

::

    router = CacheAwareRouter(index, StaticWorkers(workers), RouterConfig(namespace="llama"))
    routed = await router.route(messages=body["messages"], tenant=Tenant("acme", salt="s1"))
    url = routed.decision.endpoint          # forward there, with routed.kvshare_field()
    ...
    router.finished(routed.request_id)      # when the response is complete

Per request: tokenize once (pluggable tokenizer, byte-level by default), hash the full blocks
under the tenant's namespace root (so tenants never match each other's blocks), ask the index
(``IndexQuery.match_async``) under a deadline, add the blocks this router's recent decisions
are about to create (pending, with a TTL), and score every worker with the policy. If the
index is unreachable or slower than the deadline, the decision is load-only (same policy,
empty match) and counted as a fallback. Nothing here blocks the event loop. One router per
event loop (policies and pending state are not thread-safe).
"""

from __future__ import annotations

import array
import asyncio
import itertools
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.index.runs import HolderRuns
from kvshare.cost import Bandwidths, CostModel, PrefillModel
from kvshare.engines.tokenizer import ByteTokenizer, Tokenizer
from kvshare.hashing import DEFAULT_HASH_FN, HashFn, block_hashes, namespace_root
from kvshare.match import EMPTY_MATCH, MatchResult
from kvshare.pool_types import check_namespace
from kvshare.types import BlockHash, Tier, WorkerId, worker_location
from kvshare.workers import IndexQuery, WorkerInfo, WorkerLoad
from router.metrics import RouterMetrics
from router.pending import PendingBlocks
from router.policy import DEFAULT_POLICY, Candidate, Decision, RouteRequest, make_policy
from router.sources import Match, Sharing
from router.workers_view import InFlight, WorkerSource


@dataclass(frozen=True)
class Tenant:
    """A tenant and its cache salt ("" = the shared default root). ``admin`` lets the
    tenant's key call the gateway's pin/unpin/prefetch operations (not part of equality)."""

    name: str = "default"
    salt: str = ""
    admin: bool = field(default=False, compare=False)


_DEFAULT_TENANT = Tenant()


@dataclass(frozen=True)
class RouterConfig:
    """Everything a router needs besides the index and the workers.

    ``model_id``/``layout_fingerprint``/``block_tokens``/``hash_fn`` must be the workers' (they
    make the hash root); ``prefill_tokens_per_s`` seeds the prefill model until
    :meth:`CacheAwareRouter.observe_prefill` timings refit it; ``bandwidths`` in bytes/s
    (:meth:`~kvshare.cost.Bandwidths.from_measured` takes the transports' probes);
    ``bytes_per_token`` defaults to a Llama-3.1-8B bf16 KV cache (128 KiB/token) — use
    :meth:`from_model_keys` to take the workers' layout.
    """

    namespace: str = "default"
    model_id: str = "model"
    layout_fingerprint: str = ""
    block_tokens: int = 256
    hash_fn: HashFn = DEFAULT_HASH_FN
    bytes_per_token: int = 131_072
    policy: str = DEFAULT_POLICY
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    sharing: Sharing = Sharing.GLOBAL
    index_timeout_s: float = 0.05
    pending_ttl_s: float = 10.0
    prefill_tokens_per_s: float = 5_000.0
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    refit_every: int = 32

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if self.block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if self.index_timeout_s <= 0 or self.pending_ttl_s <= 0:
            raise ValueError("index_timeout_s and pending_ttl_s must be positive seconds")

    @classmethod
    def from_model_keys(cls, keys: Any, **options: Any) -> RouterConfig:
        """Hashing settings from a worker's ``kvshare.engines.hf.ModelKeys`` (same root)."""
        layout = keys.layout
        return cls(model_id=keys.identity, layout_fingerprint=layout.fingerprint(),
                   block_tokens=layout.block_tokens, bytes_per_token=layout.bytes_per_token,
                   **options)

    def cost_model(self, prefill: PrefillModel | None = None) -> CostModel:
        pm = prefill or PrefillModel.from_tokens_per_s(self.prefill_tokens_per_s)
        return CostModel(pm, self.bandwidths, self.block_tokens, self.bytes_per_token)


@dataclass(frozen=True)
class Routed:
    """A routing decision plus what the worker needs so it never re-tokenizes."""

    request_id: str
    decision: Decision
    tenant: Tenant
    namespace: str
    token_ids: list[int]
    hashes: list[BlockHash]
    index_s: float
    fallback: str = ""

    def kvshare_field(self) -> dict[str, Any]:
        """The ``kvshare`` JSON field forwarded to the worker."""
        out: dict[str, Any] = {
            "token_ids": self.token_ids, "namespace": self.namespace,
            "hashes_hex": [h.hex() for h in self.hashes], "tenant": self.tenant.name,
        }
        if self.tenant.salt:
            out["cache_salt"] = self.tenant.salt
        return out


class InProcessIndex:
    """:class:`~kvshare.workers.IndexQuery` over an in-process ``GlobalIndex`` (embedding a
    router next to its own index, tests, benchmarks). ``match_async`` runs inline: an
    in-process match takes microseconds and must not hop threads."""

    inline = True

    def __init__(self, index: Any) -> None:
        self.index = index

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        result: MatchResult = self.index.match(namespace, hashes)
        return result

    async def match_async(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        return self.match(namespace, hashes)

    async def match_runs_async(self, namespace: str, hashes: Sequence[BlockHash]) -> tuple[int, Any]:
        """The match in run form ``(num_blocks, runs)`` (see :class:`~actors.index.runs.HolderRuns`)."""
        result: tuple[int, Any] = self.index.match_runs(namespace, hashes)
        return result


class CacheAwareRouter:
    """Tokenize, hash, match, score; see the module docstring."""

    def __init__(
        self,
        index: IndexQuery | None,
        workers: WorkerSource,
        config: RouterConfig | None = None,
        tokenizer: Tokenizer | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = cfg = config or RouterConfig()
        self.index = index
        self.workers = workers
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.metrics = metrics or RouterMetrics()
        self.policy = make_policy(cfg.policy, cfg.cost_model(), cfg.sharing, **cfg.policy_options)
        self._load_only = make_policy("least_loaded", cfg.cost_model(), cfg.sharing)
        self.pending = PendingBlocks(cfg.pending_ttl_s)
        self.inflight = InFlight()
        self._roots: dict[str, BlockHash] = {}
        self._ids = itertools.count(1)
        self._samples: list[tuple[float, float, float]] = []
        self._seen = 0
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._down: dict[WorkerId, float] = {}
        self._cands: dict[WorkerId, Candidate] = {}
        self._last_key: tuple[tuple[WorkerInfo, ...], list[tuple[WorkerLoad, int]]] = ((), [])
        self._last_cands: list[Candidate] = []
        self._inline = bool(getattr(index, "inline", False))
        self._match_runs = getattr(index, "match_runs_async", None)
        self.decisions = 0
        self.fallbacks = 0

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
        if isinstance(prompt, list | tuple) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt
        ):
            return list(prompt)
        raise ValueError("'prompt' must be a non-empty string or a list of token ids (ints >= 0)")

    def root(self, tenant: Tenant) -> BlockHash:
        r = self._roots.get(tenant.salt)
        if r is None:
            c = self.config
            r = self._roots[tenant.salt] = namespace_root(
                c.model_id, c.layout_fingerprint, tenant.salt, fn=c.hash_fn
            )
        return r

    def hashes(self, token_ids: Sequence[int], tenant: Tenant) -> list[BlockHash]:
        c = self.config
        packed = array.array("I")
        try:  # u32 packing in C (much faster than numpy on a Python list); range-checked
            if type(token_ids) is list:
                packed.fromlist(token_ids)  # ~1.5x faster than array.array("I", list)
            else:
                packed.extend(token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be integers in [0, 2**32)") from None
        ids: Any = np.frombuffer(packed, dtype=np.uint32)
        return block_hashes(self.root(tenant), ids, c.block_tokens, fn=c.hash_fn)

    # ------------------------------------------------------------------ routing
    async def route(
        self,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tenant: Tenant | None = None,
        request_id: str | None = None,
        token_ids: Sequence[int] | None = None,
        exclude: Collection[WorkerId] = (),
    ) -> Routed:
        """Decide where a request goes. ValueError for a malformed prompt;
        :class:`~router.policy.NoEligibleWorker` if no worker serves the namespace.

        ``exclude``: workers not to use for this request (e.g. one that just refused the
        connection); workers marked down (:meth:`mark_down`) are avoided while any other
        worker is eligible. ``token_ids``: an already tokenized prompt; a ``list`` is kept
        as :attr:`Routed.token_ids` without a copy (copying 8k ids costs as much as scoring
        all workers), so do not change it afterwards.
        """
        t0 = time.perf_counter()
        tenant = tenant or _DEFAULT_TENANT
        if token_ids is None:
            ids = self.tokenize(prompt, messages)
        else:
            ids = token_ids if type(token_ids) is list else list(token_ids)
        hashes = self.hashes(ids, tenant)
        ns = self.config.namespace
        match, fallback, index_s = await self._match(ns, hashes)
        infos, loads = await self.workers.snapshot()
        cands = self._candidates(self._usable(infos, exclude), loads)
        req = RouteRequest(ns, hashes, len(ids), tenant.name, request_id or "")
        if fallback:
            d = self._load_only.choose(req, EMPTY_MATCH, cands)
            d = Decision(d.worker, d.endpoint, self.policy.name, f"fallback_{fallback}",
                         d.est_ttft_s, 0.0, 0, 0, d.plan)
        else:
            d = self.policy.choose(req, match, cands, self.pending.match_runs(ns, hashes))
        rid = request_id or f"r{next(self._ids)}"
        self.pending.add(ns, worker_location(d.worker), hashes, Tier.GPU)
        cached = d.plan.cached_tokens if d.plan is not None else 0
        self.inflight.add(rid, d.worker, len(ids) - cached, len(hashes))
        self._count(d, tenant, len(ids), cached, fallback, time.perf_counter() - t0)
        return Routed(rid, d, tenant, ns, ids, hashes, index_s, fallback)

    def mark_down(self, worker: WorkerId, for_s: float = 5.0) -> None:
        """Avoid ``worker`` for ``for_s`` seconds (it refused a connection)."""
        self._down[worker] = time.monotonic() + for_s

    def _candidates(self, infos: Sequence[WorkerInfo],
                    loads: Mapping[WorkerId, WorkerLoad]) -> list[Candidate]:
        """One candidate per worker: its last report plus this router's in-flight work.

        A worker whose inputs did not change since the last decision keeps its (frozen)
        Candidate object, so the policy's per-candidate work is reused too.
        """
        self.inflight.sweep()
        key = (tuple(infos), self.inflight.loads(infos, loads))
        if key == self._last_key:  # nothing changed (compared by identity first): same list
            return self._last_cands
        cache = self._cands
        if len(cache) > 2 * len(infos) + 64:  # workers come and go: forget the departed
            cache.clear()
        out = []
        for info, (load, blocks) in zip(*key, strict=True):
            c = cache.get(info.worker_id)
            if c is None or c.info is not info or c.load is not load or c.active_blocks != blocks:
                c = cache[info.worker_id] = Candidate(info, load, blocks)
            out.append(c)
        self._last_key, self._last_cands = key, out
        return out

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

    async def _query(self, ns: str, hashes: list[BlockHash]) -> Match:
        """The index's match: in run form when the index offers it (``match_runs_async``:
        what the index computes anyway, and cheaper to score), else a MatchResult."""
        if self._match_runs is not None:
            return HolderRuns(*await self._match_runs(ns, hashes))
        assert self.index is not None
        result: MatchResult = await self.index.match_async(ns, hashes)
        return result

    async def _match(self, ns: str, hashes: list[BlockHash]) -> tuple[Match, str, float]:
        if self.index is None:  # no index configured: pending blocks only (like Dynamo
            return EMPTY_MATCH, "", 0.0  # without KV events), not a fallback
        if not hashes:
            return EMPTY_MATCH, "", 0.0
        before = getattr(self.index, "unavailable", 0)
        t = time.perf_counter()
        try:
            if self._inline:  # in-process: no I/O, no deadline needed
                match = await self._query(ns, hashes)
            else:
                match = await asyncio.wait_for(self._query(ns, hashes), self.config.index_timeout_s)
        except TimeoutError:
            return EMPTY_MATCH, "index_timeout", time.perf_counter() - t
        except KeyError:  # namespace not declared yet: nothing cached anywhere
            return EMPTY_MATCH, "", time.perf_counter() - t
        except Exception:  # noqa: BLE001 - any index failure means load-only routing
            return EMPTY_MATCH, "index_error", time.perf_counter() - t
        dt = time.perf_counter() - t
        self.metrics.index_latency.observe(dt)
        if getattr(self.index, "unavailable", 0) != before:
            return EMPTY_MATCH, "index_unavailable", dt
        return match, "", dt

    def _count(self, d: Decision, tenant: Tenant, tokens: int, cached: int, fallback: str,
               dt: float) -> None:
        m = self.metrics
        self.decisions += 1
        key = (d.policy, d.reason, tenant.name)
        children = self._children.get(key)
        if children is None:  # labels() takes a lock and builds a key: do it once per combination
            children = self._children[key] = (
                m.decisions.labels(d.policy, d.reason), m.prompt_tokens.labels(tenant.name))
        children[0].inc()
        children[1].inc(tokens)
        m.cached_tokens.inc(cached)
        m.ttft_saved.inc(d.est_ttft_saved_s)
        m.decision_latency.observe(dt)
        if fallback:
            self.fallbacks += 1
            m.fallbacks.labels(fallback).inc()

    # ------------------------------------------------------------------ feedback
    def prefilled(self, request_id: str) -> None:
        """The worker produced the first token: its prefill no longer loads the queue."""
        self.inflight.prefilled(request_id)

    def finished(self, request_id: str) -> None:
        """The request is complete (or failed): stop counting it as load."""
        self.inflight.done(request_id)

    def report_load(self, load: WorkerLoad) -> None:
        """Record a worker's load report (for worker sources that accept reports)."""
        report = getattr(self.workers, "report", None)
        if report is not None:
            report(load)

    @property
    def prefill_samples(self) -> int:
        """Measured prefill timings seen so far (:meth:`observe_prefill`)."""
        return self._seen

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A measured prefill; every ``refit_every`` samples the prefill model is refitted."""
        if new_tokens <= 0 or seconds <= 0:
            return
        self._samples.append((float(new_tokens), float(cached_tokens), float(seconds)))
        self._samples = self._samples[-512:]
        self._seen += 1
        if self._seen % self.config.refit_every == 0 and len(self._samples) >= 2:
            cost = self.config.cost_model(PrefillModel.fit(self._samples))
            self.policy.cost = cost
            self._load_only.cost = cost
