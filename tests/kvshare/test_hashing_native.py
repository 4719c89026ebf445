"""The C chain loop (kvshare._native._chain) against the pure-Python loop: same bytes, GIL released.

The extension is optional (setup.py builds it where a C compiler and OpenSSL headers are found).
Where it is not built these tests skip and say so, unless this machine could have built it (a
compiler and ``openssl/sha.h`` present) or ``KVSHARE_REQUIRE_NATIVE=1``: then a missing
extension is a failure, not a skip.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvshare import hashing
from kvshare.hashing import HashFn, block_hashes, namespace_root

ROOT = namespace_root("meta-llama/Llama-3.1-8B", "38ad274327873df6", "tenant-a")


def _could_build() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = [Path(p) / "openssl" / "sha.h" for p in ("/usr/include", "/usr/local/include")]
    return shutil.which(cc) is not None and any(h.exists() for h in headers)


def test_extension_is_built_where_it_can_be() -> None:
    required = os.environ.get("KVSHARE_REQUIRE_NATIVE") == "1" or _could_build()
    if not required and not hashing.NATIVE_CHAIN:
        pytest.skip("kvshare._native._chain not built (no C compiler or OpenSSL headers): Python loop only")
    assert hashing.NATIVE_CHAIN, (
        "a C compiler and OpenSSL headers are here but kvshare._native._chain is not built: "
        "run `.venv/bin/pip install --no-deps -e .` and read its build warning"
    )


@pytest.fixture
def chain() -> object:
    if hashing._chain is None:
        pytest.skip("kvshare._native._chain not built: nothing native to compare")
    return hashing._chain


def _python(root: bytes, tokens: object, block_tokens: int, parent: bytes | None = None,
            monkeypatch: pytest.MonkeyPatch | None = None) -> list[bytes]:
    assert monkeypatch is not None
    with monkeypatch.context() as m:
        m.setattr(hashing, "_chain", None)
        return list(block_hashes(root, tokens, block_tokens, parent=parent))  # type: ignore[arg-type]


def test_native_equals_python_on_random_prompts(chain: object,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1234)
    for _ in range(40):
        block_tokens = int(rng.choice([1, 3, 16, 64, 256, 1000]))
        n = int(rng.integers(0, 6 * block_tokens + 1))  # 0 tokens, partial blocks, several
        tokens = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        native = block_hashes(ROOT, tokens, block_tokens)
        assert native == _python(ROOT, tokens, block_tokens, monkeypatch=monkeypatch)
        assert native == block_hashes(ROOT, tokens.tolist(), block_tokens)  # list input too
        assert len(native) == n // block_tokens
        # continuing from a parent: the tail of a split chain equals the whole chain's tail
        cut = int(rng.integers(0, len(native) + 1))
        parent = native[cut - 1] if cut else ROOT
        tail = block_hashes(ROOT, tokens[cut * block_tokens:], block_tokens, parent=parent)
        assert tail == native[cut:]
        assert tail == _python(ROOT, tokens[cut * block_tokens:], block_tokens, parent,
                               monkeypatch=monkeypatch)


def test_every_token_form_reaches_the_same_bytes(chain: object,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = np.arange(5000, 5000 + 16 * 9, dtype=np.uint32)
    expected = _python(ROOT, tokens, 16, monkeypatch=monkeypatch)
    forms = [
        tokens,                               # viewed in place (no copy)
        tokens.astype(">u4"),                 # big-endian: converted first
        tokens.astype(np.int64),              # range-checked and converted
        np.repeat(tokens, 2)[::2],            # not contiguous: converted first
        tokens.tolist(),
    ]
    for form in forms:
        assert block_hashes(ROOT, form, 16) == expected
    assert block_hashes(ROOT, tokens[:0], 16) == []
    with pytest.raises(ValueError, match="-1 is outside"):
        block_hashes(ROOT, np.array([1, -1] * 8, dtype=np.int32), 16)


def test_direct_call_matches_hashlib(chain: object) -> None:
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    for block_bytes, tail in [(1, b""), (64, b"\x00" * 4), (1000, b"x" * 100), (20_000, b"")]:
        prev, expected = bytes(ROOT), []
        for off in range(0, len(data) - block_bytes + 1, block_bytes):
            prev = hashlib.sha256(prev + data[off:off + block_bytes] + tail).digest()
            expected.append(prev)
        got = chain.sha256_chain(bytes(ROOT), memoryview(data), block_bytes, tail)  # type: ignore[attr-defined]
        assert got == expected


def test_direct_call_rejects_bad_arguments(chain: object) -> None:
    fn = chain.sha256_chain  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="parent must be 32 bytes"):
        fn(b"short", b"\x00" * 64, 16, b"")
    with pytest.raises(ValueError, match="block_bytes must be positive"):
        fn(bytes(ROOT), b"\x00" * 64, 0, b"")
    with pytest.raises((BufferError, TypeError, ValueError)):
        fn(bytes(ROOT), np.zeros(64, dtype=np.uint32)[::2], 4, b"")  # not contiguous
    with pytest.raises(TypeError):
        fn(bytes(ROOT), "not bytes", 4, b"")


def test_the_loop_runs_without_the_gil(chain: object) -> None:
    """Another Python thread keeps running while long chains are hashed. Measured in CPU time,
    not wall gaps (the machine may be shared): with the GIL held for the whole call, the main
    thread would sleep on the GIL and get almost no CPU while the worker hashes."""
    data = bytes(64 * 2**20)  # ~40 ms of sha256 per call on an idle core

    def attempt() -> tuple[float, float]:
        worker_cpu: list[float] = []

        def work() -> None:
            t0 = time.thread_time()
            for _ in range(3):
                chain.sha256_chain(bytes(ROOT), data, 1024, b"")  # type: ignore[attr-defined]
            worker_cpu.append(time.thread_time() - t0)

        worker = threading.Thread(target=work)
        t0 = time.thread_time()
        worker.start()
        while worker.is_alive():
            pass
        main_cpu = time.thread_time() - t0
        worker.join()
        return main_cpu, worker_cpu[0]

    for _attempt in range(3):  # a busy machine may starve us once; a held GIL always does
        main_cpu, worker_cpu = attempt()
        if main_cpu > 0.3 * worker_cpu:
            return
    pytest.fail(f"main thread got {main_cpu * 1e3:.1f} ms of CPU while the worker hashed for "
                f"{worker_cpu * 1e3:.1f} ms: the GIL is not released")


def test_only_sha256_and_xxh3_without_extra_keys_go_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """Extra keys and blake3 take the Python loop: sabotaging the C entry points must not
    change their results; sha256 (and xxh3, where its C chain is bound) go native."""
    class Broken:
        def sha256_chain(self, *args: object) -> list[bytes]:
            raise AssertionError("native path taken")

        def xxh3_chain(self, *args: object) -> list[bytes]:
            raise AssertionError("native xxh3 path taken")

    tokens = list(range(48))
    xxh3_native = hashing._xxh3_native()
    expected = {fn: block_hashes(namespace_root("m", "l", fn=fn), tokens, 16, fn=fn)
                for fn in (HashFn.BLAKE3, HashFn.XXH3_128)}
    with_extra = block_hashes(ROOT, tokens, 16, [b"lora:1", None, None])
    with_extra_xxh3 = block_hashes(namespace_root("m", "l", fn=HashFn.XXH3_128), tokens, 16,
                                   [b"lora:1", None, None], fn=HashFn.XXH3_128)
    monkeypatch.setattr(hashing, "_chain", Broken())
    assert block_hashes(namespace_root("m", "l", fn=HashFn.BLAKE3), tokens, 16,
                        fn=HashFn.BLAKE3) == expected[HashFn.BLAKE3]
    assert block_hashes(ROOT, tokens, 16, [b"lora:1", None, None]) == with_extra
    assert block_hashes(namespace_root("m", "l", fn=HashFn.XXH3_128), tokens, 16,
                        [b"lora:1", None, None], fn=HashFn.XXH3_128) == with_extra_xxh3
    with pytest.raises(AssertionError, match="native path taken"):
        block_hashes(ROOT, tokens, 16)
    if xxh3_native:
        with pytest.raises(AssertionError, match="native xxh3 path taken"):
            block_hashes(namespace_root("m", "l", fn=HashFn.XXH3_128), tokens, 16,
                         fn=HashFn.XXH3_128)
    monkeypatch.setattr(hashing, "_XXH3_BOUND", False)
    assert block_hashes(namespace_root("m", "l", fn=HashFn.XXH3_128), tokens, 16,
                        fn=HashFn.XXH3_128) == expected[HashFn.XXH3_128]


def test_one_pass_packing_hashes_as_packing_first(chain: object) -> None:
    """``sha256_chain_u32`` (lists of ids: packed and hashed block by block) gives the bytes of
    ``sha256_chain`` over ``pack_u32`` on random prompts of every length and id size, and refuses
    what ``pack_u32`` refuses, in a trailing partial block too; ``block_hashes`` then names it."""
    import random

    if not hasattr(chain, "sha256_chain_u32"):  # hashing falls back to pack + chain meanwhile
        pytest.skip("kvshare._native._chain was built before sha256_chain_u32: rebuild it with "
                    "`.venv/bin/pip install --no-deps -e .`")
    rng = random.Random(12)
    fused, packed, pack = (getattr(chain, n) for n in ("sha256_chain_u32", "sha256_chain", "pack_u32"))
    tail = b"\x00\x00\x00\x00"
    for bt in (1, 3, 16, 256):
        for n in (0, bt - 1, bt, 5 * bt + 2, 40 * bt):
            for hi in (300, 2**31, 2**32):
                ids = [rng.randrange(hi) for _ in range(n)]
                for form in (ids, tuple(ids)):
                    assert fused(bytes(ROOT), form, bt, tail) == packed(bytes(ROOT), pack(ids), 4 * bt, tail)
    for bad in (-1, 2**32, 1.5, "a", None):
        for at in (0, 17, 40):  # a full block, the last full one, the partial tail
            ids = list(range(41))
            ids[at] = bad  # type: ignore[call-overload]
            with pytest.raises((OverflowError, TypeError)):
                fused(bytes(ROOT), ids, 20, tail)
            with pytest.raises(ValueError, match="token id|integers"):
                block_hashes(ROOT, ids, 20)
    with pytest.raises(ValueError, match="parent must be 32 bytes"):
        fused(b"short", [1, 2], 1, tail)
    with pytest.raises(ValueError, match="block_tokens must be positive"):
        fused(bytes(ROOT), [1, 2], 0, tail)
