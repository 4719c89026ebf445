"""What both demos share: the emulated cluster, the gateway thread, the multi-turn chat workload
through the official ``openai`` client, the TTFT table, the chart and the live page's screenshot.

``examples/demo.py`` (vLLM workers, ``make demo``) and ``examples/demo_reference.py`` (reference
transformers workers, ``make demo-reference``) import it from this folder.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvshare import breakdown

USERS = 4
TURNS = 4
MAX_TOKENS = 8
SYSTEM_CHARS = 1800
DOC_CHARS = 2200


@dataclass
class Turn:
    user: int
    turn: int
    worker: str = ""
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, Any] = field(default_factory=dict)  # where its TTFT went (gateway)


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    words = ["cache", "tensor", "ray", "node", "prefix", "block", "query", "route", "layer",
             "token", "model", "share", "pool", "index", "remote", "disk", "host", "gpu"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(words))
    return " ".join(out)[:n]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster() -> Any:
    """The emulated cluster both demos run on: a head and two nodes (resources ``node_0``,
    ``node_1``), a context manager (:func:`kvshare.actors.local_cluster.local_cluster`)."""
    from kvshare.actors.local_cluster import local_cluster

    return local_cluster(2, node_cpus=2, ray_namespace="kvshare-demo",
                         temp_prefix="kvshare-demo-ray-")


@contextlib.contextmanager
def hosts_cluster(link: str) -> Iterator[Any]:
    """Two emulated hosts (:class:`kvshare.testing.hosts.EmulatedHosts`: own network, /dev/shm
    and hostname each, on a private bridge; root only) with a Ray node each, this process
    joined; host 1's link shaped to ``link`` (tbf both ways). Yields the harness; its
    ``ray_address`` is the cluster's."""
    import ray

    from kvshare.testing.hosts import EmulatedHosts

    with EmulatedHosts(2, ray=True, num_cpus=2, shm_mb=1024, object_store_mb=300,
                       start_timeout_s=600) as hs:
        hs.connect_ray("kvshare-demo")
        hs.shape(hs[1], link)
        for h in hs.hosts:
            print(f"  host {h.name} at {h.ip}" + (f", its link shaped to {link}" if h.index else ""))
        try:
            yield hs
        finally:
            ray.shutdown()


def serve_gateway(app: Any) -> tuple[str, Any]:
    """``app`` on a loopback port in a daemon thread; returns (``.../v1`` URL, server)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}/v1", server


def run_turn(client: Any, t: Turn, messages: list[dict[str, str]], model: str,
             usage: bool) -> str:
    """One streamed chat turn. Reuse comes from the worker's ``kvshare`` figures (reference
    workers) or from the usage chunk's ``prompt_tokens_details.cached_tokens`` (vLLM, with
    ``usage``); the worker from the gateway's ``x-kvshare-worker`` header."""
    start = time.perf_counter()
    first: float | None = None
    out: list[str] = []
    extra: dict[str, Any] = {}
    more: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, stream=True, **more)
    t.worker = raw.headers.get("x-kvshare-worker", "")
    for chunk in raw.parse():
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            if first is None:
                first = time.perf_counter() - start
            out.append(chunk.choices[0].delta.content or "")
        kv = (chunk.model_extra or {}).get("kvshare")
        if kv:
            extra = kv
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            t.prompt_tokens = int(chunk.usage.prompt_tokens)
            t.reused_tokens = int(details.cached_tokens or 0) if details is not None else 0
    t.ttft_s = first if first is not None else time.perf_counter() - start
    if "reused_tokens" in extra:  # a reference worker's figures (a vLLM usage event carries
        t.reused_tokens = int(extra["reused_tokens"])  # only the gateway's breakdown)
        t.prompt_tokens = t.reused_tokens + int(extra.get("computed_tokens", 0))
        t.bytes_by_transport = dict(extra.get("bytes_by_transport", {}))
        t.bytes_by_tier = dict(extra.get("bytes_by_tier", {}))
        t.worker = str(extra.get("worker", t.worker))
    if extra:
        t.breakdown = dict(extra.get("breakdown", {}))
    return "".join(out)


def drive(base_url: str, model: str, usage: bool = False,
          before_turn: Callable[[int], None] | None = None,
          after_wave: Callable[[list[Turn]], None] | None = None) -> list[Turn]:
    """USERS users x TURNS turns sharing two system prompts + documents. Turn 0 seeds the two
    prompts two users at a time; later turns run every user at once, so load spreads requests
    over both nodes and some prefixes are pulled from the other node. ``before_turn(t)`` runs
    before the first request of turn ``t``; ``after_wave(turns)`` once a wave's requests all
    ended, with them."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="demo", max_retries=0, timeout=300)
    systems = [text(100 + i, SYSTEM_CHARS) for i in range(2)]
    docs = [text(200 + i, DOC_CHARS) for i in range(2)]
    history: dict[int, list[dict[str, str]]] = {
        u: [{"role": "system", "content": systems[u % 2] + "\n\nDocument:\n" + docs[u % 2]}]
        for u in range(USERS)
    }
    done: list[Turn] = []
    total = USERS * TURNS

    def one(u: int, turn: int) -> Turn:
        history[u].append({"role": "user", "content": f"user {u} turn {turn}: " + text(
            1000 * u + turn, 120)})
        t = Turn(u, turn)
        answer = run_turn(client, t, history[u], model, usage)
        history[u].append({"role": "assistant", "content": answer})
        return t

    waves = [(0, list(range(b, min(b + 2, USERS)))) for b in range(0, USERS, 2)]
    waves += [(turn, list(range(USERS))) for turn in range(1, TURNS)]
    with ThreadPoolExecutor(USERS) as pool:
        for turn, users in waves:
            if before_turn is not None and users[0] == 0:
                before_turn(turn)
            wave = []
            for f in [pool.submit(one, u, turn) for u in users]:
                t = f.result()
                done.append(t)
                wave.append(t)
                print(f"  [{len(done):2d}/{total}] user {t.user} turn {t.turn} -> {t.worker}: "
                      f"{t.prompt_tokens:5d} prompt tokens, {t.reused_tokens:5d} reused, "
                      f"TTFT {t.ttft_s * 1000:7.1f} ms", flush=True)
            if after_wave is not None:
                after_wave(wave)
    return done


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def ttft_table(turns: list[Turn]) -> None:
    """Requests, prefill tokens saved, TTFT cold (nothing reused) vs warm (a prefix reused)."""
    cold = [t.ttft_s for t in turns if t.reused_tokens == 0]
    warm = [t.ttft_s for t in turns if t.reused_tokens > 0]
    prompt = sum(t.prompt_tokens for t in turns)
    reused = sum(t.reused_tokens for t in turns)
    print(f"requests                 {len(turns)} ({len(cold)} cold, {len(warm)} warm)")
    print(f"prefill tokens saved     {reused:,} of {prompt:,} ({reused / max(prompt, 1):.1%})")
    print(f"TTFT cold   p50 / p90    {pct(cold, .5) * 1e3:8.1f} / {pct(cold, .9) * 1e3:8.1f} ms")
    print(f"TTFT warm   p50 / p90    {pct(warm, .5) * 1e3:8.1f} / {pct(warm, .9) * 1e3:8.1f} ms")
    if cold and warm:
        print(f"TTFT speed-up (p50)      {pct(cold, .5) / pct(warm, .5):.1f}x")  # the p50s above
    groups = split_breakdowns(turns)
    if any(groups.values()):  # kvshare's workers say where their TTFT went (vLLM's streams don't)
        print(breakdown.summary(groups))


def split_breakdowns(turns: list[Turn]) -> dict[str, list[dict[str, Any]]]:
    """The turns' TTFT breakdowns, cold (nothing reused) and warm."""
    return {"cold": [t.breakdown for t in turns if t.reused_tokens == 0 and t.breakdown],
            "warm": [t.breakdown for t in turns if t.reused_tokens > 0 and t.breakdown]}


def pool_tiers(pool_status: dict[str, Any]) -> None:
    """Hits, misses and blocks per pool tier, summed over the nodes (``kvshare.actors.deploy.status``)."""
    from collections import Counter

    print("pool tiers (all nodes)   hits   misses  hit rate   blocks")
    totals: dict[str, Counter[str]] = {}
    for node in pool_status.get("nodes", []):
        for ns in node.get("pool", {}).get("namespaces", {}).values():
            for tier, st in ns.get("tiers", {}).items():
                totals.setdefault(tier, Counter()).update(
                    {k: st.get(k, 0) for k in ("hits", "misses", "blocks")})
    for tier, c in totals.items():
        rate = c["hits"] / max(1, c["hits"] + c["misses"])
        print(f"  {tier:8s}              {c['hits']:6d} {c['misses']:8d}  {rate:7.1%} {c['blocks']:8d}")


def finish_report(turns: list[Turn], pool_status: dict[str, Any], path: str, title: str) -> bool:
    """The pools' tiers and the TTFT chart; True if any prefix was reused."""
    pool_tiers(pool_status)
    plot(turns, path, title)
    return sum(t.reused_tokens for t in turns) > 0


def wrap_up(ok: bool, base_url: str, server: Any, screenshot: str, t0: float) -> int:
    """Screenshot the live page, stop the gateway; the exit code (1: nothing was reused)."""
    import sys

    page_screenshot(base_url.removesuffix("/v1") + "/dashboard", screenshot)
    server.should_exit = True
    print(f"done in {time.monotonic() - t0:.0f} s")
    if not ok:
        print("error: no prefix was reused", file=sys.stderr)
    return 0 if ok else 1


def plot(turns: list[Turn], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    groups = split_breakdowns(turns)
    if any(groups.values()):
        fig, (ax, parts) = plt.subplots(1, 2, figsize=(12, 4), width_ratios=(3, 1))
        breakdown.stack(parts, list(groups), [breakdown.medians(g) for g in groups.values()])
        parts.set_title("TTFT breakdown (median)")
    else:
        fig, ax = plt.subplots(figsize=(9, 4))
    colors = ["tab:red" if t.reused_tokens == 0 else "tab:green" for t in turns]
    ax.bar(range(len(turns)), [t.ttft_s * 1e3 for t in turns], color=colors)
    ax.set_xlabel("request (red = cold, green = prefix reused)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"chart: {path}")


def page_screenshot(url: str, path: str) -> None:
    """The gateway's live page in headless Chromium (``make browser``), saved as a PNG."""
    from kvshare.testing import browser

    if browser.missing():
        print(f"no screenshot of {url}: {browser.missing()}")
        return
    time.sleep(1.5)  # one more refresh of the page's cluster status after the last request
    browser.screenshot(url, path, wait_for_css="[data-hit-rate]")
    print(f"live page: {url} (screenshot {path})")


def timed(label: str, fn: Callable[[], Any]) -> Any:
    t0 = time.monotonic()
    out = fn()
    print(f"  {label} in {time.monotonic() - t0:.0f} s", flush=True)
    return out
