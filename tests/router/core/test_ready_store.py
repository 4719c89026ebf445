"""ReadyBlocks' storage: kept per namespace keyed by the hash alone (no key tuple per block);
this checks that it answers, holds and drops exactly as the first version did (one ordered map
of ``(namespace, hash)`` keys, kept here as the reference) on random sequences over two
namespaces, with and without the ``max_entries`` bound."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from kvshare.router.core.ready import _REMOTE_HOST, ReadyBlocks
from kvshare.router.core.sources import SourceRuns
from kvshare.types import BlockHash, WorkerId

_LOCAL_GPU_REF = 0  # Source.LOCAL_GPU


class Reference:
    """The first ReadyBlocks."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self._max = max_entries
        self._at: OrderedDict[tuple[str, BlockHash], tuple[WorkerId, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def add(self, namespace: str, worker: WorkerId, hashes: Sequence[BlockHash],
            ready_s: float, now: float) -> None:
        at = self._at
        while at:
            _, (_, t) = next(iter(at.items()))
            if t > now:
                break
            at.popitem(last=False)
        value = (worker, ready_s)
        for h in hashes:
            key = (namespace, h)
            old = at.get(key)
            if old is None or old[1] > ready_s:
                at[key] = value
                at.move_to_end(key)
        while len(at) > self._max:
            at.popitem(last=False)

    def run_from(self, namespace: str, hashes: Sequence[BlockHash], start: int) -> int:
        at, k = self._at, start
        while k < len(hashes) and (namespace, hashes[k]) in at:
            k += 1
        return k - start

    def extend(self, runs: SourceRuns, namespace: str, hashes: Sequence[BlockHash],
               worker: WorkerId, now: float, start_s: float) -> tuple[SourceRuns, float]:
        """ReadyBlocks.extend over the first storage."""
        if not self._at:
            return runs, start_s
        covered = sum(n for _, n in runs)
        at, k = self._at, covered
        out = list(runs)
        begin = start_s
        while k < len(hashes):
            entry = at.get((namespace, hashes[k]))
            if entry is None or not now < entry[1]:
                break
            if entry[0] == worker:
                src = _LOCAL_GPU_REF
                if entry[1] > begin:
                    begin = entry[1]
            elif entry[1] <= start_s:
                src = _REMOTE_HOST
            else:
                break
            if out and out[-1][0] == src:
                out[-1] = (src, out[-1][1] + 1)
            else:
                out.append((src, 1))
            k += 1
        return (runs, start_s) if k == covered else (tuple(out), begin)

    def held(self) -> list[tuple[str, BlockHash, WorkerId, float]]:
        return [(ns, h, w, t) for (ns, h), (w, t) in self._at.items()]


def held(ready: ReadyBlocks) -> list[tuple[str, BlockHash, WorkerId, float]]:
    """Every entry in the order they are dropped (the namespaces' maps merged by call)."""
    rows = [(entry[2], i, ns, h, entry[0], entry[1]) for ns, at in ready._at.items()
            for i, (h, entry) in enumerate(at.items())]
    return [(ns, h, w, t) for _, _, ns, h, w, t in sorted(rows)]


def test_per_namespace_storage_answers_and_drops_as_the_reference() -> None:
    rng = random.Random(5)
    for trial in range(60):
        cap = rng.choice((6, 25, 1_000_000))
        names = "a" if trial % 2 else "ab"  # one namespace (its own path) or two
        fast, ref = ReadyBlocks(cap), Reference(cap)
        pool = [BlockHash(bytes([trial, i]) * 16) for i in range(24)]
        workers = [WorkerId(f"w{i}") for i in range(4)]
        now = 0.0
        for _ in range(80):
            now += rng.choice((0.0, 0.05, 0.3, 1.0))
            ns, w = rng.choice(names), rng.choice(workers)
            start = rng.randrange(len(pool))
            hashes = pool[start:start + rng.randrange(0, 10)]
            if rng.random() < 0.2:  # a hash twice in one call
                hashes = hashes + hashes[:2]
            ready_s = now + rng.choice((0.0, 0.1, 0.5, 2.0))
            fast.add(ns, w, hashes, ready_s, now)
            ref.add(ns, w, hashes, ready_s, now)
            assert len(fast) == len(ref)
            assert held(fast) == ref.held()
            for _ in range(3):
                q = pool[rng.randrange(len(pool)):][:rng.randrange(1, 12)]
                qns, qw = rng.choice("abc"), rng.choice(workers)
                s = rng.randrange(len(q) + 1)
                assert fast.run_from(qns, q, s) == ref.run_from(qns, q, s)
                runs: SourceRuns = rng.choice(((), ((0, 1),), ((4, 2),), ((1, 1), (4, 1))))
                start_s = now + rng.choice((0.0, 0.2, 1.0, 3.0))
                assert fast.extend(runs, qns, q, qw, now, start_s) == ref.extend(
                    runs, qns, q, qw, now, start_s)
