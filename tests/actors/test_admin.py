"""Admin operations on a real Ray cluster (head + 2 nodes, deployed pools and index):
pin/unpin/ttl against real eviction, prefetch between nodes' pools, bad input, and the
gateway's ``/v1/kvshare/*`` endpoints over real HTTP."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from http_helpers import Served

from kvshare.layout import KVLayout

pytestmark = pytest.mark.cluster

RAY_NS = "kvs-test-admin"
PIN = "adm-pin"  # 16 host slots, no disk: an evicted block is dropped
FETCH = "adm-fetch"  # 64 host slots
LAYOUT = KVLayout(2, 2, 16, "fp32", 32)
B = LAYOUT.bytes_per_block


def bhash(tag: str, i: int) -> bytes:
    return hashlib.sha256(f"{tag}/{i}".encode()).digest()


def chain(tag: str, n: int) -> list[bytes]:
    return [bhash(tag, i) for i in range(n)]


def payload(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 255, B, dtype=np.uint8)


def write(pool: Any, ns: str, hashes: list[bytes]) -> list[str]:
    import ray

    from kvshare.tiers.base import block_checksum

    data = np.stack([payload(h) for h in hashes])
    sums = [block_checksum(d) for d in data]
    return list(ray.get(pool.transfer_write_blocks.remote(ns, hashes, data, sums)))


def held(pool: Any, ns: str, hashes: list[bytes]) -> list[bool]:
    import ray

    return list(ray.get(pool.contains.remote(ns, hashes)))


def wait_for(cond: Any, timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def leases(pool: Any, ns: str) -> int:
    import ray

    return int(ray.get(pool.stats.remote())["namespaces"][ns]["active_leases"])


@pytest.fixture(scope="module")
def kv(ray_cluster: Any) -> Iterator[dict[str, Any]]:
    import ray

    from kvshare.actors.config import NamespaceSpec
    from kvshare.actors.deploy import deploy, get_pool, shutdown

    deploy(namespaces=[NamespaceSpec(PIN, LAYOUT, 16 * B), NamespaceSpec(FETCH, LAYOUT, 64 * B)],
           ray_namespace=RAY_NS)
    nodes = {key: n["NodeID"] for n in ray.nodes() for key in ("node_0", "node_1")
             if n["Alive"] and key in n["Resources"]}
    env = {"a": nodes["node_0"], "b": nodes["node_1"],
           "pa": get_pool(nodes["node_0"], RAY_NS), "pb": get_pool(nodes["node_1"], RAY_NS)}
    try:
        yield env
    finally:
        shutdown(RAY_NS)


def test_pin_survives_eviction_unpin_and_ttl_let_it_go(kv: dict[str, Any]) -> None:
    from kvshare.actors import admin

    pa, a = kv["pa"], kv["a"]
    keep, other = chain("keep", 4), chain("other", 4)
    assert write(pa, PIN, keep + other) == [""] * 8  # stored
    assert wait_for(lambda: admin.lookup(PIN, keep, ray_namespace=RAY_NS).get(a, {})
                    .get("prefix_blocks") == 4)
    pinned = admin.pin_prefix(PIN, keep, 60.0, "keep", ray_namespace=RAY_NS)
    assert pinned[a] == 4 and pinned[kv["b"]] == 0 and len(pinned) == 3  # head, a, b
    # re-pinning the same name replaces the pin: still 4 leases, not 8
    assert admin.pin_prefix(PIN, keep, 60.0, "keep", ray_namespace=RAY_NS)[a] == 4
    assert leases(pa, PIN) == 4
    write(pa, PIN, chain("fill1", 40))  # 2.5x the host tier
    assert held(pa, PIN, keep) == [True] * 4  # pinned: survived
    assert held(pa, PIN, other) == [False] * 4  # the same age, unpinned: dropped
    assert wait_for(lambda: a not in admin.lookup(PIN, other, ray_namespace=RAY_NS))
    assert admin.lookup(PIN, keep, ray_namespace=RAY_NS)[a] == {"prefix_blocks": 4,
                                                                "tiers": {"host": 4}}
    assert admin.unpin_prefix(PIN, "keep", ray_namespace=RAY_NS) == 4
    assert leases(pa, PIN) == 0
    write(pa, PIN, chain("fill2", 40))
    assert held(pa, PIN, keep) == [False] * 4  # unpinned: evicted like any other block

    # a pin ends at its ttl by itself
    assert write(pa, PIN, keep) == [""] * 4  # stored
    assert admin.pin_prefix(PIN, keep, 1.0, "short", [a], ray_namespace=RAY_NS) == {a: 4}
    write(pa, PIN, chain("fill3", 40))
    assert held(pa, PIN, keep) == [True] * 4  # within its ttl
    assert wait_for(lambda: leases(pa, PIN) == 0, 5.0)  # the pool's background round expired it
    write(pa, PIN, chain("fill4", 40))
    assert held(pa, PIN, keep) == [False] * 4
    assert admin.unpin_prefix(PIN, "short", ray_namespace=RAY_NS) == 0


def test_admin_holders_are_never_judged_dead() -> None:
    from kvshare.actors.liveness import ray_holder_alive

    assert ray_holder_alive("admin:keep") is None
    assert ray_holder_alive("admin:" + "a" * 26) is None  # 32 characters, not an actor id


def test_prefetch_copies_the_prefix_to_a_node_that_lacks_it(kv: dict[str, Any]) -> None:
    import ray

    from kvshare.actors import admin

    a, b = kv["a"], kv["b"]
    hs = chain("fetch", 6)
    assert write(kv["pa"], FETCH, hs) == [""] * 6  # stored
    assert wait_for(lambda: admin.lookup(FETCH, hs, ray_namespace=RAY_NS).get(a, {})
                    .get("prefix_blocks") == 6)
    assert b not in admin.lookup(FETCH, hs, ray_namespace=RAY_NS)
    got = admin.prefetch(FETCH, hs, b, ray_namespace=RAY_NS)
    assert (got["present"], got["fetched"], got["missing"]) == (0, 6, 0), got
    assert got["node"] == b and sum(got["served_by"].values()) == 6
    assert all(s.startswith(f"node:{a}/") for s in got["served_by"])
    assert held(kv["pb"], FETCH, hs) == [True] * 6
    assert wait_for(lambda: admin.lookup(FETCH, hs, ray_namespace=RAY_NS).get(b, {})
                    .get("prefix_blocks") == 6)
    got = ray.get(kv["pb"].transfer_read_blocks.remote(FETCH, hs))
    assert got.reasons == ("",) * 6
    assert all(np.array_equal(got.data[got.rows[i]], payload(h)) for i, h in enumerate(hs))
    # again: nothing to move; a longer prefix that nobody holds past block 6: misses
    again = admin.prefetch(FETCH, hs + chain("nowhere", 2), b, ray_namespace=RAY_NS)
    assert (again["present"], again["fetched"], again["missing"]) == (6, 0, 2), again
    assert again["reasons"] == {"missing": 2}
    assert held(kv["pb"], FETCH, chain("nowhere", 2)) == [False, False]


def test_prefetch_from_a_dead_source_reports_misses_and_stores_nothing(kv: dict[str, Any]) -> None:
    """The index still lists a node whose pool is gone (its death not yet noticed): every
    block is a miss, the target stores nothing."""
    from kvshare.actors import admin
    from kvshare.actors.deploy import get_index_client
    from kvshare.events import BlockStored, events_to_arrow
    from kvshare.types import Tier, node_location

    ghost = "f" * 56  # a node id no pool has
    loc = node_location(ghost)
    client = get_index_client(RAY_NS)
    gen = client.new_generation(loc)
    hs = chain("ghost", 3)
    client.publish(events_to_arrow(
        [BlockStored(FETCH, loc, Tier.HOST, h, gen, i + 1) for i, h in enumerate(hs)], 32))
    assert admin.lookup(FETCH, hs, ray_namespace=RAY_NS)[ghost]["prefix_blocks"] == 3
    got = admin.prefetch(FETCH, hs, kv["b"], deadline_s=3.0, ray_namespace=RAY_NS)
    assert (got["present"], got["fetched"], got["missing"]) == (0, 0, 3), got
    assert got["reasons"] == {"source_dead": 3}
    assert held(kv["pb"], FETCH, hs) == [False] * 3
    client.drop_location(loc)


def test_bad_input_is_a_value_error_and_changes_nothing(kv: dict[str, Any]) -> None:
    from kvshare.actors import admin

    pa, a = kv["pa"], kv["a"]
    hs = chain("bad", 2)
    write(pa, PIN, hs)
    before = leases(pa, PIN)
    cases: list[tuple[Any, str]] = [
        (lambda: admin.pin_prefix("nope", hs, 5, "x", ray_namespace=RAY_NS), "unknown namespace"),
        (lambda: admin.pin_prefix(PIN, hs, 0, "x", ray_namespace=RAY_NS), "ttl_s"),
        (lambda: admin.pin_prefix(PIN, hs, -1, "x", ray_namespace=RAY_NS), "ttl_s"),
        (lambda: admin.pin_prefix(PIN, [h[:8] for h in hs], 5, "x", ray_namespace=RAY_NS),
         "32 bytes"),
        (lambda: admin.pin_prefix(PIN, [h.hex() for h in hs], 5, "x", ray_namespace=RAY_NS),
         "32 bytes"),
        (lambda: admin.pin_prefix(PIN, hs, 5, "", ray_namespace=RAY_NS), "name"),
        (lambda: admin.pin_prefix(PIN, hs, 5, "x", ["no-such-node"], ray_namespace=RAY_NS),
         "known nodes"),
        (lambda: admin.prefetch(PIN, hs, "no-such-node", ray_namespace=RAY_NS), "known nodes"),
        (lambda: admin.prefetch(PIN, hs, a, deadline_s=0, ray_namespace=RAY_NS), "deadline_s"),
        (lambda: admin.lookup(PIN, b"".join(hs), ray_namespace=RAY_NS), "list of block hashes"),
        (lambda: admin.clear("nope", ray_namespace=RAY_NS), "unknown namespace"),
        (lambda: admin.unpin_prefix(PIN, "x", ["no-such-node"], ray_namespace=RAY_NS),
         "known nodes"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()
    assert leases(pa, PIN) == before
    assert held(pa, PIN, hs) == [True, True]
    # clear drops the namespace's unpinned blocks on the chosen node only
    assert admin.clear(PIN, [a], ray_namespace=RAY_NS) >= 2
    assert held(pa, PIN, hs) == [False, False]


def test_gateway_pins_and_prefetches_by_prompt_text(kv: dict[str, Any]) -> None:
    import json

    from kvshare.actors.admin import ClusterAdmin
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig, Tenant
    from kvshare.router.core.workers_view import StaticWorkers
    from kvshare.router.gateway.api_keys import parse_api_keys
    from kvshare.router.gateway.app import create_app

    a, b = kv["a"], kv["b"]
    router = CacheAwareRouter(None, StaticWorkers([]), RouterConfig(
        namespace=FETCH, model_id="m", block_tokens=LAYOUT.block_tokens))
    keys = {"k-acme": {"tenant": "acme", "salt": "s1", "admin": True},
            "k-other": {"tenant": "other", "admin": True}, "k-user": {"tenant": "acme", "salt": "s1"}}
    prompt = "You are a helpful assistant for kvshare admins. " * 4  # 196 bytes: 6 blocks
    hs = router.hashes(router.tokenize(prompt), Tenant("acme", "s1"))
    assert len(hs) == 6
    assert write(kv["pa"], FETCH, hs) == [""] * 6  # stored
    gw = Served(create_app(router, parse_api_keys(keys), admin=ClusterAdmin(RAY_NS)))
    bare = Served(create_app(router, parse_api_keys(keys)))  # static-workers mode: no cluster
    try:
        def post(op: str, key: str = "k-acme", url: str = gw.url, **body: Any) -> httpx.Response:
            return httpx.post(f"{url}/v1/kvshare/{op}", content=json.dumps(body), timeout=60,
                              headers={"Authorization": f"Bearer {key}",
                                       "content-type": "application/json"})  # NaN too

        assert wait_for(lambda: post("lookup", prompt=prompt).json()["nodes"]
                        .get(a, {}).get("prefix_blocks") == 6)
        r = post("pin", prompt=prompt, ttl_s=30, name="sys")
        assert r.status_code == 200, r.text
        assert r.json()["pinned"][a] == 6 and r.json()["num_blocks"] == 6
        # another tenant's salt gives other hashes: nothing of acme's is pinned for it
        assert post("pin", key="k-other", prompt=prompt, ttl_s=30, name="sys").json()["pinned"][a] == 0
        r = post("prefetch", prompt=prompt, node=b)
        assert r.status_code == 200, r.text
        assert (r.json()["fetched"], r.json()["missing"]) == (6, 0), r.json()
        assert held(kv["pb"], FETCH, hs) == [True] * 6
        assert post("unpin", name="sys").json()["released"] == 6
        cli = kvshare_cli("lookup", "--gateway", gw.url, "--api-key", "k-acme", "--prompt",
                          prompt, "--json")
        assert cli.returncode == 0, cli.stderr
        nodes = json.loads(cli.stdout.strip().splitlines()[-1])["nodes"]
        assert nodes[a]["prefix_blocks"] == 6 and nodes[b]["prefix_blocks"] == 6
        assert leases(kv["pa"], FETCH) == 0
        # bad input: OpenAI-style 4xx
        for op, body, code, words in [
            ("pin", {"prompt": prompt, "ttl_s": 30}, 400, "'name'"),
            ("pin", {"prompt": prompt, "ttl_s": 0, "name": "x"}, 400, "ttl_s"),
            ("prefetch", {"prompt": prompt}, 400, "'node'"),
            ("prefetch", {"prompt": prompt, "node": "no-such-node"}, 400, "known nodes"),
            ("lookup", {}, 400, "'prompt' or 'messages'"),
            ("lookup", {"prompt": "tiny"}, 400, "fewer than one block"),
            ("evict", {"prompt": prompt}, 404, "unknown admin operation"),
            # bounded numbers, checked before anything is pinned
            ("pin", {"prompt": prompt, "ttl_s": float("inf"), "name": "x"}, 400, "Infinity"),
            ("pin", {"prompt": prompt, "ttl_s": 1e308, "name": "x"}, 400, "limit"),
            ("pin", {"prompt": prompt, "ttl_s": "30", "name": "x"}, 400, "ttl_s"),
            ("prefetch", {"prompt": prompt, "node": b, "deadline_s": float("nan")}, 400, "NaN"),
        ]:
            r = post(op, **body)
            assert r.status_code == code and words in r.json()["error"]["message"], (op, r.text)
        deep = '{"prompt": ' + "[" * 1000 + "]" * 1000 + ', "ttl_s": 30, "name": "x"}'
        r = httpx.post(f"{gw.url}/v1/kvshare/pin", content=deep, timeout=60,
                       headers={"Authorization": "Bearer k-acme"})
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text
        assert leases(kv["pa"], FETCH) == 0  # no rejected pin pinned anything
        assert post("pin", key="wrong", prompt=prompt, ttl_s=3, name="x").status_code == 401
        for op in ("pin", "unpin", "prefetch"):  # a tenant's plain key may look, not change
            r = post(op, key="k-user", prompt=prompt, ttl_s=3, name="x", node=b)
            assert r.status_code == 403 and r.json()["error"]["code"] == "not_admin", r.text
        assert post("lookup", key="k-user", prompt=prompt).status_code == 200
        r = post("pin", url=bare.url, prompt=prompt, ttl_s=3, name="x")
        assert r.status_code == 501 and r.json()["error"]["code"] == "no_cluster"
    finally:
        gw.stop()
        bare.stop()


def kvshare_cli(*args: str) -> Any:
    import os
    import subprocess
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "kvshare")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def test_cli_pins_from_a_hashes_file_and_unpins(kv: dict[str, Any], ray_cluster: Any,
                                                tmp_path: Any) -> None:
    import json

    hs = chain("cli", 3)
    assert write(kv["pa"], PIN, hs) == [""] * 3  # stored
    path = tmp_path / "prefix.txt"
    path.write_text("# system prompt\n" + "\n".join(h.hex() for h in hs) + "\n")
    addr = ["--address", ray_cluster.address, "--ray-namespace", RAY_NS, "--namespace", PIN]
    pin = kvshare_cli("pin", *addr, "--hashes-file", str(path), "--ttl", "30", "--name", "cli",
                      "--node", kv["a"][:12], "--json")
    assert pin.returncode == 0, pin.stderr
    assert json.loads(pin.stdout.strip().splitlines()[-1]) == {"pinned": {kv["a"]: 3}}
    assert leases(kv["pa"], PIN) == 3
    unpin = kvshare_cli("unpin", *addr, "--name", "cli")
    assert unpin.returncode == 0 and "released: 3" in unpin.stdout, unpin.stderr
    assert leases(kv["pa"], PIN) == 0
    path.write_text("zz-not-hex\n")
    bad = kvshare_cli("lookup", *addr, "--hashes-file", str(path))
    assert bad.returncode == 2 and "not a hex block hash" in bad.stderr, bad.stderr
