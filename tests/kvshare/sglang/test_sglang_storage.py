"""kvshare as SGLang HiCache's storage tier, against SGLang's own ``HiCacheStorage`` contract.

SGLang's real CPU pools (``MHATokenToKVPool`` and ``MHATokenToKVPoolHost`` on ``device="cpu"``,
``pin_memory=False``, as upstream's aibrix unit test builds them) and a real kvshare
deployment (head + 2 Ray nodes). SGLang needs its own environment (it pins torch 2.14.1):
``make sglang-install`` builds ``.venv-sglang`` and ``make test-sglang`` runs this folder
there; in the project's main environment this module skips, saying so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang lives in its own environment (torch 2.14.1): make sglang-install, then "
           "make test-sglang runs this folder there")

import torch  # noqa: E402
from conftest import start_cluster, stop_cluster  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from kvshare.layout import KVLayout  # noqa: E402
from kvshare.sglang.backend import KVShareStorage  # noqa: E402
from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 16, 2, 2, 64
NS = "sgl"
SPEC = TinyModelSpec(num_layers=LAYERS, hidden_size=HEADS * 2 * DIM, num_heads=HEADS * 2,
                     num_kv_heads=HEADS, intermediate_size=256)


def host_pool(page: int = PAGE) -> Any:
    """SGLang's CPU device pool and its host pool (layer_first, not pinned)."""
    kv = MHATokenToKVPool(512, page, torch.bfloat16, HEADS, DIM, LAYERS, "cpu", False,
                          v_head_dim=DIM, start_layer=0, end_layer=LAYERS - 1)
    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2, 0, page, "layer_first", pin_memory=False,
        device="cpu", device_capacity_tokens=kv.size, start_layer=kv.start_layer,
        end_layer=kv.end_layer, write_back_staging=kv.hicache_write_back_staging)


def storage(model: str, **extra: Any) -> KVShareStorage:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model, extra_config={"backend_name": "kvshare", "interface_v1": 1,
                                        "namespace": NS, "ray_namespace": "kvshare-test",
                                        **extra})
    return KVShareStorage(config)


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray

    from kvshare.actors.deploy import deploy

    model = build_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny"), SPEC)
    cluster = start_cluster(num_workers=2, object_store_mb=150)
    try:
        deploy(namespace=NS, layout=KVLayout(LAYERS, HEADS, DIM, "bf16", block_tokens=PAGE),
               host_gb=0.05, ray_namespace="kvshare-test")
        nodes = {k: n["NodeID"] for n in ray.nodes() for k in n["Resources"]
                 if k.startswith("node_")}
        env: dict[str, Any] = {"model": model, "nodes": nodes, "backends": []}
        yield env
        for backend in env["backends"]:  # their threads must not call Ray after it stops
            if backend.client is not None:
                try:
                    backend.client.close()
                except Exception:  # noqa: BLE001 - the last test killed the index
                    pass
    finally:
        stop_cluster(cluster)


def attached(env: dict[str, Any], node: str) -> tuple[KVShareStorage, Any]:
    pool = host_pool()
    backend = storage(env["model"], node=env["nodes"][node])
    backend.register_mem_pool_host(pool)
    env["backends"].append(backend)
    return backend, pool


def test_v1_pages_round_trip_byte_for_byte_and_another_node_loads_them(
        env: dict[str, Any]) -> None:
    a, pool_a = attached(env, "node_0")
    keys = [f"{os.getpid():x}-v1-{i}" for i in range(4)]
    src = indices([1, 2, 3, 4])
    pool_a.kv_buffer[:, :, src] = torch.randn(2, LAYERS, len(src), HEADS, DIM).to(torch.bfloat16)
    want = pool_a.kv_buffer[:, :, src].clone()
    assert a.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, src) == [True] * 4
    assert a.batch_exists(keys) == 4 and a.batch_exists(keys[:2] + ["other"]) == 2
    dst = indices([7, 8, 9, 10])
    assert a.batch_get_v1(keys, dst) == [True] * 4
    assert torch.equal(pool_a.kv_buffer[:, :, dst], want)
    b, pool_b = attached(env, "node_1")  # another node: its pool holds none of them
    assert b.batch_exists(keys) == 4
    assert b.batch_get_v1(keys, indices([5, 6, 7, 8])) == [True] * 4
    assert torch.equal(pool_b.kv_buffer[:, :, indices([5, 6, 7, 8])], want)
    assert b.counters["pages_loaded"] == 4 and b.client is not None
    wire = b.client.counters
    assert wire.get("bytes_nixl", 0) + wire.get("bytes_objstore", 0) > 0  # not from its own pool


def test_legacy_flat_pages_and_a_miss(env: dict[str, Any]) -> None:
    a, pool = attached(env, "node_0")
    page = torch.randn(2, LAYERS, PAGE, HEADS, DIM).to(torch.bfloat16).flatten()
    key = f"{os.getpid():x}-legacy"
    assert not a.exists(key)
    assert a.set(key, page) and a.exists(key)
    out = pool.get_dummy_flat_data_page()
    assert a.get(key, out) is out and torch.equal(out, page)
    assert a.get("never-stored", pool.get_dummy_flat_data_page()) is None
    assert a.batch_get_v1(["never-stored"], indices([3])) == [False]


def test_a_corrupt_block_is_a_miss_counted_and_the_page_never_lands(env: dict[str, Any]) -> None:
    """Bit rot in the holder's slab: the checksum fails, the page is a miss (SGLang recomputes
    it, never using the slot it was to fill) and the cause is counted."""
    import ray

    from kvshare.discovery import find_pool

    a, pool_a = attached(env, "node_0")
    keys = [f"{os.getpid():x}-rot-{i}" for i in range(2)]
    src = indices([1, 2])
    pool_a.kv_buffer[:, :, src] = torch.randn(2, LAYERS, len(src), HEADS, DIM).to(torch.bfloat16)
    assert a.batch_set_v1(keys, src) == [True, True]
    stats = ray.get(find_pool(env["nodes"]["node_0"], "kvshare-test").stats.remote(), timeout=30)
    per = KVLayout(LAYERS, HEADS, DIM, "bf16", block_tokens=PAGE).bytes_per_block
    with open(os.path.join("/dev/shm", stats["namespaces"][NS]["shm_name"]), "r+b") as f:
        data = bytearray(f.read())  # every used slot of node_0's host slab
        for slot in range(len(data) // per):
            data[slot * per + 64] ^= 0xFF
        f.seek(0)
        f.write(data)
    b, _ = attached(env, "node_1")
    assert b.batch_get_v1(keys, indices([5, 6])) == [False, False]
    assert b.counters["pages_missed"] == 2 and b.client is not None
    assert b.client.counters.get("miss_corrupt", 0) >= 1


def test_the_exists_plan_serves_the_get_and_a_stale_one_is_a_miss(env: dict[str, Any]) -> None:
    """SGLang asks batch_exists, then batch_get_v1 for those pages (or a leading part): the
    get loads by the exists' plan, no second index query. If the blocks went in between, the
    pages are misses and the host pool is left as it was."""
    from kvshare.actors.admin import clear

    a, pool_a = attached(env, "node_0")
    keys = [f"{os.getpid():x}-plan-{i}" for i in range(3)]
    src = indices([1, 2, 3])
    pool_a.kv_buffer[:, :, src] = torch.randn(2, LAYERS, len(src), HEADS, DIM).to(torch.bfloat16)
    assert a.batch_set_v1(keys, src) == [True] * 3
    b, pool_b = attached(env, "node_1")
    assert b.batch_exists(keys) == 3
    assert b.batch_get_v1(keys[:2], indices([5, 6])) == [True, True]
    assert b.counters["plans_reused"] == 1
    assert torch.equal(pool_b.kv_buffer[:, :, indices([5, 6])], pool_a.kv_buffer[:, :, indices([1, 2])])
    assert b.batch_exists(keys) == 3
    assert clear(NS, ray_namespace="kvshare-test") >= 3  # gone before the get
    before = pool_b.kv_buffer[:, :, indices([8, 9, 10])].clone()
    assert b.batch_get_v1(keys, indices([8, 9, 10])) == [False] * 3
    assert b.counters["plans_reused"] == 2 and b.counters["pages_missed"] == 3
    assert torch.equal(pool_b.kv_buffer[:, :, indices([8, 9, 10])], before)


def test_a_dead_pool_is_a_miss_counted_never_an_error(env: dict[str, Any]) -> None:
    import ray

    from kvshare.discovery import find_pool

    a, pool = attached(env, "node_0")
    keys = [f"{os.getpid():x}-dead-{i}" for i in range(2)]
    assert a.batch_set_v1(keys, indices([1, 2])) == [True, True]
    b, _ = attached(env, "node_1")
    ray.kill(find_pool(env["nodes"]["node_0"], "kvshare-test"))
    got = b.batch_get_v1(keys, indices([3, 4]))
    assert got == [False, False]
    assert b.counters["pages_missed"] == 2


@pytest.mark.parametrize("extra, match", [
    ({"namespace": ""}, "needs 'namespace'"),
    ({"namspace": "x"}, r"unknown kvshare keys \['namspace'\]"),
    ({"remote": "carrier-pigeon"}, "remote must be one of"),
])
def test_bad_settings_fail_sglangs_start_naming_the_fix(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        storage("/nonexistent", **extra)


def test_an_unknown_namespace_or_another_page_size_fails_the_attach(env: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="unknown kvshare namespace 'nope'.*kvshare up"):
        storage(env["model"], namespace="nope").register_mem_pool_host(host_pool())
    with pytest.raises(ValueError, match="block-tokens 32"):
        storage(env["model"]).register_mem_pool_host(host_pool(page=32))


def test_no_ray_address_outside_ray_fails_the_attach_naming_the_setting(
        env: dict[str, Any]) -> None:
    """A server process outside Ray with no ``ray_address`` (and no ``$RAY_ADDRESS``) stops at
    the attach, naming the key to set (in a process of its own: this one is inside Ray)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve()
    code = ("from test_sglang_storage import host_pool, storage\n"
            "try:\n"
            f"    storage({env['model']!r}).register_mem_pool_host(host_pool())\n"
            "except ValueError as e:\n    print(e)\n")
    run_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run_env["PYTHONPATH"] = os.pathsep.join(map(str, (here.parent, here.parents[2],
                                                      here.parents[3])))
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True,
                         text=True, timeout=180)
    assert 'set "ray_address" in --hicache-storage-backend-extra-config' in out.stdout, \
        out.stdout + out.stderr


def test_the_index_down_makes_every_page_a_counted_miss(env: dict[str, Any]) -> None:
    """Last in this module: the index actor is killed. Lookups and loads become misses
    (SGLang recomputes), counted by cause, never an error."""
    import ray

    from kvshare.discovery import index_name

    a, _ = attached(env, "node_0")
    keys = [f"{os.getpid():x}-down-{i}" for i in range(2)]
    assert a.batch_set_v1(keys, indices([1, 2])) == [True, True]
    assert a.batch_exists(keys) == 2
    ray.kill(ray.get_actor(index_name(0), namespace="kvshare-test"), no_restart=True)
    deadline = time.monotonic() + 15  # ray.kill returns before the actor is gone
    while (found := a.batch_exists(keys)) != 0:
        assert time.monotonic() < deadline, f"the index is down but {found} pages were found"
        time.sleep(0.2)
    assert a.batch_get_v1(keys, indices([3, 4])) == [False, False]
    assert a.client is not None and a.client.counters["index_unavailable"] >= 2, \
        a.client.counters
