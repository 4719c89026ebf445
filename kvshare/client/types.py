"""What the worker SDK hands back: plans and per-block outcomes.

The KV memory a load fills and a store reads (:data:`KVTarget`, :data:`StorableKV`) is
:mod:`kvshare.block_io`'s (re-exported here).

A :class:`Plan` is the scheduler side's answer ("load blocks 0..k-1 from here"); it is plain
data (``to_dict``/``from_dict``) so a scheduler process can send it to every TP rank.
:class:`LoadResult` reports per block what happened; only the contiguous run of good blocks
from block 0 (``loaded_blocks``) may be used, the rest is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from kvshare.block_io import KVTarget as KVTarget
from kvshare.block_io import PagedKV as PagedKV
from kvshare.block_io import StorableKV as StorableKV
from kvshare.types import BlockHash, Tier

# Where a planned block comes from, cheapest first.
TRANSPORT_GPU = "gpu"  # the worker's own gpu tier
TRANSPORT_SHM = "shm"  # this node's pool (host slab mapped; disk blocks promoted first)
TRANSPORT_NIXL = "nixl"  # another node's pool over NIXL
TRANSPORT_OBJSTORE = "objstore"  # another node's pool through Ray's object store
TRANSPORT_AUTO = "auto"  # remote transport chosen from the measured bandwidths (nixl or objstore)
TRANSPORT_LOCAL = "local"  # an in-process pool (no Ray)
REMOTE_SOURCES = (TRANSPORT_NIXL, TRANSPORT_OBJSTORE)
"""The transports that bring a block from another node's pool, fastest first."""


def hit_source(transport: str, tier: str) -> str:
    """Where a reused block came from, in vLLM's ``CacheHitSource`` names (the labels of its
    ``vllm:prompt_tokens_cached_by_source`` counter): ``device`` (the worker's own cache),
    ``p2p`` (another node's pool, any tier), ``disk`` (this node's disk tier), ``host`` (this
    node's pool in memory). ``tier`` is the tier that held the block (``Tier.value``)."""
    if transport == TRANSPORT_GPU:
        return "device"
    if transport in REMOTE_SOURCES:
        return "p2p"
    return "disk" if tier == Tier.DISK.value else "host"


@dataclass(frozen=True)
class PlannedBlock:
    """One block of the plan: where it is and how it will travel."""

    block_hash: BlockHash
    location: str
    tier: Tier
    transport: str

    def to_list(self) -> list[str]:
        """``[hash_hex, location, tier, transport]`` (JSON)."""
        return [self.block_hash.hex(), self.location, self.tier.value, self.transport]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> PlannedBlock:
        h, loc, tier, transport = data
        return cls(BlockHash(bytes.fromhex(h)), str(loc), Tier(tier), str(transport))


@dataclass(frozen=True)
class Plan:
    """How much of a prompt's prefix to load, and from where.

    ``available_blocks``: the longest prefix held anywhere (the index's combined prefix, or
    what the local pool holds). ``blocks``: the cut point chosen (``<= available_blocks``), one
    :class:`PlannedBlock` each. ``hashes``: every full block of the prompt.
    """

    namespace: str
    num_tokens: int
    block_tokens: int
    hashes: tuple[BlockHash, ...]
    available_blocks: int
    blocks: tuple[PlannedBlock, ...] = ()
    reason: str = ""

    @property
    def load_blocks(self) -> int:
        return len(self.blocks)

    @property
    def load_tokens(self) -> int:
        """Prefix tokens the plan brings (the engine still recomputes the last prompt token)."""
        return len(self.blocks) * self.block_tokens

    def by_transport(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.blocks:
            out[b.transport] = out.get(b.transport, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON data: every field as it is, but hashes as hex and blocks as lists."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hashes"] = [h.hex() for h in self.hashes]
        out["blocks"] = [b.to_list() for b in self.blocks]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(
            namespace=str(data["namespace"]),
            num_tokens=int(data["num_tokens"]),
            block_tokens=int(data["block_tokens"]),
            hashes=tuple(BlockHash(bytes.fromhex(h)) for h in data["hashes"]),
            available_blocks=int(data["available_blocks"]),
            blocks=tuple(PlannedBlock.from_list(b) for b in data["blocks"]),
            reason=str(data.get("reason", "")),
        )


@dataclass(frozen=True)
class BlockOutcome:
    """What happened to one planned block."""

    index: int
    ok: bool
    transport: str
    reason: str = ""
    nbytes: int = 0


@dataclass
class LoadResult:
    """Per-block outcomes of a load; ``loaded_blocks`` good blocks from block 0 are usable."""

    outcomes: list[BlockOutcome] = field(default_factory=list)
    seconds: float = 0.0
    transfer_s: dict[str, float] = field(default_factory=dict)
    """Per transport, seconds from submitting its first batch to its last one's end."""
    copy_s: float = 0.0
    """Seconds spent copying fetched blocks into the caller's KV memory."""

    @classmethod
    def from_reasons(
        cls, reasons: Sequence[str], transports: Sequence[str], block_bytes: int,
        seconds: float = 0.0, transfer_s: dict[str, float] | None = None, copy_s: float = 0.0,
    ) -> LoadResult:
        """One outcome per planned block: ``reasons[i]`` is ``""`` for a block that arrived
        (``block_bytes`` over ``transports[i]``), else why it did not."""
        outcomes = [BlockOutcome(i, not r, t, r, 0 if r else block_bytes)
                    for i, (r, t) in enumerate(zip(reasons, transports, strict=True))]
        return cls(outcomes, seconds, dict(transfer_s or {}), copy_s)

    @property
    def loaded_blocks(self) -> int:
        n = 0
        for o in sorted(self.outcomes, key=lambda o: o.index):
            if not o.ok or o.index != n:
                break
            n += 1
        return n

    @property
    def failed(self) -> list[BlockOutcome]:
        return [o for o in self.outcomes if not o.ok]

    def bytes_by_transport(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            if o.ok:
                out[o.transport] = out.get(o.transport, 0) + o.nbytes
        return out


@dataclass(frozen=True)
class StoreResult:
    """Outcome of one store: blocks written, already present, skipped (no space, in flight).

    ``missed``: positions (from the store's first block) of the blocks neither written nor
    already present, for engines that track each block (SGLang's storage tier)."""

    stored: int = 0
    present: int = 0
    skipped: int = 0
    nbytes: int = 0
    reason: str = ""
    missed: tuple[int, ...] = ()


@runtime_checkable
class KVClient(Protocol):
    """The SDK surface an engine uses (cluster client and in-process client alike)."""

    namespace: str
    block_tokens: int

    def hashes(self, tokens: Sequence[int]) -> list[BlockHash]: ...

    def lookup(self, tokens: Sequence[int], hashes: Sequence[BlockHash] | None = None, *,
               load_all: bool = False) -> Plan: ...

    def plan_from(self, tokens: Sequence[int], hashes: Sequence[BlockHash], match: Any, *,
                  load_all: bool = False) -> Plan: ...

    def load(self, plan: Plan, into: KVTarget) -> LoadResult: ...

    def store(self, tokens: Sequence[int], kv: StorableKV, start_block: int = 0,
              hashes: Sequence[BlockHash] | None = None) -> Future[StoreResult]: ...
