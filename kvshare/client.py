"""KVShareClient: the worker SDK (find, load and store KV blocks anywhere in the cluster).

Scheduler side: :meth:`KVShareClient.lookup` asks the index who holds the prompt's blocks and
returns a serialisable :class:`~kvshare.client_types.Plan` (where each block of the prefix
comes from and how it travels: ``shm`` from this node's pool, ``nixl``/``objstore`` from
another node's pool), cut where the cut policy says. Worker side: :meth:`load` fills the
caller's KV memory (contiguous tensor or paged) and reports per-block outcomes;
:meth:`store` writes new full blocks into this node's pool through shared memory on a
background thread, never blocking generation. ``start_load`` / ``wait_for_layer`` /
``save_layer`` / ``wait_for_save`` mirror vLLM's KV-connector split; ``*_async`` variants
serve asyncio engines.

Faults are misses, never errors: an unreachable index gives an empty plan; a dead holder, a
corrupt block, a timed-out transfer fail those blocks (``LoadResult.failed``) and the engine
recomputes from the first failed block. Everything is counted in :attr:`counters`.

Inside Ray, :meth:`KVShareClient.connect` finds the index and the node pools of a
deployment (``kvshare up`` / ``actors.deploy.deploy``) by the names :mod:`kvshare.cluster`
defines. Outside, pass them in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from kvshare.block_io import SlabIO
from kvshare.client_types import (
    SOURCE_AUTO,
    SOURCE_NIXL,
    SOURCE_OBJSTORE,
    SOURCE_SHM,
    BlockOutcome,
    KVSource,
    KVTarget,
    LoadResult,
    Plan,
    PlannedBlock,
    StoreResult,
)
from kvshare.cluster import RAY_NAMESPACE, find_index, find_pool, this_node
from kvshare.cost import Source, bytes_per_s
from kvshare.hasher import Hasher
from kvshare.kv_convert import (
    blocks_from_source,
    blocks_into_target,
    check_source,
    check_target,
    source_tokens,
)
from kvshare.layout import KVLayout
from kvshare.transfer.base import NIXL_UNAVAILABLE, SOURCE_DEAD, Transfer, Transport
from kvshare.transfer.control import ActorControl
from kvshare.transfer.estimate import BandwidthEstimator
from kvshare.transfer.objstore import ObjStoreTransport
from kvshare.transfer.probe import TransportBandwidths, parse_overrides
from kvshare.transfer.shm import ShmTransport, SlotCopy
from kvshare.transfer.wire import BlockControl
from kvshare.types import BlockHash, Tier, node_location
from kvshare.workers import IndexQuery

log = logging.getLogger(__name__)

AUTO_WAIT_S = 120.0
"""How long a ``remote="auto"`` client keeps asking for its node's first bandwidth probe."""
REFINE_EVERY = 8
"""Loads between two refinements of the bandwidths from this worker's own timed transfers."""
REFINE_MIN_SAMPLES = 4
"""Timed batches of a transport (>= 1 MiB each) before they replace the probe's figure."""

BandwidthSource = Callable[[], Mapping[str, float]] | Mapping[str, float]
"""GB/s per transport (``nixl``, ``objstore``, ...), or a callable returning them."""

CutPolicy = Callable[[int, Sequence[Source]], int]
"""``(prompt_tokens, sources) -> blocks to load``; ``sources[i]`` is the
:class:`~kvshare.cost.Source` of leading available block ``i`` (``LOCAL_HOST``, ``LOCAL_DISK``,
``REMOTE_HOST``, ``REMOTE_DISK``)."""


def load_everything(prompt_tokens: int, sources: Sequence[Source]) -> int:
    """The default cut: every available block (fetching beats recompute on every path here)."""
    return len(sources)


def _in_plan_order(copy: SlotCopy, idx: list[int]) -> SlotCopy:
    """``copy`` for a batch holding the plan's blocks ``idx`` (batch positions -> plan blocks)."""

    def run(rows: np.ndarray, positions: list[int], slots: list[int]) -> None:
        copy(rows, [idx[p] for p in positions], slots)

    return run


class KVShareClient:
    """The SDK for one worker process on node ``node`` and one ``namespace``.

    ``control_for(node_id)`` returns the :class:`BlockControl` of that node's pool (None if it
    has none). ``index`` answers matches (the sharded index client). ``remote`` picks the
    transport for other nodes' blocks: ``nixl`` (falls back to ``objstore`` when NIXL is
    unavailable), ``objstore``, or ``auto`` (the default): the faster of the two by
    ``bandwidths`` (GB/s per transport as this node's pool measured them, see
    :meth:`choose_remote`), with ``KVSHARE_BANDWIDTH_GBPS`` in this process overriding them;
    nixl only if its agent started, nixl while nothing is known.
    """

    def __init__(
        self,
        *,
        namespace: str,
        layout: KVLayout,
        root: BlockHash | Hasher,
        node: str,
        index: IndexQuery | None,
        control_for: Callable[[str], BlockControl | None],
        worker_id: str = "worker",
        remote: str = SOURCE_AUTO,
        cut_policy: CutPolicy = load_everything,
        load_deadline_s: float = 5.0,
        store_deadline_s: float = 10.0,
        bandwidths: BandwidthSource | None = None,
    ) -> None:
        if remote not in (SOURCE_AUTO, SOURCE_NIXL, SOURCE_OBJSTORE):
            raise ValueError(
                f"remote transport must be 'auto', 'nixl' or 'objstore', got {remote!r}")
        self.bandwidth_overrides = parse_overrides(os.environ.get("KVSHARE_BANDWIDTH_GBPS", ""))
        self.namespace = namespace
        self.layout = layout
        self.block_tokens = layout.block_tokens
        self.hasher = root if isinstance(root, Hasher) else Hasher.from_root(root, self.block_tokens)
        self.root = self.hasher.root
        self.node = node
        self.location = node_location(node)
        self.index = index
        self.control_for = control_for
        self.worker_id = worker_id
        self.cut_policy = cut_policy
        self.load_deadline_s = load_deadline_s
        self.store_deadline_s = store_deadline_s
        self._controls: dict[str, BlockControl] = {}
        self._load_shm = ShmTransport(node, holder=f"{worker_id}-load")
        self._store_shm = ShmTransport(node, holder=f"{worker_id}-store")
        self._objstore = ObjStoreTransport(holder=f"{worker_id}-obj")
        self._nixl: Transport | None = None
        self.nixl_error = ""
        if remote != SOURCE_OBJSTORE:
            self._nixl = self._start_nixl()
        self.remote = SOURCE_NIXL if self._nixl is not None else SOURCE_OBJSTORE
        self.auto = remote == SOURCE_AUTO
        self.bandwidths: dict[str, float] = {}  # GB/s the auto choice was made on
        self.estimator = BandwidthEstimator(32)  # this worker's own loads, per transport/peer
        self._loads = 0
        self._bw_source = bandwidths
        self._closed = threading.Event()
        if self.auto and not self.choose_remote() and callable(bandwidths):  # probe running
            threading.Thread(target=self._await_bandwidths, name="kvshare-bandwidths",
                             daemon=True).start()
        self._staging = np.empty((0, layout.bytes_per_block), dtype=np.uint8)
        self._load_lock = threading.Lock()
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="kvshare-store")
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvshare-load")
        self._counters: dict[str, float] = {}
        self._clock = threading.Lock()
        self._pending_load: Future[LoadResult] | None = None
        self._pending_saves: list[Future[StoreResult]] = []
        self._layers: dict[int, tuple[Any, Any]] = {}

    # ------------------------------------------------------------------ setup
    @classmethod
    def connect(
        cls, namespace: str, layout: KVLayout, root: BlockHash | Hasher, *,
        index_timeout_s: float = 2.0, ray_namespace: str = RAY_NAMESPACE, **kwargs: Any
    ) -> KVShareClient:
        """Inside Ray: the deployment's index client and this node's (and peers') pool actors,
        found by the names of :mod:`kvshare.cluster`.

        An index that does not answer within ``index_timeout_s`` is treated as down (a miss).
        ``remote`` defaults to ``auto``: bandwidths come from this node's pool's probe.
        ValueError when nothing is deployed in ``ray_namespace``.
        """
        index = find_index(ray_namespace, timeout_s=index_timeout_s)
        node = kwargs.pop("node", None) or this_node()

        def control_for(node_id: str) -> BlockControl | None:
            actor = find_pool(node_id, ray_namespace)
            return ActorControl(actor, namespace) if actor is not None else None

        def bandwidths() -> Mapping[str, float]:
            actor = find_pool(node, ray_namespace)
            if actor is None:
                raise LookupError(f"no kvshare pool on node {node}")
            got: Any = ray.get(actor.transfer_bandwidths.remote(), timeout=index_timeout_s)
            return dict(got["transports"])

        kwargs.setdefault("bandwidths", bandwidths)
        return cls(namespace=namespace, layout=layout, root=root, node=node, index=index,
                   control_for=control_for, **kwargs)

    def choose_remote(self) -> bool:
        """Pick :attr:`remote` from the bandwidths (``remote="auto"``): objstore only when it
        is measured (or overridden) faster than nixl, or when NIXL did not start. Returns
        True once both figures are known (or NIXL is out), False while the node's probe has
        not reported yet (the choice then stays nixl)."""
        src = self._bw_source
        try:
            measured = dict(src() if callable(src) else (src or {}))
        except Exception as exc:  # pool busy or gone: keep the current choice
            log.info("bandwidths unavailable for %s: %s", self.worker_id, exc)
            measured = {}
        bw = TransportBandwidths({k: float(v) for k, v in measured.items()}, dict(self.bandwidth_overrides))
        self.bandwidths = bw.as_dict()
        if self._nixl is None:
            self.remote = SOURCE_OBJSTORE
            self._feed_cut_policy()
            return True
        faster = bw.get(SOURCE_OBJSTORE) > bw.get(SOURCE_NIXL)
        self.remote = SOURCE_OBJSTORE if faster else SOURCE_NIXL
        self._feed_cut_policy()
        return {SOURCE_NIXL, SOURCE_OBJSTORE} <= set(self.bandwidths)

    def _feed_cut_policy(self) -> None:
        """Give a cut policy that takes them (``CostCut``) the measured bandwidths, in bytes/s,
        with the remote figure being the chosen transport's."""
        setter = getattr(self.cut_policy, "set_bandwidths", None)
        if not callable(setter) or not self.bandwidths:
            return
        gbps = {k: v for k, v in self.bandwidths.items() if k not in (SOURCE_NIXL, SOURCE_OBJSTORE)}
        if self.remote in self.bandwidths:
            gbps[self.remote] = self.bandwidths[self.remote]
        setter(bytes_per_s(gbps))

    def refine_bandwidths(self) -> dict[str, float]:
        """Replace the probe's GB/s by this worker's own timed loads where it has at least
        :data:`REFINE_MIN_SAMPLES` of a transport (overrides still win), and give them to the
        cut policy. Runs every :data:`REFINE_EVERY` loads; returns the figures in use."""
        live = {t: self.estimator.estimate(t) for t in self.estimator.transports()}
        for name, est in live.items():
            if est.samples >= REFINE_MIN_SAMPLES and est.gbps > 0:
                self.bandwidths[name] = self.bandwidth_overrides.get(name, est.gbps)
        self._feed_cut_policy()
        return dict(self.bandwidths)

    def _await_bandwidths(self) -> None:
        deadline = time.monotonic() + AUTO_WAIT_S
        while not self._closed.wait(1.0) and time.monotonic() < deadline:
            if self.choose_remote():
                log.info("%s: remote transport %s (GB/s %s)", self.worker_id, self.remote,
                         self.bandwidths)
                return

    def _start_nixl(self) -> Transport | None:
        try:
            from kvshare.transfer.nixl import NixlTransport

            return NixlTransport(f"{self.namespace}/worker/{self.worker_id}/{time.time_ns()}")
        except Exception as exc:  # TransportUnavailable, missing package: objstore instead
            self.nixl_error = str(exc)
            log.warning("NIXL unavailable for %s, remote blocks use the object store: %s",
                        self.worker_id, exc)
            return None

    def _control(self, node_id: str) -> BlockControl | None:
        """The node's pool control (cached); None (not cached) when it cannot be found."""
        control = self._controls.get(node_id)
        if control is None:
            try:
                control = self.control_for(node_id)
            except Exception as exc:  # its pool died with its node: a miss, not an error
                log.info("no pool control for node %s: %s", node_id, exc)
                control = None
            if control is not None:
                self._controls[node_id] = control
        return control

    def _count(self, key: str, amount: float = 1) -> None:
        with self._clock:
            self._counters[key] = self._counters.get(key, 0) + amount

    @property
    def counters(self) -> dict[str, float]:
        """Lookups, planned/loaded/failed blocks, bytes per transport and tier, misses by reason."""
        with self._clock:
            return dict(self._counters)

    # ------------------------------------------------------------------ scheduler side
    def hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[BlockHash]:
        """Block hashes of ``tokens`` under tenant ``salt``'s root (None: the client's root).
        A client given only a root (not a :class:`~kvshare.hasher.Hasher`) raises ValueError
        for another salt rather than hashing under the wrong root."""
        return self.hasher.hashes(tokens, salt)

    def lookup(self, tokens: Sequence[int], hashes: Sequence[BlockHash] | None = None) -> Plan:
        """Where the prompt's cached prefix is and how much of it to load."""
        hs = tuple(hashes if hashes is not None else self.hashes(tokens))
        self._count("lookups")
        if self.index is None or not hs:
            return Plan(self.namespace, len(tokens), self.block_tokens, hs, 0, (), "no index")
        match = self.index.match(self.namespace, list(hs))
        if not match.available:
            self._count("index_unavailable")
            return Plan(self.namespace, len(tokens), self.block_tokens, hs, 0, (),
                        "index unavailable")
        return self._plan(tokens, hs, match)

    async def lookup_async(
        self, tokens: Sequence[int], hashes: Sequence[BlockHash] | None = None
    ) -> Plan:
        """:meth:`lookup` without blocking the event loop."""
        hs = tuple(hashes if hashes is not None else self.hashes(tokens))
        self._count("lookups")
        if self.index is None or not hs:
            return Plan(self.namespace, len(tokens), self.block_tokens, hs, 0, (), "no index")
        match = await self.index.match_async(self.namespace, list(hs))
        if not match.available:
            self._count("index_unavailable")
            return Plan(self.namespace, len(tokens), self.block_tokens, hs, 0, (),
                        "index unavailable")
        return self._plan(tokens, hs, match)

    def _plan(self, tokens: Sequence[int], hs: tuple[BlockHash, ...], match: Any) -> Plan:
        blocks: list[PlannedBlock] = []
        kinds: list[Source] = []
        for i in range(match.combined_prefix):
            best = self._best_holder(match.holders(i))
            if best is None:
                break
            loc, tier, transport = best
            blocks.append(PlannedBlock(hs[i], loc, tier, transport))
            kinds.append(Source.of(tier, remote=transport != SOURCE_SHM))
        cut = max(0, min(len(blocks), int(self.cut_policy(len(tokens), kinds))))
        self._count("planned_blocks", cut)
        return Plan(self.namespace, len(tokens), self.block_tokens, hs, len(blocks),
                    tuple(blocks[:cut]), f"cut {cut}/{len(blocks)}")

    def _best_holder(self, holders: dict[Any, Tier]) -> tuple[str, Tier, str] | None:
        """This node's pool first, then the remote pool with the fastest tier."""
        own = holders.get(self.location)
        if own is not None and own != Tier.GPU:
            return str(self.location), own, SOURCE_SHM
        remote = sorted(
            (t.rank, str(loc)) for loc, t in holders.items()
            if str(loc).startswith("node:") and t != Tier.GPU
        )
        if not remote:
            return None
        loc = remote[0][1]
        return loc, holders[loc], self.remote

    # ------------------------------------------------------------------ worker side: loads
    def _staging_rows(self, n: int) -> np.ndarray:
        if self._staging.shape[0] < n:
            from kvshare.transfer.nixl import aligned_empty  # NIXL over cma: 2x when aligned

            self._staging = aligned_empty((max(n, 2 * self._staging.shape[0]),
                                           self.layout.bytes_per_block))
            self._staging.fill(0)  # pre-touch: page faults now, not during a load
            if self._nixl is not None:
                self._nixl.register(self._staging)  # type: ignore[attr-defined]
        return self._staging

    def load(self, plan: Plan, into: KVTarget) -> LoadResult:
        """Fetch the planned blocks and copy the usable prefix into ``into``.

        Blocks travel in one batch per (holder, transport); every block gets a
        :class:`BlockOutcome`. Only ``loaded_blocks`` leading blocks are written to ``into``.
        """
        if plan.namespace != self.namespace or plan.block_tokens != self.block_tokens:
            raise ValueError(
                f"plan is for namespace {plan.namespace!r} with {plan.block_tokens}-token "
                f"blocks; this client serves {self.namespace!r} with {self.block_tokens}"
            )
        check_target(into, self.layout, plan.load_tokens)
        start = time.perf_counter()
        transfer_s: dict[str, float] = {}
        direct = self._slot_copy_into(plan, into)
        with self._load_lock:
            n = plan.load_blocks
            # straight copies only size the batch with the staging rows: leave them untouched
            staging = self._staging_rows(n) if direct is None else np.empty(
                (n, self.layout.bytes_per_block), dtype=np.uint8)
            reasons = self._fetch(plan, staging, transfer_s, direct)
            t_copy = time.perf_counter()
            outcomes: list[BlockOutcome] = []
            good = 0  # only the contiguous prefix is usable: copy just that
            for i, b in enumerate(plan.blocks):
                ok = reasons[i] == ""
                if ok and good == i:
                    good += 1
                outcomes.append(BlockOutcome(i, ok, b.transport, reasons[i],
                                             self.layout.bytes_per_block if ok else 0))
            if good and direct is None:
                blocks_into_target(staging[:good], into, 0, self.layout)
        done = time.perf_counter()
        result = LoadResult(outcomes, done - start, transfer_s, done - t_copy)
        self._loads += 1
        if self._loads % REFINE_EVERY == 0:
            self.refine_bandwidths()
        self._count("loaded_blocks", result.loaded_blocks)
        for o in outcomes:
            if o.ok:
                self._count(f"bytes_{o.transport}", o.nbytes)
                self._count(f"blocks_{plan.blocks[o.index].tier.value}")
            else:
                self._count(f"miss_{o.reason}")
        return result

    def _slot_copy_into(self, plan: Plan, into: KVTarget) -> SlotCopy | None:
        """The straight slab -> ``into`` copy for a plan served wholly by this node's pool
        over shm, when ``into`` is a :class:`~kvshare.block_io.SlabIO` (and checksums are
        not verified); None: stage the blocks, then copy their verified prefix."""
        if (not isinstance(into, SlabIO) or self._load_shm.verify or not plan.blocks
                or any(b.transport != SOURCE_SHM for b in plan.blocks)):
            return None
        return lambda rows, positions, slots: into.write_slots(positions, rows, slots)

    def _fetch(self, plan: Plan, staging: np.ndarray, spent: dict[str, float],
               direct: SlotCopy | None = None) -> list[str]:
        """Read the plan's blocks into ``staging`` (or, with ``direct``, straight into the
        target); per block ``""`` or a miss reason. ``spent`` gets each transport's seconds
        from the first submit to its last batch's end."""
        t_start = time.perf_counter()
        groups: dict[tuple[str, str], list[int]] = {}
        for i, b in enumerate(plan.blocks):
            groups.setdefault((b.location, b.transport), []).append(i)
        reasons = [""] * plan.load_blocks
        running: list[tuple[Transport, Transfer, list[int], str, float, str]] = []
        retry: list[tuple[str, list[int]]] = []
        for (loc, transport), idx in groups.items():
            node = loc.removeprefix("node:")
            control = self._control(node)
            if control is None:
                for i in idx:
                    reasons[i] = SOURCE_DEAD
                continue
            tr = self._transport(transport)
            hs = [plan.blocks[i].block_hash for i in idx]
            t0 = time.perf_counter()
            bufs = [staging[i] for i in idx]
            if direct is not None and tr is self._load_shm:
                t = self._load_shm.submit_read(control, hs, bufs, deadline_s=self.load_deadline_s,
                                               copy=_in_plan_order(direct, idx))
            else:
                t = tr.submit_read(control, hs, bufs, deadline_s=self.load_deadline_s)
            running.append((tr, t, idx, tr.name, t0, loc))
        for tr, t, idx, used, t0, loc in running:  # each batch's own peer for the estimator
            res = tr.wait(t)
            spent[used] = time.perf_counter() - t_start
            self._count_transfer(used, t0)
            self.estimator.observe(used, loc, res.nbytes, res.seconds)
            for i, o in zip(idx, res.outcomes, strict=True):
                reasons[i] = "" if o.ok else o.reason
            if tr is self._nixl and all(reasons[i] == NIXL_UNAVAILABLE for i in idx):
                retry.append((plan.blocks[idx[0]].location, idx))
            if all(reasons[i] == SOURCE_DEAD for i in idx):  # look the pool up again next time
                self._controls.pop(plan.blocks[idx[0]].location.removeprefix("node:"), None)
        for loc, idx in retry:  # the holder has no NIXL agent: the object store always works
            control = self._control(loc.removeprefix("node:"))
            if control is None:
                continue
            hs = [plan.blocks[i].block_hash for i in idx]
            t0 = time.perf_counter()
            res = self._objstore.read(control, hs, [staging[i] for i in idx],
                                      deadline_s=self.load_deadline_s)
            spent[self._objstore.name] = time.perf_counter() - t_start
            self._count_transfer(self._objstore.name, t0)
            self.estimator.observe(self._objstore.name, loc, res.nbytes, res.seconds)
            for i, o in zip(idx, res.outcomes, strict=True):
                reasons[i] = "" if o.ok else o.reason
        return reasons

    def _count_transfer(self, transport: str, t0: float) -> None:
        """One batch read of ``transport`` finished: count it and its submit-to-done time."""
        self._count(f"transfers_{transport}")
        self._count(f"transfer_seconds_{transport}", time.perf_counter() - t0)

    def _transport(self, name: str) -> Transport:
        if name == SOURCE_SHM:
            return self._load_shm
        if name == SOURCE_NIXL and self._nixl is not None:
            return self._nixl
        return self._objstore

    async def load_async(self, plan: Plan, into: KVTarget) -> LoadResult:
        """:meth:`load` on a worker thread."""
        return await asyncio.wrap_future(self._load_pool.submit(self.load, plan, into))

    def start_load(self, plan: Plan, into: KVTarget) -> Future[LoadResult]:
        """Begin loading (worker side); :meth:`wait_for_layer` waits for it."""
        self._pending_load = self._load_pool.submit(self.load, plan, into)
        return self._pending_load

    def wait_for_layer(self, layer: int, timeout: float | None = None) -> LoadResult | None:
        """Block until layer ``layer`` of the pending load is in place (v1: the whole load)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.layout.num_layers})")
        fut = self._pending_load
        return fut.result(timeout) if fut is not None else None

    # ------------------------------------------------------------------ worker side: stores
    def store(self, tokens: Sequence[int], kv: KVSource, start_block: int = 0,
              hashes: Sequence[BlockHash] | None = None) -> Future[StoreResult]:
        """Write-through of full blocks ``start_block..`` of ``kv`` into this node's pool.

        Returns at once; the copy runs on a background thread. The caller keeps ``kv``'s
        memory unchanged until the future is done (a DynamicCache never mutates old tensors).
        """
        check_source(kv, self.layout)
        n_blocks = min(len(tokens), source_tokens(kv)) // self.block_tokens
        hs = list(hashes if hashes is not None
                  else self.hashes(tokens[: n_blocks * self.block_tokens]))[:n_blocks]
        fut = self._store_pool.submit(self._store, hs, kv, start_block)
        self._pending_saves = [f for f in self._pending_saves if not f.done()] + [fut]
        return fut

    async def store_async(
        self, tokens: Sequence[int], kv: KVSource, start_block: int = 0,
        hashes: Sequence[BlockHash] | None = None,
    ) -> StoreResult:
        return await asyncio.wrap_future(self.store(tokens, kv, start_block, hashes))

    def _store(self, hs: list[BlockHash], kv: KVSource, start: int) -> StoreResult:
        todo = hs[start:]
        if not todo:
            return StoreResult()
        control = self._control(self.node)
        if control is None:
            self._count("store_no_pool", len(todo))
            return StoreResult(skipped=len(todo), reason="no pool on this node")
        data = np.empty((len(todo), self.layout.bytes_per_block), dtype=np.uint8)
        if isinstance(kv, SlabIO):  # pages -> slab in one copy (``data`` stays untouched)
            res = self._store_shm.wait(self._store_shm.submit_write(
                control, todo, list(data), deadline_s=self.store_deadline_s,
                copy=lambda rows, pos, slots: kv.read_slots([start + p for p in pos], rows, slots)))
        else:
            blocks_from_source(kv, start, data, self.layout)
            res = self._store_shm.write(control, todo, list(data), deadline_s=self.store_deadline_s)
        stored = res.num_ok
        reasons = res.reasons()
        for reason, count in reasons.items():
            self._count(f"store_miss_{reason}", count)
        self._count("stored_blocks", stored)
        self._count("bytes_stored", res.nbytes)
        return StoreResult(stored, 0, len(todo) - stored, res.nbytes,
                           ",".join(sorted(reasons)))

    def save_layer(
        self, layer: int, keys: Any, values: Any, tokens: Sequence[int], start_block: int = 0
    ) -> None:
        """Hand over one layer's ``[1, H, T, D]`` KV; the store starts once all layers are in."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.layout.num_layers})")
        self._layers[layer] = (keys, values)
        if len(self._layers) == self.layout.num_layers:
            layers = [self._layers[i] for i in range(self.layout.num_layers)]
            self._layers = {}
            self.store(tokens, layers, start_block)

    def wait_for_save(self, timeout: float | None = None) -> list[StoreResult]:
        """Wait for every store submitted so far."""
        pending, self._pending_saves = self._pending_saves, []
        return [f.result(timeout) for f in pending]

    def close(self) -> None:
        self._closed.set()
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        self._load_shm.close()
        self._store_shm.close()
        if self._nixl is not None:
            self._nixl.close()
