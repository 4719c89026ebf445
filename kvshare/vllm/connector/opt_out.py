"""A request that keeps its KV out of the cluster: ``kv_transfer_params`` ``{"kvshare":
{"share": false}}``.

Sent by a client (or a gateway, per tenant) in vLLM's OpenAI completion and chat bodies, it
reaches the connector as ``Request.kv_transfer_params``. The connector then neither looks the
request up nor loads nor saves its blocks: its KV lives only in vLLM's own prefix cache, as
with no connector (a prompt that must not leave the engine, or a benchmark's leg that measures
vLLM's own cache behind the same servers). ``share`` absent or true: shared as always. The
other keys of the ``kvshare`` entry (the router hint, :mod:`kvshare.vllm.router_hint`) are
independent of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvshare.vllm.router_hint import KEY

SHARE = "share"


def encode(share: bool) -> dict[str, Any]:
    """The ``kv_transfer_params`` entry that shares the request (true) or keeps it out (false)."""
    return {KEY: {SHARE: bool(share)}}


def shares(kv_transfer_params: Any) -> bool:
    """Whether the request's KV may be looked up, loaded and saved through the cluster.
    Raises ValueError on a malformed entry (``share`` not a bool)."""
    if not isinstance(kv_transfer_params, Mapping):
        return True
    entry = kv_transfer_params.get(KEY)
    if not isinstance(entry, Mapping) or SHARE not in entry:
        return True
    value = entry[SHARE]
    if type(value) is not bool:
        raise ValueError(f"kv_transfer_params.{KEY}.{SHARE} must be true or false, got {value!r}")
    return value
