"""What a kvshare router tells a vLLM engine about a request it routed: the router hint.

A router ranks a request on the index's answer for its blocks; the engine's connector would
otherwise ask the index the same question again before scheduling the request, and on a busy
engine a lookup that does not answer within ``lookup_wait_s`` holds the request for at least one
engine step (:mod:`kvshare.vllm.lookup`). For a cold prompt, or a turn whose new tokens are new
to the whole cluster, that second question can only answer "nothing more" and the hold is pure
delay. So the router forwards what it found, in vLLM's ``kv_transfer_params`` (a field of vLLM's
OpenAI completion and chat bodies that reaches the connector as ``Request.kv_transfer_params``)::

    {"kvshare": {"held_tokens": N}}

``N``: the tokens of the longest prefix of the prompt that the cluster held in the router's view
(the index's answer, every tier and node, plus the blocks the router's own recent decisions
are about to write), a multiple of the router's block size. The connector skips its lookup when
``N`` leaves less than one block beyond vLLM's own prefix hit
(:meth:`kvshare.vllm.scheduler_side.SchedulerSide.num_new_matched_tokens`); otherwise, or with no
hint, or a malformed one (counted), it looks up as always. A stale hint costs at most a
recompute of blocks stored after the router's query, never a wrong token; and a hint is
trusted only while the request has waited less than the connector's ``router_hint_max_age_s``
(default 1 s) since it reached the engine: a request that queued longer is looked up (counted,
``router_hints_expired``), since blocks stored meanwhile are worth a query that is small beside
that wait. A router whose index did not answer sends no hint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KEY = "kvshare"
HELD = "held_tokens"


def encode(held_tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` entry for a prompt whose first ``held_tokens`` are held."""
    return {KEY: {HELD: int(held_tokens)}}


def decode(kv_transfer_params: Any) -> int | None:
    """The hint's held tokens; None when there is no hint. Raises ValueError on a malformed one
    (not a mapping, or ``held_tokens`` not an int >= 0)."""
    if not kv_transfer_params:
        return None
    if not isinstance(kv_transfer_params, Mapping):
        raise ValueError(f"kv_transfer_params must be an object, got {type(kv_transfer_params).__name__}")
    hint = kv_transfer_params.get(KEY)
    if hint is None:
        return None
    held = hint.get(HELD) if isinstance(hint, Mapping) else None
    if type(held) is not int or held < 0:
        raise ValueError(f"kv_transfer_params.{KEY}.{HELD} must be an int >= 0, got {held!r}")
    return held
