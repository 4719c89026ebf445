"""Chained block hashes (scheme version 1).

::

    root = H(b"kvshare-root", u32 scheme_version, field(model_id), field(layout_fp), field(salt))
    h_i  = H(h_{i-1}, tokens_i as little-endian u32, field(extra_i))      h_{-1} = root

``field(x)`` is ``u32 len(x) || x`` so that no two different field tuples encode to the same
bytes. Only full blocks are hashed. The default function is sha256 (32 bytes, cryptographic,
so a crafted prompt cannot forge another prompt's hash); blake3 (32 bytes) and xxh3-128
(16 bytes, non-cryptographic: single-tenant clusters only) are explicit choices. The scheme
never uses Python's ``hash()`` or a per-process seed: the same input gives the same bytes in
any process on any machine.

The sha256 chain without extra keys (the common case) runs in C when the optional extension
``kvshare._native._chain`` was built at install time (``NATIVE_CHAIN`` says whether it was); otherwise,
and for extra keys or the other hash functions, the Python loop below runs. Both give the same
bytes; the tests compare them.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, TypeAlias, cast

import numpy as np
import numpy.typing as npt

from kvshare.types import BlockHash

try:  # the optional C chain loop (setup.py builds it where a compiler and OpenSSL are found)
    from kvshare._native import _chain
except ImportError:  # not built: the pure-Python loop in block_hashes runs instead
    _chain = None  # type: ignore[assignment]

SCHEME_VERSION = 1
_U32 = struct.Struct("<I")
_U32LE = np.dtype("<u4")
NATIVE_CHAIN: bool = _chain is not None
"""Whether the C extension was built and imported (sha256 chains without extra keys use it)."""
FUSED_MAX_TOKENS = 16_384
"""Lists of ids up to this long are packed and hashed in one C pass with the GIL held (~50 us
on one core); longer ones are packed, then hashed with the GIL released (other threads run)."""
# an extension built before pack_u32 existed (a stale in-place build) lacks it
_pack_u32: Callable[[Sequence[int]], bytes] | None = getattr(_chain, "pack_u32", None)


class HashFn(StrEnum):
    """Hash functions the scheme can use."""

    SHA256 = "sha256"
    BLAKE3 = "blake3"
    XXH3_128 = "xxh3_128"

    @property
    def digest_size(self) -> int:
        return 16 if self is HashFn.XXH3_128 else 32


DEFAULT_HASH_FN = HashFn.SHA256


def _hasher(fn: HashFn) -> Callable[[bytes], Any]:
    """The streaming hasher class of ``fn`` (``h = cls(data); h.update(...); h.digest()``)."""
    if fn is HashFn.SHA256:
        return hashlib.sha256
    if fn is HashFn.BLAKE3:
        from blake3 import blake3

        return blake3
    if fn is HashFn.XXH3_128:
        import xxhash

        return xxhash.xxh3_128
    raise ValueError(f"unknown hash function {fn!r}; choose one of {[f.value for f in HashFn]}")


def chain_memo(fn: HashFn, block_tokens: int, capacity_blocks: int) -> _chain.ChainMemo | None:
    """A verified memo of ``capacity_blocks`` recent blocks for sha256 chains of
    ``block_tokens`` ids (:class:`kvshare._native._chain.ChainMemo`, its ``chain(parent, ids)`` gives
    :func:`block_hashes`' bytes); None when ``capacity_blocks`` is 0, ``fn`` is not sha256 or
    the C extension is not built. ValueError for a negative capacity."""
    if capacity_blocks < 0:
        raise ValueError(f"memo capacity must be >= 0 blocks, got {capacity_blocks}")
    memo_type = getattr(_chain, "ChainMemo", None)  # (a stale build may lack it)
    if not capacity_blocks or fn is not HashFn.SHA256 or memo_type is None:
        return None
    return cast("_chain.ChainMemo", memo_type(block_tokens, max(capacity_blocks, 4), _field(b"")))


_XXH3_BOUND: bool | None = None  # None: not tried yet


def _xxh3_native() -> bool:
    """Whether ``kvshare._native._chain.xxh3_chain`` is usable: the extension is built and bound to the
    ``xxhash`` package's own XXH3_128bits, and gives the Python loop's bytes on a probe
    (tried once, on the first xxh3 chain)."""
    global _XXH3_BOUND
    if _XXH3_BOUND is None:
        _XXH3_BOUND = False
        bind = getattr(_chain, "xxh3_bind", None)  # (a stale build may lack it)
        if bind is not None:
            try:
                import xxhash._xxhash as lib
            except ImportError:
                return False
            if bind(lib.__file__ or ""):
                probe = tokens_to_u32le(list(range(0, 64_000, 97)))
                root = bytes(range(16))
                want = _xxh3_loop(root, probe, 4 * 16)
                _XXH3_BOUND = _chain.xxh3_chain(root, probe, 4 * 16, _field(b"")) == want
    return _XXH3_BOUND


def xxh3_chainer(block_tokens: int) -> Callable[[bytes, Any], list[BlockHash]] | None:
    """``f(root_or_parent, tokens)``: :func:`block_hashes` of xxh3-128 chains without extra keys
    (same bytes, same ValueError for bad ids) in one C call with no per-call checks beyond the
    ids', for a :class:`~kvshare.hasher.Hasher` whose roots are known to be 16 bytes; None
    where the C chain is not available (the caller uses :func:`block_hashes`)."""
    if block_tokens <= 0 or _chain is None or not _xxh3_native():
        return None
    step, tail, chain = 4 * block_tokens, _field(b""), _chain.xxh3_chain

    def hashes(prev: bytes, tokens: Any) -> list[BlockHash]:
        return cast(list[BlockHash], chain(prev, _u32le_buffer(tokens), step, tail))

    return hashes


def _xxh3_loop(prev: bytes, data: bytes, step: int) -> list[bytes]:
    """The xxh3-128 chain without extra keys, block by block in Python (the probe's reference)."""
    import xxhash

    out = []
    for off in range(0, len(data) // step * step, step):
        h = xxhash.xxh3_128(prev)
        h.update(data[off : off + step])
        h.update(_field(b""))
        prev = h.digest()
        out.append(prev)
    return out


def _digest_fn(fn: HashFn) -> Callable[[bytes], bytes]:
    cls = _hasher(fn)
    return lambda data: cls(data).digest()


def _field(value: bytes) -> bytes:
    return _U32.pack(len(value)) + value


def _as_bytes(value: str | bytes, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"{what} must be str or bytes, got {type(value).__name__}")


def namespace_root(
    model_id: str | bytes,
    layout_fingerprint: str | bytes,
    tenant_salt: str | bytes = b"",
    *,
    scheme_version: int = SCHEME_VERSION,
    fn: HashFn = DEFAULT_HASH_FN,
) -> BlockHash:
    """The root of every chain in one namespace (model x layout x tenant x scheme)."""
    if scheme_version < 0 or scheme_version >= 2**32:
        raise ValueError(f"scheme_version must fit in u32, got {scheme_version}")
    payload = (
        b"kvshare-root"
        + _U32.pack(scheme_version)
        + _field(_as_bytes(model_id, "model_id"))
        + _field(_as_bytes(layout_fingerprint, "layout_fingerprint"))
        + _field(_as_bytes(tenant_salt, "tenant_salt"))
    )
    return BlockHash(_digest_fn(HashFn(fn))(payload))


def keyed_block_hash(root: BlockHash, key: str | bytes, fn: HashFn = DEFAULT_HASH_FN) -> BlockHash:
    """A block an engine names by its own key instead of its tokens: ``H(root, field(key))``.

    For engines whose storage tier sees only their own chained page keys (SGLang's HiCache:
    each key already covers the whole prefix before its page); the root keeps namespaces apart.
    """
    return BlockHash(_digest_fn(HashFn(fn))(bytes(root) + _field(_as_bytes(key, "key"))))


def tokens_to_u32le(tokens: Sequence[int] | npt.NDArray[np.integer]) -> bytes:
    """Token ids as little-endian u32 bytes; ValueError for non-integers or ids outside [0, 2**32)."""
    if isinstance(tokens, list | tuple):
        if _pack_u32 is not None:
            try:  # one C pass with range checks, ~3x faster than array.array
                return _pack_u32(tokens)
            except (OverflowError, TypeError):
                pass  # numpy below names the offending id or dtype
        try:  # C loop with range checks, ~4x faster than numpy for a list of Python ints
            packed = array.array("I", tokens)
        except (OverflowError, TypeError):
            pass  # numpy below names the offending id or dtype
        else:
            if packed.itemsize == 4:
                if sys.byteorder != "little":
                    packed.byteswap()
                return packed.tobytes()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"token ids must be integers, got dtype {arr.dtype}: convert them with int() first"
        )
    if arr.dtype.kind == "i" or arr.dtype.itemsize > 4:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= 2**32:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside [0, 2**32); token ids must fit in u32")
    return arr.astype("<u4", copy=False).tobytes()


PackedIds: TypeAlias = "npt.NDArray[np.uint32] | array.array[int]"
"""Token ids already packed as little-endian u32 (what :func:`packed_u32` accepts as is)."""


def packed_u32(tokens: object) -> memoryview | None:
    """The bytes of ``tokens`` (no copy) if its memory already is the ids as little-endian u32
    (:data:`PackedIds`: a 1-D C-contiguous numpy array of dtype ``<u4``, or an ``array.array``
    of 4-byte unsigned items on a little-endian host), else None."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim == 1 and tokens.dtype == _U32LE and tokens.flags.c_contiguous:
            return tokens.data
        return None
    if (isinstance(tokens, array.array) and tokens.typecode in "IL" and tokens.itemsize == 4
            and sys.byteorder == "little"):
        return memoryview(tokens)
    return None


def fast_ids(tokens: Sequence[int] | npt.NDArray[np.integer] | PackedIds) -> list[int] | PackedIds:
    """``tokens`` in a form :class:`~kvshare.hasher.Hasher` reads without converting: a list
    or packed ids (:func:`packed_u32`) as they are (no copy), another numpy integer array
    packed as ``<u4`` (a tokenizer's int64 ids: ValueError naming an id outside [0, 2**32) or
    a non-integer dtype, as :func:`tokens_to_u32le` does), anything else as a list."""
    if type(tokens) is list or packed_u32(tokens) is not None:
        return cast("list[int] | PackedIds", tokens)
    if isinstance(tokens, np.ndarray):
        return np.frombuffer(tokens_to_u32le(tokens), dtype=_U32LE)
    return list(tokens)


def _u32le_buffer(tokens: Sequence[int] | npt.NDArray[np.integer]) -> bytes | memoryview:
    """The little-endian u32 bytes of ``tokens`` as a buffer: ids already packed
    (:func:`packed_u32`) are viewed as they are (no copy), anything else goes through
    ``tokens_to_u32le`` (which validates and converts)."""
    packed = packed_u32(tokens)
    return packed if packed is not None else tokens_to_u32le(tokens)


def block_hashes(
    root: BlockHash,
    tokens: Sequence[int] | npt.NDArray[np.integer],
    block_tokens: int,
    extra_keys: Sequence[bytes | None] | None = None,
    *,
    fn: HashFn = DEFAULT_HASH_FN,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``tokens`` (a trailing partial block is not hashed).

    ``extra_keys[i]`` (LoRA id, multimodal digests, canonically encoded by the caller) joins
    block ``i``'s hash. ``parent`` continues a chain whose earlier blocks were hashed before
    (defaults to ``root``, i.e. ``tokens`` starts at position 0).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    fn = HashFn(fn)
    if len(root) != fn.digest_size:
        raise ValueError(
            f"root is {len(root)} bytes but {fn.value} digests are {fn.digest_size}: "
            "build the root with the same hash function"
        )
    if parent is not None and len(parent) != fn.digest_size:
        raise ValueError(
            f"parent is {len(parent)} bytes but {fn.value} digests are {fn.digest_size}: "
            "pass a block hash of the same chain"
        )
    step = 4 * block_tokens
    empty = _field(b"")
    prev = bytes(parent if parent is not None else root)
    if extra_keys is None and fn is HashFn.SHA256 and _chain is not None:
        # The C loop: same bytes as the loop below, without its ~0.4 us per block. A list of
        # ids of moderate length is packed and hashed block by block in one pass (GIL held);
        # longer prompts are packed first and hashed with the GIL released.
        fused = getattr(_chain, "sha256_chain_u32", None)  # (a stale build may lack it)
        if fused is not None and isinstance(tokens, list | tuple) and len(tokens) <= FUSED_MAX_TOKENS:
            try:
                return cast(list[BlockHash], fused(prev, tokens, block_tokens, empty))
            except (OverflowError, TypeError):
                pass  # tokens_to_u32le below names the offending id
        hashes = _chain.sha256_chain(prev, _u32le_buffer(tokens), step, empty)
        return cast(list[BlockHash], hashes)
    if extra_keys is None and fn is HashFn.XXH3_128 and _chain is not None and _xxh3_native():
        # the opt-in xxh3 chain in C (same bytes as the loop below; ~2 us for 32 blocks)
        return cast(list[BlockHash], _chain.xxh3_chain(prev, _u32le_buffer(tokens), step, empty))
    data = tokens_to_u32le(tokens)
    n_blocks = len(data) // step
    if extra_keys is not None and len(extra_keys) < n_blocks:
        raise ValueError(
            f"extra_keys has {len(extra_keys)} entries but there are {n_blocks} full blocks"
        )
    new = _hasher(fn)
    view = memoryview(data)
    out: list[bytes] = []
    append = out.append
    # Hot loop (one C-level hasher per block, no per-block concatenation): h_i over
    # h_{i-1} || tokens_i || field(extra_i).
    if extra_keys is None:
        for off in range(0, n_blocks * step, step):
            h = new(prev)
            h.update(view[off : off + step])
            h.update(empty)
            prev = h.digest()
            append(prev)
    else:
        for i, off in enumerate(range(0, n_blocks * step, step)):
            extra = extra_keys[i]
            h = new(prev)
            h.update(view[off : off + step])
            h.update(empty if extra is None else _field(extra))
            prev = h.digest()
            append(prev)
    return cast(list[BlockHash], out)


def shared_block_tokens(a: Sequence[int], b: Sequence[int], block_tokens: int) -> int:
    """Tokens of the full blocks of ``block_tokens`` that ``a`` and ``b`` start with: the most
    of either prompt the other's cached blocks can serve (their hash chains agree exactly that
    far, for the same root)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b)))
    return common // block_tokens * block_tokens
