"""A small DeepSeek-style MLA model (``DeepseekV3ForCausalLM``, dense layers only) on disk.

The MLA sibling of :mod:`kvshare.testing.tiny_model` (same tokenizer and chat template, same
determinism: equal specs give byte-identical files, so the same kvshare model identity in
every process and on every node). vLLM's CPU MLA backend accepts only a 576-wide latent, so
``kv_lora_rank`` is 512 and ``qk_rope_head_dim`` 64 as in DeepSeek-V3; everything else is
small. Every layer is dense (``first_k_dense_replace`` = ``num_layers``): no expert is built
or routed. KV per token: ``num_layers * 576`` values (bf16: 1,152 bytes per layer).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from kvshare.testing.tiny_model import CHAT_TEMPLATE, SPECIALS, train_tokenizer

_STAMP = "kvshare-tiny-mla.json"
_BUILDER = 1  # bump when the files a spec produces change
KV_LORA_RANK = 512
ROPE_DIM = 64


@dataclass(frozen=True)
class TinyMLASpec:
    """What :func:`build_tiny_deepseek` builds; equal specs give identical files."""

    num_layers: int = 8
    hidden_size: int = 512
    num_heads: int = 8
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    intermediate_size: int = 1408
    vocab_size: int = 1024
    max_position_embeddings: int = 16384
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIALS):
            raise ValueError(f"vocab_size must be >= {256 + len(SPECIALS)} (bytes + specials)")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")


def build_tiny_deepseek(path: str, spec: TinyMLASpec | None = None) -> str:
    """Write the model described by ``spec`` into directory ``path`` and return ``path``.

    A directory that already holds the same spec is left as it is; one holding another spec
    is rebuilt.
    """
    spec = spec or TinyMLASpec()
    stamp = os.path.join(path, _STAMP)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == {**asdict(spec), "builder": _BUILDER}:
                return path
    import torch
    import transformers

    tf: Any = transformers  # untyped constructors

    os.makedirs(path, exist_ok=True)
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size), bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", model_max_length=spec.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = tf.DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=spec.num_layers,  # every layer dense
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        rope_scaling=None,
    )
    dtype = getattr(torch, spec.dtype)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = tf.DeepseekV3ForCausalLM(config).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump({**asdict(spec), "builder": _BUILDER}, f, sort_keys=True)
    return path
