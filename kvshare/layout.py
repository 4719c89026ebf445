"""KV layout: the shape and size of one block of attention keys and values.

A block's canonical payload is ``[layer][k|v][kv_head][token][head_dim]`` in the layout's
dtype, all kv heads. Bytes per token ``= 2 * layers * kv_heads * head_dim * dtype_bytes``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

SUPPORTED_KINDS = ("mha",)  # MHA and GQA share one layout (GQA = fewer kv heads)


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
    """How one model's KV cache is cut into shareable blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    block_tokens: int = 256
    kind: str = "mha"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.kind not in SUPPORTED_KINDS:
            raise ValueError(
                f"attention kind {self.kind!r} is not supported yet (supported: MHA/GQA)"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, kv_heads, block_tokens, head_dim)``: the canonical block payload."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    def fingerprint(self) -> str:
        """A short stable digest of every field; two layouts share blocks only if equal."""
        text = json.dumps(
            [self.kind, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
             self.block_tokens],
            separators=(",", ":"),
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
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
        transformers knows, a missing key is a ValueError naming it.
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
        kind = _attention_kind(cfg, source)

        def need(key: str) -> int:
            if cfg.get(key) is None:
                default = _transformers_default(cfg.get("model_type"), key)
                if default is None:
                    raise ValueError(f"{source}: missing key {key!r} needed for the KV layout")
                return default
            return int(cfg[key])

        num_layers = need("num_hidden_layers")
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
        if dtype is None:
            dtype = cfg.get("dtype") or cfg.get("torch_dtype")
            if dtype is None:
                raise ValueError(
                    f"{source}: missing key 'torch_dtype' (or 'dtype'); pass dtype= explicitly"
                )
        return cls(num_layers, kv_heads, head_dim, str(dtype), block_tokens, kind)


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


def _attention_kind(cfg: dict[str, Any], source: str) -> str:
    if cfg.get("kv_lora_rank"):
        raise ValueError(f"{source}: MLA attention (kv_lora_rank) is not supported yet")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) is not False:
        raise ValueError(
            f"{source}: sliding-window attention (sliding_window={window}) is not supported yet"
        )
    if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
        raise ValueError(f"{source}: hybrid attention (layer_types) is not supported yet")
    return "mha"


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
