"""Lossless reuse through a plain TieredBlockPool (host and disk tiers), no Ray.

Scenario: worker A computes a prompt and stores its blocks; a second worker with the same
model answers prompts sharing that prefix by loading the blocks. Next-token logits match full
recomputation to 1e-4 (fp32) and greedy generations are identical.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import BLOCK, prompt, small_engine

from kvshare.client.local import LocalKVClient
from kvshare.engines.hf import HFEngine
from kvshare.engines.worker import ReferenceWorker
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.tiers.disk import DiskStore
from kvshare.tiers.host import HostSlab
from kvshare.types import Tier

HOST_BLOCKS = 8


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return small_engine()


def make_pool(engine: HFEngine, directory: str) -> TieredBlockPool:
    layout = engine.layout
    cfg = PoolConfig(
        "lossless", layout,
        (TierSpec(Tier.HOST, HOST_BLOCKS * layout.bytes_per_block),
         TierSpec(Tier.DISK, 64 * layout.bytes_per_block)),
    )
    stores = {
        Tier.HOST: HostSlab(layout.bytes_per_block, HOST_BLOCKS),
        Tier.DISK: DiskStore(directory, layout.bytes_per_block, 64, layout.fingerprint()),
    }
    return TieredBlockPool(cfg, stores)


def check_same(warm, cold) -> None:  # type: ignore[no-untyped-def]
    assert float((warm.first_logits - cold.first_logits).abs().max()) <= 1e-4
    assert warm.tokens == cold.tokens


def test_host_tier_reuse_is_lossless(engine: HFEngine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(engine, str(tmp_path))
    client = LocalKVClient(pool, engine.root)
    worker = ReferenceWorker(engine, client)
    cold_ref = ReferenceWorker(engine, None)
    shared = prompt(5 * BLOCK, seed=1)
    first = worker.generate(shared + prompt(9, seed=2), 10)
    assert first.stats.reused_tokens == 0
    assert [f.result(timeout=10).stored for f in first.stores] == [5, 1]  # prefill, decode
    request = shared + prompt(11, seed=3)
    warm = worker.generate(request, 10)
    assert warm.stats.reused_tokens == 5 * BLOCK and warm.stats.computed_tokens == 11
    assert all(pool.tier_of(h) == Tier.HOST for h in engine.hashes(shared))
    check_same(warm, cold_ref.generate(request, 10))
    counters = worker.counters.snapshot()
    assert counters["prefill_tokens_saved"] == 5 * BLOCK
    assert counters["bytes_loaded_local"] == 5 * engine.layout.bytes_per_block


def test_disk_tier_reuse_is_lossless(engine: HFEngine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(engine, str(tmp_path))
    worker = ReferenceWorker(engine, LocalKVClient(pool, engine.root))
    shared = prompt(6 * BLOCK, seed=4)
    for f in worker.generate(shared, 1).stores:
        f.result(timeout=10)
    # another 8 blocks push the first prompt's blocks from host down to disk
    for f in worker.generate(prompt(8 * BLOCK + 1, seed=5), 1).stores:
        f.result(timeout=10)
    assert all(pool.tier_of(h) == Tier.DISK for h in engine.hashes(shared))
    request = shared + prompt(5, seed=6)
    warm = worker.generate(request, 8)
    assert warm.stats.reused_tokens == 6 * BLOCK
    check_same(warm, ReferenceWorker(engine, None).generate(request, 8))


def test_decode_blocks_are_stored_and_reused(engine: HFEngine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(engine, str(tmp_path))
    worker = ReferenceWorker(engine, LocalKVClient(pool, engine.root))
    request = prompt(2 * BLOCK + 3, seed=7)
    done = worker.generate(request, 2 * BLOCK, stop_ids=())
    for f in done.stores:
        f.result(timeout=10)
    conversation = request + done.tokens  # the next turn starts with the previous answer
    assert pool.prefix_len(engine.hashes(conversation)) == (len(conversation) - 1) // BLOCK
    follow = conversation + prompt(4, seed=8)
    warm = worker.generate(follow, 6)
    assert warm.stats.reused_tokens == ((len(conversation) - 1) // BLOCK) * BLOCK
    check_same(warm, ReferenceWorker(engine, None).generate(follow, 6))


def test_corrupt_disk_block_is_a_counted_miss_and_same_answer(engine: HFEngine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(engine, str(tmp_path))
    worker = ReferenceWorker(engine, LocalKVClient(pool, engine.root))
    shared = prompt(4 * BLOCK, seed=9)
    for f in worker.generate(shared, 1).stores:
        f.result(timeout=10)
    for f in worker.generate(prompt(8 * BLOCK + 1, seed=10), 1).stores:
        f.result(timeout=10)
    victim = engine.hashes(shared)[2]
    assert pool.tier_of(victim) == Tier.DISK
    files = sorted(tmp_path.glob("slot-*.blk"))
    for path in files:  # flip a payload byte of the third block's file
        data = bytearray(path.read_bytes())
        if bytes(victim) in data[:128]:
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
    request = shared + prompt(3, seed=11)
    warm = worker.generate(request, 8)
    assert warm.stats.reused_tokens == 2 * BLOCK  # blocks 0-1 reused, 2-3 recomputed
    assert warm.stats.misses.get("corrupt") == 1
    assert worker.counters.snapshot()["miss_corrupt"] == 1
    check_same(warm, ReferenceWorker(engine, None).generate(request, 8))
    assert np.asarray(pool.stats()["tiers"]["disk"]["corrupt"]) == 1
