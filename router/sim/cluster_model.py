"""The modelled cluster the simulator replays traces on, with documented defaults.

Defaults follow the Mooncake FAST'25 setting the public traces come from (Fig. 10): 10
prefill workers, one per node, 3,000,000 tokens of host (DRAM) cache per node, 512-token
blocks, a Llama-2-70B-shaped KV cache (80 layers x 8 kv heads x 128 x fp16 = 320 KiB/token,
160 MiB per block), 100 Gbit/s between nodes.

Prefill speed of one worker (one 8-GPU node): ``a*n + b*n*(c + n/2)`` seconds with
``a = 2 * params / flops`` (the weight matmuls) and ``b = 4 * layers * hidden / flops`` (the
attention score and value products), at ``prefill_flops`` = 1.0e15 effective FLOP/s (8 x A100
at ~40% of bf16 peak): ``a`` = 0.138 ms/token (7,200 tokens/s), ``b`` = 2.6 ns/token^2.
The router does not read these constants: it fits its :class:`~kvshare.cost.PrefillModel`
from timings of the modelled worker (:meth:`ClusterConfig.measured_timings`), as a live
deployment fits from measured ones.

A worker serves a prompt only if the prompt's KV fits its GPUs: ``gpu_bytes`` (8 x 80 GB)
less the weights (``params`` x 2 bytes, bf16) over the KV bytes per token; the default
Llama-2-70B worker holds ~1.53M tokens. Longer prompts are reported as not fitting, never
replayed.

Bandwidths: host slab -> GPU 25 GB/s (PCIe 4 x16 with pinned memory), local NVMe 5 GB/s,
remote 12.5 GB/s (100 Gbit/s RDMA). Transfers and compute are not overlapped (conservative).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

from kvshare.cost import Bandwidths, CostModel, PrefillModel
from kvshare.layout import KVLayout, resolve_config
from kvshare.workers import META_GPU_CACHE_BLOCKS, META_POOL_BLOCKS

MAX_TOKENS = 10**15  # per node and tier: far past any real node, short of float trouble


@dataclass(frozen=True)
class ClusterConfig:
    """One simulated cluster; every field has a documented default (module docstring)."""

    workers: int = 10
    host_tokens: int = 3_000_000
    disk_tokens: int = 0
    block_tokens: int = 512
    model: str = "Llama-2-70b-hf"
    params: float = 69e9
    prefill_flops: float = 1.0e15
    host_bw: float = 25e9
    disk_bw: float = 5e9
    net_bw: float = 12.5e9
    remote_latency_s: float = 0.001
    gpu_bytes: float = 8 * 80e9
    pending_ttl_s: float = 60.0
    gpu_cache_tokens: int | None = None
    """Each worker's own prefix cache (vLLM's, in its GPUs): every block it computes or loads
    stays there, least recently used evicted first. None: ``kv_capacity_tokens``; 0: none."""
    namespace: str = "sim"
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("a cluster needs at least 1 worker (--workers)")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens} (--block-tokens)")
        for name in ("host_tokens", "disk_tokens"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_TOKENS:
                raise ValueError(
                    f"{name} must be in [0, {MAX_TOKENS:.0e}] tokens per node, got {value} "
                    f"(--{name.replace('_', '-')})"
                )
        if self.gpu_cache_tokens is not None and not 0 <= self.gpu_cache_tokens <= MAX_TOKENS:
            raise ValueError(f"gpu_cache_tokens must be in [0, {MAX_TOKENS:.0e}], got "
                             f"{self.gpu_cache_tokens}")
        if self.host_tokens + self.disk_tokens < self.block_tokens:
            raise ValueError("each node needs room for at least one block (--host-tokens)")
        for name in ("params", "prefill_flops", "host_bw", "disk_bw", "net_bw", "gpu_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClusterConfig.{name} must be positive")

    @cached_property
    def _hf(self) -> dict[str, object]:
        with open(resolve_config(self.model), encoding="utf-8") as f:
            cfg: dict[str, object] = json.load(f)
        return cfg

    @cached_property
    def layout(self) -> KVLayout:
        return KVLayout.from_hf_config(resolve_config(self.model), block_tokens=self.block_tokens)

    @property
    def hidden_size(self) -> int:
        return int(str(self._hf.get("hidden_size", self.layout.num_kv_heads * self.layout.head_dim)))

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV one worker's GPUs hold next to the weights: the longest prompt it serves."""
        return max(0, int((self.gpu_bytes - 2 * self.params) // self.layout.bytes_per_token))

    @property
    def gpu_cache_capacity_tokens(self) -> int:
        """Tokens of each worker's own prefix cache (``gpu_cache_tokens``, default the GPUs' KV room)."""
        return self.kv_capacity_tokens if self.gpu_cache_tokens is None else self.gpu_cache_tokens

    @property
    def max_context_tokens(self) -> int | None:
        """The model's ``max_position_embeddings``, if its config gives one."""
        value = self._hf.get("max_position_embeddings")
        return int(str(value)) if value is not None else None

    def worker_prefill(self) -> PrefillModel:
        """The modelled worker's true prefill speed (what the simulated GPUs take)."""
        a = 2 * self.params / self.prefill_flops
        b = 4 * self.layout.num_layers * self.hidden_size / self.prefill_flops
        return PrefillModel(a, b)

    def measured_timings(self) -> list[tuple[float, float, float]]:
        """Start-up timings ``(new, cached, seconds)`` a worker would report: a small grid."""
        pm = self.worker_prefill()
        grid = [(n, c) for n in (512, 2048, 8192, 32768) for c in (0, 4096, 32768)]
        return [(float(n), float(c), pm.time(n, c)) for n, c in grid]

    def bandwidths(self) -> Bandwidths:
        return Bandwidths(self.host_bw, self.disk_bw, self.net_bw, 0.0, self.remote_latency_s)

    def cost_model(self) -> CostModel:
        """The router's cost model: fitted prefill speed + the cluster's bandwidths, pricing
        what a hit on the model's layout moves (:meth:`CostModel.for_layout`)."""
        return CostModel.for_layout(PrefillModel.fit(self.measured_timings()), self.bandwidths(),
                                    self.layout)

    def capacity_meta(self) -> dict[str, str]:
        """What each worker reports of its caches' sizes in its meta, in blocks: its engine's
        prefix cache and its node's pool (host + disk; :mod:`kvshare.router.core.recency`)."""
        bt = self.block_tokens
        out = {META_POOL_BLOCKS: str((self.host_tokens + self.disk_tokens) // bt)}
        if self.gpu_cache_capacity_tokens >= bt:
            out[META_GPU_CACHE_BLOCKS] = str(self.gpu_cache_capacity_tokens // bt)
        return out

    def describe(self) -> dict[str, float | int | str]:
        pm = self.worker_prefill()
        return {
            "workers": self.workers, "host_tokens": self.host_tokens,
            "disk_tokens": self.disk_tokens, "block_tokens": self.block_tokens,
            "model": self.model, "kv_bytes_per_token": self.layout.bytes_per_token,
            "prefill_tokens_per_s": round(pm.tokens_per_s), "net_gbit_s": self.net_bw * 8 / 1e9,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "gpu_cache_tokens": self.gpu_cache_capacity_tokens,
        }
