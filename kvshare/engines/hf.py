"""The reference engine: a Hugging Face transformers causal LM with an external prefix cache.

:class:`HFEngine` builds the model from a local path (any Llama/Qwen/Mistral-style model) or,
by default, a small Llama from ``kvshare/configs/tiny-llama.json`` with seeded random weights.
Its prefill takes a cached prefix as a contiguous KV tensor (see :mod:`kv_convert`), puts it
into a fresh ``DynamicCache`` (``cache.update`` per layer) and computes only the remaining
tokens; decoding is greedy. It knows nothing about where the prefix came from: the worker
(:mod:`kvshare.engines.worker`) pairs it with the SDK.

Lossless: the KV of a token depends only on the tokens before it, so cached KV equals what
recomputation would produce; in fp32 the next-token logits match full recomputation to 1e-4.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch

from kvshare.attention import AttentionKind
from kvshare.hasher import Hasher
from kvshare.identity import path_identity, random_init_identity
from kvshare.kv_convert import TORCH_DTYPES, check_contiguous
from kvshare.layout import KVLayout
from kvshare.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from kvshare.types import BlockHash


def default_model_config() -> dict[str, Any]:
    """The built-in random-init model's config (``kvshare/configs/tiny-llama.json``)."""
    text = resources.files("kvshare").joinpath("configs/tiny-llama.json").read_text("utf-8")
    cfg: dict[str, Any] = json.loads(text)
    cfg.pop("_comment", None)
    return cfg


@dataclass(frozen=True)
class EngineConfig:
    """How to build the reference engine.

    ``model_path``: a local Hugging Face model directory; None builds a Llama from
    ``model_config`` (default: tiny-llama) with weights drawn from ``seed``.
    ``overrides`` patch the random-init config (e.g. ``{"num_hidden_layers": 2}`` for tests).
    ``dtype``: weights and KV dtype. ``threads``: torch intra-op threads (0 = leave as is).
    """

    model_path: str | None = None
    model_config: dict[str, Any] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    dtype: str = "fp32"
    block_tokens: int = 256
    tenant_salt: str = ""
    device: str = "cpu"
    threads: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"engine dtype must be fp32, fp16 or bf16, got {self.dtype!r}")
        if self.model_path is not None and (self.model_config is not None or self.overrides):
            raise ValueError("give either model_path or model_config/overrides, not both")


@dataclass
class Prefill:
    """Result of a prefill: logits of the next token, the filled cache, what was computed."""

    logits: torch.Tensor  # [vocab], fp32
    cache: Any  # transformers DynamicCache holding every prompt token but the last generated
    reused_tokens: int
    computed_tokens: int
    seconds: float


_HF_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ModelKeys:
    """What makes a model's blocks shareable, computed without building the model.

    The gateway uses the same keys to tokenize and hash requests for this worker.
    """

    config: dict[str, Any]  # the HF config the model is built from
    identity: str
    layout: KVLayout
    root: BlockHash
    tokenizer: ByteTokenizer | HFTokenizer

    @functools.cached_property
    def hasher(self) -> Hasher:
        """Roots per tenant salt and block hashes (default root: the configured salt's)."""
        layout = self.layout
        return Hasher(self.identity, layout.fingerprint(), layout.block_tokens, root=self.root)

    def root_for(self, salt: str | None = None) -> BlockHash:
        """The namespace root for a tenant cache salt (None: the configured one)."""
        return self.hasher.root_for(salt)

    def hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[BlockHash]:
        return self.hasher.hashes(tokens, salt)


def model_keys(cfg: EngineConfig) -> ModelKeys:
    """Identity, layout, namespace root and tokenizer of the model ``cfg`` describes."""
    if cfg.model_path is not None:
        with open(os.path.join(cfg.model_path, "config.json"), encoding="utf-8") as f:
            config_dict: dict[str, Any] = json.load(f)
        identity = path_identity(cfg.model_path, cfg.dtype)
    else:
        config_dict = {**(cfg.model_config or default_model_config()), **cfg.overrides}
        config_dict["torch_dtype"] = _HF_DTYPE[cfg.dtype]
        identity = random_init_identity(config_dict, cfg.seed, cfg.dtype)
    layout = KVLayout.from_hf_config(config_dict, dtype=cfg.dtype, block_tokens=cfg.block_tokens)
    if layout.kind is not AttentionKind.MHA:
        raise ValueError(
            f"the reference engine copies K and V per kv head (MHA/GQA) only; this model's KV "
            f"layout is {layout.kind.value!r}, which kvshare sizes and keys (`kvshare size`) but "
            "no engine loads yet: serve it with a plain model (no kvshare)")
    vocab = int(config_dict.get("vocab_size") or config_dict.get("text_config", {}).get("vocab_size", 512))
    tokenizer = load_tokenizer(cfg.model_path, vocab)
    root = Hasher.for_layout(identity, layout, cfg.tenant_salt).root
    return ModelKeys(config_dict, identity, layout, root, tokenizer)


class HFEngine:
    """A causal LM on one device, with prefill-from-cached-prefix and greedy decoding."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        try:
            from transformers import AutoModelForCausalLM, LlamaConfig
        except ImportError:
            raise ImportError("the reference engine needs transformers: "
                              "pip install 'kvshare[reference]'") from None

        self.config = cfg = config or EngineConfig()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        dtype = TORCH_DTYPES[cfg.dtype]
        self.keys = keys = model_keys(cfg)
        if cfg.model_path is not None:
            self.model: Any = AutoModelForCausalLM.from_pretrained(
                cfg.model_path, dtype=dtype, local_files_only=True
            )
            hf_config = self.model.config
        else:
            hf_config = LlamaConfig(**keys.config)
            torch.manual_seed(cfg.seed)
            self.model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)  # type: ignore[no-untyped-call]
        self.model.to(cfg.device).eval()
        self.hf_config = hf_config
        self.identity = keys.identity
        self.tokenizer = keys.tokenizer
        self.layout = keys.layout
        self.root = keys.root
        self.hasher = keys.hasher
        text = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
        self.vocab_size = int(text.vocab_size)
        self.max_positions = int(getattr(text, "max_position_embeddings", None) or 2**31)

    # ------------------------------------------------------------------ keys
    def root_for(self, salt: str | None = None) -> BlockHash:
        """The namespace root for a tenant cache salt (None: the engine's configured salt)."""
        return self.hasher.root_for(salt)

    def hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``tokens`` (in the tenant ``salt``'s namespace)."""
        return self.hasher.hashes(tokens, salt)

    def check_tokens(self, tokens: Sequence[int]) -> None:
        """ValueError naming the fix for an empty, too long or out-of-vocabulary prompt."""
        if len(tokens) == 0:
            raise ValueError("the prompt is empty: send at least one token")
        if len(tokens) > self.max_positions:
            raise ValueError(
                f"the prompt has {len(tokens)} tokens; this model takes at most {self.max_positions}"
            )
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside [0, {self.vocab_size})")

    # ------------------------------------------------------------------ compute
    def new_cache(self, prefix_kv: torch.Tensor | None = None, prefix_tokens: int = 0) -> Any:
        """A fresh ``DynamicCache`` holding the first ``prefix_tokens`` of ``prefix_kv``.

        Full-attention layers take views of ``prefix_kv`` (no copy: the first forward step
        concatenates into new tensors, so ``prefix_kv`` is never written and may be reused once
        :meth:`prefill` returns); other layer kinds go through ``cache.update``.
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.hf_config)
        if prefix_kv is not None and prefix_tokens > 0:
            check_contiguous(prefix_kv, self.layout, prefix_tokens)
            dev = self.config.device
            for i in range(self.layout.num_layers):
                k = prefix_kv[i, 0, :, :prefix_tokens].unsqueeze(0).to(dev)
                v = prefix_kv[i, 1, :, :prefix_tokens].unsqueeze(0).to(dev)
                layer = cache.layers[i] if i < len(cache.layers) else None
                if type(layer) is DynamicLayer:
                    layer.lazy_initialization(k, v)
                    layer.keys, layer.values = k, v
                else:
                    cache.update(k, v, i)
        return cache

    @torch.inference_mode()
    def prefill(
        self,
        tokens: Sequence[int],
        prefix_kv: torch.Tensor | None = None,
        prefix_tokens: int = 0,
    ) -> Prefill:
        """Compute the prompt's cache and next-token logits, reusing ``prefix_tokens`` cached.

        At least the last prompt token is always computed (a full hit still recomputes it).
        """
        self.check_tokens(tokens)
        start = time.perf_counter()
        reuse = max(0, min(prefix_tokens, len(tokens) - 1))
        cache = self.new_cache(prefix_kv, reuse)
        ids = torch.tensor([list(tokens[reuse:])], dtype=torch.long, device=self.config.device)
        pos = torch.arange(reuse, len(tokens), device=self.config.device).unsqueeze(0)
        out = self.model(
            input_ids=ids, past_key_values=cache, use_cache=True, position_ids=pos,
            logits_to_keep=1,
        )
        logits = out.logits[0, -1].float()
        return Prefill(logits, out.past_key_values, reuse, len(tokens) - reuse,
                       time.perf_counter() - start)

    @torch.inference_mode()
    def step(self, cache: Any, token: int, position: int) -> torch.Tensor:
        """Feed one token at ``position``; returns next-token logits (fp32)."""
        ids = torch.tensor([[token]], dtype=torch.long, device=self.config.device)
        pos = torch.tensor([[position]], device=self.config.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=pos)
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    def greedy(
        self, prefill: Prefill, prompt_len: int, max_new_tokens: int, stop_ids: Sequence[int] = ()
    ) -> Iterator[int]:
        """Greedy tokens after a prefill; the cache grows as tokens are consumed."""
        logits = prefill.logits
        for i in range(max_new_tokens):
            token = int(torch.argmax(logits))
            yield token
            if token in stop_ids or i + 1 == max_new_tokens or prompt_len + i + 1 >= self.max_positions:
                return
            logits = self.step(prefill.cache, token, prompt_len + i)

    def generate(
        self,
        tokens: Sequence[int],
        max_new_tokens: int,
        prefix_kv: torch.Tensor | None = None,
        prefix_tokens: int = 0,
        stop_ids: Sequence[int] = (),
    ) -> tuple[list[int], Prefill]:
        """Greedy generation (a convenience over :meth:`prefill` + :meth:`greedy`)."""
        pre = self.prefill(tokens, prefix_kv, prefix_tokens)
        return list(self.greedy(pre, len(tokens), max_new_tokens, stop_ids)), pre


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` ``[batch, kv_heads, tokens, head_dim]`` of a DynamicCache.

    The tensors are the cache's current ones; a DynamicCache replaces (never mutates) them as it
    grows, so holding these references keeps their bytes valid for an asynchronous store.
    """
    return [(layer.keys, layer.values) for layer in cache.layers]


def engine_from_env() -> HFEngine:
    """An engine configured from ``KVSHARE_MODEL`` (a path) and ``KVSHARE_SEED``."""
    path = os.environ.get("KVSHARE_MODEL") or None
    return HFEngine(EngineConfig(model_path=path, seed=int(os.environ.get("KVSHARE_SEED", "0"))))
