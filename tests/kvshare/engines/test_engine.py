"""The reference engine on its own: tokenizer, model identity, KV conversion, prefix reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_helpers import BLOCK, prompt, small_engine

from kvshare.client.types import PagedKV, Plan, PlannedBlock
from kvshare.engines.hf import HFEngine, cache_layers
from kvshare.identity import path_identity, random_init_identity
from kvshare.kv_convert import (
    block_from_source,
    block_into_target,
    block_view,
    blocks_to_contiguous,
    new_contiguous,
)
from kvshare.layout import KVLayout
from kvshare.tokenizer import ByteTokenizer, tokenizer_from_spec, tokenizer_spec
from kvshare.types import BlockHash, Tier


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return small_engine()


def test_byte_tokenizer_round_trip_and_chat_template() -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"
    ids = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi"}])
    assert ids[0] == 256 and ids[-1] == tok.special["<|assistant|>"]
    assert ids[1] == tok.special["<|system|>"] and tok.decode(ids) == "be briefhi"
    assert tokenizer_from_spec(json.dumps(tokenizer_spec(tok))).vocab_size == 512
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_identity_depends_on_config_seed_and_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = {"hidden_size": 8}
    a = random_init_identity(cfg, 0, "fp32")
    assert a == random_init_identity(dict(cfg), 0, "fp32")
    assert a != random_init_identity(cfg, 1, "fp32")
    assert a != random_init_identity({"hidden_size": 9}, 0, "fp32")
    assert a != random_init_identity(cfg, 0, "bf16")
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    first = path_identity(str(tmp_path), "fp32")
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}xx")
    assert path_identity(str(tmp_path), "fp32") != first  # new weights never match old blocks
    with pytest.raises(ValueError, match="not a directory"):
        path_identity(str(tmp_path / "nope"), "fp32")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        path_identity(str(tmp_path), "fp32")


def test_engines_with_other_seeds_have_other_namespaces(engine: HFEngine) -> None:
    other = small_engine(seed=1)
    toks = prompt(3 * BLOCK)
    assert engine.hashes(toks) == small_engine().hashes(toks)
    assert set(engine.hashes(toks)).isdisjoint(other.hashes(toks))
    assert len(engine.hashes(toks[: 3 * BLOCK - 1])) == 2  # only full blocks are hashed


def test_contiguous_and_paged_conversions_round_trip() -> None:
    layout = KVLayout(2, 2, 8, "fp32", block_tokens=8)
    kv = torch.randn(2, 2, 2, 24, 8)
    blocks = [np.empty(layout.bytes_per_block, np.uint8) for _ in range(3)]
    for i, b in enumerate(blocks):
        block_from_source(kv, i, b, layout)
    assert torch.equal(block_view(blocks[1], layout), kv[:, :, :, 8:16])
    layers = [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(2)]
    other = np.empty(layout.bytes_per_block, np.uint8)
    block_from_source(layers, 2, other, layout)
    assert np.array_equal(other, blocks[2])
    back = new_contiguous(layout, 24)
    pages = [torch.zeros(2, 10, 4, 2, 8) for _ in range(2)]  # 4-token pages
    paged = PagedKV(pages, [9, 3, 5, 0, 7, 1])
    for i, b in enumerate(blocks):
        block_into_target(b, back, i, layout)
        block_into_target(b, paged, i, layout) if i < 3 else None
    assert torch.equal(back, kv)
    assert torch.equal(pages[1][0, 3].transpose(0, 1), kv[1, 0, :, 4:8])
    again = np.empty(layout.bytes_per_block, np.uint8)
    block_from_source(paged, 1, again, layout)
    assert np.array_equal(again, blocks[1])
    with pytest.raises(ValueError, match="bytes"):
        block_view(np.empty(5, np.uint8), layout)
    with pytest.raises(ValueError, match="kv_heads"):
        block_into_target(blocks[0], torch.zeros(2, 2, 3, 8, 8), 0, layout)


def test_prefill_from_cached_prefix_equals_full_recompute(engine: HFEngine) -> None:
    toks = prompt(5 * BLOCK + 7, seed=3)
    full_out, full = engine.generate(toks, 12)
    blocks = [np.empty(engine.layout.bytes_per_block, np.uint8) for _ in range(4)]
    for i, buf in enumerate(blocks):  # the blocks a store would have written
        block_from_source(cache_layers(full.cache), i, buf, engine.layout)
    kv = blocks_to_contiguous(blocks, engine.layout)
    out, pre = engine.generate(toks, 12, kv, 4 * BLOCK)
    assert pre.reused_tokens == 4 * BLOCK and pre.computed_tokens == BLOCK + 7
    assert float((pre.logits - full.logits).abs().max()) <= 1e-4
    assert out == full_out


def test_full_hit_still_recomputes_the_last_token(engine: HFEngine) -> None:
    toks = prompt(2 * BLOCK, seed=4)
    full_out, full = engine.generate(toks, 6)
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in cache_layers(full.cache)])
    out, pre = engine.generate(toks, 6, kv, 2 * BLOCK)
    assert pre.reused_tokens == 2 * BLOCK - 1 and pre.computed_tokens == 1
    assert float((pre.logits - full.logits).abs().max()) <= 1e-4
    assert out == full_out


def test_bad_prompts_are_rejected_with_the_fix(engine: HFEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.prefill([])
    with pytest.raises(ValueError, match="outside"):
        engine.prefill([1, 2, 10_000])


def test_plan_is_serialisable() -> None:
    h = BlockHash(bytes(range(32)))
    plan = Plan("ns", 40, 16, (h, h), 2, (PlannedBlock(h, "node:a", Tier.HOST, "shm"),), "x")
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.load_tokens == 16 and again.by_transport() == {"shm": 1}


def test_cost_cut_loads_when_fetching_beats_recompute() -> None:
    from kvshare.cost import Source
    from kvshare.cost_cut import CostCut

    layout = KVLayout(4, 4, 64, "fp32", block_tokens=256)
    slow_compute = CostCut(layout, [(1000, 0, 0.5), (4000, 0, 2.5), (2000, 2000, 1.5)])
    assert slow_compute(4096, [Source.LOCAL_HOST] * 8 + [Source.REMOTE_DISK] * 8) == 16
    tiny_net = CostCut(layout, [(1000, 0, 1e-6), (4000, 0, 4e-6)],
                       bandwidths={"nixl": 1e3, "shm": 1e3, "disk": 1e3})
    assert tiny_net(4096, [Source.REMOTE_HOST] * 16) == 0  # 2 MiB at 1 kB/s: recompute instead
    for _ in range(20):
        tiny_net.observe(1000, 0, 10.0)  # live timings say compute got slow: refit
    assert tiny_net.model.prefill.a > 1e-3


def test_cost_cut_follows_measured_bandwidths() -> None:
    from kvshare.cost import Source
    from kvshare.cost_cut import CostCut

    layout = KVLayout(4, 4, 64, "fp32", block_tokens=256)
    cut = CostCut(layout, [(1000, 0, 0.01), (4000, 0, 0.05)])  # fast compute: 10 us/token
    assert cut(4096, [Source.REMOTE_HOST] * 16) == 16  # default 100 Gbit/s: pulling wins
    cut.set_bandwidths({"nixl": 1e6, "shm": 1e10, "unknown": 5.0})  # the probe saw 1 MB/s
    assert cut.model.bandwidths.remote == 1e6
    assert cut(4096, [Source.REMOTE_HOST] * 16) == 0  # 2 MiB blocks at 1 MB/s: recompute
    assert cut(4096, [Source.LOCAL_HOST] * 16) == 16  # the node's own shm is still fast


def _save_model_dir(path: str, seed: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)  # type: ignore[no-untyped-call]
    vocab = {chr(i): i for i in range(32, 127)} | {"<unk>": 200, "<eos>": 201}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # type: ignore[assignment]
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(path)


def test_model_from_a_local_path_uses_its_tokenizer_and_reuses_losslessly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvshare.engines.hf import EngineConfig
    from kvshare.tokenizer import HFTokenizer

    _save_model_dir(str(tmp_path / "m"), seed=0)
    engine = HFEngine(EngineConfig(model_path=str(tmp_path / "m"), block_tokens=8))
    assert engine.identity.startswith("path-") and isinstance(engine.tokenizer, HFTokenizer)
    assert engine.tokenizer.encode("hi!") == [104, 105, 33] and engine.tokenizer.eos_id == 201
    toks = engine.tokenizer.encode("The cached prefix of a prompt, then a question?")
    full_out, full = engine.generate(toks, 6)
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in cache_layers(full.cache)])
    out, pre = engine.generate(toks, 6, kv, 40)
    assert pre.reused_tokens == 40 and out == full_out
    assert float((pre.logits - full.logits).abs().max()) <= 1e-4
    _save_model_dir(str(tmp_path / "m"), seed=1)  # new weights at the same path
    assert HFEngine(EngineConfig(model_path=str(tmp_path / "m"))).identity != engine.identity


def test_identity_samples_big_weight_files(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kvshare import identity

    monkeypatch.setattr(identity, "SAMPLES", 2)
    monkeypatch.setattr(identity, "WINDOW", 8)
    (tmp_path / "config.json").write_text("{}")
    weights = bytearray(range(100))
    (tmp_path / "w.bin").write_bytes(bytes(weights))
    before = identity.path_identity(str(tmp_path), "fp32")
    weights[95] ^= 1  # same size, new bytes inside a sampled window
    (tmp_path / "w.bin").write_bytes(bytes(weights))
    assert identity.path_identity(str(tmp_path), "fp32") != before
