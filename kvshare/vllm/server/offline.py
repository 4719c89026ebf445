"""A vLLM engine in this process (``vllm.LLM``), as tests, benchmarks and Ray actors use it.

``ray.remote(OfflineEngine)`` pinned to a node is how "an engine on node 2" is made real in a
fake multi-node cluster: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (:data:`ENGINE_ENV`) the
EngineCore and its CPU worker run inside the actor's process, so the connector finds that
node's pool. :meth:`generate` returns plain data; :meth:`drain` steps the engine until
requests whose pages vLLM kept for an in-flight save are released (the offline ``LLM`` API
stops stepping when outputs are done; the API server keeps stepping by itself).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def kv_transfer_config(namespace: str, **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` for the KVShareConnector (``extra``: more extra-config keys)."""
    return {"kv_connector": "KVShareConnector", "kv_connector_module_path": "kvshare.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"namespace": namespace, **extra}}


class OfflineEngine:
    """``vllm.LLM`` with prefix caching, greedy requests by token ids, timings, counters."""

    def __init__(self, model: str, *, kv_transfer: Mapping[str, Any] | None = None,
                 dtype: str = "float32", block_size: int = 32, max_model_len: int = 2048,
                 num_pages: int | None = None, env: Mapping[str, str] | None = None,
                 kv_events: Mapping[str, Any] | None = None, **llm_args: Any) -> None:
        for k, v in {**ENGINE_ENV, **dict(env or {})}.items():
            os.environ.setdefault(k, v)
        from vllm import LLM
        from vllm.config import KVEventsConfig, KVTransferConfig

        args: dict[str, Any] = dict(
            model=model, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
            enable_prefix_caching=True, enforce_eager=True, distributed_executor_backend="uni",
            disable_log_stats=False, **llm_args)
        if num_pages is not None:
            args["num_gpu_blocks_override"] = num_pages
        if kv_transfer is not None:
            args["kv_transfer_config"] = KVTransferConfig(**dict(kv_transfer))
        if kv_events is not None:  # vLLM's --kv-events-config, e.g. a zmq publisher
            args["kv_events_config"] = KVEventsConfig(**dict(kv_events))
        self.llm = LLM(**args)

    def ready(self) -> dict[str, Any]:
        node = ""
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"node": node, "pid": os.getpid()}

    def _scheduler(self) -> Any:
        core: Any = self.llm.llm_engine.engine_core  # InprocClient (multiprocessing off)
        return core.engine_core.scheduler

    def drain(self, timeout_s: float = 30.0) -> None:
        """Step until no finished request still holds pages (saves done)."""
        sched = self._scheduler()
        deadline = time.monotonic() + timeout_s
        while sched.has_requests() and time.monotonic() < deadline:
            self.llm.llm_engine.step()
            time.sleep(0.001)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8,
                 logprobs: int = 0,
                 kv_transfer_params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Greedy completions: token ids, per-token logprobs of the chosen tokens (and top-k
        when ``logprobs``), cached prompt tokens and wall seconds (for all prompts).
        ``kv_transfer_params``: what every request hands the connector (as the OpenAI
        server's field of that name does; e.g. :mod:`kvshare.vllm.connector.opt_out`)."""
        from vllm import SamplingParams

        extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs or None,
                            ignore_eos=True, extra_args=extra)
        t0 = time.perf_counter()
        llm: Any = self.llm
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        self.drain()
        res = []
        for o in outs:
            c = o.outputs[0]
            lps = [{int(k): float(v.logprob) for k, v in d.items()} for d in (c.logprobs or [])]
            res.append({"tokens": list(c.token_ids), "logprobs": lps,
                        "cached_tokens": int(o.num_cached_tokens or 0), "seconds": seconds})
        return res

    def reset_prefix_cache(self) -> bool:
        self.drain()
        return bool(self.llm.reset_prefix_cache())

    def refresh_bandwidths(self) -> list[dict[str, Any]]:
        """:func:`kvshare.vllm.connector.kv_connector.refresh_bandwidths` in this engine."""
        from kvshare.vllm.connector.kv_connector import refresh_bandwidths

        return refresh_bandwidths()

    def counters(self) -> dict[str, float]:
        from kvshare.vllm.connector.kv_connector import process_counters

        return process_counters()

    def metrics(self) -> dict[str, float]:
        """vLLM's own counters (e.g. ``vllm:external_prefix_cache_hits``), summed over labels."""
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            value = getattr(m, "value", None)
            if isinstance(value, int | float):
                out[m.name] = out.get(m.name, 0.0) + float(value)
        return out
