"""StateMap: block hash -> small int state, the block index's table (C where built).

Keys are fixed-width byte strings (16- or 32-byte block hashes); a state is an int > 0 (0
means absent and is never stored). The C version (``kvshare._native._statemap``: open addressing,
keys inline, prefetched lookups) is used where it was built; :class:`PyStateMap` is the same
contract over a dict, the reference and the fallback. Operations:

- ``get(key)``, ``states(keys)``: the state per key (0 = absent);
- ``prefix_runs(keys)``: ``[(state, n), ...]``, runs of equal states covering the keys up to
  the first absent one (what a prefix match needs);
- ``update(keys, fn)``: ``state := fn(old)`` for every key (0 deletes); ``fn`` is called at
  least once per distinct old state, must not fail and must be a pure function of it; returns
  how many keys changed;
- ``transform_all(fn)``: the same over every stored key (dropping a location); with
  ``collect=True`` it returns ``(changed, keys)``, the changed keys packed in one bytes;
- ``state_counts()``, ``items()``, ``len()``.

``keys`` is a list of ``bytes`` of exactly ``key_size`` bytes, or one bytes-like buffer of
concatenated keys (an Arrow column's data buffer); anything else raises ValueError before
anything changes.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import groupby, repeat
from typing import Any, Protocol


class StateMapLike(Protocol):
    def __len__(self) -> int: ...
    def get(self, key: bytes) -> int: ...
    def states(self, keys: Any) -> list[int]: ...
    def prefix_runs(self, keys: Any) -> list[tuple[int, int]]: ...
    def update(self, keys: Any, fn: Callable[[int], int]) -> int: ...
    def transform_all(self, fn: Callable[[int], int], collect: bool = ...) -> Any: ...
    def state_counts(self) -> dict[int, int]: ...
    def items(self) -> list[tuple[bytes, int]]: ...


class PyStateMap:
    """The reference :class:`StateMapLike` over a dict."""

    def __init__(self, key_size: int) -> None:
        if not 8 <= key_size <= 32:
            raise ValueError(f"key_size must be 8..32 bytes, got {key_size}")
        self.key_size = key_size
        self._d: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._d)

    def _keys(self, keys: Any) -> list[bytes]:
        size = self.key_size
        if isinstance(keys, list):
            for i, k in enumerate(keys):
                if type(k) is not bytes or len(k) != size:
                    raise ValueError(
                        f"block hashes must be {size}-byte bytes; item {i} is "
                        f"{type(k).__name__} of length {len(k) if isinstance(k, bytes) else -1}")
            return keys
        try:
            blob = memoryview(keys).cast("B").tobytes()
        except TypeError:
            raise ValueError("block hashes must be a list of bytes or one bytes buffer, not "
                             f"{type(keys).__name__}") from None
        if len(blob) % size:
            raise ValueError(f"a buffer of {size}-byte block hashes cannot be {len(blob)} bytes long")
        return [blob[i:i + size] for i in range(0, len(blob), size)]

    def get(self, key: bytes) -> int:
        return self._d.get(key, 0) if isinstance(key, bytes) else 0

    def states(self, keys: Any) -> list[int]:
        return list(map(self._d.get, self._keys(keys), repeat(0)))

    def prefix_runs(self, keys: Any) -> list[tuple[int, int]]:
        out = []
        for s, g in groupby(self.states(keys)):
            if s == 0:
                break
            out.append((s, len(list(g))))
        return out

    def update(self, keys: Any, fn: Callable[[int], int]) -> int:
        ks = self._keys(keys)
        d, changed = self._d, 0
        memo: dict[int, int] = {}
        for k in ks:
            old = d.get(k, 0)
            new = memo.get(old)
            if new is None:
                new = memo[old] = _state(fn(old))
            if new != old:
                changed += 1
                if new:
                    d[k] = new
                else:
                    del d[k]
        return changed

    def transform_all(self, fn: Callable[[int], int], collect: bool = False) -> Any:
        memo: dict[int, int] = {}
        out: dict[bytes, int] = {}
        keys: list[bytes] = []
        for k, old in self._d.items():
            new = memo.get(old)
            if new is None:
                new = memo[old] = _state(fn(old))
            if new != old:
                keys.append(k)
            if new:
                out[k] = new
        self._d = out
        return (len(keys), b"".join(keys)) if collect else len(keys)

    def state_counts(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self._d.values():
            out[s] = out.get(s, 0) + 1
        return out

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._d.items())


def _state(v: int) -> int:
    if v < 0:
        raise ValueError("a state must be an int >= 0")
    return v


def make_state_map(key_size: int, native: bool = True) -> StateMapLike:
    """A :class:`StateMapLike`: the C table where it was built (and ``native``), else Python."""
    if native:
        try:
            from kvshare._native._statemap import StateMap
        except ImportError:
            pass
        else:
            return StateMap(key_size)
    return PyStateMap(key_size)


def native_available() -> bool:
    try:
        import kvshare._native._statemap  # noqa: F401
    except ImportError:
        return False
    return True
