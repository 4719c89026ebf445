"""Hasher: one object for namespace roots per tenant salt and block hashes per prompt, used by
the SDK clients, the reference engine, the routers and the simulator."""

from __future__ import annotations

import pytest
from test_hashing import LAYOUT_FP, MODEL, SALT, TOKENS, VECTORS

from kvshare.client.sdk import KVShareClient
from kvshare.hasher import Hasher
from kvshare.hashing import HashFn, block_hashes, namespace_root
from kvshare.layout import KVLayout


@pytest.mark.parametrize("fn", list(HashFn))
def test_pinned_vectors_through_the_hasher(fn: HashFn) -> None:
    root_hex, first_hex, second_hex, lora_first_hex = VECTORS[fn]
    tenant = Hasher(MODEL, LAYOUT_FP, 16, salt=SALT, fn=fn)
    assert tenant.root.hex() == root_hex
    assert [h.hex() for h in tenant.hashes(TOKENS)] == [first_hex, second_hex]
    assert tenant.hashes(TOKENS, extra_keys=[b"lora:7", None])[0].hex() == lora_first_hex
    shared = Hasher(MODEL, LAYOUT_FP, 16, fn=fn)  # default salt "": another root
    assert shared.root.hex() != root_hex
    assert [h.hex() for h in shared.hashes(TOKENS, salt=SALT)] == [first_hex, second_hex]
    assert shared.root_for(SALT) is shared.root_for(SALT)  # memoised per salt


def test_a_continued_chain_equals_the_whole_chain() -> None:
    h = Hasher(MODEL, LAYOUT_FP, 16, salt=SALT)
    whole = h.hashes(list(range(48)))
    assert h.hashes(list(range(16, 48)), parent=whole[0]) == whole[1:]


def test_a_root_only_hasher_refuses_a_salt_instead_of_hashing_under_the_wrong_root() -> None:
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    h = Hasher.from_root(root, 16)
    assert [x.hex() for x in h.hashes(TOKENS)] == list(VECTORS[HashFn.SHA256][1:3])
    for salt in ("tenant-b", "", SALT):
        with pytest.raises(ValueError, match="Hasher.for_layout"):
            h.hashes(TOKENS, salt=salt)
    with pytest.raises(ValueError, match="xxh3_128 digests are 16"):
        Hasher.from_root(root, 16, fn=HashFn.XXH3_128)
    with pytest.raises(ValueError, match="block_tokens"):
        Hasher(MODEL, LAYOUT_FP, 0)


def test_kvshare_client_hashes_honour_the_tenant_salt() -> None:
    layout = KVLayout(2, 2, 16, "fp32", block_tokens=8)
    tokens = list(range(24))
    client = KVShareClient(namespace="ns", layout=layout, root=Hasher.for_layout("m", layout),
                           node="n0", index=None, control_for=lambda node: None)
    try:
        acme = block_hashes(namespace_root("m", layout.fingerprint(), "acme"), tokens, 8)
        assert client.hashes(tokens, salt="acme") == acme
        assert client.hashes(tokens) == block_hashes(namespace_root("m", layout.fingerprint()), tokens, 8)
        assert client.hashes(tokens) != acme
    finally:
        client.close()
    root_only = KVShareClient(namespace="ns", layout=layout, root=client.root, node="n0",
                              index=None, control_for=lambda node: None)
    try:
        assert root_only.hashes(tokens) == client.hashes(tokens)
        with pytest.raises(ValueError, match="salt 'acme'"):
            root_only.hashes(tokens, salt="acme")
    finally:
        root_only.close()
