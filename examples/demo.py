"""`make demo` (interim): what exists end to end — KV sizing of a bundled config and a
host+disk pool round trip with a restart. Replaced by the cluster demo when workers land."""

from __future__ import annotations

import sys
import tempfile
from importlib import resources

import numpy as np

from kvshare.cli import main as cli_main
from kvshare.hashing import block_hashes, namespace_root
from kvshare.layout import KVLayout
from kvshare.pool import TieredBlockPool
from kvshare.pool_types import PoolConfig, TierSpec
from kvshare.tiers.disk import DiskStore
from kvshare.tiers.host import HostSlab
from kvshare.types import Tier


def main() -> int:
    cfg = resources.files("kvshare") / "configs" / "llama-3.1-8b.json"
    if cfg.is_file():
        cli_main(["size", str(cfg), "--tokens", "131072"])
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="fp32", block_tokens=64)
    b = layout.bytes_per_block
    config = PoolConfig("demo", layout, (TierSpec(Tier.HOST, 8 * b), TierSpec(Tier.DISK, 64 * b)))
    disk = tempfile.mkdtemp(prefix="kvshare-demo-")
    root = namespace_root("demo-model", layout.fingerprint())
    tokens = np.arange(64 * 32) % 50_000
    hashes = block_hashes(root, tokens, layout.block_tokens)
    rng = np.random.default_rng(0)
    blocks = {h: rng.integers(0, 256, b, dtype=np.uint8) for h in hashes}
    pool = TieredBlockPool(config, {Tier.HOST: HostSlab(b, 8), Tier.DISK: DiskStore(disk, b, 64, layout.fingerprint())})
    for h in hashes:
        pool.put(h, blocks[h])
    ok = all(np.array_equal(pool.get(h), blocks[h]) for h in hashes)
    tiers = pool.stats()["tiers"]
    print(f"stored {len(hashes)} blocks of {b} bytes: host {tiers['host']['blocks']}, "
          f"disk {tiers['disk']['blocks']} (demoted {tiers['host']['demotions']}); read back ok={ok}")
    pool.close()
    again = TieredBlockPool(config, {Tier.HOST: HostSlab(b, 8), Tier.DISK: DiskStore(disk, b, 64, layout.fingerprint())})
    print(f"after restart: {again.recovered} disk blocks recovered")
    survivors_ok = all(np.array_equal(again.get(h), blocks[h]) for h, _ in again.inventory())
    again.close()
    return 0 if ok and survivors_ok and again.recovered > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
