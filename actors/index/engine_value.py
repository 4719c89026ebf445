"""What each worker's own engine cache (the gpu tier) is worth, from its load reports.

An engine counts, since it started, the prompt tokens it admitted and those its own prefix
cache served (:attr:`~kvshare.workers.WorkerLoad.prompt_tokens`,
:attr:`~kvshare.workers.WorkerLoad.engine_cached_tokens`; vLLM's ``prompt_tokens_total`` and
``prefix_cache_hits_total``). :class:`EngineCacheLedger` turns the differences between a
worker's successive reports into a :class:`~kvshare.pool.value.ValueLedger` per node and
namespace (the worker's first namespace: one engine serves one model), tier ``gpu``, counted in
tokens (``lookups``: prompt tokens, ``hits``: tokens served; one block = one token, so
:func:`~kvshare.pool.value.assess` takes ``block_tokens`` 1). Nothing is spent moving them: the
engine's cache is where the KV already is. A counter that went down means the engine
restarted: its new count is the difference. Plain class, no Ray; the index's worker registry
feeds it, and the index's stats carry :meth:`EngineCacheLedger.figures`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvshare.pool.value import HITS, LOOKUPS, ValueConfig, ValueLedger
from kvshare.types import Tier, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad

GPU = Tier.GPU.value


class EngineCacheLedger:
    """Per node and namespace, the engines' own-cache tokens over a window and since start."""

    def __init__(self, config: ValueConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or ValueConfig()
        self._clock = clock
        self._ledgers: dict[tuple[str, str], ValueLedger] = {}
        self._last: dict[WorkerId, tuple[int, int]] = {}

    def report(self, info: WorkerInfo, load: WorkerLoad) -> None:
        """Count what ``info``'s engine admitted and served from its cache since its last report."""
        now = (load.prompt_tokens, load.engine_cached_tokens)
        if now == (0, 0):
            return  # an engine that does not report them
        last = self._last.get(load.worker_id, (0, 0))
        self._last[load.worker_id] = now
        prompt, cached = now[0] - last[0], now[1] - last[1]
        if prompt < 0 or cached < 0:  # restarted: its counters began again
            prompt, cached = now
        key = (str(info.node), info.namespaces[0])
        ledger = self._ledgers.get(key)
        if ledger is None:
            ledger = self._ledgers[key] = ValueLedger([GPU], self.config, self._clock)
        ledger.add(GPU, LOOKUPS, prompt)
        ledger.add(GPU, HITS, cached)

    def forget(self, worker_id: WorkerId) -> None:
        """The worker left: its next incarnation's counts start from zero."""
        self._last.pop(worker_id, None)

    def figures(self) -> dict[str, dict[str, object]]:
        """``{node: {namespace: ValueLedger.figures()}}``."""
        out: dict[str, dict[str, object]] = {}
        for (node, ns), ledger in sorted(self._ledgers.items()):
            out.setdefault(node, {})[ns] = ledger.figures()
        return out
