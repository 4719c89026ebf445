"""The :class:`~kvshare.tiers.base.TierStore` contract as plain checks, one function each.

``tests/kvshare/tiers/test_tiers.py`` runs every check against every tier (host, host in shared memory,
disk, gpu) and the GPU check (:mod:`kvshare.testing.gpu_check`) runs them on the device, so
the contract is written once. A check takes a fresh store with at least
:data:`MIN_SLOTS` slots, raises AssertionError naming what broke, and needs no pytest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from kvshare.tiers.base import ByteArray, TierStore, as_u8, block_checksum
from kvshare.types import BlockHash, Tier

MIN_SLOTS = 4


def payload(seed: int, size: int) -> ByteArray:
    """``size`` random bytes, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def bh(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def read(store: TierStore, slot: int, i: int, checksum: int = -1) -> ByteArray:
    """Slot ``slot`` read back as the block of hash ``bh(i)``."""
    out = np.empty(store.slot_bytes, dtype=np.uint8)
    store.read_into(slot, out, bh(i), checksum)
    return out


@contextmanager
def raises(exc: type[BaseException], match: str) -> Iterator[None]:
    """AssertionError unless the block raises ``exc`` with a message matching ``match``."""
    try:
        yield
    except exc as err:
        if not re.search(match, str(err)):
            raise AssertionError(f"{exc.__name__} raised, but {str(err)!r} lacks {match!r}") from err
    else:
        raise AssertionError(f"{exc.__name__} matching {match!r} was not raised")


def check_shape_and_tier(store: TierStore) -> None:
    assert store.slot_bytes > 0 and store.num_slots >= MIN_SLOTS, (store.slot_bytes,
                                                                    store.num_slots)
    assert isinstance(store.tier, Tier), store.tier


def check_every_slot_round_trips_independently(store: TierStore) -> None:
    blocks = [payload(i, store.slot_bytes) for i in range(store.num_slots)]
    for slot, data in enumerate(blocks):
        store.write(slot, data, bh(slot), block_checksum(data))
    for slot, data in enumerate(blocks):
        assert np.array_equal(read(store, slot, slot, block_checksum(data)), data), slot
        assert store.checksum(slot) == block_checksum(data), slot


def check_write_checksummed_equals_write_plus_checksum(store: TierStore) -> None:
    for slot in range(store.num_slots):
        data = payload(40 + slot, store.slot_bytes)
        assert store.write_checksummed(slot, data, bh(slot)) == block_checksum(data), slot
        assert np.array_equal(read(store, slot, slot, block_checksum(data)), data), slot
    with raises(ValueError, "check the KV layout"):
        store.write_checksummed(0, payload(1, store.slot_bytes - 8), bh(0))


def check_write_replaces_content(store: TierStore) -> None:
    first, second = payload(1, store.slot_bytes), payload(2, store.slot_bytes)
    store.write(0, first, bh(1), block_checksum(first))
    store.write(0, second, bh(2), block_checksum(second))
    assert np.array_equal(read(store, 0, 2, block_checksum(second)), second)


def check_bad_slot_or_size_changes_nothing(store: TierStore) -> None:
    size, slots = store.slot_bytes, store.num_slots
    data = payload(3, size)
    store.write(1, data, bh(3), block_checksum(data))
    with raises(IndexError, "out of range"):
        store.write(slots, data, bh(3), block_checksum(data))
    with raises(IndexError, "out of range"):
        store.write(-1, data, bh(3), block_checksum(data))
    with raises(ValueError, "check the KV layout"):
        store.write(1, payload(4, size - 1), bh(4), 0)
    with raises(ValueError, "check the KV layout"):
        store.read_into(1, np.empty(size + 1, dtype=np.uint8), bh(3), -1)
    assert np.array_equal(read(store, 1, 3, block_checksum(data)), data)


def check_discard_forgets_and_accepts_any_valid_slot(store: TierStore) -> None:
    data = payload(5, store.slot_bytes)
    store.write(2, data, bh(5), block_checksum(data))
    store.discard(2)
    store.discard(3)  # never written: fine
    with raises(IndexError, ""):
        store.discard(store.num_slots)
    assert all(slot != 2 for slot, _, _ in store.recover())


def check_accepts_any_bytes_like_view(store: TierStore) -> None:
    data = payload(6, store.slot_bytes)
    as_bytes = as_u8(data.tobytes())
    store.write(0, as_bytes, bh(6), block_checksum(as_bytes))
    assert np.array_equal(read(store, 0, 6), data)


CHECKS: tuple[Callable[[TierStore], None], ...] = (
    check_shape_and_tier,
    check_every_slot_round_trips_independently,
    check_write_checksummed_equals_write_plus_checksum,
    check_write_replaces_content,
    check_bad_slot_or_size_changes_nothing,
    check_discard_forgets_and_accepts_any_valid_slot,
    check_accepts_any_bytes_like_view,
)
"""Every check of the contract, in the order the suites run them."""
