"""The holding pool's NIXL pump: periodic while idle, continuous while a NIXL transfer it
serves is in flight (from the reader's prepare to its finish, never past the lease's end)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvshare.layout import KVLayout
from kvshare.transfer.base import TransportUnavailable
from kvshare.transfer.holder.local import make_local_source
from kvshare.transfer.holder.server import BlockServer
from kvshare.transfer.nixl_agent import ServingWindows
from kvshare.transfer.reader.control import LocalControl
from kvshare.types import BlockHash

LAYOUT = KVLayout(1, 1, 8, "fp32", 64)  # 4 KiB blocks


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "little") + b"\x09" * 28)


def test_windows_open_until_closed_or_expired() -> None:
    w = ServingWindows()
    assert not w.busy(0.0)
    w.open("reader-1", until=10.0)
    w.open("reader-2", until=5.0)
    assert w.busy(1.0)
    w.close("reader-1")
    assert w.busy(4.9)  # reader-2 never finished ...
    assert not w.busy(5.0)  # ... and its window ends with its lease
    w.open("reader-3", until=20.0)
    w.open("reader-3", until=15.0)  # a second prepare of one holder never shortens it
    assert w.busy(19.0) and not w.busy(20.0)
    w.close("never-opened")  # harmless


@pytest.fixture()
def source() -> Iterator[BlockServer]:
    try:
        src = make_local_source(f"pump{os.getpid()}", "ut-pump", LAYOUT, 8)
    except TransportUnavailable as exc:
        pytest.skip(f"NIXL unavailable: {exc}")
    if src.nixl_source is None:
        src.pool.close()
        pytest.skip(f"NIXL unavailable: {src.nixl_error}")
    for i in range(4):
        assert src.pool.put(h(i), np.full(LAYOUT.bytes_per_block, i, np.uint8))
    yield src
    src.close()
    src.pool.close()


def busy(src: BlockServer) -> bool:
    nixl = src.nixl_source
    assert nixl is not None
    return nixl.windows.busy(time.monotonic())


def test_a_nixl_reader_keeps_the_pump_busy_until_it_finishes(source: BlockServer) -> None:
    ctl = LocalControl(source)
    ctl.prepare_read([h(0), h(1)], "shm-reader", 30.0).get(0)  # shm: the pump stays periodic
    assert not busy(source)
    ctl.finish("shm-reader", [])
    ctl.prepare_read([h(0), h(1)], "nixl-reader", 30.0, nixl=True).get(0)
    assert busy(source)
    ctl.finish("nixl-reader", [])
    assert not busy(source)
    ctl.prepare_read([h(99)], "nixl-miss", 30.0, nixl=True).get(0)  # nothing pinned: no window
    assert not busy(source)
    ctl.finish("late", [])  # a reader that gave up: its prepare arrives after its finish
    ctl.prepare_read([h(2)], "late", 30.0, nixl=True).get(0)
    assert not busy(source)
    ctl.prepare_write([h(50)], "nixl-writer", 30.0, nixl=True).get(0)
    assert busy(source)
    ctl.commit_write("nixl-writer", [], [])
    assert not busy(source)


def test_the_pump_polls_continuously_only_while_busy(source: BlockServer) -> None:
    nixl = source.nixl_source
    assert nixl is not None

    class Counting:
        def __init__(self, agent: Any) -> None:
            self.agent, self.calls = agent, 0

        def get_new_notifs(self) -> Any:
            self.calls += 1
            return self.agent.get_new_notifs()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.agent, name)

    counting = Counting(nixl.agent)
    nixl.agent = counting
    try:
        time.sleep(0.2)
        idle = counting.calls
        counting.calls = 0
        nixl.serving("reader", 0.2)  # a reader that never finishes: 0.2 s, then periodic
        time.sleep(0.2)
        during = counting.calls
        counting.calls = 0
        time.sleep(0.2)
        after = counting.calls
    finally:
        nixl.agent = counting.agent
    print(f"pump calls per 0.2 s: idle {idle}, serving {during}, after the lease {after}")
    assert idle <= 0.2 / 0.002 + 5 and after <= 0.2 / 0.002 + 5  # one per PUMP_PERIOD_S
    assert during > 3 * max(idle, after, 1)
