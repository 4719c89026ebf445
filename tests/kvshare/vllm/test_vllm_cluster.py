"""vLLM workers in a kvshare cluster: two real vLLM-CPU servers started as Ray actors on two
nodes (``kvshare.actors.vllm_workers``) with the kvshare connector, registered, their prefix caches fed
to the index by their KV events. The gateway routes a repeated prompt to the worker whose own
cache holds it, a prompt held only in a pool to the worker that loads it cheapest (which then
really loads it), and chat as the gateway's token ids; Ray Serve's kvshare router does the
same in front of them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")

from http_helpers import Served, wait_idle  # noqa: E402
from vllm_helpers import DTYPE, tiny_model, wait_for  # noqa: E402

from kvshare.breakdown import GATEWAY_STAGES  # noqa: E402
from kvshare.hashing import shared_block_tokens  # noqa: E402
from kvshare.types import Tier  # noqa: E402
from kvshare.vllm.server.launch import reset_prefix_cache  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
RAY_NS = "kvshare-vllm-cluster"
NS = "tiny-vllm"
BLOCK = 128
# These tests assert where the index sends a prompt, so the index gets a deadline sized for a
# 2-core CI machine with two vLLM engines busy (at the 50 ms default a slow answer falls back
# to load-only routing by design: test_index_recovery and test_embed cover that path).
INDEX_TIMEOUT_S = 10.0
GATEWAY_OWN = set(GATEWAY_STAGES) - {"network"}  # network needs the worker's own time


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray

    from kvshare.actors.config import NamespaceSpec
    from kvshare.actors.deploy import deploy, get_index_client, shutdown
    from kvshare.actors.vllm_workers import start_workers, stop_workers
    from kvshare.vllm.server.worker import VllmKeys

    model = tiny_model(str(tmp_path_factory.mktemp("model")))
    keys = VllmKeys.from_model(model, BLOCK, DTYPE)  # float32: see DTYPE
    bb = keys.layout.bytes_per_block
    deploy(namespaces=[NamespaceSpec(NS, keys.layout, host_bytes=64 * bb)], ray_namespace=RAY_NS)
    nodes = sorted(n["NodeID"] for n in ray.nodes()
                   if n["Alive"] and any(k.startswith("node_") for k in n["Resources"]))
    try:
        infos = start_workers(model, nodes, namespace=NS, block_tokens=BLOCK,
                              max_model_len=2048, connector=True, dtype=DTYPE,
                              ray_namespace=RAY_NS)
        yield {"model": model, "keys": keys, "infos": infos,
               "index": get_index_client(RAY_NS), "stop": stop_workers}
    finally:
        stop_workers(RAY_NS)
        shutdown(RAY_NS)


@pytest.fixture(scope="module")
def gateway(cluster: dict[str, Any]) -> Iterator[tuple[Served, Any]]:
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers
    from kvshare.router.gateway.app import create_app
    from kvshare.tokenizer import HFTokenizer

    keys = cluster["keys"]
    cfg = RouterConfig.from_model_keys(keys, namespace=NS, policy="cost",
                                       index_timeout_s=INDEX_TIMEOUT_S)
    assert cfg.block_tokens == BLOCK
    router = CacheAwareRouter(cluster["index"], IndexWorkers(cluster["index"]), cfg,
                              HFTokenizer(cluster["model"]))
    gw = Served(create_app(router))
    try:
        yield gw, router
    finally:
        gw.stop()


def test_workers_register_with_node_endpoint_namespace_and_layout(cluster: dict[str, Any]) -> None:
    index, keys = cluster["index"], cluster["keys"]
    registered = {w.worker_id: w for w in index.workers()}
    assert len(cluster["infos"]) == 2 and len({i["node"] for i in cluster["infos"]}) == 2
    for info in cluster["infos"]:
        w = registered[info["worker_id"]]
        assert w.node == info["node"] and w.endpoint == info["endpoint"]
        assert w.namespaces == (NS,) and w.layout_fingerprint == keys.layout.fingerprint()
        assert w.meta["engine"] == "vllm"
    wait_for(lambda: all(ld.ts > 0 for ld in index.loads().values()))


def cpu_ticks(group: int) -> dict[int, int]:
    """CPU clock ticks (user + system) of every process in process group ``group``."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # (gone meanwhile)
                continue
            if int(fields[2]) == group:  # pgrp; then utime, stime
                out[int(entry)] = int(fields[11]) + int(fields[12])
    return out


def test_idle_vllm_engine_processes_do_not_spin(cluster: dict[str, Any]) -> None:
    """An idle server's engine processes use next to no CPU. The connector joins Ray as a
    driver inside vLLM's processes, where Ray's error-listener thread polled the GCS in a loop
    (~20-33% of a core each, and the GCS ~57%) until ``kvshare.ray_env.stop_error_listener``;
    the API server itself is left out (the worker's load reports scrape it every 100 ms)."""
    from kvshare.actors.vllm_workers import list_workers

    wait_all_idle(cluster, time.time())
    pids = [w["pid"] for w in list_workers(RAY_NS)]
    assert len(pids) == 2 and all(pids)
    before = {pid: cpu_ticks(pid) for pid in pids}
    t0 = time.monotonic()
    time.sleep(4.0)
    seconds = time.monotonic() - t0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        after = cpu_ticks(pid)
        engine = [p for p in after if p != pid and p in before[pid]]
        assert engine, f"no engine process beside the API server {pid}"
        for p in engine:
            share = (after[p] - before[pid][p]) / tick / seconds
            assert share < 0.1, f"process {p} of server {pid} used {share:.0%} of a core idle"


def test_gateway_routes_a_prompt_to_the_vllm_worker_whose_cache_holds_it(
        cluster: dict[str, Any], gateway: tuple[Served, Any]) -> None:
    gw, router = gateway
    for n, info in enumerate(cluster["infos"]):
        text = f"Worker {n} alone has read this document. " * 30
        prefill_directly(cluster, info, router, text)
        r = httpx.post(f"{gw.url}/v1/completions", timeout=120,
                       json={"model": NS, "prompt": text, "max_tokens": 4, "stream": True,
                             "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvshare-worker"] == info["worker_id"], r.headers
        assert "data: [DONE]" in r.text  # streamed through from vLLM
        # vLLM reports no stages: the gateway's own and its wait for the first chunk, in a
        # header and in vLLM's usage event
        stages = json.loads(r.headers["x-kvshare-breakdown"])
        assert {*GATEWAY_OWN, "upstream"} <= set(stages) and min(stages.values()) >= 0, stages
        usage = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == 4
        assert usage[-1]["kvshare"]["breakdown"] == pytest.approx(stages, abs=1e-5)


def prefill_directly(cluster: dict[str, Any], info: dict[str, Any], router: Any,
                     text: str) -> list[Any]:
    """Send ``text`` straight to one vLLM worker (no router sees it) and wait until its KV
    events put the prompt's share blocks in the index as that worker's gpu tier and every
    worker reports idle again (``wait_all_idle``)."""
    ids = router.tokenize(prompt=text)
    r = httpx.post(f"{info['endpoint']}/v1/completions", timeout=120,
                   json={"model": cluster["model"], "prompt": ids, "max_tokens": 1})
    assert r.status_code == 200, r.text
    hashes = router.hasher.hashes(ids)
    wait_for(lambda: held(cluster["index"], hashes, f"worker:{info['worker_id']}", Tier.GPU))
    wait_all_idle(cluster, time.time())
    return list(hashes)


def wait_all_idle(cluster: dict[str, Any], since: float) -> None:
    """:func:`wait_idle` for every worker of ``cluster``."""
    wait_idle(cluster["index"], [i["worker_id"] for i in cluster["infos"]], since)


def metric(endpoint: str, name: str, label: str = "") -> float:
    """A counter of a vLLM server's ``/metrics`` (summed over the label sets that contain
    ``label``, e.g. ``why="router"``)."""
    text = httpx.get(f"{endpoint}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line)


def held(index: Any, hashes: list[Any], loc: str, tier: Tier | None) -> bool:
    """Whether every block is at ``loc`` (in ``tier``; None: absent there)."""
    return all(h.get(loc) == tier for h in index.lookup(NS, hashes))


def test_chat_reaches_vllm_as_the_gateways_token_ids(
        cluster: dict[str, Any], gateway: tuple[Served, Any]) -> None:
    gw, router = gateway
    msgs = [{"role": "system", "content": "You answer questions about caches. " * 20},
            {"role": "user", "content": "Which blocks does a prefix cache keep?"}]
    r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=120,
                   json={"model": NS, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    ids = router.tokenize(messages=msgs)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # vLLM cached exactly the blocks the gateway hashed: its events name the same share blocks
    loc = f"worker:{r.headers['x-kvshare-worker']}"
    wait_for(lambda: held(cluster["index"], router.hasher.hashes(ids), loc, Tier.GPU))


def test_a_real_engine_reports_its_prefill_backlog_and_empties_it(
        cluster: dict[str, Any], gateway: tuple[Served, Any]) -> None:
    """The load report's exact prefill work comes from a real engine's scheduler: a cold
    prompt adds its tokens to the backlog, its prefill takes them off again."""
    gw, router = gateway
    text = "A backlog counts every prompt token still to compute. " * 30
    ids = router.tokenize(prompt=text)
    endpoints = [i["endpoint"] for i in cluster["infos"]]

    def backlog() -> tuple[float, float]:
        """Tokens added to the engines' backlogs, and still in them."""
        added = sum(metric(e, "vllm:kvshare_backlog_tokens_added_total") for e in endpoints)
        removed = sum(metric(e, "vllm:kvshare_backlog_tokens_removed_total") for e in endpoints)
        return added, added - removed

    wait_for(lambda: backlog()[1] == 0, timeout_s=10)
    before = backlog()[0]
    r = httpx.post(f"{gw.url}/v1/completions", timeout=120,
                   json={"model": NS, "prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text
    # the whole cold prompt (less the last token vLLM never caches) was owed, then computed
    wait_for(lambda: backlog()[0] - before >= len(ids) - 1 and backlog()[1] == 0, timeout_s=10)

    # two cold prompts at once: the steps that compute them (and go on to decode) count in how
    # fast the engine drains its backlog
    one = endpoints[0]

    def drain() -> tuple[float, float]:
        return (metric(one, "vllm:kvshare_backlog_drained_tokens_total"),
                metric(one, "vllm:kvshare_backlog_drain_seconds_total"))

    tokens0, seconds0 = drain()
    long_ids = [router.tokenize(prompt=f"Prompt {k} drains the backlog step by step. " * 45)
                for k in (1, 2)]
    assert all(1100 < len(x) < 2000 for x in long_ids), [len(x) for x in long_ids]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda x: httpx.post(
            f"{one}/v1/completions", timeout=120,
            json={"model": cluster["model"], "prompt": x, "max_tokens": 3}), long_ids))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    tokens, seconds = drain()
    assert 0 < tokens - tokens0 <= sum(map(len, long_ids)) and seconds > seconds0
    rate = (tokens - tokens0) / (seconds - seconds0)
    assert 50 < rate < 1e6, rate  # tokens per second of those steps: a speed, not a glitch


def test_a_prompt_only_in_a_pool_goes_where_loading_is_cheapest_and_is_loaded(
        cluster: dict[str, Any], gateway: tuple[Served, Any]) -> None:
    gw, router = gateway
    index = cluster["index"]
    a = cluster["infos"][0]
    text = "Only the pool of the first node keeps this long report. " * 40
    hashes = prefill_directly(cluster, a, router, text)
    pool = f"node:{a['node']}"
    wait_for(lambda: held(index, hashes, pool, Tier.HOST))  # the connector stored it
    epochs = {w: load.cache_epoch for w, load in index.loads().items()}
    for info in cluster["infos"]:  # empty every vLLM's own cache; a step publishes the reset
        assert reset_prefix_cache(info["endpoint"]), info  # refused while a save holds pages
        httpx.post(f"{info['endpoint']}/v1/completions", timeout=120,
                   json={"model": cluster["model"], "prompt": [7, 8, 9], "max_tokens": 1})
    for info in cluster["infos"]:
        wait_for(lambda i=info: held(index, hashes, f"worker:{i['worker_id']}", None))
        # its load reports say its cache was emptied (routers forget what they sent it)
        wait_for(lambda i=info: index.loads()[i["worker_id"]].cache_epoch
                 > epochs[i["worker_id"]])
    assert held(index, hashes, pool, Tier.HOST)
    wait_all_idle(cluster, time.time())
    before = metric(a["endpoint"], "vllm:external_prefix_cache_hits_total")
    planned = metric(a["endpoint"], "vllm:kvshare_lookups_from_router_total")
    r = httpx.post(f"{gw.url}/v1/completions", timeout=120,
                   json={"model": NS, "prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text
    # the cost model: shared memory from its own node's pool beats a transfer to the other node
    assert r.headers["x-kvshare-worker"] == a["worker_id"], r.headers
    loaded = metric(a["endpoint"], "vllm:external_prefix_cache_hits_total") - before
    assert loaded >= (len(hashes) - 1) * BLOCK, loaded  # vLLM loaded it through the connector
    # planned from the index answer the gateway sent with it: the engine asked the index nothing
    wait_for(lambda: metric(a["endpoint"], "vllm:kvshare_lookups_from_router_total")
             >= planned + 1, timeout_s=10)


def chat(gw: Served, messages: list[dict[str, str]]) -> tuple[str, int, str]:
    """One chat turn through the gateway: (answer text, cached prompt tokens, worker)."""
    r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=120,
                   json={"model": NS, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return body["choices"][0]["message"]["content"], int(cached), r.headers["x-kvshare-worker"]


def back_to_back(seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A conversation's first turn (a new system prompt) and its second (the first, the
    answer, a new question), as a chat client sends them."""
    first = [{"role": "system", "content": f"Agent {seed} follows these rules closely. " * 60},
             {"role": "user", "content": "Which file should I open first?"}]
    second = first + [{"role": "assistant", "content": ""},
                      {"role": "user", "content": "And after that one?"}]
    return first, second


def shared_blocks_tokens(router: Any, first: list[dict[str, str]],
                         second: list[dict[str, str]]) -> int:
    """Tokens of the full share blocks both turns' prompts start with."""
    return shared_block_tokens(router.tokenize(messages=first), router.tokenize(messages=second),
                               BLOCK)


def test_back_to_back_turn_reuses_the_previous_turn_on_the_same_vllm_worker(
        cluster: dict[str, Any], gateway: tuple[Served, Any]) -> None:
    gw, router = gateway
    wait_all_idle(cluster, time.time())

    def skipped() -> float:  # lookups the router's hint spared the engines
        return sum(metric(i["endpoint"], "vllm:kvshare_lookups_skipped_total", 'why="router"')
                   for i in cluster["infos"])
    before = skipped()
    first, second = back_to_back(1)
    answer, cached, w1 = chat(gw, first)
    assert cached == 0  # a new system prompt: nothing cached anywhere
    # the gateway's index query found none of it: the engine did not ask the index again
    wait_for(lambda: skipped() >= before + 1, timeout_s=10)
    second[2]["content"] = answer  # sent back at once, no pause
    _, cached, w2 = chat(gw, second)
    assert w2 == w1, "the router's pending blocks keep the conversation on its worker"
    shared = shared_blocks_tokens(router, first, second)
    assert shared >= 4 * BLOCK and cached >= 0.95 * shared, (cached, shared)


def test_back_to_back_turn_on_the_other_vllm_node_loads_the_previous_turn(
        cluster: dict[str, Any], gateway: tuple[Served, Any]) -> None:
    """Read-after-write across nodes: the blocks the first turn's engine computed are in its
    node's pool (stored by the connector) and found by the other node's connector the moment
    the first answer ends."""
    gw, router = gateway
    wait_all_idle(cluster, time.time())

    def counts(name: str) -> dict[str, float]:
        return {i["worker_id"]: metric(i["endpoint"], name) for i in cluster["infos"]}
    saves, late = counts("vllm:kvshare_sync_saves_total"), counts(
        "vllm:kvshare_sync_saves_late_total")
    first, second = back_to_back(2)
    answer, _, w1 = chat(gw, first)
    node = next(i["node"] for i in cluster["infos"] if i["worker_id"] == w1)
    hashes = router.hasher.hashes(router.tokenize(messages=first))
    here = lambda: held(cluster["index"], hashes, f"node:{node}", Tier.HOST)  # noqa: E731
    # the answer ended: its prompt's blocks are already in its node's pool, and indexed there
    at_once = here()
    endpoint = next(i["endpoint"] for i in cluster["infos"] if i["worker_id"] == w1)
    wait_for(lambda: metric(endpoint, "vllm:kvshare_sync_saves_total") >= saves[w1] + 1,
             timeout_s=10)
    # the server's worker process maps the EngineCore's save marks (held, not skipped)
    assert metric(endpoint, "vllm:kvshare_sync_saves_unmarked_total") == 0
    if not at_once:  # the hold is bounded (SYNC_SAVE_WAIT_S): only a late save may miss it
        assert metric(endpoint, "vllm:kvshare_sync_saves_late_total") > late[w1]
        wait_for(here, timeout_s=30)
    second[2]["content"] = answer
    router.mark_down(w1, for_s=5.0)  # the first worker refuses: the turn goes to the other
    try:
        _, cached, w2 = chat(gw, second)
    finally:
        router.mark_up(w1)  # the next tests route to both workers
    assert w2 != w1
    shared = shared_blocks_tokens(router, first, second)
    assert shared >= 4 * BLOCK and cached >= 0.95 * shared, (cached, shared)


def bench_trace(path: Any, first_id: int) -> str:
    """A Mooncake-format trace of three 128-token-block prompts: the second shares the first's
    three blocks, the third shares nothing."""
    rows = [{"timestamp": 0, "input_length": 384, "output_length": 4,
             "hash_ids": [first_id, first_id + 1, first_id + 2]},
            {"timestamp": 200, "input_length": 512, "output_length": 4,
             "hash_ids": [first_id, first_id + 1, first_id + 2, first_id + 3]},
            {"timestamp": 400, "input_length": 256, "output_length": 4,
             "hash_ids": [first_id + 10, first_id + 11]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_kvshare_bench_against_the_gateway_and_a_vllm_server(
        cluster: dict[str, Any], gateway: tuple[Served, Any], tmp_path: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``kvshare bench`` on the live stack: through the gateway (tier counters read from the
    workers its /health lists) and on one vLLM server directly; one request at a time, so the
    second finds the first's blocks. Distinct ids per run: each run's prompts are new."""
    from kvshare.cli import main

    gw, _ = gateway
    wait_all_idle(cluster, time.time())
    direct = cluster["infos"][0]["endpoint"]
    runs = {}
    for n, url in enumerate((gw.url, direct)):
        rc = main(["bench", "--url", url, "--trace", bench_trace(tmp_path / f"t{n}.jsonl", 1000 * n + 1),
                   "--block-tokens", str(BLOCK), "--vocab", "1024", "--max-concurrency", "1",
                   "--speed", "4", "--json"])
        out = capsys.readouterr().out
        assert rc == 0, out
        runs[url] = json.loads(out.strip().splitlines()[-1])["runs"][0]
    via_gw, on_vllm = runs[gw.url], runs[direct]
    assert via_gw["kind"] == "gateway" and on_vllm["kind"] == "vllm"
    assert via_gw["usage_extension"] and not on_vllm["usage_extension"]
    assert sorted(via_gw["hit_rate_from"]) == sorted(i["endpoint"] for i in cluster["infos"])
    for run in (via_gw, on_vllm):
        assert run["requests"] == {"sent": 3, "completed": 3, "failed": 0, "skipped": 0}, run
        assert set(run["ttft_s"]) == {"p50", "p90", "p99", "mean"} and run["ttft_s"]["p50"] > 0
        assert run["prompt_tokens"] == 384 + 512 + 256 and run["output_tokens"] == 12
    # the second prompt's three blocks: 384 of 1152 tokens, at most; vLLM's own cache holds
    # them on the server asked directly (its pages are 32 tokens: the last may be recomputed)
    assert 0.2 < on_vllm["hit_rate_by_tier"]["engine"] <= 384 / 1152 + 1e-9, on_vllm
    # through the gateway: the worker that computed the first prompt (its engine) or the
    # other one loading it from a pool
    tiers = via_gw["hit_rate_by_tier"]
    assert 0.2 < tiers["engine"] + tiers["local_pool"] + tiers["remote_pool"] <= 384 / 1152 + 1e-9, via_gw
    assert tiers["external"] == 0


def test_serve_kvshare_router_in_front_of_vllm_replicas(cluster: dict[str, Any],
                                                        gateway: tuple[Served, Any]) -> None:
    from ray import serve

    from kvshare.router.serve.vllm_replicas import KVSHARE_ROUTER, ServeCompletion, vllm_app

    _, router = gateway
    serve.start(proxy_location="Disabled")
    try:
        handle = serve.run(vllm_app(KVSHARE_ROUTER, 2, NS, ray_namespace=RAY_NS,
                                    router_kwargs={"ray_namespace": RAY_NS, "namespace": NS,
                                                  "index_timeout_s": INDEX_TIMEOUT_S}),
                           name="vllm-serve", route_prefix=None)
        fronted = {handle.worker_id.remote().result() for _ in range(16)}
        assert fronted == {i["worker_id"] for i in cluster["infos"]}
        time.sleep(3)  # the replicas' routing stats (every 1 s) reach the router
        for n, info in enumerate(cluster["infos"]):
            text = f"Serve replica {n} fronts the only cache of this page. " * 30
            prefill_directly(cluster, info, router, text)
            ids = router.tokenize(prompt=text)
            pieces = list(handle.options(stream=True).remote(ServeCompletion(text, ids, 3)))
            assert pieces and {p["worker"] for p in pieces} == {info["worker_id"]}
    finally:
        serve.shutdown()


def test_stop_unregisters_and_drops_the_workers_entries(cluster: dict[str, Any]) -> None:
    index = cluster["index"]
    assert cluster["stop"](RAY_NS) == 2
    assert index.workers() == []
    locs = index.stats()[0]["locations"]
    assert not [k for k in locs if k.startswith("worker:")]
