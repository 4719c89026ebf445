"""The reference worker: the transformers engine plus the kvshare SDK.

Per request: plan the cached prefix (``client.lookup``), load it into a contiguous KV buffer
(``client.load``), prefill only the remainder, decode greedily, and store the new full blocks
(prefill's right after the first token, decode's at the end) without waiting for them.
Anything that goes wrong on the cache side — index down, a holder gone, a corrupt block — is a
miss: the worker recomputes, counts why, and the answer is the same.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvshare.client.types import KVClient, LoadResult, Plan, StoreResult, hit_source
from kvshare.engines.hf import HFEngine, cache_layers
from kvshare.kv_convert import new_contiguous
from kvshare.types import BlockHash

log = logging.getLogger(__name__)


@dataclass
class RequestStats:
    """What one request reused, computed and moved."""

    prompt_tokens: int = 0
    planned_blocks: int = 0
    loaded_blocks: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    lookup_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    store_wait_s: float = 0.0
    """How long the answer waited for the request's stores (WorkerRuntime's ordering)."""
    transfer_s: dict[str, float] = field(default_factory=dict)
    """Seconds each transport took to bring its blocks (batches run at once)."""
    copy_s: float = 0.0
    """Seconds copying the fetched blocks into the engine's KV buffer."""
    receive_s: float = 0.0
    """The host reading and admitting the request (set by the host, e.g. the HTTP server)."""
    queue_s: float = 0.0
    """Admitted until the engine started on it (set by :class:`WorkerRuntime`)."""
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    tokens_by_source: dict[str, int] = field(default_factory=dict)
    """The reused tokens by where they came from (:func:`~kvshare.client.types.hit_source`);
    they sum to ``reused_tokens``."""
    block_sources: list[str] = field(default_factory=list, repr=False)
    """The source of each loaded block of the reused prefix, in order (set by the load)."""
    misses: dict[str, int] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)


@dataclass
class Completion:
    tokens: list[int]
    stats: RequestStats
    first_logits: Any = None  # [vocab] fp32 tensor: the next-token logits after the prompt
    stores: list[Future[StoreResult]] = field(default_factory=list)
    ended: str = ""  # why generation stopped early: a should_stop reason ("" = EOS or length)
    text: str | None = None  # the host's text of the tokens, when it made one (stop strings)


class WorkerCounters:
    """Cumulative, thread-safe counters (exported on /metrics and /v1/kvshare/stats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = {}

    def add(self, key: str, amount: float = 1) -> None:
        with self._lock:
            self.values[key] = self.values.get(key, 0) + amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)


class ReferenceWorker:
    """Serve completions from an :class:`HFEngine`, reusing KV through a :class:`KVClient`.

    ``client=None`` runs with no cache at all (the cold baseline). Not re-entrant: the
    server runs one request at a time per worker.
    """

    def __init__(self, engine: HFEngine, client: KVClient | None, *, store: bool = True) -> None:
        self.engine = engine
        self.client = client
        self.store_enabled = store
        self.counters = WorkerCounters()
        self._lock = threading.Lock()
        self._kv_buf: Any = None

    def _buffer(self, tokens: int) -> Any:
        """A reused, pre-touched contiguous KV buffer (free again once prefill returns)."""
        if self._kv_buf is None or self._kv_buf.shape[3] < tokens:
            self._kv_buf = new_contiguous(self.engine.layout, tokens).zero_()
        return self._kv_buf[:, :, :, :tokens]

    def _plan_and_load(
        self, tokens: Sequence[int], hashes: Sequence[BlockHash], stats: RequestStats
    ) -> tuple[Any, int]:
        if self.client is None or not hashes:
            return None, 0
        t0 = time.perf_counter()
        try:
            plan: Plan = self.client.lookup(tokens, hashes)
        except Exception as exc:  # the cache is advisory: a failed lookup is a miss
            log.warning("lookup failed, recomputing: %s", exc)
            stats.misses["lookup_error"] = stats.misses.get("lookup_error", 0) + 1
            return None, 0
        stats.lookup_s = time.perf_counter() - t0
        stats.planned_blocks = plan.load_blocks
        stats.plan = {"available": plan.available_blocks, "by_transport": plan.by_transport(),
                      "reason": plan.reason}
        if not plan.blocks:
            return None, 0
        kv = self._buffer(plan.load_tokens)
        t1 = time.perf_counter()
        try:
            result: LoadResult = self.client.load(plan, into=kv)
        except Exception as exc:
            log.warning("load failed, recomputing: %s", exc)
            stats.misses["load_error"] = stats.misses.get("load_error", 0) + plan.load_blocks
            return None, 0
        stats.load_s = time.perf_counter() - t1
        stats.transfer_s, stats.copy_s = dict(result.transfer_s), result.copy_s
        for o in result.failed:
            key = o.reason.split(":")[0] or "failed"
            stats.misses[key] = stats.misses.get(key, 0) + 1
        stats.loaded_blocks = result.loaded_blocks
        stats.bytes_by_transport = result.bytes_by_transport()
        for o in sorted(result.outcomes, key=lambda o: o.index):
            if o.ok:
                tier = plan.blocks[o.index].tier.value
                stats.bytes_by_tier[tier] = stats.bytes_by_tier.get(tier, 0) + o.nbytes
                if o.index < result.loaded_blocks:
                    stats.block_sources.append(hit_source(o.transport, tier))
        return kv, result.loaded_blocks * self.engine.layout.block_tokens

    def _store(
        self, tokens: Sequence[int], cache: Any, start_block: int,
        stores: list[Future[StoreResult]], salt: str | None,
    ) -> None:
        if self.client is None or not self.store_enabled:
            return
        B = self.engine.layout.block_tokens
        cached = cache.get_seq_length()
        n = min(len(tokens), cached) // B
        if n <= start_block:
            return
        try:
            full = tokens[: n * B]
            fut = self.client.store(full, cache_layers(cache), start_block,
                                    self.engine.hashes(full, salt))
        except Exception as exc:
            log.warning("store failed: %s", exc)
            self.counters.add("store_errors")
            return
        fut.add_done_callback(self._count_store)
        stores.append(fut)

    def _count_store(self, fut: Future[StoreResult]) -> None:
        exc = fut.exception()
        if exc is not None:
            log.warning("store failed: %s", exc)
            self.counters.add("store_errors")
            return
        res = fut.result()
        self.counters.add("blocks_stored", res.stored)
        self.counters.add("bytes_stored", res.nbytes)

    def generate(
        self,
        tokens: Sequence[int],
        max_new_tokens: int = 16,
        *,
        hashes: Sequence[BlockHash] | None = None,
        salt: str | None = None,
        stop_ids: Sequence[int] | None = None,
        on_token: Callable[[int], None] | None = None,
        on_prefill: Callable[[RequestStats], None] | None = None,
        should_stop: Callable[[], str] | None = None,
    ) -> Completion:
        """Greedy completion of ``tokens``.

        ``hashes``: the prompt's block hashes if the caller has them (the gateway sends them);
        ``salt``: the tenant's cache salt (its blocks live in their own namespace root).
        ``on_prefill`` sees the request's stats once the prompt is prefilled (before the first
        token); ``on_token`` sees each token as it is produced.
        """
        self.engine.check_tokens(tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if hashes is None:
            hashes = self.engine.hashes(tokens, salt)
        stops = tuple(stop_ids) if stop_ids is not None else (self.engine.tokenizer.eos_id,)
        with self._lock:
            start = time.perf_counter()
            stats = RequestStats(prompt_tokens=len(tokens))
            if should_stop is not None and (why := should_stop()):
                self.counters.add(f"ended_{why}")
                return Completion([], stats, ended=why)  # gone or late before it started
            kv, reuse = self._plan_and_load(tokens, hashes, stats)
            pre = self.engine.prefill(tokens, kv, reuse)
            del kv
            stats.reused_tokens, stats.computed_tokens = pre.reused_tokens, pre.computed_tokens
            stats.tokens_by_source = _by_source(stats.block_sources,
                                                self.engine.layout.block_tokens, pre.reused_tokens)
            stats.prefill_s = pre.seconds
            observe = getattr(getattr(self.client, "cut_policy", None), "observe", None)
            if callable(observe):  # a cost-model cut policy learns from live timings
                observe(pre.computed_tokens, pre.reused_tokens, pre.seconds)
            if on_prefill is not None:
                on_prefill(stats)
            stores: list[Future[StoreResult]] = []
            out: list[int] = []
            first_logits = pre.logits
            ended = ""
            for i, tok in enumerate(self.engine.greedy(pre, len(tokens), max_new_tokens, stops)):
                if i == 0:
                    stats.ttft_s = time.perf_counter() - start
                out.append(tok)
                if on_token is not None:
                    on_token(tok)  # the first token goes out before its prompt's store starts
                if i == 0:
                    self._store(tokens, pre.cache, stats.loaded_blocks, stores, salt)
                if should_stop is not None and (ended := should_stop()):
                    self.counters.add(f"ended_{ended}")
                    break
            self.counters.add("tokens_generated", len(out))
            full = list(tokens) + out
            self._store(full, pre.cache, len(tokens) // self.engine.layout.block_tokens, stores,
                        salt)
            self._count(stats)
            return Completion(out, stats, first_logits, stores, ended)

    def _count(self, s: RequestStats) -> None:
        c = self.counters
        c.add("requests")
        c.add("prompt_tokens", s.prompt_tokens)
        c.add("prefill_tokens_computed", s.computed_tokens)
        c.add("prefill_tokens_saved", s.reused_tokens)
        c.add("blocks_loaded", s.loaded_blocks)
        for transport, n in s.bytes_by_transport.items():
            c.add(f"bytes_loaded_{transport}", n)
        for tier, n in s.bytes_by_tier.items():
            c.add(f"bytes_loaded_tier_{tier}", n)
        for reason, n in s.misses.items():
            c.add(f"miss_{reason}", n)
        c.add("ttft_s_sum", s.ttft_s)


def _by_source(block_sources: Sequence[str], block_tokens: int, reused: int) -> dict[str, int]:
    """Tokens per source for a reused prefix of ``reused`` tokens whose blocks came from
    ``block_sources`` in order (the engine may reuse fewer tokens than it loaded)."""
    out: dict[str, int] = {}
    left = reused
    for src in block_sources:
        if left <= 0:
            break
        n = min(block_tokens, left)
        out[src] = out.get(src, 0) + n
        left -= n
    return out
