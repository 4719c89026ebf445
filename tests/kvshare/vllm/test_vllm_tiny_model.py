"""The tiny test model builder: deterministic files, a working tokenizer and chat template."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama

SMALL = TinyModelSpec(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                      intermediate_size=256, vocab_size=512, max_position_embeddings=2048)


def _digests(path: str) -> dict[str, str]:
    return {n: hashlib.sha256(Path(path, n).read_bytes()).hexdigest() for n in os.listdir(path)}


def test_same_spec_same_files_and_a_usable_tokenizer(tmp_path: Path) -> None:
    a = build_tiny_llama(str(tmp_path / "a"), SMALL)
    b = build_tiny_llama(str(tmp_path / "b"), SMALL)
    assert _digests(a) == _digests(b)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(a))

    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges were learnt, not just bytes
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<s><|user|>hi<|end|><|assistant|>"
    cfg = AutoConfig.from_pretrained(a)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (2, 2, len(tok))


def test_other_seed_other_weights_and_rebuilt_in_place(tmp_path: Path) -> None:
    path = str(tmp_path / "m")
    first = _digests(build_tiny_llama(path, SMALL))
    again = _digests(build_tiny_llama(path, SMALL))  # same spec: left as it is
    assert again == first
    other = _digests(build_tiny_llama(path, TinyModelSpec(**{**SMALL.__dict__, "seed": 1})))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_bad_spec_names_the_fix() -> None:
    with pytest.raises(ValueError, match="kv heads"):
        TinyModelSpec(num_heads=8, num_kv_heads=3)
