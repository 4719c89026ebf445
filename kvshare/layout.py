"""KV layout: the shape and size of one block of KV cache, per attention kind.

Canonical share-block payloads (``B`` = ``block_tokens`` tokens, in the layout's dtype):

- ``mha`` (MHA/GQA): ``[layer][k|v][kv_head][token][head_dim]``, all kv heads; bytes per token
  ``= 2 * layers * kv_heads * head_dim * dtype_bytes``. Tensor-parallel rank r owns a contiguous
  range of kv heads in each layer.
- ``mla``: ``[layer][token][latent]``, one latent per token per layer (``kv_lora_rank`` values
  then the ``qk_rope_head_dim`` rotary key, ``head_dim`` = their sum, ``num_kv_heads`` 1);
  bytes per token ``= layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes``: no K/V pair,
  no heads. Every TP rank holds the whole latent, so a block is stored once and each rank reads
  all of it (no shards). DeepSeek-V3 in bf16: 61 * 576 * 2 = 70,272 bytes per token.
- ``sliding``: the layers fall into KV-cache groups, one per attention window (full attention
  is a group without one). Block ``i`` of a prompt has one share block per group,
  ``[layer of the group][k|v][kv_head][token][head_dim]``. A hit on the first ``k`` blocks
  needs the full group's blocks ``0..k-1`` but a window-``W`` group's last
  ``ceil((W - 1) / B)`` blocks only: what the engine still holds at save time (vLLM frees the
  pages behind the window) and all the next token can see. So a sliding group's blocks are
  kept for the last window of a saved prefix, and :meth:`KVLayout.hit_bytes` prices a hit at
  far fewer bytes than :attr:`KVLayout.bytes_per_token` suggests.

The layout fingerprint (part of the namespace root) covers the kind and, per kind, the MLA
rotary width or the layer-to-group map with each group's window.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshare.attention import AttentionKind, KVGroup, canonical_groups, read_attention

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "fp16": 2,
    "bf16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

_DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "fp32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "fp16": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "fp8_e5m2": "fp8_e5m2",
}

SUPPORTED_KINDS = tuple(k.value for k in AttentionKind)


def normalize_dtype(dtype: str) -> str:
    """Canonical dtype name (``bf16``, ``fp16``, ``fp32``, ``fp8_e4m3``, ``fp8_e5m2``)."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(
            f"unsupported KV dtype {dtype!r}: use one of {sorted(set(_DTYPE_ALIASES.values()))}"
        )
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class KVLayout:
    """How one model's KV cache is cut into shareable blocks (see the module docstring).

    ``rope_dim`` is MLA's only (the latent's trailing rotary width); ``groups`` the SLIDING
    kind's only (its KV-cache groups, kept in :func:`canonical_groups` order).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    block_tokens: int = 256
    kind: AttentionKind = AttentionKind.MHA
    rope_dim: int = 0
    groups: tuple[KVGroup, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.kind not in SUPPORTED_KINDS:
            raise ValueError(f"attention kind {self.kind!r} is not supported yet (supported: "
                             f"{', '.join(SUPPORTED_KINDS)})")
        kind = AttentionKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if kind is AttentionKind.MLA:
            if self.num_kv_heads != 1 or not 0 < self.rope_dim < self.head_dim:
                raise ValueError(
                    "an MLA KVLayout has num_kv_heads 1, head_dim = kv_lora_rank + rope_dim and "
                    f"0 < rope_dim < head_dim; got {self.num_kv_heads} kv heads, head_dim "
                    f"{self.head_dim}, rope_dim {self.rope_dim} (KVLayout.mla builds one)")
        elif self.rope_dim:
            raise ValueError(f"KVLayout.rope_dim is MLA's only, got {self.rope_dim} for {kind}")
        if kind is AttentionKind.SLIDING:
            object.__setattr__(self, "groups", canonical_groups(self.groups, self.num_layers))
        elif self.groups:
            raise ValueError(f"KVLayout.groups are the sliding kind's only, not {kind}'s")

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: str = "bf16",
            block_tokens: int = 256) -> KVLayout:
        """An MLA layout: one ``kv_lora_rank + rope_dim`` latent per token per layer."""
        return cls(num_layers, 1, kv_lora_rank + rope_dim, dtype, block_tokens,
                   AttentionKind.MLA, rope_dim=rope_dim)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def planes(self) -> int:
        """Tensors per layer and token: 2 (K and V), MLA's 1 (the latent)."""
        return 1 if self.kind is AttentionKind.MLA else 2

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token keeps in every layer (a SLIDING model's while all are live)."""
        return self.planes * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, planes, kv_heads, block_tokens, head_dim)``: the canonical block payload
        (MLA: ``(layers, 1, 1, block_tokens, latent)``)."""
        return (self.num_layers, self.planes, self.num_kv_heads, self.block_tokens,
                self.head_dim)

    def group_bytes_per_token(self, group: KVGroup) -> int:
        """KV bytes one token keeps in the layers of ``group``."""
        return self.planes * len(group.layers) * self.num_kv_heads * self.head_dim * \
            self.dtype_bytes

    def hit_bytes(self, blocks: int) -> int:
        """Bytes a hit on a prompt's first ``blocks`` blocks moves: every block's, except that
        a sliding group moves only its last window's blocks (:meth:`KVGroup.blocks_needed`)."""
        if blocks < 0:
            raise ValueError(f"blocks must be >= 0, got {blocks}")
        if self.kind is not AttentionKind.SLIDING:
            return blocks * self.bytes_per_block
        return sum(g.blocks_needed(blocks, self.block_tokens) * self.block_tokens
                   * self.group_bytes_per_token(g) for g in self.groups)

    def fetch_terms(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """For the cost model: bytes per token that every fetched block moves, and per
        sliding group ``(window blocks, bytes per token)`` moved by the last window only."""
        if self.kind is not AttentionKind.SLIDING:
            return self.bytes_per_token, ()
        every = sum(self.group_bytes_per_token(g) for g in self.groups if g.window is None)
        windows = tuple((g.window_blocks(self.block_tokens), self.group_bytes_per_token(g))
                        for g in self.groups if g.window is not None)
        return every, windows

    def fingerprint(self) -> str:
        """A short stable digest of every field; two layouts share blocks only if equal."""
        fields: list[Any] = [self.kind.value, self.num_layers, self.num_kv_heads, self.head_dim,
                             self.dtype, self.block_tokens]
        if self.kind is AttentionKind.MLA:
            fields.append(self.rope_dim)
        elif self.kind is AttentionKind.SLIDING:  # the layer-to-group map and the windows
            fields.append([[g.window, list(g.layers)] for g in self.groups])
        text = json.dumps(fields, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "kind": self.kind.value,
        }
        if self.kind is AttentionKind.MLA:
            out["rope_dim"] = self.rope_dim
        elif self.kind is AttentionKind.SLIDING:
            out["groups"] = [g.to_dict() for g in self.groups]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        data = dict(data)
        if "groups" in data:
            data["groups"] = tuple(KVGroup(tuple(g["layers"]), g.get("window"))
                                   for g in data["groups"])
        return cls(**data)

    @classmethod
    def from_hf_config(
        cls,
        config: dict[str, Any] | str | Path,
        *,
        dtype: str | None = None,
        block_tokens: int = 256,
    ) -> KVLayout:
        """Build from a Hugging Face ``config.json`` (a dict or a path to the file).

        ``num_key_value_heads`` falls back to ``num_attention_heads``; ``head_dim`` falls back
        to ``hidden_size / num_attention_heads``; dtype comes from ``dtype`` /
        ``torch_dtype`` unless given; a nested ``text_config`` (multimodal models) is used
        when present. A key the config omits is taken from the transformers default of its
        ``model_type`` (as transformers itself does when it loads the config; real configs
        such as llava-1.5's ``text_config`` rely on that); without a ``model_type`` that
        transformers knows, a missing key is a ValueError naming it. The attention kind comes
        from :func:`~kvshare.attention.read_attention` (MLA from ``kv_lora_rank``; sliding
        windows from ``layer_types``, ``sliding_window`` and the model type's pattern).
        """
        source = str(config) if not isinstance(config, dict) else "config"
        if not isinstance(config, dict):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"{source}: expected a JSON object")
        cfg: dict[str, Any] = config
        if isinstance(cfg.get("text_config"), dict):
            outer = cfg
            cfg = {**cfg["text_config"]}
            for key in ("torch_dtype", "dtype"):
                cfg.setdefault(key, outer.get(key))

        def need(key: str) -> int:
            if cfg.get(key) is None:
                default = _transformers_default(cfg.get("model_type"), key)
                if default is None:
                    raise ValueError(f"{source}: missing key {key!r} needed for the KV layout")
                return default
            return int(cfg[key])

        num_layers = need("num_hidden_layers")
        attn = read_attention(cfg, num_layers, source)
        if dtype is None:
            dtype = cfg.get("dtype") or cfg.get("torch_dtype")
            if dtype is None:
                raise ValueError(
                    f"{source}: missing key 'torch_dtype' (or 'dtype'); pass dtype= explicitly"
                )
        if attn.kind is AttentionKind.MLA:
            return cls.mla(num_layers, attn.latent_dim - attn.rope_dim, attn.rope_dim,
                           str(dtype), block_tokens)
        num_heads = need("num_attention_heads")
        kv_heads = int(cfg["num_key_value_heads"]) if cfg.get("num_key_value_heads") else num_heads
        if cfg.get("head_dim"):
            head_dim = int(cfg["head_dim"])
        else:
            hidden = need("hidden_size")
            if hidden % num_heads:
                raise ValueError(
                    f"{source}: hidden_size {hidden} is not divisible by num_attention_heads "
                    f"{num_heads}; set 'head_dim' explicitly"
                )
            head_dim = hidden // num_heads
        return cls(num_layers, kv_heads, head_dim, str(dtype), block_tokens, attn.kind,
                   groups=attn.groups)


CONFIG_DIR = Path(__file__).parent / "configs"


def bundled_configs() -> dict[str, Path]:
    """Model configs shipped with kvshare, by name (file name without ``.json``)."""
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*.json"))}


def resolve_config(name_or_path: str | Path) -> Path:
    """An existing path as given, else a bundled config of that name (``Llama-3.1-8B``)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    bundled = bundled_configs()
    name = path.name.removesuffix(".json")
    if name in bundled and path.parent == Path("."):
        return bundled[name]
    raise FileNotFoundError(
        f"no config file {str(name_or_path)!r}; give a path to a config.json or one of the "
        f"bundled configs: {', '.join(bundled)}"
    )


def _transformers_default(model_type: object, key: str) -> int | None:
    """The default of ``key`` in transformers' config class for ``model_type``, if any."""
    if not isinstance(model_type, str) or key not in _DEFAULTABLE:
        return None
    try:
        from transformers import AutoConfig

        value = getattr(AutoConfig.for_model(model_type), key, None)
    except Exception:  # transformers missing or model_type unknown: no default
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_DEFAULTABLE = ("num_hidden_layers", "num_attention_heads", "hidden_size")


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
