"""Real SGLang servers on kvshare: HiCache's storage tier shared across the nodes of a Ray cluster.

A head + 2-node Ray cluster with a kvshare namespace; two SGLang servers launched on it by
``kvshare.actors.sglang_workers`` (what ``kvshare sglang start`` runs), one per node, each with
HiCache and the kvshare backend on its node's pool, registered with the index and their KV
events followed; and, before them, one SGLang server without HiCache, the reference. Server A (node 0)
serves a long prompt and writes its pages through to node 0's pool; server B (node 1, fresh)
then serves the same prompt: SGLang reports the prefix as a storage hit (``cached_tokens_details``
and ``/metrics``) and its greedy output and logprobs equal the reference's. The gateway routes
a prompt to the SGLang worker whose radix cache holds it (SGLang's KV events in the index) and
returns the reference's answer.

SGLang runs on the CPU here only with the two test-only provisions in ``cpu_provisions/``
(an ``sgl_kernel`` import stand-in; HiCache's host pool unpinned with a torch direct copy), put
on the servers' ``PYTHONPATH`` by this module alone. Every stand-in op records a call before it
raises; ``test_no_sgl_kernel_stand_in_op_was_called`` fails if any was.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang lives in its own environment (torch 2.14.1): make sglang-install, then "
           "make test-sglang runs this folder there")

import httpx  # noqa: E402
from conftest import start_cluster, stop_cluster  # noqa: E402
from http_helpers import Served  # noqa: E402

from kvshare.layout import KVLayout  # noqa: E402
from kvshare.sglang.launch import SglangProcess, SglangSpec, only_models  # noqa: E402
from kvshare.sglang.load import parse_sglang_metrics  # noqa: E402
from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama  # noqa: E402
from kvshare.types import Tier  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
PROVISIONS = Path(__file__).resolve().parent / "cpu_provisions"
RAY_NS = "kvshare-sglang-server"
NS = "tiny-sglang"
PAGE = 16
SPEC = TinyModelSpec(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                     intermediate_size=256)
PREFIX = [300 + (i * 7) % 600 for i in range(32 * PAGE)]  # 512 tokens: 32 pages
PROMPT = PREFIX + [11, 12, 13, 14, 15]
MAX_TOTAL_TOKENS = 2048


def provisions_env(log: str) -> dict[str, str]:
    """The servers' environment: the test-only CPU provisions, this checkout's kvshare, the
    stand-in's call log."""
    path = os.pathsep.join([str(PROVISIONS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path.rstrip(os.pathsep), "KVSHARE_SGL_STANDIN_LOG": log,
            **only_models("llama")}  # SGLang imports ~250 model modules otherwise


GATEWAY_TEXT = "Only server B has read this page about radix caches. " * 12


def reference_answers(model: str, env: dict[str, str], tmp: Path) -> dict[str, Any]:
    """What a server without HiCache answers (greedy) to every prompt the tests send; the
    server is stopped before the cluster's start (two CPU cores, 24 GiB shared)."""
    from kvshare.tokenizer import HFTokenizer

    gateway_ids = HFTokenizer(model).encode(GATEWAY_TEXT)
    ref = SglangProcess(SglangSpec(model, storage="", cpu=True, page_size=PAGE,
                                   max_total_tokens=MAX_TOTAL_TOKENS, env=env,
                                   events_dir=str(tmp / "ref")))
    try:
        ref.start().wait_ready(600)
        url = ref.spec.endpoint
        return {"cold": generate(url, PROMPT),
                "warm": generate(url, PROMPT),  # its own radix cache: prefix reused
                "gateway": httpx.post(f"{url}/v1/completions", timeout=300, json={
                    "model": model, "prompt": gateway_ids, "max_tokens": 6,
                    "temperature": 0}).json()["choices"][0]["text"]}
    finally:
        ref.stop()


def started_cluster(attempts: int = 3) -> Any:
    """``start_cluster``, tried again when a raylet misses Ray's fixed 30 s start deadline (a
    2-core machine under a load of 50 does; CI's first try does not)."""
    import ray

    for attempt in range(attempts):
        try:
            return start_cluster(num_workers=2, object_store_mb=150)
        except Exception:
            if attempt == attempts - 1:
                raise
            ray.shutdown()
            time.sleep(5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    from kvshare.actors.deploy import deploy, get_index_client, shutdown
    from kvshare.actors.sglang_workers import PREFIX as ACTORS
    from kvshare.actors.sglang_workers import start_workers
    from kvshare.actors.vllm_workers import stop_workers

    t0 = time.monotonic()
    # SGLang builds its page-hash C++ extension at first use; servers starting together race
    # on the build (one fails, and its storage queries with it): build it here, once
    _load_native_hash_module()
    tmp = tmp_path_factory.mktemp("sglang")
    model = build_tiny_llama(str(tmp / "tiny"), SPEC)
    log = str(tmp / "standin-calls.log")
    env = provisions_env(log)
    reference = reference_answers(model, env, tmp)
    ref_s = time.monotonic() - t0
    cluster = started_cluster()
    try:
        layout = KVLayout.from_hf_config(os.path.join(model, "config.json"), dtype="bf16",
                                         block_tokens=PAGE)
        deploy(namespace=NS, layout=layout, host_gb=0.05, ray_namespace=RAY_NS)
        nodes = {k: n["NodeID"] for n in ray.nodes() for k in n["Resources"]
                 if k.startswith("node_")}
        infos = start_workers(model, [nodes["node_0"], nodes["node_1"]], namespace=NS,
                              page_size=PAGE, max_total_tokens=MAX_TOTAL_TOKENS, cpu=True,
                              env=env, ray_namespace=RAY_NS, timeout_s=600)
        by_node = {i["node"]: i for i in infos}
        yield {"model": model, "log": log, "reference": reference,
               "a": by_node[nodes["node_0"]], "b": by_node[nodes["node_1"]],
               "index": get_index_client(RAY_NS), "nodes": nodes,
               "reference_s": ref_s, "start_s": time.monotonic() - t0}
    finally:
        stop_workers(RAY_NS, ACTORS)
        shutdown(RAY_NS)
        stop_cluster(cluster)


def generate(endpoint: str, ids: list[int], new: int = 8) -> dict[str, Any]:
    """Greedy ``/generate`` of ``ids``: its output ids, logprobs and cache report."""
    r = httpx.post(f"{endpoint}/generate", timeout=300, json={
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"max_new_tokens": new, "temperature": 0}})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def logprobs(answer: dict[str, Any]) -> list[float]:
    return [float(lp[0]) for lp in answer["meta_info"]["output_token_logprobs"]]


def metrics(endpoint: str) -> dict[str, float]:
    return parse_sglang_metrics(httpx.get(f"{endpoint}/metrics", timeout=30).text)


def wait_for(check: Any, timeout_s: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(0.2)


def test_a_fresh_server_on_another_node_takes_the_prefix_from_the_cluster(
        stack: dict[str, Any]) -> None:
    print(f"\nreference answers in {stack['reference_s']:.1f} s, stack up in "
          f"{stack['start_s']:.1f} s")
    a, b = stack["a"]["endpoint"], stack["b"]["endpoint"]
    ref, again = stack["reference"]["cold"], stack["reference"]["warm"]
    first = generate(a, PROMPT)
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["output_ids"] == ref["output_ids"]
    # write-through: A's HiCache backs the pages up to its storage tier (kvshare, node 0's pool)
    wait_for(lambda: metrics(a).get("sglang:backuped_tokens_total", 0) >= len(PREFIX),
             what="server A to back its pages up to kvshare")
    got = generate(b, PROMPT)  # B has never seen it; its node's pool holds none of it
    details = got["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) >= len(PREFIX), got["meta_info"]
    assert got["meta_info"]["cached_tokens"] >= len(PREFIX)
    assert got["output_ids"] == ref["output_ids"]
    # The reference computed the whole prompt, B only the suffix over loaded KV: the same
    # bf16 bytes, another attention split, so logprobs agree to float rounding.
    assert logprobs(got) == pytest.approx(logprobs(ref), abs=2e-2)
    assert again["meta_info"]["cached_tokens"] >= len(PREFIX)  # its own cache: same split
    assert logprobs(got) == pytest.approx(logprobs(again), abs=1e-6)
    assert metrics(b).get("cached:storage", 0) >= len(PREFIX)


def test_sglang_workers_register_with_their_node_address_and_report_load(
        stack: dict[str, Any]) -> None:
    import ray

    index = stack["index"]
    registered = {w.worker_id: w for w in index.workers()}
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    for info in (stack["a"], stack["b"]):
        w = registered[info["worker_id"]]
        assert w.meta["engine"] == "sglang" and w.namespaces == (NS,)
        assert w.endpoint == info["endpoint"]
        assert w.endpoint.startswith(f"http://{ips[info['node']]}:")
    wait_for(lambda: all(ld.ts > 0 for ld in index.loads().values()), what="load reports")


@pytest.fixture(scope="module")
def gateway(stack: dict[str, Any]) -> Iterator[tuple[Served, Any]]:
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers
    from kvshare.router.gateway.app import create_app
    from kvshare.tokenizer import HFTokenizer
    from kvshare.vllm.server.worker import VllmKeys

    keys = VllmKeys.from_model(stack["model"], PAGE, "bfloat16")
    cfg = RouterConfig.from_model_keys(keys, namespace=NS, policy="cost", index_timeout_s=10.0)
    router = CacheAwareRouter(stack["index"], IndexWorkers(stack["index"]), cfg,
                              HFTokenizer(stack["model"]))
    gw = Served(create_app(router))
    try:
        yield gw, router
    finally:
        gw.stop()


def test_the_gateway_routes_to_the_sglang_worker_whose_radix_cache_holds_the_prompt(
        stack: dict[str, Any], gateway: tuple[Served, Any]) -> None:
    gw, router = gateway
    index, b = stack["index"], stack["b"]
    text = GATEWAY_TEXT
    ids = router.tokenize(prompt=text)
    r = httpx.post(f"{b['endpoint']}/v1/completions", timeout=300,
                   json={"model": stack["model"], "prompt": ids, "max_tokens": 1})
    assert r.status_code == 200, r.text
    hashes = router.hasher.hashes(ids)
    where = f"worker:{b['worker_id']}"
    wait_for(lambda: all(h.get(where) in (Tier.GPU, Tier.HOST)
                         for h in index.lookup(NS, hashes)),
             what="SGLang's KV events to put B's pages in the index")
    r = httpx.post(f"{gw.url}/v1/completions", timeout=300,
                   json={"model": NS, "prompt": text, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvshare-worker"] == b["worker_id"], r.headers
    assert r.json()["choices"][0]["text"] == stack["reference"]["gateway"]


def test_the_stand_in_records_and_raises_when_an_op_is_called(tmp_path: Path) -> None:
    """The check above can fail: a stand-in op called in a process set up like the servers
    records its name and raises."""
    log = tmp_path / "calls.log"
    code = ("import sgl_kernel, sgl_kernel.kvcacheio as k\n"
            "try:\n    k.transfer_kv_direct([], [], None, None, 16)\n"
            "except sgl_kernel.StandInCalled:\n    print('raised')\n")
    env = {**os.environ, **provisions_env(str(log))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "raised", out.stderr
    assert log.read_text().split()[1] == "sgl_kernel.kvcacheio.transfer_kv_direct"


def test_no_sgl_kernel_stand_in_op_was_called(stack: dict[str, Any]) -> None:
    """Runs after the servers served: the stand-in's call log must be empty."""
    calls = Path(stack["log"]).read_text() if os.path.exists(stack["log"]) else ""
    assert calls == "", f"sgl_kernel stand-in ops were called while serving:\n{calls}"
