"""Chained block hashing of a 131072-token prompt against the bare hash function.

For each hash function (the default, sha256, first): ``block_hashes`` over a 131072-token prompt
(numpy uint32 token ids, 256-token blocks -> 512 chained hashes) against the bare hash of the
same u32 bytes in one call. Best of ``--reps`` runs each (a CPU-cost figure; the median is
printed beside it). Also timed: the same prompt given as a Python list of ints, and the bare hash of each
block on its own (unchained: what per-block hashing costs before any chaining).

sha256 chains without extra keys run in C when the optional extension ``kvshare._native._chain`` is
built (``native_chain`` in the output says whether it ran); for honesty the pure-Python loop
(the fallback where it is not built) is timed beside it, ``ratio_python``.

Last line: one JSON object with ``tokens_per_s``, ``baseline_tokens_per_s`` and ``ratio``
(chained / bare, target >= 0.8) for the default function, ``ms_per_128k_tokens`` (target < 2),
``native_chain``, ``ratio_python``, and the same figures per function under ``by_fn``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvshare import hashing  # noqa: E402
from kvshare.hashing import DEFAULT_HASH_FN, HashFn, _hasher, block_hashes, namespace_root  # noqa: E402
from kvshare.layout import KVLayout  # noqa: E402

TOKENS = 131072
BLOCK_TOKENS = 256


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(best, median) seconds of ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _bare(hasher: Callable[[bytes], Any], data: bytes) -> bytes:
    """The bare hash function over all the bytes in one call."""
    digest: bytes = hasher(data).digest()
    return digest


def _unchained(hasher: Callable[[bytes], Any], data: bytes, step: int) -> list[bytes]:
    """The bare hash of each block on its own (no parent, no extra field): per-call cost only."""
    view = memoryview(data)
    return [hasher(view[o : o + step]).digest() for o in range(0, len(data), step)]


def _python_loop(root: bytes, tokens: np.ndarray, fn: HashFn) -> list[bytes]:
    """``block_hashes`` with the C chain loop switched off: the pure-Python fallback."""
    saved, hashing._chain = hashing._chain, None
    try:
        return list(block_hashes(root, tokens, BLOCK_TOKENS, fn=fn))
    finally:
        hashing._chain = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128256, TOKENS, dtype=np.uint32)
    as_list = tokens.tolist()
    data = tokens.astype("<u4").tobytes()
    layout = KVLayout(32, 8, 128, "bf16", BLOCK_TOKENS)
    by_fn: dict[str, dict[str, float]] = {}
    print(f"{TOKENS} tokens, {BLOCK_TOKENS}-token blocks ({TOKENS // BLOCK_TOKENS} chained "
          f"hashes), best of {args.reps}; C chain loop (kvshare._native._chain) built: "
          f"{hashing.NATIVE_CHAIN}")
    for fn in [DEFAULT_HASH_FN, *(f for f in HashFn if f is not DEFAULT_HASH_FN)]:
        root = namespace_root("meta-llama/Llama-3.1-8B", layout.fingerprint(), "bench", fn=fn)
        hasher = _hasher(fn)
        assert len(block_hashes(root, tokens, BLOCK_TOKENS, fn=fn)) == TOKENS // BLOCK_TOKENS
        chain, chain_med = timed(partial(block_hashes, root, tokens, BLOCK_TOKENS, fn=fn),
                                 args.reps)
        bare, bare_med = timed(partial(_bare, hasher, data), args.reps)
        unchained, _ = timed(partial(_unchained, hasher, data, 4 * BLOCK_TOKENS), args.reps)
        from_list, _ = timed(partial(block_hashes, root, as_list, BLOCK_TOKENS, fn=fn),
                             max(10, args.reps // 10))
        assert _python_loop(root, tokens, fn) == block_hashes(root, tokens, BLOCK_TOKENS, fn=fn)
        python, _ = timed(partial(_python_loop, root, tokens, fn), args.reps)
        by_fn[fn.value] = {
            "tokens_per_s": round(TOKENS / chain),
            "baseline_tokens_per_s": round(TOKENS / bare),
            "ratio": round(bare / chain, 3),
            "ms_per_128k_tokens": round(chain * 1e3, 3),
            "ms_per_128k_tokens_from_list": round(from_list * 1e3, 3),
            "ratio_vs_unchained_blocks": round(unchained / chain, 3),
            "ms_per_128k_tokens_python": round(python * 1e3, 3),
            "ratio_python": round(bare / python, 3),
        }
        native = hashing.NATIVE_CHAIN and fn is HashFn.SHA256
        print(f"{fn.value:9s} chained {chain * 1e3:6.3f} ms (median {chain_med * 1e3:6.3f}, "
              f"{'C loop' if native else 'Python loop'})  "
              f"bare {bare * 1e3:6.3f} ms (median {bare_med * 1e3:6.3f})  "
              f"ratio {bare / chain:4.2f}  unchained per block {unchained * 1e3:6.3f} ms  "
              f"from a list of ints {from_list * 1e3:6.3f} ms  "
              f"Python loop {python * 1e3:6.3f} ms (ratio {bare / python:4.2f})")
    main_fn = by_fn[DEFAULT_HASH_FN.value]
    print(json.dumps({
        "tokens_per_s": main_fn["tokens_per_s"],
        "baseline_tokens_per_s": main_fn["baseline_tokens_per_s"],
        "ratio": main_fn["ratio"],
        "ms_per_128k_tokens": main_fn["ms_per_128k_tokens"],
        "native_chain": hashing.NATIVE_CHAIN,
        "ratio_python": main_fn["ratio_python"],
        "hash_fn": DEFAULT_HASH_FN.value,
        "block_tokens": BLOCK_TOKENS,
        "by_fn": by_fn,
    }))


if __name__ == "__main__":
    main()
