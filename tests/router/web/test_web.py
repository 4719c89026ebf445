"""The live page and the Grafana dashboard against a real deployment.

Head + 2 nodes (``ray.cluster_utils.Cluster``), kvshare deployed, one reference transformers
worker per node serving HTTP, the gateway (uvicorn on loopback, API keys) in front of them.
Requests that share a system prompt go through the gateway, then: the page's JSON needs a key
(admin view for the admin key); every Grafana query names a metric that the live scrape of
``kvshare metrics``, the gateway and the workers exports; and headless Chromium shows both
nodes, non-zero hit rates, and the node we remove marked down within 5 s.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import uvicorn
from conftest import start_cluster, stop_cluster
from engine_helpers import BLOCK, SMALL
from paths import ROOT
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.actors.admin import ClusterAdmin
from kvshare.actors.deploy import deploy
from kvshare.actors.index.client import IndexClient
from kvshare.actors.metrics import ClusterCollector, cluster_registry
from kvshare.engines.hf import EngineConfig, model_keys
from kvshare.engines.service import WorkerService
from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
from kvshare.router.core.workers_view import IndexWorkers
from kvshare.router.gateway.api_keys import parse_api_keys
from kvshare.router.gateway.app import create_app
from kvshare.testing import browser

pytestmark = pytest.mark.cluster

NS = "web"
CFG = EngineConfig(overrides=dict(SMALL), block_tokens=BLOCK, threads=1)
KEYS = {"k-admin": {"tenant": "ops", "admin": True}, "k-acme": {"tenant": "acme"}}
DASHBOARD = ROOT / "deploy" / "grafana" / "kvshare.json"
SYSTEM = "You are the kvshare assistant; answer briefly about cache reuse. " * 6


class Env:
    def __init__(self, cluster: Any, url: str, workers: dict[str, Any], nodes: dict[str, str]):
        self.cluster, self.url, self.workers, self.nodes = cluster, url, workers, nodes

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + path, headers=headers, timeout=30)

    def chat(self, user: str, key: str = "k-acme", stream: bool = False) -> str:
        body = {"model": NS, "max_tokens": 2, "stream": stream, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.text


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    cluster = start_cluster()
    server: uvicorn.Server | None = None
    workers: dict[str, Any] = {}
    try:
        keys = model_keys(CFG)
        bpb = keys.layout.bytes_per_block
        deploy(cluster.address, namespace=NS, layout=keys.layout,
               host_gb=64 * bpb / 2**30, disk_gb=64 * bpb / 2**30,
               disk_dir=tempfile.mkdtemp(prefix="kvs-web-disk-"))
        Worker = ray.remote(num_cpus=1)(WorkerService)
        workers = {f"w{i}": Worker.options(resources={f"node_{i}": 0.1}).remote(  # type: ignore[attr-defined]
            NS, CFG, worker_id=f"w{i}", model_name=NS) for i in range(2)}
        nodes = {name: ray.get(w.ready.remote(), timeout=180)["node"] for name, w in workers.items()}
        index = IndexClient.connect()
        cfg = RouterConfig.from_model_keys(keys, namespace=NS, policy="cost")
        router = CacheAwareRouter(index, IndexWorkers(index), cfg, keys.tokenizer)
        app = create_app(router, parse_api_keys(KEYS), admin=ClusterAdmin())
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        e = Env(cluster, f"http://127.0.0.1:{port}", workers, nodes)
        deadline = time.monotonic() + 30  # both workers registered with the index
        while e.get("/health").json().get("workers", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        for turn in range(4):  # the shared system prompt is reused from turn 1 on
            e.chat(f"question {turn}: what is a KV block?", stream=turn % 2 == 1)
        e.chat("an admin question", key="k-admin")
        yield e
    finally:
        if server is not None:
            server.should_exit = True
        for w in workers.values():
            try:
                ray.get(w.stop.remote(), timeout=30)
            except Exception:  # a worker on the removed node is gone already
                pass
        stop_cluster(cluster)


def test_page_is_offline_and_state_needs_a_key(env: Env) -> None:
    page = env.get("/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text)  # nothing remote
    assert "@import" not in page.text and "url(" not in page.text
    assert env.get("/dashboard/state").status_code == 401
    assert env.get("/dashboard/state", "wrong").status_code == 401
    tenant = env.get("/dashboard/state", "k-acme").json()
    assert tenant["tenant"] == "acme" and not tenant["admin"] and tenant["tenants"] is None
    assert tenant["router"]["recent"] and {d["tenant"] for d in tenant["router"]["recent"]} == {"acme"}
    admin = env.get("/dashboard/state", "k-admin").json()
    assert admin["admin"] and {t["tenant"] for t in admin["tenants"]} == {"acme", "ops"}
    assert {d["tenant"] for d in admin["router"]["recent"]} == {"acme", "ops"}
    recent = admin["router"]["recent"]  # plain and streamed replies: the worker's figures
    assert all("ttft_s" in d["worker_stats"] for d in recent), recent
    assert any(d["worker_stats"].get("reused_tokens") for d in recent), recent
    assert len(admin["cluster"]["nodes"]) >= 2 and len(admin["cluster"]["workers"]) == 2


def scraped(env: Env) -> dict[str, set[str]]:
    """Metric sample names -> label names, from a live scrape of every kvshare exporter."""
    texts = [generate_latest(cluster_registry(ClusterCollector(timeout_s=10))).decode(),
             env.get("/metrics").text]
    for w in env.workers.values():
        texts.append(httpx.get(ray.get(w.endpoint.remote()) + "/metrics", timeout=30).text)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count"), "gauge": ("",)}
    out: dict[str, set[str]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            for suffix in suffixes.get(fam.type, ("",)):  # declared, even with no sample yet
                out.setdefault(fam.name + suffix, set())
            for s in fam.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def queries(dashboard: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The PromQL of every panel target, and the templating queries (Grafana functions)."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    templating = [v["query"]["query"] for v in dashboard["templating"]["list"]
                  if v["type"] == "query"]
    return exprs, templating


def selectors(node: Any, groups: list[tuple[list[str], set[str]]]) -> set[str]:
    """Metric names selected under a parsed PromQL ``node``; appends to ``groups`` each
    aggregation's ``by`` labels and, via the names, which metrics they must be on."""
    import promql_parser as pq

    if isinstance(node, pq.VectorSelector):
        assert node.name, f"selector without a metric name: {node.prettify()}"
        return {node.name}
    if isinstance(node, pq.MatrixSelector):
        return selectors(node.vector_selector, groups)
    if isinstance(node, pq.Call):
        return set().union(*(selectors(a, groups) for a in node.args))
    if isinstance(node, pq.BinaryExpr):
        return selectors(node.lhs, groups) | selectors(node.rhs, groups)
    if isinstance(node, pq.AggregateExpr):
        names = selectors(node.expr, groups)
        if node.modifier is not None and node.modifier.type == pq.AggModifierType.By:
            groups.append((list(node.modifier.labels), names))
        return names
    if isinstance(node, pq.ParenExpr | pq.UnaryExpr | pq.SubqueryExpr):
        return selectors(node.expr, groups)
    return set()  # number and string literals


def test_grafana_queries_name_exported_metrics(env: Env) -> None:
    """Every panel query parses as PromQL (Prometheus' grammar, promql-parser) and selects
    only metrics, labels and grouping labels that a live scrape of kvshare exports."""
    import promql_parser as pq

    dashboard = json.loads(DASHBOARD.read_text())
    exported = scraped(env)
    exprs, templating = queries(dashboard)
    assert len(exprs) >= 20
    named: set[str] = set()
    for expr in exprs:
        concrete = expr.replace("$__rate_interval", "1m").replace("$namespace", ".*")
        groups: list[tuple[list[str], set[str]]] = []
        tree = pq.parse(concrete)  # ValueError names the syntax error
        metrics = selectors(tree, groups)
        assert metrics and all(m.startswith("kvshare_") for m in metrics), expr
        unknown = metrics - set(exported)
        assert not unknown, f"{expr}\n  names {sorted(unknown)}, which kvshare does not export"
        matched = set(re.findall(r"[{,]\s*(\w+)\s*[=!]~?", concrete))
        for labels, under in groups + [(sorted(matched), metrics)]:
            have = set().union(*(exported[m] for m in under))
            if have:  # series present in the scrape: their labels must cover the query's
                assert set(labels) <= have, f"{expr}\n  labels {sorted(set(labels) - have)} not on {under}"
        named |= metrics
    for query in templating:
        metric, label = re.fullmatch(r"label_values\((\w+), *(\w+)\)", query).groups()  # type: ignore[union-attr]
        assert label in exported[metric], query
    for family in ("kvshare_pool_hits_total", "kvshare_client_transfer_bytes_total",
                   "kvshare_pool_evictions_total", "kvshare_pool_demotions_total",
                   "kvshare_router_decisions_total", "kvshare_router_est_ttft_saved_seconds_total",
                   "kvshare_index_gaps_total", "kvshare_index_blocks"):
        assert family in named, f"the dashboard has no panel over {family}"


def test_status_web_serves_the_same_page(env: Env) -> None:
    """``kvshare status --web``: the cluster's page without a gateway (no router section)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [os.path.join(os.path.dirname(sys.executable), "kvshare"), "status", "--address",
           env.cluster.address, "--web", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        state: dict[str, Any] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                state = httpx.get(f"http://127.0.0.1:{port}/dashboard/state", timeout=10).json()
                break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert state, f"kvshare status --web never answered: {proc.stderr and proc.stderr.read()}"
        assert state["router"] is None and state["admin"]
        ours = {n["node_id"]: n for n in state["cluster"]["nodes"]}
        assert set(env.nodes.values()) <= set(ours)
        assert all(ours[n]["state"] == "up" and ours[n]["tiers"] for n in env.nodes.values())
        assert "<title>kvshare status</title>" in httpx.get(f"http://127.0.0.1:{port}/dashboard").text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(bool(browser.missing()), reason=browser.missing() or "ok")
def test_browser_shows_nodes_hit_rates_and_a_dead_node(env: Env) -> None:
    """Runs last: it removes node 1 (and the worker on it)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser.headless_chromium()
    try:
        driver.get(env.url + "/dashboard#key=k-admin")
        wait = WebDriverWait(driver, 30, poll_frequency=0.1)

        def attrs(css: str, *names: str) -> list[list[str]]:
            """The attributes of every element matching ``css``, read in one script call
            (the page re-renders every second: element handles go stale)."""
            return driver.execute_script(  # type: ignore[no-any-return]
                "return [...document.querySelectorAll(arguments[0])]"
                ".map(e => arguments[1].map(n => e.getAttribute(n)))", css, list(names))

        def states() -> dict[str, str]:
            return {node: state for node, state in attrs("[data-node]", "data-node", "data-state")}

        wait.until(lambda _: all(states().get(n) == "up" for n in env.nodes.values()))
        rates = wait.until(lambda _: [float(r) for (r,) in attrs("[data-hit-rate]", "data-hit-rate")
                                      if r] or None)
        assert max(rates) > 0, f"no tier shows a hit after reuse: {rates}"
        # what each tier is worth: priced once the workers reported their prefill speed
        nets = wait.until(lambda _: [float(n) for _, n in attrs("[data-value]", "data-value",
                                                                "data-net") if n] or None)
        assert max(nets) > 0, f"no tier shows prefill saved after reuse: {nets}"
        assert attrs("[data-reason]", "data-reason")  # routing decisions shown
        assert "acme" in driver.execute_script("return document.getElementById('tenants').textContent")
        with tempfile.TemporaryDirectory() as tmp:  # the page renders to pixels
            assert driver.save_screenshot(f"{tmp}/page.png") and Path(f"{tmp}/page.png").stat().st_size > 10_000

        victim = env.nodes["w1"]
        node = next(n for n in env.cluster.worker_nodes if n.node_id == victim)
        t0 = time.monotonic()
        env.cluster.remove_node(node, allow_graceful=False)
        WebDriverWait(driver, 5, poll_frequency=0.1).until(
            lambda _: states().get(victim) == "down",
            message=f"node {victim[:12]} not marked down within 5 s: {states()}")
        took = time.monotonic() - t0
        assert states()[env.nodes["w0"]] == "up"
        print(f"node marked down {took:.1f} s after removal")
    finally:
        driver.quit()
