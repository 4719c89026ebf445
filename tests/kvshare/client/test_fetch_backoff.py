"""A remote holder that cannot be reached is backed off (kvshare/client/fetch.py): the next
loads miss it at once instead of each waiting out the deadline, and it is asked again later."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kvshare.client import fetch
from kvshare.client.fetch import BlockFetcher
from kvshare.client.types import TRANSPORT_NIXL, Plan, PlannedBlock
from kvshare.transfer.base import (
    DEADLINE,
    HOLDER_DEAD,
    BlockResult,
    Transfer,
    TransferResult,
    Transport,
)
from kvshare.transfer.estimate import BandwidthEstimator
from kvshare.types import Tier


class CutOff(Transport):
    """A remote transport to a holder whose link is down: each batch ends at its deadline with
    nothing (``reason``); ``asked`` counts the batches submitted."""

    name = TRANSPORT_NIXL

    def __init__(self, reason: str = DEADLINE) -> None:
        self.reason = reason
        self.asked = 0

    def submit_read(self, source: Any, hashes: Sequence[bytes], dest: Sequence[Any], *,
                    deadline_s: float) -> Transfer:
        self.asked += 1
        return self.new_transfer("read", hashes, dest, deadline_s, "cut")

    def submit_write(self, sink: Any, hashes: Sequence[bytes], data: Sequence[Any], *,
                     deadline_s: float) -> Transfer:
        raise NotImplementedError

    def poll(self, transfer: Transfer) -> TransferResult | None:
        return TransferResult(self.name, "read", tuple(
            BlockResult(h, False, self.reason) for h in transfer.hashes))


def plan(n: int, where: str = "node:b") -> Plan:
    hs = tuple(bytes([i]) * 16 for i in range(n))
    return Plan("ns", n * 16, 16, hs, n, tuple(PlannedBlock(h, where, Tier.HOST, TRANSPORT_NIXL)
                                               for h in hs))


@pytest.mark.parametrize("reason", [DEADLINE, HOLDER_DEAD])
def test_an_unreachable_holder_is_skipped_until_its_back_off_ends(
        reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(fetch.time, "monotonic", lambda: clock[0])
    counts: dict[str, float] = {}
    cut = CutOff(reason)
    f = BlockFetcher(node="a", worker_id="w", control_for=lambda node: object(), nixl=cut,
                     estimator=BandwidthEstimator(8), deadline_s=0.0,
                     count=lambda k, v: counts.__setitem__(k, counts.get(k, 0) + v))
    staging = np.zeros((2, 8), dtype=np.uint8)
    assert f.reachable("node:b")
    assert f.fetch(plan(2), staging, {}) == [reason] * 2 and cut.asked == 1
    assert not f.reachable("node:b") and f.reachable("node:c")  # only that holder
    assert counts["holders_backed_off"] == 1
    clock[0] += fetch.BACKOFF_S - 1
    assert f.fetch(plan(2), staging, {}) == [HOLDER_DEAD] * 2 and cut.asked == 1  # not asked
    clock[0] += 1
    assert f.reachable("node:b")  # asked again once the back-off ends
    f.fetch(plan(2), staging, {})
    assert cut.asked == 2


def test_a_holder_that_answered_part_of_a_batch_is_not_backed_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Partial(CutOff):
        def poll(self, transfer: Transfer) -> TransferResult | None:
            first, *rest = transfer.hashes
            return TransferResult(self.name, "read", (BlockResult(first, True), *(
                BlockResult(h, False, DEADLINE) for h in rest)))

    f = BlockFetcher(node="a", worker_id="w", control_for=lambda node: object(), nixl=Partial(),
                     estimator=BandwidthEstimator(8), deadline_s=0.0, count=lambda k, v: None)
    assert f.fetch(plan(2), np.zeros((2, 8), dtype=np.uint8), {}) == ["", DEADLINE]
    assert f.reachable("node:b")
