"""Ray Serve replicas in front of vLLM workers, for any Serve request router.

``kvshare vllm start`` (:mod:`kvshare.actors.vllm_workers`) runs one vLLM OpenAI server per node,
registered with the kvshare index and feeding it its prefix cache. :class:`VllmReplica` is a
thin Serve replica in front of one of them (the replica of rank *r* fronts the *r*-th worker
of the namespace, by worker id, so ``num_replicas`` = number of workers covers each once;
it need not share the worker's node, it only relays HTTP): it streams
completions to that server as token ids, and advertises in its routing stats what request
routers need to see the server's cache:

- ``kvshare_worker_id`` (:data:`~kvshare.router.serve.request.FRONTS_WORKER`): the registered worker,
  so :class:`~kvshare.router.serve.request_router.KVShareRequestRouter` ranks this replica by that worker's own
  prefix cache, its node's pool and load;
- ``kv_event_metadata``: the server's KV-events and replay sockets and its page size, the
  contract of Ray Serve LLM's ``KVAwareRouter`` (its Dynamo selection service subscribes to
  them).

Ray Serve LLM's ``PrefixCacheAffinityRouter`` needs nothing from the replica: it matches the
request's ``prompt`` text. Requests are :class:`ServeCompletion` objects (attributes, not a
dict, as Serve LLM's routers read them)::

    app = vllm_app(router=KVSHARE_ROUTER, num_replicas=2, namespace="tiny")
    handle = serve.run(app, name="vllm")
    async for chunk in handle.options(stream=True).remote(ServeCompletion(text, ids, 8)):
        ...  # {"worker": id, "text": "...", "finish_reason": None | "stop" | "length"}
        # the first piece adds "upstream_ttft_s"; a last one carries the server's "usage"
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvshare.router.gateway.sse_stream import stream_events
from kvshare.router.serve.request import FRONTS_WORKER

KVSHARE_ROUTER = "kvshare.router.serve:KVShareRequestRouter"
HINT_KWARG = "kvshare_hint"
"""The keyword :class:`VllmReplica` takes the router hint in (``hint_kwarg`` of the kvshare
router's settings; :func:`vllm_app` sets it)."""


@dataclass(frozen=True)
class ServeCompletion:
    """One completion request: the ``prompt`` text (what text-matching routers read) and its
    ``prompt_token_ids`` (what the replica sends to vLLM and token-level routers hash)."""

    prompt: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    extra: Mapping[str, Any] = field(default_factory=dict)


class VllmReplica:
    """The body of the Serve deployment built by :func:`vllm_app` (module docstring).

    ``namespace``: the kvshare namespace the vLLM workers registered in; the replica fronts
    the one its Serve rank names (module docstring).
    ``max_num_batched_tokens``: the server's prefill budget, advertised to KV-aware routers
    as its load capacity.
    """

    def __init__(self, namespace: str, ray_namespace: str = "kvshare",
                 max_num_batched_tokens: int = 4096, timeout_s: float = 300.0) -> None:
        import httpx
        from ray import serve

        from kvshare.actors.index.client import IndexClient

        index = IndexClient.connect(ray_namespace)
        workers = sorted((w for w in index.workers()
                          if namespace in w.namespaces and w.meta.get("engine") == "vllm"),
                         key=lambda w: w.worker_id)
        if not workers:
            raise RuntimeError(f"no vLLM worker of namespace {namespace!r} is registered: "
                               "start them first (kvshare vllm start)")
        rank = serve.get_replica_context().rank
        self.worker = workers[int(getattr(rank, "rank", 0) or 0) % len(workers)]
        self.max_num_batched_tokens = max_num_batched_tokens
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve's request routers read about this replica (module docstring)."""
        meta = self.worker.meta
        stats: dict[str, Any] = {FRONTS_WORKER: self.worker.worker_id}
        if meta.get("kv_events_endpoint"):
            stats["kv_event_metadata"] = {
                "endpoint": meta["kv_events_endpoint"],
                "replay_endpoint": meta.get("kv_replay_endpoint"),
                "block_size": int(meta.get("block_size", "32")),
                "max_num_batched_tokens": self.max_num_batched_tokens, "dp_rank": 0}
        return stats

    def worker_id(self) -> str:
        return str(self.worker.worker_id)

    async def __call__(self, request: ServeCompletion,
                       kvshare_hint: Mapping[str, Any] | None = None,
                       **_: Any) -> AsyncIterator[dict[str, Any]]:
        """Stream the completion from the vLLM server: one dict per generated piece; extra
        keyword arguments (a router's, e.g. ``request_token_ids``) are ignored.
        ``kvshare_hint`` (set by :class:`~kvshare.router.serve.request_router.KVShareRequestRouter`, its
        ``hint_kwarg``): the router hint, forwarded as ``kv_transfer_params``
        (:mod:`kvshare.vllm.router_hint`).

        The first piece also carries ``upstream_ttft_s`` (seconds from this replica's call to
        the server's first token: the engine's queue and prefill, without Serve's routing);
        the server's usage (``prompt_tokens``, ``cached_tokens``) comes as a last piece with
        empty ``text`` and ``usage`` set. A connection the server dropped before answering is
        retried once (:func:`~kvshare.router.gateway.sse_stream.stream_events`)."""
        body = {**dict(request.extra), "model": self.worker.meta.get("model"),
                "prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        if kvshare_hint is not None:
            body["kv_transfer_params"] = dict(kvshare_hint)
        wid = str(self.worker.worker_id)
        t0 = time.perf_counter()
        first = True
        async for data in stream_events(self.http, f"{self.worker.endpoint}/v1/completions",
                                        body, what=f"vLLM worker {wid}"):
            for choice in data.get("choices") or []:
                piece = {"worker": wid, "text": choice.get("text", ""),
                         "finish_reason": choice.get("finish_reason")}
                if first:
                    piece["upstream_ttft_s"] = time.perf_counter() - t0
                    first = False
                yield piece
            if data.get("usage"):
                yield {"worker": wid, "text": "", "finish_reason": None,
                       "usage": _usage(data["usage"])}


def _usage(usage: Mapping[str, Any]) -> dict[str, int]:
    """vLLM's usage object as plain counts (``cached_tokens``: its prefix cache and the KV
    connector's, with ``--enable-prompt-tokens-details``)."""
    details = usage.get("prompt_tokens_details") or {}
    return {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0),
            "cached_tokens": int(details.get("cached_tokens") or 0)}


def vllm_app(router: str | None, num_replicas: int, namespace: str, *,
             ray_namespace: str = "kvshare", router_kwargs: Mapping[str, Any] | None = None,
             replica_resources: Mapping[str, float] | None = None,
             max_ongoing_requests: int = 64, stats_period_s: float = 1.0,
             name: str = "VllmReplica") -> Any:
    """The Serve application of ``num_replicas`` :class:`VllmReplica`s routed by ``router``
    (an import path such as :data:`KVSHARE_ROUTER`, Ray Serve LLM's routers, or None for
    Serve's default power of two). ``replica_resources``: a custom resource each replica
    needs, to place one per node (e.g. ``{"vllm_slot": 1}`` with one slot per node)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    options: dict[str, Any] = {"num_cpus": 0}
    if replica_resources:
        options["resources"] = dict(replica_resources)
    cfg: dict[str, Any] = {"request_routing_stats_period_s": stats_period_s}
    if router is not None:
        cfg["request_router_class"] = router
        cfg["request_router_kwargs"] = dict(router_kwargs or {})
        if router == KVSHARE_ROUTER:
            cfg["request_router_kwargs"].setdefault("hint_kwarg", HINT_KWARG)
    dep = serve.deployment(name=name, num_replicas=num_replicas, ray_actor_options=options,
                           max_ongoing_requests=max_ongoing_requests,
                           request_router_config=RequestRouterConfig(**cfg))(VllmReplica)
    return dep.bind(namespace, ray_namespace)
