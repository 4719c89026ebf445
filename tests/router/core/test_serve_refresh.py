"""The Serve router's registry reads stay out of a request's path once the workers are known:
Ray Serve's real ``KVShareRequestRouter`` class over a real in-process ``GlobalIndex`` whose
worker registry answers late (a busy index actor)."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.serve._private.common import DeploymentHandleSource
from test_router_core import DEPLOYMENT, NS, STREAM, TPS, cluster, pending_request, replicas

from kvshare.router.core.embed import InProcessIndex
from kvshare.router.serve.request_router import KVShareRequestRouter
from kvshare.workers import WorkerInfo


class LateRegistry(InProcessIndex):
    """The index, except that registry reads after the first wait for ``answer``."""

    def __init__(self, index: Any) -> None:
        super().__init__(index)
        self.reads = 0
        self.answer = asyncio.Event()

    async def workers_async(self) -> list[WorkerInfo]:
        self.reads += 1
        if self.reads > 1:
            await self.answer.wait()
        return await super().workers_async()


def test_a_known_worker_set_is_refreshed_in_the_background_not_in_the_request_path() -> None:
    """Once every replica's worker is known, a request arriving after ``workers_refresh_s``
    is ranked by kvshare at once, while the registry read it started is still unanswered
    (before: it waited for that read, up to ``index_timeout_s``, then fell back to power of
    two); the read's answer is used when it comes."""
    reps = replicas(2)
    index = cluster(reps)

    async def route() -> tuple[KVShareRequestRouter, LateRegistry, int]:
        serve = KVShareRequestRouter(deployment_id=DEPLOYMENT,
                                     handle_source=DeploymentHandleSource.UNKNOWN)
        serve.initialize_state(namespace=NS, prefill_tokens_per_s=TPS, workers_refresh_s=0.0,
                               index_timeout_s=10.0)
        registry = LateRegistry(index)
        serve.use_index(registry)
        serve.update_replicas(reps)
        for i in range(3):
            await asyncio.wait_for(serve.choose_replicas(reps, pending_request(i, STREAM[i])), 30)
        pending = registry.reads
        registry.answer.set()
        for _ in range(100):  # bounded: the background read finishes
            if getattr(serve, "_workers_task", None) is None:
                break
            await asyncio.sleep(0.01)
        return serve, registry, pending

    serve, registry, pending = asyncio.run(route())
    decisions = sum(n for k, n in serve.counters.items() if k.startswith("decision_"))
    assert decisions == 3, serve.counters  # every request ranked by kvshare
    assert not any(k.startswith("fallback") for k in serve.counters), serve.counters
    assert pending == 2  # one read in the path (workers unknown), one in the background
    assert getattr(serve, "_workers_task", None) is None and len(serve._workers) == 2
