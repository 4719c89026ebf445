"""The router hint's wire form (:mod:`kvshare.vllm.router_hint`): what a router encodes from
its index answer is what the connector decodes, and a malformed hint is refused by name."""

from __future__ import annotations

import json

import pytest

from kvshare.actors.index.runs import HolderRuns
from kvshare.match import build_match
from kvshare.types import BlockHash, Location, Tier
from kvshare.vllm.router_hint import MAX_RUNS, decode, encode, pool_runs

HASHES = [BlockHash(bytes([i]) * 16) for i in range(6)]
A, B, W = Location("node:a"), Location("node:b"), Location("worker:w1")


def test_the_pools_answer_survives_the_wire_and_leaves_out_what_no_connector_loads() -> None:
    """Pools in host or disk tiers, up to the first block no pool holds; a worker's gpu tier
    is left out (not loaded from), in either form of the index's answer."""
    per_block = [{A: Tier.HOST, W: Tier.GPU}, {A: Tier.HOST, B: Tier.DISK}, {B: Tier.DISK},
                 {W: Tier.GPU}, {A: Tier.HOST}]
    match = build_match(per_block)
    runs = HolderRuns(6, [(((A, 1), (W, 0)), 1), (((A, 1), (B, 2)), 1), (((B, 2),), 1),
                          (((W, 0),), 1), (((A, 1),), 1)])
    want = [[1, [[A, 1]]], [1, [[A, 1], [B, 2]]], [1, [[B, 2]]]]
    assert pool_runs(match) == pool_runs(runs) == want
    wire = json.loads(json.dumps(encode(5 * 32, want, HASHES)))
    hint = decode(wire)
    assert hint is not None and hint.held_tokens == 160 and hint.pools is not None
    assert [hint.pools.holders(i) for i in range(3)] == [
        {A: Tier.HOST}, {A: Tier.HOST, B: Tier.DISK}, {B: Tier.DISK}]
    assert hint.pools.combined_prefix == 3
    assert hint.matches(HASHES) and not hint.matches(HASHES[::-1]) and not hint.matches(HASHES[:2])


def test_runs_with_the_same_pools_merge_and_an_answer_with_no_pool_is_empty() -> None:
    runs = HolderRuns(4, [(((A, 1),), 2), (((A, 1), (W, 0)), 2)])
    assert pool_runs(runs) == [[4, [[A, 1]]]]
    assert pool_runs(HolderRuns(4, [(((W, 0),), 4)])) == []
    alternating = [(((A if i % 2 else B, 1),), 1) for i in range(MAX_RUNS + 1)]
    assert pool_runs(HolderRuns(len(alternating), alternating)) is None  # too long to send
    assert len(pool_runs(HolderRuns(MAX_RUNS, alternating[:MAX_RUNS])) or []) == MAX_RUNS
    hint = decode(encode(128, [], HASHES))
    assert hint is not None and hint.pools is not None and hint.pools.combined_prefix == 0
    assert hint.matches([])  # nothing to check


@pytest.mark.parametrize("entry, names", [
    ({"held_tokens": -1}, "held_tokens"),
    ({"held_tokens": "64"}, "held_tokens"),
    ({"held_tokens": 64, "pools": [[1, [["node:a", 1]]]]}, "tip"),
    ({"held_tokens": 64, "pools": [[0, [["node:a", 1]]]], "tip": ""}, "pools"),
    ({"held_tokens": 64, "pools": [[1, [["node:a", 0]]]], "tip": ""}, "pools"),
    ({"held_tokens": 64, "pools": [[1, []]], "tip": ""}, "pools"),
    ({"held_tokens": 64, "pools": {"node:a": 1}, "tip": ""}, "pools"),
])
def test_a_malformed_hint_is_refused_naming_the_field(entry: dict, names: str) -> None:
    with pytest.raises(ValueError, match=f"kvshare.{names}"):
        decode({"kvshare": entry})


def test_no_hint_decodes_to_none() -> None:
    assert decode(None) is None and decode({}) is None
    assert decode({"prompt_token_ids": [1]}) is None
    assert decode({"kvshare": {"share": False}}) is None  # the opt-out alone
    with pytest.raises(ValueError, match="cover 7 blocks"):
        encode(64, [[7, [["node:a", 1]]]], HASHES)
