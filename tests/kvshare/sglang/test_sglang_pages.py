"""SGLang's pages as kvshare blocks, without SGLang: keys as keyed block hashes (fixed vectors),
the ``layer_first`` host pool as the SDK's block memory, and the backend's settings."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from kvshare.client.local import LocalKVClient
from kvshare.hashing import keyed_block_hash, namespace_root
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.sglang.pages import HostPages, host_layout, page_hashes
from kvshare.sglang.settings import StorageSettings
from kvshare.tiers.host import HostSlab
from kvshare.types import Tier

PAGE, LAYERS, HEADS, DIM = 16, 2, 2, 8


def test_page_keys_hash_under_the_root_with_fixed_vectors() -> None:
    root = namespace_root("m", "fp")
    assert root.hex() == "1395afe107d66e9c5f1eba2f3384336f5697b9376fe091167c9a19416d7dd27d"
    assert keyed_block_hash(root, "abc").hex() == (
        "83577a60fa7ac96494ca20f8e7cdcfe0529bc2ce0d1062d7029cade9db948970")
    # the scheme, spelled out once: H(root || u32 len(key) || key)
    assert keyed_block_hash(root, "abc") == hashlib.sha256(
        bytes(root) + struct.pack("<I", 3) + b"abc").digest()
    other = namespace_root("m", "fp", "tp=1/2")
    assert page_hashes(root, ["abc"]) != page_hashes(other, ["abc"])  # ranks never share
    with pytest.raises(ValueError, match="non-empty string"):
        page_hashes(root, [""])


def buffer(tokens: int = 8 * PAGE) -> torch.Tensor:
    return torch.zeros(2, LAYERS, tokens, HEADS, DIM, dtype=torch.bfloat16)


def test_host_pages_store_and_load_through_the_sdk_byte_for_byte() -> None:
    src = buffer()
    src[:, :, PAGE : 4 * PAGE] = torch.randn(2, LAYERS, 3 * PAGE, HEADS, DIM).to(torch.bfloat16)
    layout = host_layout(src, PAGE, "layer_first")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
            layout.block_tokens) == (LAYERS, HEADS, DIM, "bf16", PAGE)
    pool = TieredBlockPool(PoolConfig("sgl", layout, (TierSpec(Tier.HOST, 16 * layout.bytes_per_block),)),
                           {Tier.HOST: HostSlab(layout.bytes_per_block, 16)})
    root = namespace_root("m", layout.fingerprint())
    client = LocalKVClient(pool, root, layout)
    hashes = page_hashes(root, ["k1", "k2", "k3"])
    ids = torch.arange(PAGE, 4 * PAGE)  # SGLang's host_indices: one per token
    stored = client.store([0] * 3 * PAGE, HostPages.from_indices(src, PAGE, ids),
                          hashes=hashes).result()
    assert stored.stored == 3 and stored.missed == ()
    dst = buffer()
    plan = client.lookup([0] * 3 * PAGE, hashes)
    got = client.load(plan, HostPages(dst, PAGE, [5 * PAGE, 2 * PAGE, 7 * PAGE]))
    assert got.loaded_blocks == 3
    assert torch.equal(dst[:, :, 5 * PAGE : 6 * PAGE], src[:, :, PAGE : 2 * PAGE])
    assert torch.equal(dst[:, :, 2 * PAGE : 3 * PAGE], src[:, :, 2 * PAGE : 3 * PAGE])
    assert torch.equal(dst[:, :, 7 * PAGE : 8 * PAGE], src[:, :, 3 * PAGE : 4 * PAGE])
    assert not dst[:, :, : 2 * PAGE].any()  # pages not listed are never touched
    client.close()


def test_batched_copies_equal_page_by_page_over_runs_gaps_and_reversals() -> None:
    """write_blocks/read_blocks copy one run of adjacent pages at a time: the same bytes, in
    the same pages, as write_block/read_block one page each, whatever the pages' order."""
    starts = [p * PAGE for p in (1, 2, 3, 7, 6, 0, 9, 10)]  # a run, a jump, a reversal, a run
    blocks = torch.randn(len(starts), LAYERS, 2, HEADS, PAGE, DIM).to(torch.bfloat16)
    batched, one_by_one = buffer(12 * PAGE), buffer(12 * PAGE)
    HostPages(batched, PAGE, starts).write_blocks(2, blocks[2:7])
    for i in range(2, 7):
        HostPages(one_by_one, PAGE, starts).write_block(i, blocks[i])
    assert torch.equal(batched, one_by_one) and batched.any()
    assert not batched[:, :, 1 * PAGE : 3 * PAGE].any()  # blocks 0-1 were not written
    out = torch.zeros(5, LAYERS, 2, HEADS, PAGE, DIM, dtype=torch.bfloat16)
    HostPages(batched, PAGE, starts).read_blocks(2, out)
    assert torch.equal(out, blocks[2:7])


def test_host_pages_refuse_what_is_not_a_page_naming_it() -> None:
    with pytest.raises(ValueError, match="not a page"):
        HostPages(buffer(), PAGE, [3])
    with pytest.raises(ValueError, match="not whole 16-token pages"):
        HostPages.from_indices(buffer(), PAGE, list(range(20)))
    with pytest.raises(ValueError, match="--hicache-mem-layout layer_first"):
        host_layout(buffer(), PAGE, "page_first")


@pytest.mark.parametrize("extra, match", [
    ({}, "needs 'namespace'"),
    ({"namespace": "n", "namspace": "x"}, r"unknown kvshare keys \['namspace'\]"),
    ({"namespace": "n", "remote": "pigeon"}, "remote must be one of"),
    ({"namespace": "n", "load_deadline_s": 0}, "load_deadline_s must be a positive number"),
])
def test_bad_settings_are_refused_naming_the_fix(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StorageSettings.from_extra(extra)


def test_sglangs_own_keys_pass_and_ours_are_read() -> None:
    s = StorageSettings.from_extra({"backend_name": "kvshare", "module_path": "m",
                                    "class_name": "C", "interface_v1": 1, "namespace": "n",
                                    "remote": "nixl"})
    assert (s.namespace, s.remote, s.ray_namespace) == ("n", "nixl", "kvshare")
