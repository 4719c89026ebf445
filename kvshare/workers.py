"""What the index knows about inference workers, and the query interface routers use.

Workers register ``WorkerInfo`` under a lease that their ``WorkerLoad`` reports renew; the
index drops an expired or dead worker together with its gpu-tier entries. Routers and the SDK
talk to the index through :class:`IndexQuery`, implemented by the (sharded) index client in
``actors`` and by the in-process ``GlobalIndex`` (simulator, unit tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvshare.match import MatchResult
from kvshare.types import BlockHash, NodeId, WorkerId


@dataclass(frozen=True)
class WorkerInfo:
    """A registered inference worker. ``endpoint`` is its HTTP base URL ('' if none)."""

    worker_id: WorkerId
    node: NodeId
    namespaces: tuple[str, ...]
    endpoint: str = ""
    tp: int = 1
    layout_fingerprint: str = ""
    meta: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load report (also its liveness heartbeat).

    ``queued_prefill_tokens``: prompt tokens admitted but not yet prefilled;
    ``running``: requests in flight; ``prefill_tokens_per_s``: measured prefill speed
    (0 = unknown); ``ts``: the worker's wall clock at report time (``time.time()``);
    ``waiting``: requests queued but not yet scheduled (engines that say so, e.g. vLLM);
    ``kv_usage``: fraction of the engine's own KV cache in use (0..1, 0 = unknown).
    """

    worker_id: WorkerId
    queued_prefill_tokens: int = 0
    running: int = 0
    prefill_tokens_per_s: float = 0.0
    ts: float = 0.0
    waiting: int = 0
    kv_usage: float = 0.0


@runtime_checkable
class IndexQuery(Protocol):
    """Read side of the global index, as routers and workers use it."""

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Per-location holdings of the prefix ``hashes`` (see :mod:`kvshare.match`). An index
        that cannot answer returns an empty result with ``unavailable`` set to the reason."""
        ...

    async def match_async(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Same as :meth:`match`, without blocking the event loop."""
        ...
