"""What the gateway sends a worker, by engine: kvshare workers get the ``kvshare`` field, vLLM
servers get the gateway's token ids in vLLM's own fields (completions as ``prompt``, chat as
``kv_transfer_params.prompt_token_ids``) and the tenant's salt as ``cache_salt``."""

from __future__ import annotations

from kvshare.match import build_match
from kvshare.router.core.embed import Routed, Tenant
from kvshare.router.core.policy import Decision, Ranking, RouteRequest
from kvshare.router.gateway.forward import forward_body
from kvshare.types import BlockHash, Location, NodeId, Tier, WorkerId
from kvshare.workers import WorkerInfo

VLLM = WorkerInfo(WorkerId("v0"), NodeId("n0"), ("ns",), "http://127.0.0.1:1", 1, "",
                  {"engine": "vllm", "model": "/models/tiny"})
REFERENCE = WorkerInfo(WorkerId("w0"), NodeId("n0"), ("ns",), "http://127.0.0.1:2")
IDS = [3, 1, 4, 1, 5]


def routed(salt: str = "") -> Routed:
    d = Decision(WorkerId("v0"), "http://127.0.0.1:1", "cost", "cache", 0.1, 0.0, 0, 0)
    return Routed("r1", d, Tenant("acme", salt), "ns", list(IDS), [BlockHash(b"\1" * 16)], 0.0)


def test_chat_to_vllm_carries_the_gateways_token_ids_and_keeps_the_messages() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 2}
    out = forward_body(body, routed("s1"), VLLM, chat=True)
    assert out["kv_transfer_params"] == {"prompt_token_ids": IDS}
    assert out["messages"] == msgs and out["model"] == "/models/tiny"
    assert out["cache_salt"] == "s1" and "kvshare" not in out


def test_completion_to_vllm_sends_token_ids_as_the_prompt() -> None:
    out = forward_body({"model": "tiny", "prompt": "hello"}, routed(), VLLM, chat=False)
    assert out["prompt"] == IDS and "cache_salt" not in out and "kv_transfer_params" not in out


def test_a_clients_salt_and_connector_parameters_never_reach_a_worker() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "cache_salt": "someone-else",
            "kv_transfer_params": {"prompt_token_ids": [9, 9], "do_remote_prefill": True}}
    out = forward_body(body, routed(), VLLM, chat=True)
    assert out["kv_transfer_params"] == {"prompt_token_ids": IDS} and "cache_salt" not in out
    ref = forward_body(body, routed(), REFERENCE, chat=True)
    assert "kv_transfer_params" not in ref and "cache_salt" not in ref
    assert ref["kvshare"]["token_ids"] == IDS


def test_vllm_gets_the_routers_hint_only_when_the_index_answered() -> None:
    """What the router saw held (its index query and pending blocks, and which pools held it)
    rides in vLLM's ``kv_transfer_params`` for completions and chat alike, so the engine's
    connector need not ask the index again; a decision the index did not answer sends none
    (the engine looks up)."""
    import dataclasses

    from kvshare.vllm.router_hint import decode, encode

    hint = encode(512, [[1, [["node:n1", 1]]]], [BlockHash(b"\1" * 16)])
    base = routed()
    held = build_match([{Location("node:n1"): Tier.HOST, Location("worker:v0"): Tier.GPU}])
    ranking = Ranking(RouteRequest("ns", base.hashes, len(IDS)), base.decision,
                      held_blocks=2, index_match=held)
    seen = dataclasses.replace(base, ranking=ranking, block_tokens=256)
    comp = forward_body({"prompt": "hello"}, seen, VLLM, chat=False)
    assert comp["kv_transfer_params"] == hint
    chat = forward_body({"messages": [{"role": "user", "content": "x"}]}, seen, VLLM, chat=True)
    assert chat["kv_transfer_params"] == {**hint, "prompt_token_ids": IDS}
    got = decode(chat["kv_transfer_params"])
    assert got is not None and got.held_tokens == 512 and got.matches([BlockHash(b"\1" * 16)])
    assert got.pools is not None and got.pools.holders(0) == {"node:n1": "host"}
    assert "kv_transfer_params" not in forward_body({"prompt": "x"}, seen, REFERENCE, chat=False)
    assert decode(forward_body({"prompt": "hello"}, routed(), VLLM, chat=False)
                  .get("kv_transfer_params")) is None


def test_packed_token_ids_reach_a_worker_as_a_json_list_of_ints() -> None:
    """A prompt routed packed (numpy uint32, array("I")) is forwarded as the same list of
    Python ints a list-routed one is (JSON bodies cannot carry a buffer)."""
    import array
    import dataclasses
    import json

    import numpy as np

    for packed in (np.asarray(IDS, dtype=np.uint32), array.array("I", IDS)):
        r = dataclasses.replace(routed(), token_ids=packed)
        assert r.token_list() == IDS and all(type(i) is int for i in r.token_list())
        for info, chat in ((VLLM, False), (VLLM, True), (REFERENCE, False)):
            out = json.loads(json.dumps(forward_body({"prompt": "x"}, r, info, chat=chat)))
            assert out == json.loads(json.dumps(forward_body({"prompt": "x"}, routed(), info,
                                                             chat=chat)))


SGLANG = WorkerInfo(WorkerId("s0"), NodeId("n0"), ("ns",), "http://127.0.0.1:3", 1, "",
                    {"engine": "sglang", "model": "/models/tiny"})


def test_sglang_gets_token_ids_and_the_salt_but_no_vllm_parameters() -> None:
    out = forward_body({"model": "tiny", "prompt": "hello", "kv_transfer_params": {"x": 1}},
                       routed("s1"), SGLANG, chat=False)
    assert out == {"model": "/models/tiny", "prompt": IDS, "cache_salt": "s1"}
    msgs = [{"role": "user", "content": "hi"}]
    chat = forward_body({"model": "tiny", "messages": msgs}, routed(), SGLANG, chat=True)
    assert chat == {"model": "/models/tiny", "messages": msgs}
