"""The opt-in xxh3-128 chain in C (``kvshare._native._chain.xxh3_chain``, bound to the ``xxhash``
package's own XXH3_128bits) against the Python loop: the same bytes for lists, packed ids,
any block size and parent, through ``block_hashes`` and ``Hasher``; the same ValueError for a
bad id. Skips where the extension is not built or not bound, unless ``KVSHARE_REQUIRE_NATIVE=1``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare import hashing
from kvshare.hasher import Hasher
from kvshare.hashing import HashFn, block_hashes, namespace_root

NATIVE = hashing._xxh3_native()
if not NATIVE and os.environ.get("KVSHARE_REQUIRE_NATIVE") == "1":
    raise AssertionError("kvshare._native._chain.xxh3_chain is not built or not bound")
pytestmark = pytest.mark.skipif(not NATIVE, reason="xxh3 C chain not available: Python loop only")

ROOT = namespace_root("meta-llama/Llama-3.1-8B", "38ad274327873df6", "t", fn=HashFn.XXH3_128)


def python_loop(tokens: object, block_tokens: int, parent: bytes | None = None) -> list[bytes]:
    """block_hashes with the C chain switched off (the Python loop)."""
    saved = hashing._XXH3_BOUND
    hashing._XXH3_BOUND = False
    try:
        return block_hashes(ROOT, tokens, block_tokens, fn=HashFn.XXH3_128,  # type: ignore[arg-type]
                            parent=parent)
    finally:
        hashing._XXH3_BOUND = saved


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=700), st.integers(1, 70), st.booleans(),
       st.binary(min_size=16, max_size=16))
def test_c_chain_gives_the_python_loops_bytes(ids: list[int], bt: int, packed: bool,
                                              parent: bytes) -> None:
    tokens = np.asarray(ids, dtype=np.uint32) if packed else ids
    for par in (None, parent):
        want = python_loop(tokens, bt, par)
        assert block_hashes(ROOT, tokens, bt, fn=HashFn.XXH3_128, parent=par) == want
    hasher = Hasher("meta-llama/Llama-3.1-8B", "38ad274327873df6", bt, salt="t",
                    fn=HashFn.XXH3_128)
    assert hasher._xxh3 is not None
    assert hasher.hashes(tokens) == python_loop(tokens, bt)


def test_bad_ids_are_refused_alike() -> None:
    hasher = Hasher("m", "l", 16, fn=HashFn.XXH3_128)
    for bad in ([1, -1] + [0] * 40, [2**32] + [0] * 40, np.array([-3] * 40, dtype=np.int64)):
        with pytest.raises(ValueError, match="outside"):
            hasher.hashes(bad)
        with pytest.raises(ValueError, match="outside"):
            python_loop(bad, 16)


def test_unbound_chain_refuses() -> None:
    from kvshare._native import _chain

    with pytest.raises(ValueError):
        _chain.xxh3_chain(b"short", b"\0" * 64, 64, b"")
    assert _chain.xxh3_bind("/nonexistent/libxxhash.so") is False
