"""The gateway's transfer prices kept current.

Each node's pool probes its peers at start and again every ``probe_interval_s`` (10 min by
default), or when an operator asks (``kvshare probe``): a link that slows down or comes back
gets a new figure there. :class:`LinkFigures` re-reads those figures every ``interval_s`` (the
per-transport medians and the per-link figures, :func:`kvshare.actors.deploy.measured_bandwidths`
and :func:`~kvshare.actors.deploy.measured_links`) and hands them to the router's cost model,
which is rebuilt only when they changed. ``--bandwidth`` overrides keep winning; a read that
fails (the cluster busy, a pool gone) keeps the figures in use.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace

from kvshare.cost import Bandwidths
from kvshare.links import Links
from kvshare.router.core.routing import RoutingCore

log = logging.getLogger(__name__)

Reader = Callable[[], tuple[Mapping[str, float], Links]]
"""Returns the cluster's probed bytes/s per transport and per link."""


def priced(measured: Mapping[str, float], links: Links,
           given: Mapping[str, float]) -> Bandwidths:
    """What the router prices pulls with: the probed figures, per link where the pools probed
    links, with the operator's overrides (``given``, ``--bandwidth``) on top. An override of a
    remote transport prices every pull (the per-link figures are left out)."""
    base = Bandwidths()
    if not set(given) & {"nixl", "objstore", "remote"}:
        base = replace(base, links=links)
    return Bandwidths.from_measured({**measured, **given}, base)


class LinkFigures:
    """Re-reads the cluster's probed figures every ``interval_s`` into ``core``'s cost model
    (module docstring). :meth:`refresh` does one read; :meth:`start` runs them on a daemon
    thread until :meth:`stop`."""

    def __init__(self, core: RoutingCore, read: Reader, given: Mapping[str, float],
                 interval_s: float = 60.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive seconds, got {interval_s}")
        self.core = core
        self.read = read
        self.given = dict(given)
        self.interval_s = interval_s
        self.counters = {"reads": 0, "changed": 0, "failed": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> bool:
        """One read; True when the figures changed (and the cost model was rebuilt)."""
        try:
            measured, links = self.read()
        except Exception as exc:  # noqa: BLE001 - a read is best effort: keep what is in use
            self.counters["failed"] += 1
            log.info("re-reading the probed bandwidths failed (%s); keeping the last ones", exc)
            return False
        self.counters["reads"] += 1
        bandwidths = priced(measured, links, self.given)
        if not measured and not links:  # nothing probed (yet): keep what is in use
            return False
        if not self.core.use_bandwidths(bandwidths):
            return False
        self.counters["changed"] += 1
        log.info("transfer prices re-read from the pools' probes: %s", bandwidths)
        return True

    def start(self) -> LinkFigures:
        self._thread = threading.Thread(target=self._run, name="kvshare-link-figures",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
