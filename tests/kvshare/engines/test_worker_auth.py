"""Workers trust no one: a real reference worker (small transformers model, host-slab pool)
behind a real gateway, over real HTTP. The worker serves only callers with the cluster's token,
tenants' salts cannot be guessed from their names, and a forged salt or an unauthenticated
caller learns nothing about another tenant's prompts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from engine_helpers import BLOCK, SMALL, small_engine
from http_helpers import serve_app

from kvshare.auth import WorkerAuth, tenant_salt
from kvshare.client.local import LocalKVClient
from kvshare.engines.hf import EngineConfig, model_keys
from kvshare.engines.server import WorkerServer
from kvshare.engines.worker import ReferenceWorker
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
from kvshare.router.core.workers_view import StaticWorkers
from kvshare.router.gateway.api_keys import parse_api_keys
from kvshare.router.gateway.app import create_app
from kvshare.tiers.host import HostSlab
from kvshare.types import NodeId, Tier, WorkerId
from kvshare.workers import WorkerInfo

NS = "auth-test"
NEW, OLD = "tok-new-0123456789abcdef", "tok-old-0123456789abcdef"
SECRET = b"test-cluster-secret-0123456789"
KEYS = {"ka": {"tenant": "A"}, "kb": {"tenant": "B"}, "kc": {"tenant": "C"}}
PROMPT = "B's confidential system prompt, long enough for a few blocks. " * 3


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    engine = small_engine()
    layout = engine.layout
    pool = TieredBlockPool(PoolConfig(NS, layout, (TierSpec(Tier.HOST, 64 * layout.bytes_per_block),)),
                           {Tier.HOST: HostSlab(layout.bytes_per_block, 64)})
    worker = ReferenceWorker(engine, LocalKVClient(pool, engine.root))
    info = WorkerInfo(WorkerId("w0"), NodeId("n0"), (NS,), layout_fingerprint=layout.fingerprint())
    server = WorkerServer(worker, info, model_name=NS, auth=WorkerAuth((NEW, OLD)))
    server.start()
    keys = model_keys(EngineConfig(overrides=dict(SMALL), seed=0, block_tokens=BLOCK))
    router = CacheAwareRouter(None, StaticWorkers([server.info]),
                              RouterConfig.from_model_keys(keys, namespace=NS), keys.tokenizer)
    gateway = serve_app(create_app(router, parse_api_keys(KEYS, SECRET),
                                   worker_auth=WorkerAuth((NEW,))))
    try:
        yield {"gw": gateway.url, "worker": server.endpoint, "router": router, "w": worker,
               "server": server}
    finally:
        gateway.stop()
        server.stop()


def via_gateway(env: dict[str, Any], key: str, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{env['gw']}/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": NS, "prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    return dict(r.json()["kvshare"])


def test_salts_are_secret_and_not_the_tenant_name() -> None:
    keys = parse_api_keys(KEYS, SECRET)
    assert keys["kb"].salt == tenant_salt(SECRET, "B") and keys["kb"].salt != "B"
    assert parse_api_keys(KEYS, b"another-secret-0123456789")["kb"].salt != keys["kb"].salt
    assert parse_api_keys({"k": {"tenant": "B", "salt": "chosen"}}, SECRET)["k"].salt == "chosen"


def test_an_unauthenticated_or_forged_caller_gets_nothing(env: dict[str, Any]) -> None:
    via_gateway(env, "kb")
    assert via_gateway(env, "kb")["reused_tokens"] > 0  # B's prompt is cached now
    router = env["router"]
    ids = router.tokenize(PROMPT)
    b_salt = parse_api_keys(KEYS, SECRET)["kb"].salt
    routed = {"token_ids": ids, "namespace": NS, "cache_salt": b_salt}  # even the right salt
    before = env["w"].counters.snapshot()
    url = f"{env['worker']}/v1/completions"
    for headers in ({}, {"Authorization": "Bearer guess-0123456789abcdef"},
                    {"Authorization": NEW}):  # no token, a wrong one, a malformed header
        r = httpx.post(url, headers=headers, timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 2, "kvshare": routed})
        assert r.status_code == 401 and "kvshare" not in r.json(), r.text
        assert httpx.get(f"{env['worker']}/v1/kvshare/stats", headers=headers,
                         timeout=30).status_code == 401
    assert env["w"].counters.snapshot() == before, "a refused request reached the engine"
    # the old token still works during a rotation; a guessed salt reuses nothing of B's
    r = httpx.post(url, headers={"Authorization": f"Bearer {OLD}"}, timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 2, "cache_salt": "B"})
    assert r.status_code == 200 and r.json()["kvshare"]["reused_tokens"] == 0, r.text
    # through the gateway, a tenant naming B's salt (or B's name) reuses nothing of B's
    for key, forged in (("ka", "B"), ("kc", b_salt)):  # each tenant's first request
        assert via_gateway(env, key, cache_salt=forged)["reused_tokens"] == 0


def test_a_standalone_worker_runs_no_idle_loop(env: dict[str, Any]) -> None:
    """Without an index there is nothing to report: the reporter thread ends at once (it used
    to spin on ``wait(0)`` and burn a core while the worker was idle)."""
    import time

    server = env["server"]
    deadline = time.monotonic() + 10
    while server.reporter.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.reporter.running
