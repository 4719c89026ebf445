"""Bandwidth probe: how fast each transport moves blocks from a given pool, measured at start.

Every node pool stores a few *probe blocks* under hashes derived from its node id
(:func:`probe_hashes`), so any process can read them without asking. The cluster's pools keep
them in a private namespace (:data:`PROBE_NAMESPACE`, :data:`PROBE_LAYOUT`: 4 blocks of 2 MiB,
never published to the index) so probing never shows up as cached blocks. :func:`probe`
reads them through each transport after a warm-up, in batches of two sizes, several times, and
fits latency + bytes / bandwidth with a robust estimator (:func:`kvshare.transfer.estimate.fit`):
the bytes/s it returns is the copy rate a large prefix sees, not one small batch's.
:class:`TransportBandwidths` holds the measured figures, lets a config override any of them, and ranks
transports for :class:`~kvshare.transfer.reader.fetch.PeerFetcher` and the router's cost model.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvshare.cost import GB
from kvshare.layout import KVLayout
from kvshare.pool.tiered import TieredBlockPool
from kvshare.tiers.base import ByteArray
from kvshare.transfer.base import Transport, call
from kvshare.transfer.estimate import BandwidthEstimator, fit
from kvshare.transfer.wire import BlockControl, SourceGone
from kvshare.types import BlockHash

log = logging.getLogger(__name__)

PROBE_BLOCKS = 16
PROBE_NAMESPACE = "kvshare-probe"
"""The private namespace a node pool serves its probe blocks from (not in the index)."""
PROBE_LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="fp32", block_tokens=256)
"""2 MiB blocks: probe batches move 8 and 32 MiB (``PROBE_BLOCKS // 4`` and ``PROBE_BLOCKS``)."""
TRANSPORTS = ("shm", "nixl", "objstore")


def probe_hashes(node: str, n: int = PROBE_BLOCKS, hash_size: int = 32) -> list[BlockHash]:
    """The hashes of node ``node``'s probe blocks (deterministic, never a real prefix)."""
    return [
        BlockHash(hashlib.sha256(f"kvshare-probe/{node}/{i}".encode()).digest()[:hash_size])
        for i in range(n)
    ]


def seed_probe_blocks(pool: TieredBlockPool, node: str, n: int = PROBE_BLOCKS) -> int:
    """Store ``n`` probe blocks (random bytes) in ``pool``; returns how many were new."""
    rng = np.random.default_rng(0)
    stored = 0
    for h in probe_hashes(node, n, pool.config.hash_size):
        if h not in pool and pool.put(h, rng.integers(0, 255, pool.block_bytes, dtype=np.uint8), "probe"):
            stored += 1
    return stored


def probe(
    transports: Mapping[str, Transport],
    control: BlockControl,
    dest: Sequence[ByteArray],
    *,
    repeats: int = 5,
    warmup: int = 1,
    deadline_s: float = 5.0,
    estimator: BandwidthEstimator | None = None,
    peer: str = "",
) -> dict[str, float]:
    """Bytes/s per transport of reading probe blocks of a pool into ``dest`` (one per block).

    Per transport: ``warmup`` untimed reads (connections, registrations, page faults), then
    ``repeats`` rounds of one batch of ``len(dest) // 4`` blocks and one of ``len(dest)``; the
    figure is the Theil-Sen fit of the timings (robust to a slow round). The samples also go to
    ``estimator`` under ``peer``, where live transfers keep refining them. The pool seeds its
    probe blocks on first request. A transport that cannot reach it (another node for shm,
    NIXL missing, a dead pool) measures 0.0.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"probe needs repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    try:
        hashes = call(control.probe_blocks(len(dest)), deadline_s)
    except (TimeoutError, SourceGone) as exc:
        log.info("probe: pool unreachable (%s)", exc)
        return dict.fromkeys(transports, 0.0)
    small = max(1, len(dest) // 4)
    sizes = [small, len(dest)] if small < len(dest) else [len(dest)]
    out: dict[str, float] = {}
    for name, transport in transports.items():
        samples: list[tuple[int, float]] = []
        for i in range(warmup + repeats * len(sizes)):
            n = sizes[i % len(sizes)]
            res = transport.read(control, hashes[:n], dest[:n], deadline_s=deadline_s)
            if not res.ok:
                log.info("probe over %s: %s", name, res.reasons())
                samples = []
                break
            if i >= warmup:
                samples.append((res.nbytes, res.seconds))
        out[name] = fit(samples).bytes_per_s
        if estimator is not None:
            estimator.observe_all(name, peer, samples)
    return out


def parse_overrides(text: str) -> dict[str, float]:
    """``"nixl=10,objstore=1.5"``: GB/s per transport as an operator writes them (``--bandwidth``,
    ``KVSHARE_BANDWIDTH_GBPS``), returned in bytes/s."""
    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value) * GB
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(
                f"bandwidth override {item!r} is malformed: write transport=GBps, e.g. nixl=10"
            )
    return out


@dataclass
class TransportBandwidths:
    """Bytes/s per transport (``shm``, ``nixl``, ``objstore``) as probed, with config overrides
    taking precedence (what :meth:`kvshare.cost.Bandwidths.from_measured` takes)."""

    measured: dict[str, float] = field(default_factory=dict)
    overrides: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, v in self.overrides.items():
            if v < 0:
                raise ValueError(f"bandwidth override for {name!r} must be >= 0, got {v / GB:g} GB/s")

    def get(self, name: str) -> float:
        return self.overrides.get(name, self.measured.get(name, 0.0))

    def as_dict(self) -> dict[str, float]:
        return {n: self.get(n) for n in sorted({*self.measured, *self.overrides})}

    def update(self, measured: Mapping[str, float]) -> None:
        self.measured.update(measured)

    def rank(self, names: Sequence[str]) -> list[str]:
        """``names`` fastest first; those measured at 0 (unusable) last."""
        return sorted(names, key=lambda n: -self.get(n))
