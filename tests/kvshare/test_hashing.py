"""Chained block hashes: pinned test vectors, disjoint namespaces, input validation."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvshare import hashing
from kvshare.attention import AttentionKind, KVGroup
from kvshare.hashing import DEFAULT_HASH_FN, HashFn, block_hashes, namespace_root, tokens_to_u32le
from kvshare.layout import KVLayout

MODEL = "meta-llama/Llama-3.1-8B"
LAYOUT_FP = "38ad274327873df6"  # KVLayout(32, 8, 128, "bf16", 256).fingerprint()
SALT = "tenant-a"
TOKENS = list(range(40))  # two full blocks of 16 plus a partial one

# Computed once with scheme version 1 and pasted here; a change means the scheme changed
# (bump SCHEME_VERSION) and every stored block becomes unreachable.
VECTORS = {
    HashFn.SHA256: (
        "aa2f79e26c217b818095d6f93b173a0c7b90831efd8ea3495e1e0e2cee798a42",
        "d83a5b0b0a9a49ec6fc257b93171e32f2f8a5b05f7013f1e1f85f608ad1021c3",
        "78c261cb4351c6d403f1d7c031a7a36f0e4fd59830fb034a51ff922f8b61e2d2",
        "733a56f5a9a1db976fd937a30422822029ca385d1a564c73a688f5a828eb5eb9",
    ),
    HashFn.BLAKE3: (
        "febb9633f2daf0bef824a7f075ca2ad6c64202b1a46e1fe3dd9213c35edac339",
        "8de9a009a9a1e79c3f73f512bc46ca9f60633cdffeb80d9a3ea8007df920cc12",
        "a5208ebee9707737e4688c2edd605ef22c1372fbb8b5a80d8500e6e8520cdb45",
        "55231dd29dca17965f59e22e12740abb679d828cf781563907fe8d5f0422025d",
    ),
    HashFn.XXH3_128: (
        "a0003ce1686b4399a30c69e3408670ff",
        "b0a5674287048d8089a66cf97f68934a",
        "a2b7320b6e69de3f64f530ac4a6be40e",
        "551934c752b2ad478c81848a3efaafa2",
    ),
}


@pytest.mark.parametrize("fn", list(HashFn))
def test_fixed_vectors(fn: HashFn) -> None:
    root_hex, first_hex, second_hex, lora_first_hex = VECTORS[fn]
    root = namespace_root(MODEL, LAYOUT_FP, SALT, fn=fn)
    assert root.hex() == root_hex
    assert len(root) == fn.digest_size
    hashes = block_hashes(root, TOKENS, 16, fn=fn)
    assert [h.hex() for h in hashes] == [first_hex, second_hex]
    with_lora = block_hashes(root, TOKENS, 16, [b"lora:7", None], fn=fn)
    assert with_lora[0].hex() == lora_first_hex
    assert with_lora[1] != hashes[1]  # the chain carries the changed parent forward


def test_fixed_vectors_on_the_python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sha256 vectors with the C chain loop switched off (the fallback where it is not
    built); test_fixed_vectors above ran on the C loop when it is built."""
    monkeypatch.setattr(hashing, "_chain", None)
    root_hex, first_hex, second_hex, _ = VECTORS[HashFn.SHA256]
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    assert [h.hex() for h in block_hashes(root, TOKENS, 16)] == [first_hex, second_hex]


def test_default_is_sha256_and_str_equals_utf8_bytes() -> None:
    assert DEFAULT_HASH_FN is HashFn.SHA256
    root = namespace_root(MODEL.encode(), LAYOUT_FP.encode(), SALT.encode())
    assert root.hex() == VECTORS[HashFn.SHA256][0]


def test_input_forms_agree() -> None:
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    expected = block_hashes(root, TOKENS, 16)
    for form in (tuple(TOKENS), np.array(TOKENS, dtype=np.int64),
                 np.array(TOKENS, dtype=np.uint32), np.array(TOKENS, dtype=np.uint16),
                 np.array(TOKENS, dtype=">i4")):
        assert block_hashes(root, form, 16) == expected  # type: ignore[arg-type]
    assert tokens_to_u32le([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"


@pytest.mark.skipif(hashing._pack_u32 is None, reason="kvshare._native._chain not built")
def test_the_c_packer_packs_as_array_does() -> None:
    """``tokens_to_u32le`` packs lists in C (``_chain.pack_u32``): the same bytes as
    ``array.array("I")`` on random ids of every size class, and the same refusals."""
    import array
    import random

    rng = random.Random(7)
    edges = [0, 1, 255, 256, 2**15, 2**30 - 1, 2**30, 2**31, 2**32 - 1, True, np.int64(9)]
    for n in (0, 1, 17, 4096):
        for hi in (300, 2**16, 2**32):
            ids = [rng.randrange(hi) for _ in range(n)] + edges
            rng.shuffle(ids)
            want = array.array("I", ids).tobytes()
            assert hashing._pack_u32(ids) == want
            assert tokens_to_u32le(tuple(ids)) == want
    for bad in ([1, -1], [2**32], [-(2**70)], [2**70], [1.0], ["a"], [None]):
        with pytest.raises((OverflowError, TypeError)):
            hashing._pack_u32(bad)
        with pytest.raises((OverflowError, TypeError)):
            array.array("I", bad)


def test_continuing_a_chain_equals_hashing_at_once() -> None:
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    tokens = list(range(1000, 1064))
    whole = block_hashes(root, tokens, 16)
    head = block_hashes(root, tokens[:32], 16)
    tail = block_hashes(root, tokens[32:], 16, parent=head[-1])
    assert head + tail == whole
    assert len(set(whole)) == 4


def test_only_full_blocks_are_hashed() -> None:
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    assert block_hashes(root, list(range(15)), 16) == []
    assert len(block_hashes(root, list(range(47)), 16)) == 2
    assert block_hashes(root, list(range(47)), 16) == block_hashes(root, list(range(32)), 16)
    assert block_hashes(root, [], 16) == []


def test_prefix_sharing_and_divergence() -> None:
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    a = block_hashes(root, list(range(48)), 16)
    b = block_hashes(root, list(range(32)) + [7] * 16, 16)
    assert a[:2] == b[:2] and a[2] != b[2]
    c = block_hashes(root, [99] + list(range(1, 48)), 16)  # first token differs
    assert not set(a) & set(c)


@pytest.mark.parametrize("fn", list(HashFn))
def test_salts_models_layouts_are_disjoint(fn: HashFn) -> None:
    roots = [
        namespace_root(MODEL, LAYOUT_FP, SALT, fn=fn),
        namespace_root(MODEL, LAYOUT_FP, "tenant-b", fn=fn),
        namespace_root(MODEL, LAYOUT_FP, "", fn=fn),
        namespace_root("Qwen/Qwen2.5-7B", LAYOUT_FP, SALT, fn=fn),
        namespace_root(MODEL, "0000000000000000", SALT, fn=fn),
        namespace_root(MODEL, LAYOUT_FP, SALT, scheme_version=2, fn=fn),
        # field boundaries matter: moving bytes between fields must change the root
        namespace_root(MODEL + "3", "8ad274327873df6", SALT, fn=fn),
    ]
    assert len(set(roots)) == len(roots)
    tokens = list(range(256))
    chains = [set(block_hashes(r, tokens, 16, fn=fn)) for r in roots]
    for i in range(len(chains)):
        for j in range(i + 1, len(chains)):
            assert not chains[i] & chains[j], (i, j)


def test_extra_keys_change_the_hash() -> None:
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    plain = block_hashes(root, TOKENS, 16)
    assert block_hashes(root, TOKENS, 16, [None, None]) == plain
    lora_a = block_hashes(root, TOKENS, 16, [b"lora:a", None])
    lora_b = block_hashes(root, TOKENS, 16, [b"lora:b", None])
    second_only = block_hashes(root, TOKENS, 16, [None, b"img:1"])
    assert lora_a[0] != plain[0] and lora_a[0] != lora_b[0]
    assert second_only[0] == plain[0] and second_only[1] != plain[1]
    # the empty extra key is encoded like "no extra key" (both are an empty field)
    assert block_hashes(root, TOKENS, 16, [b"", None]) == plain
    with pytest.raises(ValueError, match="extra_keys has 1 entries but there are 2 full blocks"):
        block_hashes(root, TOKENS, 16, [None])


@pytest.mark.parametrize("tokens, match", [
    ([0, 1, -1], r"-1 is outside \[0, 2\*\*32\)"),
    ([0, 2**32], r"4294967296 is outside \[0, 2\*\*32\)"),
    (np.array([5, -3], dtype=np.int32), "-3 is outside"),
    (np.array([2**40], dtype=np.uint64), "is outside"),
    ([1.0, 2.0], "must be integers"),
    (np.array([1.5]), "must be integers"),
    (np.array([[1, 2]]), "1-D"),
    (["a"], "must be integers"),
])
def test_bad_token_ids(tokens: object, match: str) -> None:
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    with pytest.raises(ValueError, match=match):
        block_hashes(root, tokens, 1)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    root = namespace_root(MODEL, LAYOUT_FP, SALT)
    with pytest.raises(ValueError, match="block_tokens must be positive"):
        block_hashes(root, TOKENS, 0)
    with pytest.raises(ValueError, match="build the root with the same hash function"):
        block_hashes(root, TOKENS, 16, fn=HashFn.XXH3_128)
    for fn in HashFn:  # the C loop (sha256) and the Python loop reject it alike
        with pytest.raises(ValueError, match="parent is 5 bytes"):
            block_hashes(namespace_root(MODEL, LAYOUT_FP, SALT, fn=fn), TOKENS, 16, fn=fn,
                         parent=b"short")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        namespace_root(MODEL, LAYOUT_FP, SALT, fn="md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="u32"):
        namespace_root(MODEL, LAYOUT_FP, SALT, scheme_version=-1)
    with pytest.raises(TypeError, match="model_id must be str or bytes"):
        namespace_root(123, LAYOUT_FP, SALT)  # type: ignore[arg-type]


def test_same_bytes_under_another_pythonhashseed() -> None:
    code = (
        "from kvshare.hashing import HashFn, block_hashes, namespace_root\n"
        "for fn in HashFn:\n"
        f"    r = namespace_root({MODEL!r}, {LAYOUT_FP!r}, {SALT!r}, fn=fn)\n"
        "    print(fn.value, r.hex(), *(h.hex() for h in block_hashes(r, list(range(40)), 16, fn=fn)))\n"
    )
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60, check=True)
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    for line in outputs[0].splitlines():
        name, *digests = line.split()
        assert tuple(digests) == VECTORS[HashFn(name)][:3]


def test_shared_block_tokens_counts_the_full_blocks_two_prompts_start_with() -> None:
    from kvshare.hashing import shared_block_tokens

    a = list(range(100))
    assert shared_block_tokens(a, a[:70] + [7] * 30, 16) == 64  # differ at 70: 4 full blocks
    assert shared_block_tokens(a, a, 16) == 96  # the trailing partial block is not shared
    assert shared_block_tokens(a, a[:40], 16) == 32  # one ends: its full blocks
    assert shared_block_tokens([1, 2], [3, 4], 1) == 0
    with pytest.raises(ValueError, match="block_tokens"):
        shared_block_tokens(a, a, 0)


# The layout fingerprint is what brings the attention kind into the root: an MLA layout
# (kind + rotary width) and a sliding-window layout (kind + layer-to-group map + windows).
# Computed once (sha256, scheme version 1) and pasted here.
KIND_VECTORS = {
    "mla": ("c3cb59fc31842ac2",
            "6af43cdd09c9bdbad8f864bbf5122d0dec303a594fb4dda7a68c5f47afc41f93",
            "633446402ac8ba6f2203787b8dab4044832ea4771e1ab7491bd1690d378ba61b"),
    "sliding": ("f91c2bdd3d59e658",
                "e671138b715f97594cb0e0ef0b2b3b2a13d0c3a1ea9fea3341eeb214c65e11b3",
                "d2e9bb33d8b10750a7646f9d2d8ee212e084667d6802fb18bd6a1d3a1ec8e8a5"),
}


def _kind_layouts() -> dict[str, tuple[str, KVLayout]]:
    gpt_oss = (KVGroup(tuple(range(1, 24, 2))), KVGroup(tuple(range(0, 24, 2)), 128))
    return {
        "mla": ("deepseek-ai/DeepSeek-V3", KVLayout.mla(61, 512, 64, "bf16", block_tokens=16)),
        "sliding": ("openai/gpt-oss-20b", KVLayout(24, 8, 64, "bf16", 16, AttentionKind.SLIDING,
                                                   groups=gpt_oss)),
    }


@pytest.mark.parametrize("kind", sorted(KIND_VECTORS))
def test_fixed_vectors_of_the_attention_kinds(kind: str) -> None:
    fp_hex, root_hex, first_hex = KIND_VECTORS[kind]
    model, layout = _kind_layouts()[kind]
    assert layout.fingerprint() == fp_hex
    root = namespace_root(model, layout.fingerprint(), SALT)
    assert root.hex() == root_hex
    assert block_hashes(root, TOKENS, 16)[0].hex() == first_hex
    # the same numbers read as MHA (or with another window) are another namespace
    as_mha = KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, "bf16", 16)
    assert namespace_root(model, as_mha.fingerprint(), SALT) != root
