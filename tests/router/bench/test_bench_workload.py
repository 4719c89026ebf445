"""``kvshare bench``'s workload: hash ids as token blocks, the readers' checks, chat logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.router.bench.workload import (
    TOKEN_SCHEME,
    BenchRequest,
    from_trace,
    read_chat_log,
    read_source,
    token_block,
)
from kvshare.router.sim.trace import Trace

VOCAB = 1024


def mooncake(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def requests(path: Path | list[Path], **kw: object) -> list[BenchRequest]:
    paths = path if isinstance(path, list) else [path]
    src = read_source(paths, block_tokens=kw.pop("block_tokens", 16))  # type: ignore[arg-type]
    assert isinstance(src, Trace)
    return from_trace(src, VOCAB, **kw).requests  # type: ignore[arg-type]


def blocks(r: BenchRequest, b: int = 16) -> list[tuple[int, ...]]:
    return [r.prompt[i:i + b] for i in range(0, len(r.prompt), b)]


def test_token_blocks_are_a_fixed_function_of_the_id_and_position() -> None:
    assert TOKEN_SCHEME == "splitmix64-v1"
    assert token_block(7, 6, VOCAB) == [773, 904, 921, 728, 248, 396]  # splitmix64 by hand
    assert token_block(7, 16, VOCAB) == token_block(7, 16, VOCAB)
    assert token_block(7, 16, VOCAB) != token_block(8, 16, VOCAB)
    assert all(100 <= t < VOCAB for h in range(50) for t in token_block(h, 64, VOCAB))
    with pytest.raises(ValueError, match="--vocab"):
        token_block(1, 4, 50)


def test_equal_ids_give_equal_blocks_and_different_ids_different_ones(tmp_path: Path) -> None:
    path = mooncake(tmp_path, [
        {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 48, "output_length": 500, "hash_ids": [1, 2, 4]},
        {"timestamp": 900, "input_length": 20, "output_length": 0, "hash_ids": [5, 6]},
    ])
    a, b, c = requests(path, max_tokens=64)
    assert [len(r.prompt) for r in (a, b, c)] == [40, 48, 20]  # the last block is cut to fit
    assert blocks(a)[:2] == blocks(b)[:2] and blocks(a)[2] != blocks(b)[2][:8]
    assert not set(blocks(c)) & set(blocks(a) + blocks(b))
    assert (a.arrival_s, b.arrival_s) == (0.0, 0.5)  # Mooncake's ms as seconds
    assert [r.max_tokens for r in (a, b, c)] == [5, 64, 1]  # the trace's, capped, at least 1


def test_prompts_longer_than_the_model_keep_their_first_tokens(tmp_path: Path) -> None:
    path = mooncake(tmp_path, [{"timestamp": 0, "input_length": 64, "output_length": 8,
                                "hash_ids": [1, 2, 3, 4]}])
    src = read_source([path], block_tokens=16)
    assert isinstance(src, Trace)
    w = from_trace(src, VOCAB, max_model_len=40)
    assert len(w.requests[0].prompt) == 32 and w.truncated == 1


def agentic(tmp_path: Path, name: str, requests: list[dict[str, object]]) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"block_size": 16, "hash_id_scope": "local", "tool_tokens": 0,
                             "system_tokens": 0, "requests": requests}))
    return p


def test_agentic_ids_are_scoped_per_conversation_and_subagents_are_users(tmp_path: Path) -> None:
    turn = [{"t": 0, "in": 40, "out": 4, "hash_ids": [1, 2]},
            {"t": 1, "in": 56, "out": 4, "hash_ids": [1, 2, 3]}]
    sub = {"t": 2, "type": "subagent", "requests": [{"t": 0, "in": 20, "out": 2, "hash_ids": [9]}]}
    a = agentic(tmp_path, "a.json", [*turn, sub])
    b = agentic(tmp_path, "b.json", turn)  # the same ids, another conversation
    reqs = requests([a, b])
    by_user: dict[int, list[BenchRequest]] = {}
    for r in reqs:
        by_user.setdefault(r.user, []).append(r)
    assert len(by_user) == 3  # two conversations and a sub-agent
    (a1, a2), (b1, b2) = by_user[0], by_user[1]
    assert blocks(a1)[:2] == blocks(a2)[:2] and blocks(b1)[:2] == blocks(b2)[:2]
    assert not set(blocks(a2)) & set(blocks(b2))  # file-local ids never meet
    assert len(a1.prompt) == 40 and blocks(a1)[2] != blocks(b1)[2]  # the partial tail is private


@pytest.mark.parametrize(("row", "message"), [
    ({"timestamp": 0, "input_length": 32, "hash_ids": [1]}, "line 2: 1 hash ids but input_length 32"),
    ({"timestamp": None, "input_length": 16, "hash_ids": [1]}, "line 2: timestamp is missing"),
    ({"timestamp": 0, "input_length": 0, "hash_ids": []}, "line 2: input_length is 0"),
    ({"timestamp": 0, "input_length": 16, "hash_ids": [-1]}, "line 2: a hash id is not a whole"),
])
def test_a_bad_trace_row_is_an_error_naming_the_row_and_field(
        tmp_path: Path, row: dict[str, object], message: str) -> None:
    path = mooncake(tmp_path, [{"timestamp": 0, "input_length": 16, "hash_ids": [1]}, row])
    with pytest.raises(ValueError, match=message):
        read_source([path], block_tokens=16)


def chat_log(tmp_path: Path, rows: list[object]) -> Path:
    p = tmp_path / "chat.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def test_a_chat_log_is_sent_as_logged_at_its_times(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    path = chat_log(tmp_path, [{"messages": msgs, "timestamp": 1000.5, "max_tokens": 9},
                               {"messages": msgs, "timestamp": 1000.0}])
    w = read_source([path], max_tokens=100)
    assert not isinstance(w, Trace)
    assert [(r.row, r.arrival_s, r.max_tokens) for r in w.requests] == [(1, 0.0, 100), (0, 0.5, 9)]
    assert w.requests[0].messages == tuple(msgs) and not w.requests[0].prompt
    assert read_chat_log(path, max_tokens=4).requests[1].max_tokens == 4


@pytest.mark.parametrize(("row", "message"), [
    ("{not json", "line 2: the line is not JSON"),
    ({"timestamp": 1}, "line 2: messages is missing"),
    ({"messages": [{"role": "user"}], "timestamp": 1}, r"line 2: messages\[0\] needs"),
    ({"messages": [{"role": "user", "content": "x"}]}, "line 2: timestamp is None"),
    ({"messages": [{"role": "user", "content": "x"}], "timestamp": 1, "max_tokens": 0},
     "line 2: max_tokens is 0"),
])
def test_a_bad_chat_log_row_is_an_error_naming_the_row_and_field(
        tmp_path: Path, row: object, message: str) -> None:
    good = {"messages": [{"role": "user", "content": "x"}], "timestamp": 0}
    with pytest.raises(ValueError, match=message):
        read_source([chat_log(tmp_path, [good, row])], fmt="chat")


def test_trace_knobs_are_refused_for_a_chat_log(tmp_path: Path) -> None:
    path = chat_log(tmp_path, [{"messages": [{"role": "user", "content": "x"}], "timestamp": 0}])
    with pytest.raises(ValueError, match="not to a chat log"):
        read_source([path], block_tokens=16)
    with pytest.raises(ValueError, match="users"):
        read_source([path], users=2)
