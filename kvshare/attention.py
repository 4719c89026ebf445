"""Attention kinds: what one token leaves in the KV cache, read from a Hugging Face config.

- ``mha``: MHA/GQA. Every layer keeps a key and a value per kv head.
- ``mla``: multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2). Every layer keeps one
  latent per token, ``kv_lora_rank`` compressed-KV values then ``qk_rope_head_dim`` rotary-key
  values; no heads, no separate K and V, identical on every TP rank.
- ``sliding``: some or all layers attend to a sliding window (Gemma 2/3, gpt-oss, Cohere 2,
  Mistral-7B-v0.1). The layers fall into KV-cache groups, one per window (full attention is a
  group without one), as vLLM's hybrid allocator groups them.

Anything else keeps per-sequence state that is not attention KV (Mamba/SSM, linear attention,
convolutions) or attention kvshare has no block format for yet; :func:`read_attention` raises a
ValueError naming the model type and what is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class AttentionKind(StrEnum):
    """The kind of a :class:`~kvshare.layout.KVLayout` (its value is what ``to_dict`` writes)."""

    MHA = "mha"
    MLA = "mla"
    SLIDING = "sliding"


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: the layers (ascending indices) that share one attention window.

    ``window`` is the tokens a layer attends to, itself included (``sliding_window`` of the HF
    config); None is full attention.
    """

    layers: tuple[int, ...]
    window: int | None = None

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers or any(not isinstance(i, int) or isinstance(i, bool) or i < 0
                             for i in layers):
            raise ValueError(f"KVGroup.layers must be non-negative layer indices, got {layers!r}")
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"KVGroup.layers must be ascending and distinct, got {layers!r}")
        object.__setattr__(self, "layers", layers)
        w = self.window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
            raise ValueError(f"KVGroup.window must be a positive int or None, got {w!r}")

    def blocks_needed(self, blocks: int, block_tokens: int) -> int:
        """Share blocks of this group that a hit on the first ``blocks`` blocks needs: all of
        them under full attention; under a window ``W`` only the last ``ceil((W - 1) / B)``
        (the tokens the next token can still see, as vLLM's sliding-window manager counts)."""
        return blocks if self.window is None else min(blocks, self.window_blocks(block_tokens))

    def window_blocks(self, block_tokens: int) -> int:
        """``ceil((W - 1) / block_tokens)``: the blocks a windowed group's hit needs at most."""
        assert self.window is not None, "a full-attention group has no window"
        return -(-(self.window - 1) // block_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "window": self.window}


# model types whose per-sequence state is not attention KV: what that state is
_STATE_MODELS: dict[str, str] = {
    "mamba": "Mamba SSM state", "mamba2": "Mamba-2 SSM state",
    "falcon_mamba": "Mamba SSM state", "falcon_h1": "Mamba-2 SSM state beside attention",
    "jamba": "Mamba SSM state beside attention", "zamba": "Mamba SSM state beside attention",
    "zamba2": "Mamba-2 SSM state beside attention", "bamba": "Mamba-2 SSM state beside attention",
    "nemotron_h": "Mamba-2 SSM state beside attention",
    "granitemoehybrid": "Mamba-2 SSM state beside attention",
    "qwen3_next": "gated DeltaNet linear-attention state beside attention",
    "kimi_linear": "Kimi delta linear-attention state beside MLA",
    "minimax": "lightning linear-attention state beside attention",
    "lfm2": "short-convolution state beside attention",
    "recurrent_gemma": "RG-LRU recurrent state", "rwkv": "RWKV recurrent state",
    "xlstm": "xLSTM recurrent state",
}
_STATE_KEYS = ("ssm_state_size", "mamba_d_state", "state_size", "linear_conv_kernel_dim")
_LAYER_TYPE_STATE = {"linear_attention": "linear-attention state", "mamba": "Mamba SSM state",
                     "conv": "short-convolution state",
                     "chunked_attention": "chunked local attention (Llama 4)"}
# sliding layers with their own kv heads or head size: one head geometry per layout for now
_PER_GROUP_GEOMETRY = ("swa_num_key_value_heads", "swa_num_kv_heads", "swa_head_dim",
                       "global_head_dim", "num_global_key_value_heads")
# configs that state the interleaving as a period (layer i slides unless (i + 1) % period == 0)
# instead of listing layer_types; the value is transformers' default period of that model type
_PERIODIC = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}


@dataclass(frozen=True)
class Attention:
    """What :func:`read_attention` found: the kind and its own fields."""

    kind: AttentionKind
    latent_dim: int = 0
    """MLA: ``kv_lora_rank + qk_rope_head_dim``, the values one token keeps per layer."""
    rope_dim: int = 0
    """MLA: the latent's trailing rotary part (``qk_rope_head_dim``)."""
    groups: tuple[KVGroup, ...] = ()
    """SLIDING: the KV-cache groups (:func:`canonical_groups` order)."""


def read_attention(cfg: dict[str, Any], num_layers: int, source: str) -> Attention:
    """The attention kind of one HF text config (``text_config`` already unwrapped).

    ValueError, naming the model type and what is missing, for kinds without a block format.
    """
    model_type = str(cfg.get("model_type") or "model")
    name = f"{source} (model_type {model_type!r})"
    state = _STATE_MODELS.get(model_type)
    if state is None:
        state = next((f"SSM state ({k})" for k in _STATE_KEYS if cfg.get(k)), None)
    layer_types = cfg.get("layer_types")
    if state is None and isinstance(layer_types, list):
        state = next((f"{_LAYER_TYPE_STATE.get(str(t), 'state')} (layer_types has {t!r})"
                      for t in layer_types if t not in ("full_attention", "sliding_attention")),
                     None)
    if state is None and cfg.get("attention_chunk_size"):
        state = "chunked local attention (attention_chunk_size)"
    if state is not None:
        raise ValueError(
            f"{name} keeps {state}, which kvshare does not share yet: missing is a block "
            "format for that state (kvshare has one for attention KV only: MHA/GQA, MLA, "
            "sliding-window groups)")
    if cfg.get("kv_lora_rank"):
        return _mla(cfg, name)
    return _sliding(cfg, num_layers, name, layer_types)


def _mla(cfg: dict[str, Any], name: str) -> Attention:
    if cfg.get("index_topk"):
        raise ValueError(
            f"{name}: MLA with DeepSeek sparse attention (index_topk) keeps an indexer key cache "
            "beside the latent, which kvshare does not share yet")
    rope = cfg.get("qk_rope_head_dim")
    if not rope:
        raise ValueError(f"{name}: MLA config (kv_lora_rank) without 'qk_rope_head_dim': the "
                         "latent's width is kv_lora_rank + qk_rope_head_dim")
    rank = int(cfg["kv_lora_rank"])
    return Attention(AttentionKind.MLA, latent_dim=rank + int(rope), rope_dim=int(rope))


def _sliding(cfg: dict[str, Any], num_layers: int, name: str, layer_types: object) -> Attention:
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window", True) is False:
        return Attention(AttentionKind.MHA)
    model_type = str(cfg.get("model_type"))
    sliding: Sequence[bool]
    if isinstance(layer_types, list):
        if len(layer_types) != num_layers:
            raise ValueError(f"{name}: layer_types lists {len(layer_types)} layers but "
                             f"num_hidden_layers is {num_layers}")
        sliding = [t == "sliding_attention" for t in layer_types]
    elif model_type in _PERIODIC or cfg.get("sliding_window_pattern"):
        period = int(cfg.get("sliding_window_pattern") or _PERIODIC[model_type])
        sliding = [(i + 1) % period != 0 for i in range(num_layers)]
    elif cfg.get("max_window_layers") is not None:  # Qwen2/3: the layers from there on slide
        sliding = [i >= int(cfg["max_window_layers"]) for i in range(num_layers)]
    else:  # Mistral-7B-v0.1, Phi-3, Starcoder2: every layer slides
        sliding = [True] * num_layers
    if not any(sliding):
        return Attention(AttentionKind.MHA)
    bad = [k for k in _PER_GROUP_GEOMETRY if cfg.get(k)]
    if bad:
        raise ValueError(f"{name}: sliding-window layers with their own kv heads or head size "
                         f"({', '.join(bad)}) are not supported yet: one head geometry per model")
    full = tuple(i for i, s in enumerate(sliding) if not s)
    slid = tuple(i for i, s in enumerate(sliding) if s)
    groups = ((KVGroup(full),) if full else ()) + (KVGroup(slid, int(window)),)
    return Attention(AttentionKind.SLIDING, groups=groups)


def canonical_groups(groups: Sequence[KVGroup | dict[str, Any]], num_layers: int
                     ) -> tuple[KVGroup, ...]:
    """Groups in canonical order (full attention first, then by window), checked to hold every
    layer once, one group per window and at least one windowed group."""
    out = [g if isinstance(g, KVGroup) else KVGroup(tuple(g["layers"]), g.get("window"))
           for g in groups]
    out.sort(key=lambda g: (g.window is not None, g.window or 0))
    windows = [g.window for g in out]
    if len(set(windows)) != len(windows):
        raise ValueError(f"KVLayout groups: one group per window, got windows {windows}")
    if all(w is None for w in windows):
        raise ValueError("KVLayout groups: no sliding-window group; use kind 'mha'")
    layers = sorted(i for g in out for i in g.layers)
    if layers != list(range(num_layers)):
        raise ValueError(f"KVLayout groups must hold each of the {num_layers} layers once, "
                         f"got {layers}")
    return tuple(out)
