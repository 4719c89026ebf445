"""StateMap (the index's block table): one conformance suite for the C table and the dict
reference, plus a property test of random operations against a plain dict model."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.statemap import PyStateMap, StateMapLike, make_state_map, native_available

IMPLS = ["python"] + (["native"] if native_available() else [])


def h(i: int, size: int = 32) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()[:size]


def make(kind: str, size: int = 32) -> StateMapLike:
    return PyStateMap(size) if kind == "python" else make_state_map(size)


@pytest.fixture(params=IMPLS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_store_three_then_prefix_runs_stop_at_the_first_absent_block(kind: str) -> None:
    m = make(kind)
    assert m.update([h(0), h(1), h(2)], lambda s: s + 1) == 3
    assert m.update([h(1)], lambda s: s + 5) == 1  # 1 -> 6
    assert m.prefix_runs([h(0), h(1), h(2), h(9), h(0)]) == [(1, 1), (6, 1), (1, 1)]
    assert m.prefix_runs([h(9), h(0)]) == []
    assert m.states([h(2), h(9)]) == [1, 0]
    assert m.get(h(1)) == 6 and m.get(h(9)) == 0 and len(m) == 3


def test_a_packed_buffer_is_the_same_as_a_list(kind: str) -> None:
    m = make(kind, 16)
    keys = [h(i, 16) for i in range(100)]
    m.update(b"".join(keys), lambda s: 3)
    assert m.prefix_runs(keys) == m.prefix_runs(memoryview(b"".join(keys))) == [(3, 100)]


def test_update_to_zero_deletes_and_transform_all_drops(kind: str) -> None:
    m = make(kind)
    m.update([h(i) for i in range(1000)], lambda s: 2)
    m.update([h(i) for i in range(0, 1000, 2)], lambda s: 7)
    assert m.update([h(i) for i in range(0, 10)], lambda s: 0) == 10
    assert m.state_counts() == {2: 495, 7: 495}
    assert m.transform_all(lambda s: 0 if s == 7 else s) == 495
    assert len(m) == 495 and m.state_counts() == {2: 495}
    assert sorted(m.items()) == sorted((h(i), 2) for i in range(11, 1000, 2))
    assert all(m.get(h(i)) == 0 for i in range(0, 1000, 2))


@pytest.mark.parametrize("bad", [[b"short"], [bytearray(32)], ["x" * 32], 42, b"x" * 33])
def test_malformed_keys_raise_and_change_nothing(kind: str, bad: object) -> None:
    m = make(kind)
    m.update([h(1)], lambda s: 4)
    with pytest.raises(ValueError, match="block hashes"):
        m.update(bad, lambda s: 9)
    with pytest.raises(ValueError, match="block hashes"):
        m.prefix_runs(bad)
    assert m.items() == [(h(1), 4)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "del", "drop"]),
                          st.lists(st.integers(0, 40), max_size=30), st.integers(1, 5)),
                max_size=40))
def test_random_operations_match_a_dict(ops: list[tuple[str, list[int], int]]) -> None:
    model: dict[bytes, int] = {}
    maps = [make(k) for k in IMPLS]
    for op, ids, v in ops:
        keys = [h(i) for i in ids]
        for m in maps:
            if op == "set":
                m.update(keys, lambda s, v=v: s + v)
            elif op == "del":
                m.update(keys, lambda s: 0)
            else:
                m.transform_all(lambda s, v=v: 0 if s % 2 == v % 2 else s)
        if op == "set":
            for k in keys:  # in order: a repeated key moves on from its new state
                model[k] = model.get(k, 0) + v
        elif op == "del":
            for k in keys:
                model.pop(k, None)
        else:
            model = {k: s for k, s in model.items() if s % 2 != v % 2}
        for m in maps:
            assert dict(m.items()) == model
            probe = [h(i) for i in range(42)]
            assert m.states(probe) == [model.get(k, 0) for k in probe]


def test_transform_all_can_name_the_keys_it_changed(kind: str) -> None:
    m = make(kind, 16)
    m.update([h(i, 16) for i in range(20)], lambda s: 1 + s % 2)
    m.update([h(i, 16) for i in range(5)], lambda s: 3)
    n, keys = m.transform_all(lambda s: 0 if s == 3 else s, True)
    assert n == 5 and sorted(keys[i:i + 16] for i in range(0, len(keys), 16)) == sorted(
        h(i, 16) for i in range(5))
