"""kvshare inside Ray Serve: the request router, the reference worker deployment, the ingress.

One real local cluster (head + 2 nodes), kvshare deployed on it, and two Serve applications
built by ``router/serve_app.build_app`` with identical worker deployments (2 replicas, one
per node, each reusing only its own node's cache): ``kv`` with kvshare's request router and
``df`` with Serve's default power-of-two router. Each app has its own kvshare namespace, so
neither sees the other's blocks.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from paths import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ is not a package on the installed path

from kvshare.engines.hf import default_model_config  # noqa: E402
from kvshare.layout import KVLayout  # noqa: E402
from kvshare.router.serve.request import ServeRouterSettings, extract_prompt, replica_worker_id  # noqa: E402

# A small model so the whole file stays near two minutes on two shared cores.
OVERRIDES = {"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
ENGINE = {"overrides": OVERRIDES, "block_tokens": 64, "threads": 1}
LAYOUT = KVLayout.from_hf_config({**default_model_config(), **OVERRIDES}, dtype="fp32",
                                 block_tokens=64)
B = 64


# ---------------------------------------------------------------------- no cluster needed
def test_prompt_extraction_prefers_routed_fields_then_messages_then_prompt() -> None:
    h = "ab" * 32
    routed = {"prompt": "ignored", "kvshare": {"token_ids": [1, 2, 3], "hashes_hex": [h],
                                               "namespace": "ns"}}
    p = extract_prompt([routed], {})
    assert p is not None and p.namespace == "ns" and p.tokens == (1, 2, 3)
    assert p.hashes is not None and p.hashes[0] == bytes.fromhex(h)
    p = extract_prompt([], {"body": {"messages": [{"role": "user", "content": "hi"}]}})
    assert p is not None and p.messages is not None and p.messages[0]["content"] == "hi"
    p = extract_prompt([{"prompt": ["one prompt"]}], {})
    assert p is not None and p.text == "one prompt"
    assert extract_prompt([{"other": 1}, 42], {}) is None


def test_replica_worker_id_is_a_valid_index_worker_id() -> None:
    from ray.serve._private.common import DeploymentID, ReplicaID

    rid = ReplicaID(unique_id="abc123", deployment_id=DeploymentID(name="W", app_name="a:b"))
    assert replica_worker_id(rid) == "serve.a_b#W#abc123"  # the index refuses ':' in ids


def test_router_settings_reject_unknown_kwargs_and_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown request_router_kwargs"):
        ServeRouterSettings.from_kwargs({"index_timeout": 1})
    with pytest.raises(ValueError, match="positive"):
        ServeRouterSettings.from_kwargs({"index_timeout_s": 0})
    with pytest.raises(ValueError):
        ServeRouterSettings.from_kwargs({"sharing": "everywhere"})
    assert ServeRouterSettings.from_kwargs({"policy": "cost"}).policy == "cost"
    with pytest.raises(ValueError, match="replica_poll_s"):
        ServeRouterSettings.from_kwargs({"loads_refresh_s": -1})


# ---------------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def apps(ray_cluster: Any) -> Iterator[dict[str, str]]:
    from ray import serve
    from ray.serve.api import RunTarget

    from kvshare.actors.deploy import deploy, shutdown
    from kvshare.engines.server import free_port
    from kvshare.router.serve.app import build_app

    deploy(namespaces={"serve-kv": LAYOUT, "serve-df": LAYOUT}, host_gb=0.125)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    common = {"engine": ENGINE, "sharing": "local", "replica_cpus": 0.5, "num_replicas": 2}
    # This machine runs everyone's tests on 2 cores (load average 15-40): a generous deadline.
    slow_ok = {"index_timeout_s": 2.0, "log_decisions": True}
    # the kvshare app routes on its own copy of the index, load reports read in the background
    # (the per-request index path: test_vllm_cluster's Serve test, test_router_core)
    slow_ok |= {"index_replica": True, "loads_refresh_s": 0.1}
    serve.run_many([
        RunTarget(build_app(router="kvshare", namespace="serve-kv", router_kwargs=slow_ok,
                            **common), "kv", "/kv"),
        RunTarget(build_app(router="default", namespace="serve-df", **common), "df", "/df"),
    ])
    base = f"http://127.0.0.1:{port}"
    try:
        yield {"kv": f"{base}/kv", "df": f"{base}/df"}
    finally:
        serve.shutdown()
        shutdown()


def _complete(url: str, prompt: str, max_tokens: int = 2) -> dict[str, Any]:
    import httpx

    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _text(seed: int, n: int) -> str:
    words = ["kv", "cache", "ray", "serve", "block", "prefix", "node", "route", "token", "pool"]
    out: list[str] = []
    x = seed * 7919 + 17
    while sum(len(w) + 1 for w in out) < n:
        x = (x * 1103515245 + 12345) % 2**31
        out.append(words[x % len(words)] + str(x % 97))
    return " ".join(out)[:n]


@pytest.mark.cluster
def test_requests_sharing_a_long_prefix_land_on_the_replica_that_holds_it(
    apps: dict[str, str],
) -> None:
    prefix = _text(1, 40 * B)  # 40 blocks
    first = _complete(apps["kv"], prefix + " first question")["kvshare"]
    holder = first["worker_id"]
    time.sleep(0.3)  # the pool's events reach the index within its publish interval
    later = [_complete(apps["kv"], prefix + f" question {i}")["kvshare"] for i in range(6)]
    print("holder", holder, "later", [(k["worker_id"][-8:], k["local_reused_tokens"]) for k in later])
    assert all(k["worker_id"] == holder for k in later)
    assert all(k["local_reused_tokens"] >= 39 * B for k in later)
    # another long prefix spreads to the other replica when the holder is busy with nothing
    # special: at least the routing still reuses whatever it sends there
    other = _text(2, 40 * B)
    a = _complete(apps["kv"], other + " x")["kvshare"]
    time.sleep(0.3)
    b = _complete(apps["kv"], other + " y")["kvshare"]
    assert b["worker_id"] == a["worker_id"] and b["local_reused_tokens"] >= 39 * B


def _multi_turn(url: str, users: int = 4, turns: int = 4) -> tuple[float, list[float]]:
    """Chat sessions over 2 shared system prompts, each user with its own document;
    returns (local prefix hit rate, per-request latencies)."""
    import httpx

    systems = [_text(100 + i, 10 * B) for i in range(2)]
    docs = [_text(200 + u, 12 * B) for u in range(users)]
    history: list[list[dict[str, str]]] = [[] for _ in range(users)]
    reused = total = 0
    lat = []
    with httpx.Client(timeout=120) as http:
        for t in range(turns):
            for u in range(users):
                history[u].append({"role": "user", "content": f"turn {t}: " + _text(300 + 10 * u + t, 3 * B)})
                msgs = [{"role": "system", "content": systems[u % 2] + docs[u]}] + history[u]
                t0 = time.perf_counter()
                r = http.post(f"{url}/v1/chat/completions",
                              json={"messages": msgs, "max_tokens": 4, "temperature": 0})
                lat.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
                body = r.json()
                history[u].append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                reused += body["kvshare"]["local_reused_tokens"]
                total += body["kvshare"]["prompt_tokens"]
                time.sleep(0.15)  # let this turn's blocks reach the index
    return reused / total, lat


@pytest.mark.cluster
def test_kvshare_router_beats_serve_default_router_on_prefix_hit_rate(apps: dict[str, str]) -> None:
    kv_rate, kv_lat = _multi_turn(apps["kv"])
    df_rate, df_lat = _multi_turn(apps["df"])
    print(f"\nprefix hit rate: kvshare router {kv_rate:.3f}, Serve default router {df_rate:.3f}")
    print(f"mean latency: kvshare {sum(kv_lat) / len(kv_lat):.3f}s, default {sum(df_lat) / len(df_lat):.3f}s")
    assert kv_rate > df_rate
    assert kv_rate >= 0.7  # every turn after a user's first reuses its whole history


@pytest.mark.cluster
def test_openai_client_works_against_the_serve_ingress(apps: dict[str, str]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=apps["kv"] + "/v1", api_key="unused")
    models = client.models.list()
    assert models.data and models.data[0].owned_by == "kvshare"
    chat = client.chat.completions.create(
        model=models.data[0].id, max_tokens=5, temperature=0,
        messages=[{"role": "system", "content": _text(5, 3 * B)}, {"role": "user", "content": "hello"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    comp = client.completions.create(model=models.data[0].id, prompt=_text(6, 2 * B), max_tokens=4,
                                     temperature=0)
    assert comp.usage is not None and comp.usage.prompt_tokens == 2 * B
    stream = client.chat.completions.create(
        model=models.data[0].id, max_tokens=6, temperature=0, stream=True,
        messages=[{"role": "user", "content": _text(7, 2 * B)}])
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    again = client.chat.completions.create(
        model=models.data[0].id, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": _text(7, 2 * B)}])
    assert streamed == again.choices[0].message.content  # same greedy answer either way
    import httpx

    bad = httpx.post(apps["kv"] + "/v1/completions", json={"prompt": 5}, timeout=30)
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]


@pytest.mark.cluster
def test_killing_a_replica_mid_workload_loses_no_request(apps: dict[str, str]) -> None:
    import ray

    served: list[str] = []
    errors: list[str] = []

    def client(i: int) -> None:
        import httpx

        for j in range(4):
            try:
                r = httpx.post(apps["kv"] + "/v1/completions", timeout=120, json={
                    "prompt": _text(50 + i, 16 * B) + f" q{j}", "max_tokens": 16, "temperature": 0})
                assert r.status_code == 200, r.text
                served.append(r.json()["kvshare"]["worker_id"])
            except Exception as exc:  # noqa: BLE001 - any failure is a lost request
                errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(served) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = served[-1]  # a replica that is serving this workload right now
    app, dep, unique = victim.removeprefix("serve.").split("#")
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{app}#{dep}#{unique}", namespace="serve"),
             no_restart=True)
    killed_after = len(served)
    for t in threads:
        t.join(timeout=180)
    print("killed", victim, "after", killed_after, "served", [w[-8:] for w in served], errors)
    assert not errors and len(served) == 16
    assert victim not in served[killed_after + 4:]  # at most the in-flight ones came back late


@pytest.mark.cluster
def test_index_down_still_serves_every_request_with_the_same_answer(apps: dict[str, str]) -> None:
    import ray

    prompt = _text(77, 8 * B)
    ref = _complete(apps["kv"], prompt, max_tokens=8)["choices"][0]["text"]
    index = ray.get_actor("kvshare-index-0", namespace="kvshare")
    ray.kill(index, no_restart=False)  # it restarts; meanwhile routing falls back, lookups miss
    outs = [_complete(apps["kv"], prompt, max_tokens=8) for _ in range(4)]
    assert [o["choices"][0]["text"] for o in outs] == [ref] * 4
