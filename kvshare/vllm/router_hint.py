"""What a kvshare router tells a vLLM engine about a request it routed: the router hint.

A router ranks a request on the index's answer for its blocks; the engine's connector would
otherwise ask the index the same question again before scheduling the request, and on a busy
engine a lookup that does not answer within ``lookup_wait_s`` holds the request for at least one
engine step (:mod:`kvshare.vllm.connector.lookup`). So the router forwards what it found, in vLLM's
``kv_transfer_params`` (a field of vLLM's OpenAI completion and chat bodies that reaches the
connector as ``Request.kv_transfer_params``)::

    {"kvshare": {"held_tokens": N, "pools": [[count, [[location, tier], ...]], ...], "tip": H}}

- ``held_tokens``: the tokens of the longest prefix of the prompt that the cluster held in the
  router's view (the index's answer, every tier and node, plus the blocks the router's own
  recent decisions are about to write), a multiple of the router's block size. The connector
  skips its lookup when ``N`` leaves less than one block beyond vLLM's own prefix hit.
- ``pools`` (optional): the index's answer itself, for the pools (the only holders a connector
  loads from): runs of ``count`` consecutive blocks from block 0 with the same pool holders
  (``location`` a pool's index location, ``tier`` its code: 1 host, 2 disk), up to the first
  block no pool held. With it the connector plans its load from the router's answer, exactly
  as from its own index query (:meth:`kvshare.client.sdk.KVShareClient.plan_from`), and asks the
  index nothing: the request is scheduled in the step it arrives. ``tip``: the first 8 bytes
  (hex) of the hash of the last block ``pools`` covers; a connector whose own hash of that
  block differs (another hashing of the prompt) ignores the hint (counted,
  ``router_hints_mismatched``) and looks up.

Without a hint, or with a malformed one (counted), the connector looks up as always. A stale
hint costs at most a recompute (blocks stored after the router's query are not loaded; a block
evicted since is a failed load, recomputed), never a wrong token; and a hint is trusted only
while the request has waited less than the connector's ``router_hint_max_age_s`` (default 1 s)
since it reached the engine: a request that queued longer is looked up (counted,
``router_hints_expired``), and when that lookup is not back at once (the scheduler's usual
wait) the expired hint answers after all (counted, ``router_hints_expired_used``): on a
loaded engine, where a request queues for seconds, holding it a step more for the blocks
stored meanwhile would cost a step's time for what is usually nothing. A router whose index
did not answer sends no hint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvshare.match import MatchResult, build_match
from kvshare.types import TIERS, Location, Tier

KEY = "kvshare"
HELD = "held_tokens"
POOLS = "pools"
TIP = "tip"
TIP_BYTES = 8
WireRuns = list[list[Any]]
"""``[[count, [[location, tier code], ...]], ...]``: the ``pools`` field."""
MAX_RUNS = 256
"""The most runs a hint carries (a prompt whose holders alternate more is looked up: the hint
stays a few kilobytes in the request body)."""


@dataclass(frozen=True)
class Hint:
    """A decoded hint: ``held_tokens``; ``pools``, the pools' part of the router's index answer
    (None: the router sent only ``held_tokens``), covering ``pools.combined_prefix`` blocks
    whose last one's hash starts with ``tip``."""

    held_tokens: int
    pools: MatchResult | None = None
    tip: str = ""

    def matches(self, hashes: Sequence[bytes]) -> bool:
        """Whether ``hashes`` (the connector's, of the same prompt) agree with the router's
        at the last block ``pools`` covers (always, with no pools or an empty answer)."""
        n = self.pools.combined_prefix if self.pools is not None else 0
        return n == 0 or (n <= len(hashes) and bytes(hashes[n - 1])[:TIP_BYTES].hex() == self.tip)


def pool_runs(match: Any) -> WireRuns | None:
    """The ``pools`` field for an index answer: a :class:`~kvshare.match.MatchResult`, or one
    in run form (``.runs``: ``[(((location, tier code), ...), count), ...]``, as
    :class:`kvshare.actors.index.runs.HolderRuns`). Only pools (``node:`` locations) in host or disk
    tiers count (a worker's gpu tier is not loaded from); the runs stop at the first block no
    pool holds. None when that takes more than :data:`MAX_RUNS` runs."""
    out: WireRuns = []
    if hasattr(match, "runs"):
        runs = [([(str(loc), int(code)) for loc, code in items], int(n)) for items, n in match.runs]
    else:
        runs = [([(str(loc), t.rank) for loc, t in match.holders(i).items()], 1)
                for i in range(match.combined_prefix)]
    for items, n in runs:
        pools = sorted([loc, code] for loc, code in items if loc.startswith("node:") and code > 0)
        if not pools:
            break
        if out and out[-1][1] == pools:
            out[-1][0] += n
        elif len(out) == MAX_RUNS:
            return None
        else:
            out.append([n, pools])
    return out


def encode(held_tokens: int, pools: WireRuns | None = None,
           hashes: Sequence[bytes] = ()) -> dict[str, Any]:
    """The ``kv_transfer_params`` entry for a prompt whose first ``held_tokens`` are held;
    with ``pools`` (:func:`pool_runs`) and the router's block ``hashes`` of the prompt, the
    pools' answer and its ``tip``."""
    entry: dict[str, Any] = {HELD: int(held_tokens)}
    if pools is not None:
        n = sum(run[0] for run in pools)
        if n > len(hashes):
            raise ValueError(f"the pools' runs cover {n} blocks, the prompt has {len(hashes)}")
        entry[POOLS] = pools
        entry[TIP] = bytes(hashes[n - 1])[:TIP_BYTES].hex() if n else ""
    return {KEY: entry}


def decode(kv_transfer_params: Any) -> Hint | None:
    """The hint; None when there is none. Raises ValueError on a malformed one (not a mapping,
    ``held_tokens`` not an int >= 0, ``pools`` not runs of ``[count >= 1, [[location, 1 or
    2], ...]]``, ``tip`` not a string)."""
    if not kv_transfer_params:
        return None
    if not isinstance(kv_transfer_params, Mapping):
        raise ValueError(f"kv_transfer_params must be an object, got {type(kv_transfer_params).__name__}")
    hint = kv_transfer_params.get(KEY)
    if hint is None or (isinstance(hint, Mapping) and HELD not in hint and POOLS not in hint):
        return None  # e.g. only the opt-out flag (kvshare.vllm.connector.opt_out)
    held = hint.get(HELD) if isinstance(hint, Mapping) else None
    if type(held) is not int or held < 0:
        raise ValueError(f"kv_transfer_params.{KEY}.{HELD} must be an int >= 0, got {held!r}")
    assert isinstance(hint, Mapping)
    if POOLS not in hint:
        return Hint(held)
    tip = hint.get(TIP)
    if not isinstance(tip, str):
        raise ValueError(f"kv_transfer_params.{KEY}.{TIP} must be a string, got {tip!r}")
    return Hint(held, _match(hint[POOLS]), tip)


def _match(runs: Any) -> MatchResult:
    bad = ValueError(f"kv_transfer_params.{KEY}.{POOLS} must be a list of [count >= 1, "
                     f"[[pool location, tier 1 or 2], ...]], got {str(runs)[:200]}")
    if not isinstance(runs, list):
        raise bad
    per_block: list[dict[Location, Tier]] = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and type(run[0]) is int and run[0] >= 1
                and isinstance(run[1], list) and run[1]):
            raise bad
        holders: dict[Location, Tier] = {}
        for item in run[1]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                    and type(item[1]) is int and 1 <= item[1] < len(TIERS)):
                raise bad
            holders[Location(item[0])] = TIERS[item[1]]
        if len(per_block) + run[0] > 1 << 20:
            raise bad
        per_block += [holders] * run[0]
    return build_match(per_block)
