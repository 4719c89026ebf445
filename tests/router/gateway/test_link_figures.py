"""The gateway re-reads the pools' probed figures into its cost model (``LinkFigures``): a link
that slowed down since start is priced as probed; overrides keep winning; a failed or empty
read keeps the figures in use."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest

from kvshare.cost import Bandwidths
from kvshare.links import Links
from kvshare.router.core.routing import CostInputs, RoutingCore
from kvshare.router.gateway.link_figures import LinkFigures, priced

GB = 1e9


def core() -> RoutingCore:
    return RoutingCore(None, CostInputs(256, 8192, Bandwidths(), 5000.0), policy="cost")


class Probes:
    """What the cluster's pools report, changed by the test between reads."""

    def __init__(self) -> None:
        self.measured: Mapping[str, float] = {"shm": 12 * GB, "nixl": 3 * GB}
        self.links = Links((("a", "b", 3 * GB),))
        self.fail = False

    def __call__(self) -> tuple[Mapping[str, float], Links]:
        if self.fail:
            raise TimeoutError("a pool did not answer")
        return self.measured, self.links


def test_a_link_that_slowed_down_is_priced_as_probed_at_the_next_read() -> None:
    c, probes = core(), Probes()
    figures = LinkFigures(c, probes, given={})
    assert figures.refresh() and c.cost.bandwidths.links.get("a", "b") == 3 * GB
    assert not figures.refresh()  # the same figures: nothing rebuilt
    fast = c.cost.bandwidths.for_pull(["a"], "b").remote
    probes.links = Links((("a", "b", 0.05 * GB),))  # a's port congested, re-probed
    assert figures.refresh()
    assert c.cost.bandwidths.for_pull(["a"], "b").remote == 0.05 * GB < fast
    assert c.cost.bandwidths.host == 12 * GB  # the other inputs stay
    assert c.cost_inputs.prefill_tokens_per_s == 5000.0
    assert figures.counters == {"reads": 3, "changed": 2, "failed": 0}


def test_overrides_win_and_a_failed_or_empty_read_keeps_the_figures() -> None:
    c, probes = core(), Probes()
    figures = LinkFigures(c, probes, given={"nixl": 8 * GB})
    assert figures.refresh()
    assert c.cost.bandwidths.remote == 8 * GB and not c.cost.bandwidths.links  # override prices
    in_use = c.cost.bandwidths
    probes.fail = True
    assert not figures.refresh() and c.cost.bandwidths == in_use
    probes.fail, probes.measured, probes.links = False, {}, Links()
    assert not figures.refresh() and c.cost.bandwidths == in_use
    assert figures.counters["failed"] == 1
    assert priced({}, Links(), {}) == Bandwidths()  # nothing probed, nothing given: defaults


def test_reads_run_on_their_own_thread_until_stopped() -> None:
    c, probes = core(), Probes()
    figures = LinkFigures(c, probes, given={}, interval_s=0.02).start()
    try:
        deadline = time.monotonic() + 10
        while figures.counters["reads"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        figures.stop()
    reads = figures.counters["reads"]
    time.sleep(0.1)
    assert figures.counters["reads"] == reads and c.cost.bandwidths.links == probes.links
    with pytest.raises(ValueError, match="interval_s must be positive"):
        LinkFigures(c, probes, given={}, interval_s=0)
