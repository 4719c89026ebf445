"""KVLayout: bundled real model configs against hand-computed sizes, fallbacks, bad configs."""

from __future__ import annotations

import json
from typing import Any

import pytest
from paths import ROOT

from kvshare.layout import (
    KVLayout,
    bundled_configs,
    format_bytes,
    normalize_dtype,
    resolve_config,
)

CONFIGS = ROOT / "kvshare" / "configs"

# name -> (layers, kv_heads, head_dim, dtype, bytes/token computed by hand:
#          2 (k and v) * layers * kv_heads * head_dim * dtype bytes)
EXPECTED = {
    "Llama-3.1-8B": (32, 8, 128, "bf16", 2 * 32 * 8 * 128 * 2),  # 131072
    "Llama-2-70b-hf": (80, 8, 128, "fp16", 2 * 80 * 8 * 128 * 2),  # 327680, head_dim 8192/64
    "Qwen2.5-7B": (28, 4, 128, "bf16", 2 * 28 * 4 * 128 * 2),  # 57344, head_dim 3584/28
    "Mistral-7B-v0.3": (32, 8, 128, "bf16", 2 * 32 * 8 * 128 * 2),  # 131072
    # text_config omits layers/heads/hidden: transformers' LlamaConfig defaults 32/32/4096
    "llava-1.5-7b-hf": (32, 32, 128, "fp16", 2 * 32 * 32 * 128 * 2),  # 524288
    "Mistral-Small-3.1-24B-Instruct-2503": (40, 8, 128, "bf16", 2 * 40 * 8 * 128 * 2),  # 163840
    "tiny-llama": (4, 4, 64, "fp32", 2 * 4 * 4 * 64 * 4),  # 8192
}


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return data


def test_every_bundled_config_has_a_hand_computed_expectation() -> None:
    assert set(bundled_configs()) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_config_sizes(name: str) -> None:
    layers, kv_heads, head_dim, dtype, per_token = EXPECTED[name]
    layout = KVLayout.from_hf_config(CONFIGS / f"{name}.json")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (
        layers, kv_heads, head_dim, dtype)
    assert layout.bytes_per_token == per_token
    assert layout.bytes_per_block == per_token * 256
    assert layout.kind == "mha"


def test_literal_sizes_of_the_issue() -> None:
    llama3 = KVLayout.from_hf_config(CONFIGS / "Llama-3.1-8B.json")
    assert llama3.bytes_per_token == 131072
    assert llama3.bytes_per_block == 32 * 2**20
    tiny = KVLayout.from_hf_config(CONFIGS / "tiny-llama.json")
    assert tiny.bytes_per_block == 2 * 2**20  # 2 MiB blocks: what the pool benchmark uses


def test_dtype_and_block_tokens_overrides() -> None:
    layout = KVLayout.from_hf_config(load("Llama-3.1-8B"), dtype="fp8", block_tokens=16)
    assert layout.dtype == "fp8_e4m3"
    assert layout.bytes_per_token == 65536
    assert layout.bytes_per_block == 65536 * 16


def test_explicit_fields_and_block_shape() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=5, dtype="torch.float16",
                      block_tokens=7)
    assert layout.dtype == "fp16"
    assert layout.block_shape == (2, 2, 3, 7, 5)
    assert layout.bytes_per_block == 2 * 2 * 3 * 7 * 5 * 2
    assert KVLayout.from_dict(layout.to_dict()) == layout


def test_kv_heads_and_head_dim_fallbacks() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
           "torch_dtype": "float32"}
    layout = KVLayout.from_hf_config(cfg)
    assert (layout.num_kv_heads, layout.head_dim) == (4, 64)
    explicit = KVLayout.from_hf_config({**cfg, "num_key_value_heads": 2, "head_dim": 96})
    assert (explicit.num_kv_heads, explicit.head_dim) == (2, 96)
    assert KVLayout.from_hf_config({**cfg, "dtype": "bfloat16", "torch_dtype": None}).dtype == "bf16"


def test_nested_text_config_takes_the_outer_dtype() -> None:
    cfg = load("Mistral-Small-3.1-24B-Instruct-2503")
    assert "torch_dtype" not in cfg["text_config"]
    assert KVLayout.from_hf_config(cfg).dtype == "bf16"


def test_fingerprint_is_pinned_and_field_sensitive() -> None:
    layout = KVLayout.from_hf_config(CONFIGS / "Llama-3.1-8B.json")
    assert layout.fingerprint() == "38ad274327873df6"
    others = [
        KVLayout(32, 8, 128, "bf16", 128), KVLayout(32, 8, 128, "fp16"),
        KVLayout(31, 8, 128), KVLayout(32, 4, 128), KVLayout(32, 8, 64),
    ]
    assert len({layout.fingerprint(), *(o.fingerprint() for o in others)}) == 6


@pytest.mark.parametrize("key", ["num_hidden_layers", "num_attention_heads", "hidden_size",
                                 "torch_dtype"])
def test_missing_key_is_named(key: str) -> None:
    cfg = load("Llama-2-70b-hf")
    del cfg["model_type"]  # without a model type there are no transformers defaults
    del cfg[key]
    with pytest.raises(ValueError, match=key):
        KVLayout.from_hf_config(cfg)


def test_missing_key_with_an_unknown_model_type_is_named() -> None:
    cfg = {"model_type": "no-such-model", "num_attention_heads": 8, "hidden_size": 512,
           "torch_dtype": "float16"}
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVLayout.from_hf_config(cfg)


def test_indivisible_hidden_size_asks_for_head_dim() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100,
           "torch_dtype": "float16"}
    with pytest.raises(ValueError, match="head_dim"):
        KVLayout.from_hf_config(cfg)


# Excerpts of real configs with attention kinds v1 does not share.
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "hidden_size": 2048, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
MISTRAL_7B_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096,
                  "torch_dtype": "bfloat16"}
HYBRID = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
          "torch_dtype": "bfloat16", "layer_types": ["full_attention", "linear_attention"]}


@pytest.mark.parametrize("cfg, what", [(DEEPSEEK_V2_LITE, "MLA"), (MISTRAL_7B_V01, "sliding"),
                                       (HYBRID, "hybrid")])
def test_unsupported_attention_kinds(cfg: dict[str, Any], what: str) -> None:
    with pytest.raises(ValueError, match=f"(?s){what}.*not supported yet"):
        KVLayout.from_hf_config(cfg)


def test_sliding_window_switched_off_is_fine() -> None:
    cfg = load("Qwen2.5-7B")
    assert cfg["sliding_window"] and cfg["use_sliding_window"] is False
    KVLayout.from_hf_config(cfg)
    with pytest.raises(ValueError, match="not supported yet"):
        KVLayout.from_hf_config({**cfg, "use_sliding_window": True})


@pytest.mark.parametrize("kwargs, match", [
    ({"num_layers": 0}, "num_layers"), ({"num_kv_heads": -1}, "num_kv_heads"),
    ({"head_dim": 1.5}, "head_dim"), ({"block_tokens": True}, "block_tokens"),
    ({"dtype": "int4"}, "int4"), ({"kind": "mla"}, "not supported yet"),
])
def test_invalid_fields(kwargs: dict[str, Any], match: str) -> None:
    fields: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        KVLayout(**fields)


def test_normalize_dtype_and_format_bytes() -> None:
    assert [normalize_dtype(d) for d in ("bfloat16", "torch.float32", "half", "FP16")] == [
        "bf16", "fp32", "fp16", "fp16"]
    assert format_bytes(512) == "512 B"
    assert format_bytes(131072) == "128.00 KiB"
    assert format_bytes(17179869184) == "16.00 GiB"


def test_resolve_config() -> None:
    assert resolve_config("Llama-3.1-8B") == CONFIGS / "Llama-3.1-8B.json"
    assert resolve_config("tiny-llama.json") == CONFIGS / "tiny-llama.json"
    with pytest.raises(FileNotFoundError, match="bundled configs: .*Llama-3.1-8B"):
        resolve_config("no-such-model")
