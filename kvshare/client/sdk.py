"""KVShareClient: the worker SDK (find, load and store KV blocks anywhere in the cluster).

Scheduler side: :meth:`KVShareClient.lookup` asks the index who holds the prompt's blocks and
returns a serialisable :class:`~kvshare.client.types.Plan` (where each block of the prefix
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
deployment (``kvshare up`` / ``kvshare.actors.deploy.deploy``) by the names :mod:`kvshare.discovery`
defines. Outside, pass them in.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from kvshare.block_io import KVTarget, SlabIO, StorableKV
from kvshare.client.fetch import BlockFetcher, start_nixl
from kvshare.client.remote import BandwidthSource, PeerSource, RemoteChoice
from kvshare.client.types import (
    TRANSPORT_AUTO,
    TRANSPORT_NIXL,
    TRANSPORT_OBJSTORE,
    TRANSPORT_SHM,
    LoadResult,
    Plan,
    PlannedBlock,
    StoreResult,
)
from kvshare.cost import Source
from kvshare.cost_cut import CostCut
from kvshare.discovery import RAY_NAMESPACE, find_index, find_pool, this_node
from kvshare.hasher import Hasher
from kvshare.kv_convert import (
    blocks_from_source,
    blocks_into_target,
    check_source,
    check_target,
    source_tokens,
)
from kvshare.layout import KVLayout
from kvshare.transfer.estimate import BandwidthEstimator
from kvshare.transfer.reader.control import ActorControl
from kvshare.transfer.reader.shm import ShmTransport, SlotCopy
from kvshare.transfer.wire import BlockControl
from kvshare.types import BlockHash, Tier, node_location
from kvshare.workers import IndexQuery

log = logging.getLogger(__name__)

CutPolicy = Callable[[int, Sequence[Source], Sequence[str]], int]
"""``(prompt_tokens, sources, holders) -> blocks to load``; ``sources[i]`` is the
:class:`~kvshare.cost.Source` of leading available block ``i`` (``LOCAL_HOST``, ``LOCAL_DISK``,
``REMOTE_HOST``, ``REMOTE_DISK``) and ``holders[i]`` the node it would come from (this
worker's own node for a local block): a policy may price each link on its own."""


def load_everything(prompt_tokens: int, sources: Sequence[Source],
                    holders: Sequence[str] = ()) -> int:
    """The default cut: every available block (fetching beats recompute on every path here)."""
    return len(sources)


class KVShareClient:
    """The SDK for one worker process on node ``node`` and one ``namespace``.

    ``control_for(node_id)`` returns the :class:`BlockControl` of that node's pool (None if it
    has none). ``index`` answers matches (the sharded index client). ``remote`` picks the
    transport for other nodes' blocks: ``nixl`` (falls back to ``objstore`` when NIXL is
    unavailable), ``objstore``, or ``auto`` (the default): the faster of the two by
    ``bandwidths`` (bytes/s per transport as this node's pool measured them, see
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
        remote: str = TRANSPORT_AUTO,
        cut_policy: CutPolicy = load_everything,
        load_deadline_s: float = 5.0,
        store_deadline_s: float = 10.0,
        bandwidths: BandwidthSource | None = None,
        peer_bandwidths: PeerSource | None = None,
    ) -> None:
        if remote not in (TRANSPORT_AUTO, TRANSPORT_NIXL, TRANSPORT_OBJSTORE):
            raise ValueError(
                f"remote transport must be 'auto', 'nixl' or 'objstore', got {remote!r}")
        self.namespace = namespace
        self.layout = layout
        self.block_tokens = layout.block_tokens
        self.hasher = root if isinstance(root, Hasher) else Hasher.from_root(root, self.block_tokens)
        self.root = self.hasher.root
        self.node = node
        self.location = node_location(node)
        self.index = index
        self.worker_id = worker_id
        self.cut_policy = cut_policy
        if isinstance(cut_policy, CostCut) and cut_policy.deadline_s is None:
            cut_policy.deadline_s = load_deadline_s  # no cut whose fetch would miss it
        self.store_deadline_s = store_deadline_s
        self._store_shm = ShmTransport(node, holder=f"{worker_id}-store")
        self._nixl, self.nixl_error = (None, "") if remote == TRANSPORT_OBJSTORE else start_nixl(
            namespace, worker_id)
        self.choice = RemoteChoice(nixl_up=self._nixl is not None, auto=remote == TRANSPORT_AUTO,
                                   source=bandwidths, cut_policy=cut_policy, name=worker_id,
                                   node=node, peers=peer_bandwidths)
        self.fetcher = BlockFetcher(node=node, worker_id=worker_id, control_for=control_for,
                                    nixl=self._nixl, estimator=self.choice.estimator,
                                    count=self._count, deadline_s=load_deadline_s,
                                    known=self._store_shm.known)  # what it stored, it loads fast
        self._closed = threading.Event()
        self._staging = np.empty((0, layout.bytes_per_block), dtype=np.uint8)
        self._load_lock = threading.Lock()
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="kvshare-store")
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvshare-load")
        self._counters: dict[str, float] = {}
        self._clock = threading.Lock()
        self._pending_load: Future[LoadResult] | None = None
        self._pending_saves: list[Future[StoreResult]] = []
        self._layers: dict[int, tuple[Any, Any]] = {}
        self.choice.start(self._closed)

    # ------------------------------------------------------------------ setup
    @classmethod
    def connect(
        cls, namespace: str, layout: KVLayout, root: BlockHash | Hasher, *,
        index_timeout_s: float = 2.0, ray_namespace: str = RAY_NAMESPACE, **kwargs: Any
    ) -> KVShareClient:
        """Inside Ray: the deployment's index client and this node's (and peers') pool actors,
        found by the names of :mod:`kvshare.discovery`.

        An index that does not answer within ``index_timeout_s`` is treated as down (a miss).
        ``remote`` defaults to ``auto``: bandwidths come from this node's pool's probe.
        ValueError when nothing is deployed in ``ray_namespace``.
        """
        index = find_index(ray_namespace, timeout_s=index_timeout_s)
        node = kwargs.pop("node", None) or this_node()

        def control_for(node_id: str) -> BlockControl | None:
            actor = find_pool(node_id, ray_namespace)
            return ActorControl(actor, namespace) if actor is not None else None

        per_peer: dict[str, dict[str, float]] = {}  # the last answer's links, per peer

        def bandwidths() -> Mapping[str, float]:
            actor = find_pool(node, ray_namespace)
            if actor is None:
                raise LookupError(f"no kvshare pool on node {node}")
            got: Any = ray.get(actor.transfer_bandwidths.remote(), timeout=index_timeout_s)
            per_peer.clear()
            per_peer.update({str(k): dict(v) for k, v in (got.get("per_node") or {}).items()})
            return dict(got["transports"])

        kwargs.setdefault("bandwidths", bandwidths)
        kwargs.setdefault("peer_bandwidths", lambda: dict(per_peer))
        return cls(namespace=namespace, layout=layout, root=root, node=node, index=index,
                   control_for=control_for, **kwargs)

    # ------------------------------------------------------------------ remote transport
    @property
    def remote(self) -> str:
        """The transport for other nodes' blocks now (``nixl`` or ``objstore``)."""
        return self.choice.remote

    @property
    def auto(self) -> bool:
        return self.choice.auto

    @property
    def bandwidths(self) -> dict[str, float]:
        """Bytes/s per transport the remote choice was made on."""
        return self.choice.bandwidths

    @property
    def estimator(self) -> BandwidthEstimator:
        """This worker's timed loads, per transport and peer."""
        return self.choice.estimator

    def choose_remote(self) -> bool:
        """:meth:`RemoteChoice.choose <kvshare.client.remote.RemoteChoice.choose>`."""
        return self.choice.choose()

    def refine_bandwidths(self) -> dict[str, float]:
        """:meth:`RemoteChoice.refine <kvshare.client.remote.RemoteChoice.refine>` (runs every
        :data:`~kvshare.client.remote.REFINE_EVERY` loads)."""
        return self.choice.refine()

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

    def lookup(self, tokens: Sequence[int], hashes: Sequence[BlockHash] | None = None, *,
               load_all: bool = False) -> Plan:
        """Where the prompt's cached prefix is and how much of it to load (``load_all``:
        every available block, whatever the cut policy says)."""
        hs = self._lookup_hashes(tokens, hashes)
        if self.index is None or not hs:
            return self._no_plan(tokens, hs, "no index")
        return self._plan(tokens, hs, self.index.match(self.namespace, list(hs)), load_all)

    async def lookup_async(
        self, tokens: Sequence[int], hashes: Sequence[BlockHash] | None = None
    ) -> Plan:
        """:meth:`lookup` without blocking the event loop."""
        hs = self._lookup_hashes(tokens, hashes)
        if self.index is None or not hs:
            return self._no_plan(tokens, hs, "no index")
        return self._plan(tokens, hs, await self.index.match_async(self.namespace, list(hs)))

    def plan_from(self, tokens: Sequence[int], hashes: Sequence[BlockHash], match: Any, *,
                  load_all: bool = False) -> Plan:
        """:meth:`lookup`'s plan from an index answer already in hand (``match``, for these
        ``hashes``: e.g. a router's, carried in its hint, :mod:`kvshare.vllm.router_hint`);
        no index call."""
        return self._plan(tokens, tuple(hashes), match, load_all)

    def _lookup_hashes(self, tokens: Sequence[int],
                       hashes: Sequence[BlockHash] | None) -> tuple[BlockHash, ...]:
        hs = tuple(hashes if hashes is not None else self.hashes(tokens))
        self._count("lookups")
        return hs

    def _no_plan(self, tokens: Sequence[int], hs: tuple[BlockHash, ...], reason: str) -> Plan:
        return Plan(self.namespace, len(tokens), self.block_tokens, hs, 0, (), reason)

    def _plan(self, tokens: Sequence[int], hs: tuple[BlockHash, ...], match: Any,
              load_all: bool = False) -> Plan:
        if not match.available:
            self._count("index_unavailable")
            return self._no_plan(tokens, hs, "index unavailable")
        blocks: list[PlannedBlock] = []
        kinds: list[Source] = []
        holders: list[str] = []
        for i in range(match.combined_prefix):
            best = self._best_holder(match.holders(i))
            if best is None:
                break
            loc, tier, transport = best
            blocks.append(PlannedBlock(hs[i], loc, tier, transport))
            kinds.append(Source.of(tier, remote=transport != TRANSPORT_SHM))
            holders.append(loc.partition(":")[2])
        policy = load_everything if load_all else self.cut_policy
        cut = max(0, min(len(blocks), int(policy(len(tokens), kinds, holders))))
        self._count("planned_blocks", cut)
        return Plan(self.namespace, len(tokens), self.block_tokens, hs, len(blocks),
                    tuple(blocks[:cut]), f"cut {cut}/{len(blocks)}")

    def _best_holder(self, holders: dict[Any, Tier]) -> tuple[str, Tier, str] | None:
        """This node's pool first, then the remote pool with the fastest tier (a holder the
        fetcher backed off, unreachable of late, is left out)."""
        own = holders.get(self.location)
        if own is not None and own != Tier.GPU:
            return str(self.location), own, TRANSPORT_SHM
        remote = sorted(
            (t.rank, str(loc)) for loc, t in holders.items()
            if str(loc).startswith("node:") and t != Tier.GPU
            and self.fetcher.reachable(str(loc))
        )
        if not remote:
            return None
        loc = remote[0][1]
        return loc, holders[loc], self.remote

    # ------------------------------------------------------------------ worker side: loads
    def _staging_rows(self, n: int) -> np.ndarray:
        if self._staging.shape[0] < n:
            from kvshare.transfer.reader.nixl import aligned_empty  # NIXL over cma: 2x when aligned

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
            reasons = self.fetcher.fetch(plan, staging, transfer_s, direct)
            t_copy = time.perf_counter()
            good = next((i for i, r in enumerate(reasons) if r), len(reasons))
            if good and direct is None:  # only the contiguous prefix is usable: copy just that
                blocks_into_target(staging[:good], into, 0, self.layout)
        done = time.perf_counter()
        result = LoadResult.from_reasons(reasons, [b.transport for b in plan.blocks],
                                         self.layout.bytes_per_block, done - start, transfer_s,
                                         done - t_copy)
        self.choice.loaded()
        self._count("loaded_blocks", result.loaded_blocks)
        for o in result.outcomes:
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
        if (not isinstance(into, SlabIO) or self.fetcher.shm.verify or not plan.blocks
                or any(b.transport != TRANSPORT_SHM for b in plan.blocks)):
            return None
        return lambda rows, positions, slots: into.write_slots(positions, rows, slots)

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
    def store(self, tokens: Sequence[int], kv: StorableKV, start_block: int = 0,
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
        self, tokens: Sequence[int], kv: StorableKV, start_block: int = 0,
        hashes: Sequence[BlockHash] | None = None,
    ) -> StoreResult:
        return await asyncio.wrap_future(self.store(tokens, kv, start_block, hashes))

    def _store(self, hs: list[BlockHash], kv: StorableKV, start: int) -> StoreResult:
        todo = hs[start:]
        if not todo:
            return StoreResult()
        control = self.fetcher.control(self.node)
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
        return StoreResult(stored, 0, len(todo) - stored, res.nbytes, ",".join(sorted(reasons)),
                           tuple(i for i, o in enumerate(res.outcomes) if not o.ok))

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
        self.fetcher.close()
        self._store_shm.close()
        if self._nixl is not None:
            self._nixl.close()
