"""One conformance suite for the C modules kvshare keeps and their Python twins (setup.py).

Every test takes an implementation fixture parametrised over both, ``c`` and ``python``:

- ``chain``: ``kvshare._native._chain`` (sha256 and xxh3-128 block-hash chains) against the hashlib /
  xxhash loop of :func:`kvshare.hashing.block_hashes`: fixed digests, every input form, a
  chain continued from its parent, prompts past the one-pass size, the same ValueErrors;
- ``copier``: ``kvshare._native._copy`` (non-temporal stores) against numpy's copy behind
  :func:`kvshare.tiers.base.copy_block` and the host slab: the same bytes on awkward sizes and
  offsets, nothing outside the destination touched, the same checksums;
- ``kind``: ``kvshare._native._statemap`` (the index's block table) against :class:`PyStateMap`.

Where a C module is not built its ``c`` cases skip and say so, unless
``KVSHARE_REQUIRE_NATIVE=1`` (then they fail). Module-specific checks that have no Python twin
(the C chain releasing the GIL, the verified memo) stay in tests/kvshare/test_hashing_native.py,
tests/kvshare/test_chain_memo.py and tests/kvshare/tiers/test_copy_native.py.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare import hashing
from kvshare.hashing import FUSED_MAX_TOKENS, HashFn, block_hashes, namespace_root
from kvshare.statemap import PyStateMap, StateMapLike, make_state_map, native_available
from kvshare.tiers import base as tiers_base
from kvshare.tiers.base import STREAM_MIN_BYTES, block_checksum, copy_block
from kvshare.tiers.host import HostSlab
from kvshare.types import BlockHash

IMPLS = ["c", "python"]
REQUIRE = os.environ.get("KVSHARE_REQUIRE_NATIVE") == "1"


def _need(built: bool, what: str) -> None:
    if built:
        return
    if REQUIRE:
        raise AssertionError(f"{what} is not built (KVSHARE_REQUIRE_NATIVE=1): run "
                             "setup.py build_ext --inplace")
    pytest.skip(f"{what} not built: only the Python twin runs")


# ---------------------------------------------------------------- kvshare._native._chain

MODEL = "meta-llama/Llama-3.1-8B"
LAYOUT_FP = "38ad274327873df6"
SALT = "tenant-a"
TOKENS = list(range(40))  # two full blocks of 16 and a partial one
# the pinned vectors of tests/test_hashing.py (scheme version 1): root, block 0, block 1
VECTORS = {
    HashFn.SHA256: ("aa2f79e26c217b818095d6f93b173a0c7b90831efd8ea3495e1e0e2cee798a42",
                    "d83a5b0b0a9a49ec6fc257b93171e32f2f8a5b05f7013f1e1f85f608ad1021c3",
                    "78c261cb4351c6d403f1d7c031a7a36f0e4fd59830fb034a51ff922f8b61e2d2"),
    HashFn.XXH3_128: ("a0003ce1686b4399a30c69e3408670ff",
                      "b0a5674287048d8089a66cf97f68934a",
                      "a2b7320b6e69de3f64f530ac4a6be40e"),
}
LONG = [(i * 7919) % 2**32 for i in range(FUSED_MAX_TOKENS + 4 * 256)]  # past the one-pass size
# sha256 over the concatenated block hashes of LONG (256-token blocks), computed once with the
# Python loop and pasted here
LONG_DIGEST = {
    HashFn.SHA256: "45f934547dc5947fc68bb22df842269079d483b23f4e8d915b7da48486f39aaf",
    HashFn.XXH3_128: "1f28bb1fbfc580cee5c14a373e97901d1dabd0dc750c00314d096b58d04dc574",
}


@pytest.fixture(params=IMPLS)
def chain(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``c``: the chains as built; ``python``: the C module taken away (its import failed)."""
    if request.param == "c":
        _need(hashing._chain is not None, "kvshare._native._chain")
    else:
        monkeypatch.setattr(hashing, "_chain", None)
        monkeypatch.setattr(hashing, "_pack_u32", None)
        monkeypatch.setattr(hashing, "_XXH3_BOUND", False)
    yield str(request.param)


def _fn_for(chain: str, fn: HashFn) -> HashFn:
    if chain == "c" and fn is HashFn.XXH3_128:
        _need(hashing._xxh3_native(), "kvshare._native._chain.xxh3_chain (bound to xxhash)")
    return fn


@pytest.mark.parametrize("fn", list(VECTORS))
def test_chain_gives_the_pinned_digests(chain: str, fn: HashFn) -> None:
    fn = _fn_for(chain, fn)
    root_hex, first_hex, second_hex = VECTORS[fn]
    root = namespace_root(MODEL, LAYOUT_FP, SALT, fn=fn)
    assert root.hex() == root_hex
    assert [h.hex() for h in block_hashes(root, TOKENS, 16, fn=fn)] == [first_hex, second_hex]


@pytest.mark.parametrize("fn", list(VECTORS))
def test_chain_input_forms_and_continuation_agree(chain: str, fn: HashFn) -> None:
    fn = _fn_for(chain, fn)
    root = namespace_root(MODEL, LAYOUT_FP, SALT, fn=fn)
    want = [h.hex() for h in block_hashes(root, TOKENS, 16, fn=fn)]
    assert want == list(VECTORS[fn][1:])
    for form in (tuple(TOKENS), np.array(TOKENS, np.uint32), np.array(TOKENS, np.int64)):
        assert [h.hex() for h in block_hashes(root, form, 16, fn=fn)] == want
    first = block_hashes(root, TOKENS[:16], 16, fn=fn)
    rest = block_hashes(root, TOKENS[16:], 16, fn=fn, parent=first[-1])
    assert [h.hex() for h in first + rest] == want


@pytest.mark.parametrize("fn", list(VECTORS))
def test_chain_of_a_long_prompt(chain: str, fn: HashFn) -> None:
    fn = _fn_for(chain, fn)
    root = namespace_root(MODEL, LAYOUT_FP, SALT, fn=fn)
    got = block_hashes(root, LONG, 256, fn=fn)
    assert len(got) == len(LONG) // 256
    assert hashlib.sha256(b"".join(got)).hexdigest() == LONG_DIGEST[fn]


@pytest.mark.parametrize("tokens, match", [
    ([0, 1, -1] * 6, r"-1 is outside \[0, 2\*\*32\)"),
    ([0, 2**32] * 9, r"4294967296 is outside \[0, 2\*\*32\)"),
    (["a"] * 16, "must be integers"),
])
@pytest.mark.parametrize("fn", list(VECTORS))
def test_chain_refuses_bad_ids_alike(chain: str, fn: HashFn, tokens: list[object],
                                     match: str) -> None:
    fn = _fn_for(chain, fn)
    root = namespace_root(MODEL, LAYOUT_FP, SALT, fn=fn)
    with pytest.raises(ValueError, match=match):
        block_hashes(root, tokens, 4, fn=fn)  # type: ignore[arg-type]


# ---------------------------------------------------------------- kvshare._native._copy


@pytest.fixture(params=IMPLS)
def copier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``c``: streaming stores as built; ``python``: numpy's copy (the C module taken away)."""
    if request.param == "c":
        _need(tiers_base.STREAMING_COPY, "kvshare._native._copy (x86-64 streaming stores)")
    else:
        monkeypatch.setattr(tiers_base, "STREAMING_COPY", False)
    yield str(request.param)


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", [0, 1, 17, STREAM_MIN_BYTES - 1, STREAM_MIN_BYTES,
                               STREAM_MIN_BYTES + 7, 2**20 + 33])
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (1, 0), (0, 5), (3, 7)])
def test_copy_block_copies_exactly_the_destination(copier: str, n: int, src_off: int,
                                                   dst_off: int) -> None:
    src = rand(n + src_off, n)[src_off:]
    guard = rand(n + dst_off + 64, 1)
    dst_all = guard.copy()
    dst = dst_all[dst_off : dst_off + n]
    copy_block(dst, src)
    assert np.array_equal(dst, src)
    assert np.array_equal(dst_all[:dst_off], guard[:dst_off])
    assert np.array_equal(dst_all[dst_off + n :], guard[dst_off + n :])


def test_host_slab_stores_and_returns_the_same_bytes_and_checksums(copier: str) -> None:
    size = 3 * 512 * 1024 + 4096 + 5  # several copy-and-hash chunks and a ragged tail
    slab = HostSlab(size, 3)
    try:
        data, other = rand(size, 9), rand(size, 10)
        assert slab.write_checksummed(1, data, BlockHash(b"\x01" * 32)) == block_checksum(data)
        assert np.array_equal(slab.view(1), data) and not slab.view(0).any()
        slab.write(2, other, BlockHash(b"\x02" * 32), block_checksum(other))
        out = np.empty(size, np.uint8)
        slab.read_into(2, out, BlockHash(b"\x02" * 32), 0)
        assert np.array_equal(out, other) and slab.checksum(1) == block_checksum(data)
    finally:
        slab.close()


# ---------------------------------------------------------------- kvshare._native._statemap


def h(i: int, size: int = 32) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()[:size]


def make(kind: str, size: int = 32) -> StateMapLike:
    return PyStateMap(size) if kind == "python" else make_state_map(size)


@pytest.fixture(params=IMPLS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "c":
        _need(native_available(), "kvshare._native._statemap")
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


def test_transform_all_can_name_the_keys_it_changed(kind: str) -> None:
    m = make(kind, 16)
    m.update([h(i, 16) for i in range(20)], lambda s: 1 + s % 2)
    m.update([h(i, 16) for i in range(5)], lambda s: 3)
    n, keys = m.transform_all(lambda s: 0 if s == 3 else s, True)
    assert n == 5 and sorted(keys[i:i + 16] for i in range(0, len(keys), 16)) == sorted(
        h(i, 16) for i in range(5))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "del", "drop"]),
                          st.lists(st.integers(0, 40), max_size=30), st.integers(1, 5)),
                max_size=40))
def test_random_operations_match_a_dict(ops: list[tuple[str, list[int], int]]) -> None:
    """Both tables (the C one where built) against a plain dict model, in lockstep."""
    model: dict[bytes, int] = {}
    maps = [make(k) for k in IMPLS if k == "python" or native_available()]
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

