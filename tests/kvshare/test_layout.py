"""KVLayout: bundled real model configs against hand-computed sizes, fallbacks, bad configs."""

from __future__ import annotations

import json
from typing import Any

import pytest
from paths import ROOT

from kvshare.attention import AttentionKind, KVGroup
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


# MLA: layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes (no K/V pair, no heads)
EXPECTED_MLA = {"DeepSeek-V3": (61, 512, 64, 61 * 576 * 2)}  # 70272, the issue's figure
# sliding: (layers, kv_heads, head_dim, full-attention layers, windowed layers, window)
EXPECTED_SLIDING = {
    "gemma-2-9b-it": (42, 8, 256, 21, 21, 4096),  # layers alternate, layer 0 slides
    "gemma-3-27b-it": (62, 16, 128, 10, 52, 1024),  # every 6th layer full (transformers' default)
    "gpt-oss-20b": (24, 8, 64, 12, 12, 128),  # layer_types alternate, layer 0 slides
}


def test_every_bundled_config_has_a_hand_computed_expectation() -> None:
    assert set(bundled_configs()) == set(EXPECTED) | set(EXPECTED_MLA) | set(EXPECTED_SLIDING)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_config_sizes(name: str) -> None:
    layers, kv_heads, head_dim, dtype, per_token = EXPECTED[name]
    layout = KVLayout.from_hf_config(CONFIGS / f"{name}.json")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (
        layers, kv_heads, head_dim, dtype)
    assert layout.bytes_per_token == per_token
    assert layout.bytes_per_block == per_token * 256
    assert layout.kind == "mha" and layout.kind is AttentionKind.MHA


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


def test_bundled_mla_config() -> None:
    layout = KVLayout.from_hf_config(CONFIGS / "DeepSeek-V3.json")
    layers, rank, rope, per_token = EXPECTED_MLA["DeepSeek-V3"]
    assert layout.kind is AttentionKind.MLA
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.rope_dim) == (
        layers, 1, rank + rope, rope)
    assert layout.bytes_per_token == per_token == 70272  # not 2 * 128 heads * ...: one latent
    assert layout.block_shape == (61, 1, 1, 256, 576)
    assert layout.bytes_per_block == 70272 * 256
    assert layout.hit_bytes(10) == 10 * layout.bytes_per_block  # every block: the whole latent
    assert layout == KVLayout.mla(61, 512, 64, "bf16")


@pytest.mark.parametrize("name", sorted(EXPECTED_SLIDING))
def test_bundled_sliding_configs(name: str) -> None:
    layers, heads, dim, n_full, n_slid, window = EXPECTED_SLIDING[name]
    layout = KVLayout.from_hf_config(CONFIGS / f"{name}.json")
    assert layout.kind is AttentionKind.SLIDING
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (layers, heads, dim)
    full, slid = layout.groups
    assert (len(full.layers), full.window, len(slid.layers), slid.window) == (
        n_full, None, n_slid, window)
    assert layout.bytes_per_token == 2 * layers * heads * dim * 2  # every layer's pages live
    assert layout.group_bytes_per_token(full) == 2 * n_full * heads * dim * 2
    assert layout.group_bytes_per_token(slid) == 2 * n_slid * heads * dim * 2


def test_sliding_group_maps_by_hand() -> None:
    gemma2 = KVLayout.from_hf_config(CONFIGS / "gemma-2-9b-it.json")
    assert gemma2.groups[0].layers == tuple(range(1, 42, 2))  # full attention: odd layers
    assert gemma2.groups[1].layers == tuple(range(0, 42, 2))
    gemma3 = KVLayout.from_hf_config(CONFIGS / "gemma-3-27b-it.json")
    assert gemma3.groups[0].layers == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)
    oss = KVLayout.from_hf_config(CONFIGS / "gpt-oss-20b.json")
    assert oss.groups[1] == KVGroup(tuple(range(0, 24, 2)), 128)


@pytest.mark.parametrize("cfg", [
    {"model_type": "gemma2", "num_hidden_layers": 6, "sliding_window": 4096},
    {"model_type": "gemma3_text", "num_hidden_layers": 13, "sliding_window": 512},
    {"model_type": "gemma3_text", "num_hidden_layers": 8, "sliding_window": 512,
     "sliding_window_pattern": 4},
    {"model_type": "cohere2", "num_hidden_layers": 9, "sliding_window": 4096},
    {"model_type": "qwen2", "num_hidden_layers": 6, "sliding_window": 100,
     "use_sliding_window": True, "max_window_layers": 4},
])
def test_layer_map_matches_transformers(cfg: dict[str, Any]) -> None:
    """Configs that state the interleaving as a pattern: the same layers slide as in
    transformers' own config class (which fills in ``layer_types``)."""
    transformers = pytest.importorskip("transformers")
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    if "sliding_window_pattern" in cfg:  # transformers 5 reads the period as layer_types only
        n, p = cfg["num_hidden_layers"], cfg["sliding_window_pattern"]
        kwargs["layer_types"] = ["full_attention" if (i + 1) % p == 0 else "sliding_attention"
                                 for i in range(n)]
    theirs = transformers.AutoConfig.for_model(cfg["model_type"], **kwargs).layer_types
    layout = KVLayout.from_hf_config({**cfg, "num_attention_heads": 4, "head_dim": 8,
                                      "torch_dtype": "bfloat16"})
    ours = ["full_attention"] * cfg["num_hidden_layers"]
    for i in layout.groups[-1].layers:
        ours[i] = "sliding_attention"
    assert ours == list(theirs)


def test_a_hit_moves_only_the_last_window_of_a_sliding_group() -> None:
    oss = KVLayout.from_hf_config(CONFIGS / "gpt-oss-20b.json")  # window 128: 1 block of 256
    mha = KVLayout(24, 8, 64, "bf16")  # the same layers, all full attention
    half = 12 * 2 * 8 * 64 * 2 * 256  # one group's block: 6 MiB
    assert oss.hit_bytes(0) == 0
    assert oss.hit_bytes(1) == 2 * half == mha.hit_bytes(1)
    assert oss.hit_bytes(512) == 512 * half + half  # 131,072 tokens
    assert mha.hit_bytes(512) / oss.hit_bytes(512) == pytest.approx(1024 / 513)
    gemma2 = KVLayout.from_hf_config(CONFIGS / "gemma-2-9b-it.json", block_tokens=16)
    assert gemma2.groups[1].window_blocks(16) == 256  # ceil(4095 / 16): the last 4,095 tokens
    assert gemma2.hit_bytes(1000) == (1000 + 256) * 21 * 2 * 8 * 256 * 2 * 16
    assert oss.fetch_terms() == (12 * 2 * 8 * 64 * 2, ((1, 12 * 2 * 8 * 64 * 2),))
    assert mha.fetch_terms() == (mha.bytes_per_token, ())


@pytest.mark.parametrize("window, blocks", [(1, 0), (2, 1), (257, 1), (258, 2), (4096, 16)])
def test_window_blocks(window: int, blocks: int) -> None:
    assert KVGroup((0,), window).window_blocks(256) == blocks
    assert KVGroup((0,), window).blocks_needed(1, 256) == min(1, blocks)


MISTRAL_7B_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096,
                  "torch_dtype": "bfloat16"}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "hidden_size": 2048, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}


def test_every_layer_sliding_and_other_mla_models() -> None:
    mistral = KVLayout.from_hf_config(MISTRAL_7B_V01)
    assert mistral.groups == (KVGroup(tuple(range(32)), 4096),)
    assert mistral.hit_bytes(100) == 16 * mistral.bytes_per_block
    lite = KVLayout.from_hf_config(DEEPSEEK_V2_LITE)
    assert (lite.kind, lite.bytes_per_token) == (AttentionKind.MLA, 27 * 576 * 2)


def test_sliding_window_switched_off_or_on_no_layer() -> None:
    cfg = load("Qwen2.5-7B")
    assert cfg["sliding_window"] and cfg["use_sliding_window"] is False
    assert KVLayout.from_hf_config(cfg).kind is AttentionKind.MHA
    on = {**cfg, "use_sliding_window": True}  # max_window_layers 28 of 28: still no layer slides
    assert KVLayout.from_hf_config(on).kind is AttentionKind.MHA
    some = KVLayout.from_hf_config({**on, "max_window_layers": 20})
    assert some.groups == (KVGroup(tuple(range(20))), KVGroup(tuple(range(20, 28)), 131072))


def test_fingerprints_of_the_kinds_are_pinned_and_field_sensitive() -> None:
    mla = KVLayout.from_hf_config(CONFIGS / "DeepSeek-V3.json")
    oss = KVLayout.from_hf_config(CONFIGS / "gpt-oss-20b.json")
    gemma2 = KVLayout.from_hf_config(CONFIGS / "gemma-2-9b-it.json")
    assert mla.fingerprint() == "8af1654f145631ad"
    assert oss.fingerprint() == "37a8469de35cf63d"
    assert gemma2.fingerprint() == "06dbd2750d940276"
    full, slid = oss.groups
    moved = (KVGroup(full.layers[1:]), KVGroup(tuple(sorted((full.layers[0], *slid.layers))), 128))
    others = [
        KVLayout.mla(61, 448, 128),  # same 576-wide latent, another rotary split
        KVLayout(61, 1, 576, "bf16"),  # an MHA layout of the same numbers
        KVLayout(24, 8, 64, "bf16", kind=AttentionKind.SLIDING,
                 groups=(full, KVGroup(slid.layers, 256))),  # another window
        KVLayout(24, 8, 64, "bf16", kind=AttentionKind.SLIDING, groups=moved),  # another map
        KVLayout(24, 8, 64, "bf16"),  # no window at all
    ]
    prints = {mla.fingerprint(), oss.fingerprint(), *(o.fingerprint() for o in others)}
    assert len(prints) == 7


def test_kinds_round_trip_and_groups_are_canonical() -> None:
    oss = KVLayout.from_hf_config(CONFIGS / "gpt-oss-20b.json")
    mla = KVLayout.from_hf_config(CONFIGS / "DeepSeek-V3.json")
    for layout in (oss, mla):
        assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert mla.to_dict()["rope_dim"] == 64 and mla.to_dict()["kind"] == "mla"
    flipped = KVLayout(24, 8, 64, "bf16", kind="sliding", groups=oss.groups[::-1])
    assert flipped == oss and flipped.fingerprint() == oss.fingerprint()


@pytest.mark.parametrize("groups, match", [
    ((KVGroup((0,)), KVGroup((1, 2), 8)), "each of the 4 layers once"),
    ((KVGroup((0, 1)), KVGroup((2,), 8), KVGroup((3,), 8)), "one group per window"),
    ((KVGroup((0, 1, 2, 3)),), "no sliding-window group"),
])
def test_bad_groups(groups: tuple[KVGroup, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVLayout(4, 2, 8, kind=AttentionKind.SLIDING, groups=groups)


BASE = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256,
        "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("cfg, what", [
    ({**BASE, "model_type": "qwen3_next",
      "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
     "'qwen3_next'.*linear-attention state"),
    ({**BASE, "model_type": "jamba", "attn_layer_period": 8}, "'jamba'.*Mamba SSM state"),
    ({**BASE, "model_type": "mamba", "state_size": 16}, "'mamba'.*Mamba SSM state"),
    ({**BASE, "model_type": "someday_ssm", "ssm_state_size": 128}, "SSM state.*ssm_state_size"),
    ({**BASE, "layer_types": ["full_attention", "linear_attention"] * 2},
     "linear-attention state.*'linear_attention'"),
    ({**BASE, "model_type": "llama4_text", "attention_chunk_size": 8192},
     "chunked local attention"),
])
def test_state_and_unsupported_attention_are_refused(cfg: dict[str, Any], what: str) -> None:
    with pytest.raises(ValueError, match=f"(?s){what}.*not share yet"):
        KVLayout.from_hf_config(cfg)


@pytest.mark.parametrize("cfg, what", [
    ({**DEEPSEEK_V2_LITE, "qk_rope_head_dim": None}, "qk_rope_head_dim"),
    ({**DEEPSEEK_V2_LITE, "model_type": "deepseek_v32", "index_topk": 2048},
     "'deepseek_v32'.*indexer"),
    ({**BASE, "model_type": "mimo", "sliding_window": 128, "swa_num_key_value_heads": 8},
     "'mimo'.*swa_num_key_value_heads"),
    ({**BASE, "sliding_window": 128, "layer_types": ["sliding_attention"] * 3},
     "layer_types lists 3 layers"),
])
def test_configs_missing_what_a_kind_needs(cfg: dict[str, Any], what: str) -> None:
    with pytest.raises(ValueError, match=f"(?s){what}"):
        KVLayout.from_hf_config(cfg)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_layers": 0}, "num_layers"), ({"num_kv_heads": -1}, "num_kv_heads"),
    ({"head_dim": 1.5}, "head_dim"), ({"block_tokens": True}, "block_tokens"),
    ({"dtype": "int4"}, "int4"), ({"kind": "ssm"}, "not supported yet"),
    ({"kind": "mla"}, "num_kv_heads 1"), ({"rope_dim": 64}, "MLA's only"),
    ({"kind": "sliding"}, "no sliding-window group"),
    ({"groups": (KVGroup((0, 1), 8),)}, "sliding kind's only"),
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


@pytest.mark.parametrize("name", ["DeepSeek-V3", "gpt-oss-20b"])
def test_the_reference_engine_refuses_kinds_it_cannot_load(name: str) -> None:
    from kvshare.engines.hf import EngineConfig, model_keys

    with pytest.raises(ValueError, match="reference engine copies K and V per kv head"):
        model_keys(EngineConfig(model_config=load(name)))
