"""The body a gateway forwards to a worker, by the worker's engine.

- kvshare workers (the reference worker, SDK engines): the client's body plus the ``kvshare``
  field (token ids, namespace, block hashes, tenant, cache salt), so they never re-tokenize.
- vLLM servers (``WorkerInfo.meta["engine"] == "vllm"``, registered by
  :mod:`kvshare.vllm.server.worker`): vLLM's own fields. Completions carry the gateway's token ids as
  ``prompt`` (vLLM takes a list of ids); the tenant's salt travels as vLLM's ``cache_salt``, so
  vLLM's prefix cache and its KV events are keyed per tenant exactly as the gateway hashed;
  ``model`` is the served model name. Chat requests keep their ``messages`` (vLLM's schema
  needs them) and carry the gateway's token ids, rendered with the model's chat template, as
  ``kv_transfer_params.prompt_token_ids``: vLLM (>= 0.32) then prefills exactly those ids
  without rendering the messages again (``renderers/online_renderer.py``), so the blocks the
  router hashed are the blocks vLLM caches. Both carry the router hint in
  ``kv_transfer_params`` (:mod:`kvshare.vllm.router_hint`: how much of the prompt the cluster
  held when it was routed, and which pools held it), so the engine's connector plans its load
  from the router's index answer and does not ask the index again.
- SGLang servers (``engine == "sglang"``, registered by :mod:`kvshare.sglang.worker`): the
  same, less ``kv_transfer_params`` (SGLang has no such field; its kvshare storage backend
  asks the index itself): completions carry the token ids as ``prompt``, chat requests their
  ``messages`` (SGLang renders them with the same chat template), the salt as ``cache_salt``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvshare.router.core.embed import Routed
from kvshare.router.core.policy import Ranking
from kvshare.vllm import router_hint
from kvshare.workers import WorkerInfo

ENGINES = ("vllm", "sglang")
"""Registered ``engine`` values of OpenAI servers that take their own fields (not kvshare's)."""


def is_vllm(info: WorkerInfo | None) -> bool:
    return info is not None and info.meta.get("engine") == "vllm"


def is_engine(info: WorkerInfo | None) -> bool:
    """An engine's own OpenAI server (vLLM, SGLang), not a kvshare worker."""
    return info is not None and info.meta.get("engine") in ENGINES


def forward_body(body: Mapping[str, Any], routed: Routed, info: WorkerInfo | None,
                 chat: bool, deadline_s: float | None = None) -> dict[str, Any]:
    """What to POST to the chosen worker for the client's ``body``; ``deadline_s``: the
    seconds left of the request's deadline (a reference worker ends generation there; vLLM
    has no such field: the gateway closes the stream at the deadline instead)."""
    # the salt is the tenant's, the KV connector's parameters and the deadline the gateway's
    out = {k: v for k, v in body.items()
           if k not in ("kvshare", "cache_salt", "kv_transfer_params", "deadline_s")}
    if not is_engine(info):
        kv = routed.kvshare_field()
        if deadline_s is not None:
            kv["deadline_s"] = round(max(deadline_s, 0.001), 3)
        return {**out, "kvshare": kv}
    assert info is not None
    out["model"] = info.meta.get("model", out.get("model"))
    if routed.tenant.salt:
        out["cache_salt"] = routed.tenant.salt
    if not is_vllm(info):  # SGLang: no kv_transfer_params
        if not chat:
            out["prompt"] = routed.token_list()
        return out
    params: dict[str, Any] = {}
    hint = vllm_hint(routed.ranking, routed.block_tokens) if routed.ranking is not None else None
    if hint is not None:
        params.update(hint)
    if not chat:
        out["prompt"] = routed.token_list()
    else:
        params["prompt_token_ids"] = routed.token_list()
    if params:
        out["kv_transfer_params"] = params
    return out


def vllm_hint(ranking: Ranking, block_tokens: int) -> dict[str, Any] | None:
    """What the index answered when ``ranking`` was made, as vLLM's ``kv_transfer_params``: the
    router hint (held tokens and the pools' part of the index answer,
    :mod:`kvshare.vllm.router_hint`) forwarded to a vLLM worker, so its connector need not ask
    the index again. None when the index did not answer (the engine looks up). Built when a
    vLLM worker is sent the request (here, or by the Serve router), not for every decision."""
    if ranking.held_blocks is None or not block_tokens:
        return None
    match = ranking.index_match
    pools = router_hint.pool_runs(match) if match is not None else None
    return router_hint.encode(ranking.held_blocks * block_tokens, pools, ranking.request.hashes)
