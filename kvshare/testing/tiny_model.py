"""A small Llama with seeded random weights and a trained byte-level BPE tokenizer, on disk.

No model hub is reachable from test machines, so tests and benchmarks build their own model:
:func:`build_tiny_llama` writes a Hugging Face model directory (``config.json``, safetensors
weights, ``tokenizer.json`` + ``tokenizer_config.json`` with a chat template) that vLLM and
transformers load like any downloaded model. The result is deterministic: the same
:class:`TinyModelSpec` gives byte-identical files (so the same kvshare model identity) in every
process and on every node. The default size (8 layers, hidden 512, 8 heads, 4 kv heads,
head_dim 64: ~24M parameters, 8 KiB of bf16 KV per token) makes prefill cost real on a CPU:
~2.4 s for 8,192 tokens on two cores.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

SPECIALS = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_STAMP = "kvshare-tiny-model.json"
_BUILDER = 2  # bump when the files a spec produces change

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "KV caches hold the attention keys and values of every token a model has seen. ",
    "A cluster of nodes shares blocks of cached prefixes so prefill is not repeated. ",
    "def main():\n    for i in range(10):\n        print(i * i)\n",
    "Once upon a time there was a small model that ran on two CPU cores. ",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" ",
)


@dataclass(frozen=True)
class TinyModelSpec:
    """What :func:`build_tiny_llama` builds; equal specs give identical files."""

    num_layers: int = 8
    hidden_size: int = 512
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1408
    vocab_size: int = 1024
    max_position_embeddings: int = 16384
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must split into {self.num_heads} heads and "
                f"num_heads into {self.num_kv_heads} kv heads"
            )
        if self.vocab_size < 256 + len(SPECIALS):
            raise ValueError(f"vocab_size must be >= {256 + len(SPECIALS)} (bytes + specials)")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")


def train_tokenizer(vocab_size: int) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _corpus(lines: int = 400) -> list[str]:
    """Fixed text plus seeded pseudo-words: enough distinct pairs for ~1k merges."""
    import random

    rng = random.Random(1234)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    out = list(_CORPUS)
    for _ in range(lines):
        out.append(" ".join(rng.choice(words) for _ in range(24)) + ".")
    return out


def build_tiny_llama(path: str, spec: TinyModelSpec | None = None) -> str:
    """Write the model described by ``spec`` into directory ``path`` and return ``path``.

    A directory that already holds the same spec is left as it is (cheap to call per test
    module); one holding another spec is rebuilt.
    """
    spec = spec or TinyModelSpec()
    stamp = os.path.join(path, _STAMP)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == {**asdict(spec), "builder": _BUILDER}:
                return path
    import torch
    import transformers

    tf: Any = transformers  # untyped constructors

    os.makedirs(path, exist_ok=True)
    backend = train_tokenizer(spec.vocab_size)
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=spec.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    dtype = getattr(torch, spec.dtype)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = tf.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump({**asdict(spec), "builder": _BUILDER}, f, sort_keys=True)
    return path


@dataclass(frozen=True)
class TinyHybridSpec:
    """What :func:`build_tiny_gemma2` builds: a Gemma-2-style sliding-window hybrid, layers
    alternating ``[sliding, full, ...]`` (window ``sliding_window`` tokens); equal specs give
    identical files."""

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 256
    sliding_window: int = 128
    vocab_size: int = 1024
    max_position_embeddings: int = 16384
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads or self.num_layers < 2:
            raise ValueError(f"num_heads {self.num_heads} must split into {self.num_kv_heads} kv "
                             f"heads, and a hybrid needs >= 2 layers (got {self.num_layers})")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")


def build_tiny_gemma2(path: str, spec: TinyHybridSpec | None = None) -> str:
    """Write a :class:`TinyHybridSpec` ``Gemma2ForCausalLM`` (seeded random weights, the same
    tokenizer as :func:`build_tiny_llama`) into ``path`` and return it; a directory that holds
    the same spec already is left as it is. Saved with ``tie_word_embeddings`` (vLLM's Gemma2
    has no ``lm_head``)."""
    spec = spec or TinyHybridSpec()
    stamp = os.path.join(path, _STAMP)
    want = {**asdict(spec), "builder": _BUILDER, "arch": "gemma2"}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return path
    import torch
    import transformers

    tf: Any = transformers  # untyped constructors

    os.makedirs(path, exist_ok=True)
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size), bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", model_max_length=spec.max_position_embeddings)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = tf.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, query_pre_attn_scalar=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, sliding_window=spec.sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(spec.num_layers)],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = tf.Gemma2ForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(path, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump(want, f, sort_keys=True)
    return path
