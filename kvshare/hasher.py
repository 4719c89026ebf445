"""Hasher: the namespace roots (one per tenant salt) and block hashes of one model namespace.

Every place that hashes a prompt — the worker SDK, the reference engine, the routers, the
simulator — holds one :class:`Hasher` instead of combining :func:`~kvshare.hashing.namespace_root`
and :func:`~kvshare.hashing.block_hashes` itself, so all of them hash a prompt the same way::

    hasher = Hasher.for_layout(identity, layout)          # model x layout, default salt ""
    hasher.hashes(tokens)                                  # the default tenant's chain
    hasher.hashes(tokens, salt="acme")                     # tenant "acme": another root

``memo_blocks`` > 0 keeps a verified memo of that many recent blocks (sha256 lists of ids
only, where the C extension is built: :class:`kvshare._native._chain.ChainMemo`): a block whose parent
hash and ids equal a kept block's, byte for byte, takes its digest instead of rehashing it,
so a conversation's next turn or a shared system prompt costs reading the ids, not sha256.
The hashes are the same with or without it (every id is still read and checked).

Token ids may come packed (:func:`packed_u32`: a 1-D numpy ``uint32`` array or an
``array.array("I")``): the memo then reads their bytes as they are, with no Python int to read
or range-check, and a gateway that keeps a prompt packed holds one buffer instead of thousands
of int objects for the garbage collector to walk. Same hashes as the same ids in a list.

A hasher built from a root alone (:meth:`from_root`: a worker or router that was handed a
root, not the model's identity) hashes under that root and refuses any explicit salt with a
ValueError instead of silently hashing under the wrong root.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias, cast

import numpy as np
import numpy.typing as npt

from kvshare.hashing import (
    DEFAULT_HASH_FN,
    FUSED_MAX_TOKENS,
    HashFn,
    PackedIds,
    block_hashes,
    chain_memo,
    namespace_root,
    packed_u32,
    xxh3_chainer,
)
from kvshare.layout import KVLayout
from kvshare.types import BlockHash

Tokens: TypeAlias = "Sequence[int] | npt.NDArray[np.integer] | PackedIds"


class Hasher:
    """Roots per salt (memoised) and chained hashes of full blocks; see the module docstring.

    ``salt`` is the default tenant salt (used when a call passes ``salt=None``). Roots are
    memoised per salt; the memo is bounded by the salts seen (tenants are few).
    """

    def __init__(
        self,
        model_id: str | bytes | None,
        layout_fingerprint: str | bytes,
        block_tokens: int,
        *,
        salt: str = "",
        fn: HashFn = DEFAULT_HASH_FN,
        root: BlockHash | None = None,
        memo_blocks: int = 0,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        if model_id is None and root is None:
            raise ValueError("a Hasher needs the model identity or a root (Hasher.from_root)")
        self.model_id = model_id
        self.layout_fingerprint = layout_fingerprint
        self.block_tokens = block_tokens
        self.salt = salt
        self.fn = HashFn(fn)
        self._roots: dict[str | bytes, BlockHash] = {}
        if root is not None and len(root) != self.fn.digest_size:
            raise ValueError(f"root is {len(root)} bytes but {self.fn.value} digests are "
                             f"{self.fn.digest_size}: pass the hash function it was made with")
        self.root: BlockHash = root if root is not None else self.root_for(salt)
        """The root of the default salt (given, or made from the identity)."""
        self.memo = chain_memo(self.fn, block_tokens, memo_blocks)
        """The verified block memo (None: off, or not available for this hash function)."""
        self._xxh3 = xxh3_chainer(block_tokens) if self.fn is HashFn.XXH3_128 else None

    @classmethod
    def for_layout(cls, model_id: str, layout: KVLayout, salt: str = "",
                   fn: HashFn = DEFAULT_HASH_FN) -> Hasher:
        """The hasher of a model identity and its KV layout (block size from the layout)."""
        return cls(model_id, layout.fingerprint(), layout.block_tokens, salt=salt, fn=fn)

    @classmethod
    def from_root(cls, root: BlockHash, block_tokens: int, fn: HashFn = DEFAULT_HASH_FN) -> Hasher:
        """A hasher of one known root (an explicit salt raises ValueError: the identity is unknown)."""
        return cls(None, b"", block_tokens, fn=fn, root=root)

    def root_for(self, salt: str | bytes | None = None) -> BlockHash:
        """The namespace root of tenant ``salt`` (None: this hasher's default root)."""
        if salt is None:
            return self.root
        root = self._roots.get(salt)
        if root is None:
            if self.model_id is None:
                raise ValueError(
                    f"this Hasher was given one root and cannot make the root of salt {salt!r}: "
                    "build it with Hasher.for_layout(model identity, layout) to hash for tenants"
                )
            root = self._roots[salt] = namespace_root(
                self.model_id, self.layout_fingerprint, salt, fn=self.fn)
        return root

    def hashes(
        self,
        tokens: Tokens,
        salt: str | bytes | None = None,
        *,
        extra_keys: Sequence[bytes | None] | None = None,
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``tokens`` under tenant ``salt``'s root (None: the
        default salt); ``extra_keys``/``parent`` as in :func:`~kvshare.hashing.block_hashes`.
        ValueError for token ids outside [0, 2**32) or an unknown salt of a root-only hasher."""
        if self._xxh3 is not None and extra_keys is None and parent is None:
            return self._xxh3(self.root_for(salt), tokens)  # (the opt-in xxh3 chain in C)
        memo = self.memo
        if memo is not None and extra_keys is None and not isinstance(tokens, list | tuple):
            packed = packed_u32(tokens)
            if packed is not None:
                head = parent if parent is not None else self.root_for(salt)
                return cast(list[BlockHash], memo.chain_packed(head, packed))
        if (memo is not None and extra_keys is None and isinstance(tokens, list | tuple)
                and len(tokens) <= FUSED_MAX_TOKENS):
            try:
                head = parent if parent is not None else self.root_for(salt)
                return cast(list[BlockHash], memo.chain(head, tokens))
            except (OverflowError, TypeError):
                pass  # block_hashes below names the offending id
        return block_hashes(self.root_for(salt), tokens, self.block_tokens, extra_keys,
                            fn=self.fn, parent=parent)
