"""Which transport brings other nodes' blocks to one worker: ``nixl`` or ``objstore``.

A ``remote="auto"`` worker takes the faster of the two by the bandwidths its node's pool
measured (bytes/s per transport), with ``KVSHARE_BANDWIDTH_GBPS`` in the process overriding
them, and later by its own timed loads. nixl only if the worker's NIXL agent started; nixl
while nothing is known. A cut policy that takes bandwidths (``CostCut``) gets the figures
the choice was made on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

from kvshare.client.types import TRANSPORT_NIXL, TRANSPORT_OBJSTORE
from kvshare.cost import GB
from kvshare.transfer.estimate import BandwidthEstimator
from kvshare.transfer.probe import TransportBandwidths, parse_overrides

log = logging.getLogger(__name__)

AUTO_WAIT_S = 120.0
"""How long a ``remote="auto"`` client keeps asking for its node's first bandwidth probe."""
REFINE_EVERY = 8
"""Loads between two refinements of the bandwidths from this worker's own timed transfers."""
REFINE_MIN_SAMPLES = 4
"""Timed batches of a transport (>= 1 MiB each) before they replace the probe's figure."""

BandwidthSource = Callable[[], Mapping[str, float]] | Mapping[str, float]
"""Bytes/s per transport (``nixl``, ``objstore``, ...), or a callable returning them."""
PeerSource = Callable[[], Mapping[str, Mapping[str, float]]]
"""Per peer node, bytes/s per transport of a pull from it to this node (the pool's probe)."""


class RemoteChoice:
    """The remote transport of one worker (``remote``) and the bytes/s it was chosen on.

    ``nixl_up``: the worker's NIXL agent started. ``auto``: choose by bandwidths (else the
    transport stays what the worker asked for: nixl when up, objstore otherwise).
    ``source``: the node's measured figures. ``cut_policy``: the worker's cut policy (fed the
    figures when it has ``set_bandwidths``, and each peer's link figure of the chosen
    transport when it has ``set_peer_bandwidths`` and ``peers`` is given, unless that
    transport's figure is overridden). ``node``: this worker's node. ``name``: the worker, for
    logs.
    """

    def __init__(self, *, nixl_up: bool, auto: bool, source: BandwidthSource | None,
                 cut_policy: object, name: str, node: str = "",
                 peers: PeerSource | None = None) -> None:
        self.overrides = parse_overrides(os.environ.get("KVSHARE_BANDWIDTH_GBPS", ""))
        self.nixl_up = nixl_up
        self.auto = auto
        self.remote = TRANSPORT_NIXL if nixl_up else TRANSPORT_OBJSTORE
        self.bandwidths: dict[str, float] = {}  # bytes/s the auto choice was made on
        self.estimator = BandwidthEstimator(32)  # this worker's own loads, per transport/peer
        self.cut_policy = cut_policy
        self._source = source
        self._peers = peers
        self.peer_bandwidths: dict[str, float] = {}  # bytes/s from each peer, chosen transport
        self._node = node
        self._name = name
        self._loads = 0

    def start(self, closed: threading.Event) -> None:
        """Make the first choice; while the node's probe has not reported, keep asking on a
        thread (for :data:`AUTO_WAIT_S`, or until ``closed`` is set)."""
        if self.auto and not self.choose() and callable(self._source):
            threading.Thread(target=self._await_probe, args=(closed,), name="kvshare-bandwidths",
                             daemon=True).start()

    def choose(self) -> bool:
        """Pick :attr:`remote` from the bandwidths: objstore only when it is measured (or
        overridden) faster than nixl, or when NIXL did not start. Returns True once both
        figures are known (or NIXL is out), False while the node's probe has not reported yet
        (the choice then stays nixl)."""
        src = self._source
        try:
            measured = dict(src() if callable(src) else (src or {}))
        except Exception as exc:  # pool busy or gone: keep the current choice
            log.info("bandwidths unavailable for %s: %s", self._name, exc)
            measured = {}
        bw = TransportBandwidths({k: float(v) for k, v in measured.items()}, dict(self.overrides))
        self.bandwidths = bw.as_dict()
        if not self.nixl_up:
            self.remote = TRANSPORT_OBJSTORE
            self._feed_cut_policy()
            return True
        faster = bw.get(TRANSPORT_OBJSTORE) > bw.get(TRANSPORT_NIXL)
        self.remote = TRANSPORT_OBJSTORE if faster else TRANSPORT_NIXL
        self._feed_cut_policy()
        return {TRANSPORT_NIXL, TRANSPORT_OBJSTORE} <= set(self.bandwidths)

    def loaded(self) -> None:
        """One load done: every :data:`REFINE_EVERY` loads, :meth:`refine`."""
        self._loads += 1
        if self._loads % REFINE_EVERY == 0:
            self.refine()

    def refine(self) -> dict[str, float]:
        """Replace the probe's bytes/s by this worker's own timed loads where it has at least
        :data:`REFINE_MIN_SAMPLES` of a transport (overrides still win), and give them to the
        cut policy; returns the figures in use."""
        live = {t: self.estimator.estimate(t) for t in self.estimator.transports()}
        for name, est in live.items():
            if est.samples >= REFINE_MIN_SAMPLES and est.bytes_per_s > 0:
                self.bandwidths[name] = self.overrides.get(name, est.bytes_per_s)
        self._feed_cut_policy()
        return dict(self.bandwidths)

    def _feed_cut_policy(self) -> None:
        """The measured bandwidths in bytes/s, the remote figure being the chosen transport's."""
        setter = getattr(self.cut_policy, "set_bandwidths", None)
        if not callable(setter) or not self.bandwidths:
            return
        bw = {k: v for k, v in self.bandwidths.items() if k not in (TRANSPORT_NIXL, TRANSPORT_OBJSTORE)}
        if self.remote in self.bandwidths:
            bw[self.remote] = self.bandwidths[self.remote]
        setter(bw)
        set_peers = getattr(self.cut_policy, "set_peer_bandwidths", None)
        if callable(set_peers) and self._peers is not None and self.remote not in self.overrides:
            try:
                per = {str(p): float(f.get(self.remote, 0.0)) for p, f in self._peers().items()}
            except Exception as exc:  # pool busy or gone: keep the last figures
                log.info("per-peer bandwidths unavailable for %s: %s", self._name, exc)
                return
            self.peer_bandwidths = {p: v for p, v in per.items() if p != self._node and v > 0}
            set_peers(self._node, self.peer_bandwidths)

    def _await_probe(self, closed: threading.Event) -> None:
        deadline = time.monotonic() + AUTO_WAIT_S
        while not closed.wait(1.0) and time.monotonic() < deadline:
            if self.choose():
                log.info("%s: remote transport %s (GB/s %s)", self._name, self.remote,
                         {k: round(v / GB, 2) for k, v in self.bandwidths.items()})
                return
