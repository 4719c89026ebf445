"""The worker half of the connector: copy blocks between the cluster and vLLM's pages.

Runs in every vLLM worker process (one per TP rank). Loads go into the request's pages
(:class:`~kvshare.vllm.connector.paged.PagedRequestKV`; from this node's pool straight from the shared
slab, one copy): asynchronous ones through the SDK's load thread
(:meth:`kvshare.client.sdk.KVShareClient.start_load`), vLLM learning they are done from
``get_finished`` (``finished_recving``); synchronous ones (small loads from this node's pool)
inside ``start_load_kv``, before the forward pass that computes the request's suffix. Which
pages failed goes to ``get_block_ids_with_load_errors`` (vLLM recomputes from the first failed
page: a fault is a recompute, never a wrong token). Saves are handed to the SDK's store thread after the
forward pass (``wait_for_save`` returns at once: no step waits for a store); each ended save
is marked for the scheduler side (:mod:`kvshare.vllm.connector.save_marks`), which holds a finishing
request until its saves have ended (read-after-write). A request's pages stay allocated until
its saves are done (``finished_sending``), and a preempted request's saves finish before vLLM
reuses its pages (``handle_preemptions``).

Tensor parallelism (*written, checked only on GPUs*): rank ``r`` writes heads
``[r*H/tp, (r+1)*H/tp)`` of each loaded block; stores need every rank's heads in one block,
which the pools cannot assemble yet, so TP>1 engines load but do not store (counted
``store_skipped_tp``). An MLA block is the same on every rank (one latent per token): each
rank loads all of it and rank 0 stores it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import Any

import torch

from kvshare.attention import AttentionKind
from kvshare.client.types import REMOTE_SOURCES, KVClient, LoadResult, Plan, StoreResult
from kvshare.types import BlockHash
from kvshare.vllm.connector.config import ModelKeys
from kvshare.vllm.connector.groups import CopySignal, EngineGroups, GroupedRequestKV
from kvshare.vllm.connector.metadata import KVShareMetadata, LoadSpec
from kvshare.vllm.connector.mla_pages import mla_page_views
from kvshare.vllm.connector.paged import PagedRequestKV, PageViews
from kvshare.vllm.connector.save_marks import SYNC_SAVE_WAIT_S, SaveMarker

log = logging.getLogger(__name__)

LOAD_STAGE = "load_stage_seconds_"
"""Counter prefix: seconds loads spent per stage, ``<transport>`` (fetching over it) or
``copy`` (staged blocks into vLLM's pages)."""

IDLE_WAIT_S = 0.01
"""How long a step with no forward pass waits for a pending load (it returns as soon as one
finishes). Each such step is an engine step of Python work that competes with the load
thread for the GIL; a new request waits at most this long for an otherwise idle engine."""


class WorkerSide:
    """Plain class behind KVShareConnector's worker-role methods."""

    def __init__(self, client: Any, keys: ModelKeys, page_tokens: int, *, tp_rank: int = 0,
                 tp_size: int = 1, groups: EngineGroups | None = None) -> None:
        self.client: KVClient = client
        self._client: Any = client
        self.keys = keys
        self.layout = keys.layout
        self.page_tokens = page_tokens
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.groups = groups or EngineGroups.single(keys.layout.num_layers)
        self._failed_recv: set[str] = set()  # loads that failed, reported per request
        self._marker: SaveMarker | None = None  # the scheduler side's mark file, mapped
        self._unmappable = ""  # a mark file this process could not map (not tried again)
        self.pages: PageViews | None = None
        self._loading: dict[str, tuple[Future[LoadResult], LoadSpec]] = {}
        self._load_t0: dict[str, float] = {}
        self._saving: dict[str, list[Future[StoreResult]]] = {}
        self._saved: set[str] = set()  # had a save: vLLM waits for finished_sending
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {}

    def _count(self, key: str, n: float = 1) -> None:
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + n

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """``register_kv_caches``: views over vLLM's per-layer tensors (layout checked)."""
        if self.layout.kind is AttentionKind.MLA:  # every rank holds the whole latent
            self.pages = mla_page_views(kv_caches, latent=self.layout.head_dim,
                                        page_tokens=self.page_tokens)
        else:
            local = self.layout.num_kv_heads // self.tp_size
            self.pages = PageViews.from_vllm(
                kv_caches, local_heads=local, head_dim=self.layout.head_dim,
                page_tokens=self.page_tokens, head_start=self.tp_rank * local)
        if len(self.pages.views) != self.layout.num_layers:
            raise ValueError(f"vLLM registered {len(self.pages.views)} KV caches, the model has "
                             f"{self.layout.num_layers} attention layers")
        log.info("kvshare: %d layers of %s pages registered", len(self.pages.views), self.pages.kind)

    def _views(self) -> PageViews:
        if self.pages is None:
            raise RuntimeError("register_kv_caches was not called")
        return self.pages

    def start_loads(self, meta: KVShareMetadata) -> None:
        """``start_load_kv``: submit this step's asynchronous loads (returns at once) and run
        its synchronous ones (vLLM calls this before a forward pass that needs them; their
        failed pages are reported in this step, they are never in ``finished_recving``)."""
        for spec in meta.loads:
            if spec.req_id in self._loading:
                continue
            plan = Plan.from_dict(spec.plan)
            sub = replace(plan, blocks=plan.blocks[spec.first_block:])
            target = self._request_kv(spec.page_ids, spec.group_pages, spec.first_block,
                                      spec.keep_tokens)
            t0 = time.perf_counter()
            fut: Future[LoadResult] = Future()
            try:
                if spec.sync:
                    fut.set_result(self._client.load(sub, target))
                else:
                    fut = self._client.start_load(sub, target)
            except Exception as exc:  # bad plan for these pages: recompute it all
                log.warning("kvshare load of %s failed to start: %s", spec.req_id, exc)
                fut = Future()
                fut.set_exception(exc)
            if spec.sync:
                self._count_wait(self._load_done(fut, spec), time.perf_counter() - t0)
                continue
            self._loading[spec.req_id] = (fut, spec)
            self._load_t0[spec.req_id] = t0

    def submit_saves(self, meta: KVShareMetadata) -> None:
        """``wait_for_save``: hand this step's saves to the store thread and return; each save
        is marked in the scheduler side's mark file when it ends (stored, failed, or skipped),
        so a request that finishes waits for its own saves only (read-after-write); saves
        marked ``sync`` (a request with stop strings) are waited for here, at most
        ``SYNC_SAVE_WAIT_S``."""
        marker = self._marker_for(meta.marks)
        sync: list[Future[StoreResult]] = []
        copies: list[tuple[CopySignal, Future[StoreResult]]] = []
        for spec in meta.saves:
            self._saved.add(spec.req_id)
            if self.tp_size > 1 and not (self.tp_rank == 0 and self.layout.kind is AttentionKind.MLA):
                # MLA: rank 0 stores the latent every rank holds; MHA: no rank holds a block
                self._count("store_skipped_tp", len(spec.hashes) - spec.start_block)
                self._mark(marker, spec.seq)
                continue
            copied = CopySignal() if spec.group_pages else None
            src = self._request_kv(spec.page_ids, spec.group_pages, copied=copied)
            hashes = [BlockHash(h) for h in spec.hashes]
            try:
                fut = self._client.store(range(len(hashes) * self.layout.block_tokens), src,
                                         spec.start_block, hashes)
            except Exception:
                self._mark(marker, spec.seq)
                raise
            self._saving.setdefault(spec.req_id, []).append(fut)
            if marker is not None and spec.seq:
                fut.add_done_callback(lambda _f, seq=spec.seq: self._mark(marker, seq))
            if spec.sync:
                sync.append(fut)
            if copied is not None:
                copies.append((copied, fut))
        self._wait_copies(copies)
        if sync:
            t0 = time.perf_counter()
            _, late = wait(sync, timeout=SYNC_SAVE_WAIT_S)
            self._count("sync_saves")
            self._count("sync_save_s", time.perf_counter() - t0)
            if late:
                self._count("sync_saves_late")

    def _request_kv(self, page_ids: tuple[int, ...], group_pages: tuple[tuple[int, ...], ...],
                    first_block: int = 0, keep_tokens: int = 0,
                    copied: CopySignal | None = None) -> PagedRequestKV | GroupedRequestKV:
        """The request's pages: one list (one KV-cache group), or one per group."""
        if group_pages:
            return GroupedRequestKV(self._views(), self.layout, self.groups, group_pages,
                                    first_block, keep_tokens, copied)
        return PagedRequestKV(self._views(), self.layout, page_ids, first_block, keep_tokens)

    def _wait_copies(self, copies: list[tuple[CopySignal, Future[StoreResult]]]) -> None:
        """Wait until this step's stores over several KV-cache groups have read their pages
        (not for their commits): vLLM frees a sliding group's pages behind the window at the
        next step's allocation whatever the connector does, and another request may write
        them in that step's forward pass. Counted ``save_copy_wait_s``; a store that takes
        longer than its deadline is counted ``save_copy_late``."""
        if not copies:
            return
        t0 = time.perf_counter()
        deadline = t0 + float(getattr(self._client, "store_deadline_s", 10.0))
        for signal, fut in copies:
            while not signal.event.wait(0.002) and not fut.done():
                if time.perf_counter() > deadline:
                    self._count("save_copy_late")
                    break
        self._count("save_copy_wait_s", time.perf_counter() - t0)

    def _marker_for(self, path: str) -> SaveMarker | None:
        """The mark file named by the metadata, mapped once (rank 0 only: with TP>1 every
        rank skips its stores; a file this process cannot map marks nothing, and the
        scheduler side then waits for nothing)."""
        if not path or self.tp_rank != 0 or path == self._unmappable:
            return None
        if self._marker is None or self._marker.path != path:
            if self._marker is not None:
                self._marker.close()
            try:
                self._marker = SaveMarker(path)
            except OSError as exc:
                self._unmappable = path
                log.warning("kvshare: cannot map the save marks %s (%s): finishing requests "
                            "will not wait for their saves", path, exc)
                return None
        return self._marker

    @staticmethod
    def _mark(marker: SaveMarker | None, seq: int) -> None:
        if marker is not None:
            marker.mark(seq)

    def wait_preempted(self, meta: KVShareMetadata) -> None:
        """``handle_preemptions``: finish the saves of requests about to lose their pages."""
        for rid in meta.preempted:
            for fut in self._saving.pop(rid, []):
                self._result(fut)

    def _result(self, fut: Future[StoreResult]) -> None:
        try:
            res = fut.result()
        except Exception as exc:
            log.warning("kvshare store failed: %s", exc)
            self._count("store_errors")
            return
        self._count("saved_blocks", res.stored)

    def finished(self, finished_req_ids: set[str], meta: KVShareMetadata | None
                 ) -> tuple[set[str], set[str]]:
        """``get_finished``: (saves done for finished requests, loads done)."""
        if self._loading:
            self._count("load_polls")
            if meta is None or not meta.busy:
                wait([f for f, _ in self._loading.values()], timeout=IDLE_WAIT_S,
                     return_when=FIRST_COMPLETED)
        recving = set()
        for rid, (fut, spec) in list(self._loading.items()):
            if fut.done():
                del self._loading[rid]
                where = self._load_done(fut, spec)
                # submit -> vLLM told: the load plus how long the steps took to notice it
                self._count_wait(where, time.perf_counter() - self._load_t0.pop(rid, time.perf_counter()))
                recving.add(rid)
        self._finished |= finished_req_ids & self._saved
        sending = set()
        for rid in list(self._finished):
            futs = self._saving.get(rid, [])
            if all(f.done() for f in futs):
                for f in futs:
                    self._result(f)
                self._saving.pop(rid, None)
                self._finished.discard(rid)
                self._saved.discard(rid)
                sending.add(rid)
        return sending, recving

    def _count_wait(self, where: str, waited: float) -> None:
        """A request waited ``waited`` seconds for its load (``where``: local or remote;
        exported by :mod:`kvshare.vllm.connector.stats`)."""
        self._count("load_reported_seconds", waited)
        self._count(f"load_reported_seconds_{where}", waited)
        self._count(f"loads_{where}")

    def _load_done(self, fut: Future[LoadResult], spec: LoadSpec) -> str:
        """Count the load; pages of blocks that did not arrive become load errors. Returns
        ``remote`` if a block came from another node, else ``local``."""
        n = len(spec.plan["blocks"]) - spec.first_block
        where = "local"
        try:
            res = fut.result()
            good = res.loaded_blocks
            if any(o.transport in REMOTE_SOURCES for o in res.outcomes):
                where = "remote"
            self._count("load_seconds", res.seconds)
            for transport, spent in res.transfer_s.items():  # where that time went
                self._count(f"{LOAD_STAGE}{transport}", spent)
            self._count(f"{LOAD_STAGE}copy", res.copy_s)
            for o in res.failed:
                self._count(f"load_failed_{o.reason or 'unknown'}")
        except Exception as exc:
            log.warning("kvshare load of %s failed: %s", spec.req_id, exc)
            self._count("load_errors")
            good = 0
        self._count("load_blocks_ok", good)
        if good >= n:
            return where
        per = self.layout.block_tokens // self.page_tokens
        first_page = (spec.first_block + good) * per
        keep_pages = -(-spec.keep_tokens // self.page_tokens)
        bad = spec.page_ids[max(first_page, keep_pages):(spec.first_block + n) * per]
        self._count("failed_blocks", n - good)
        if spec.group_pages:  # several KV-cache groups: vLLM takes the request, not pages
            with self._lock:
                self._failed_recv.add(spec.req_id)
            return where
        with self._lock:
            self._errors.update(int(p) for p in bad)
        return where

    def failed_loads(self) -> set[str]:
        """Requests whose load (over several KV-cache groups) failed, each reported once:
        ``failed_recving`` (vLLM recomputes the request from its first token)."""
        with self._lock:
            out, self._failed_recv = self._failed_recv, set()
        return out

    def load_errors(self) -> set[int]:
        """``get_block_ids_with_load_errors`` (each reported once)."""
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def close(self) -> None:
        for fut, _ in list(self._loading.values()):
            fut.cancel()
        for futs in self._saving.values():
            for f in futs:
                self._result(f)
        if self._marker is not None:
            self._marker.close()
            self._marker = None
