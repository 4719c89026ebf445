"""One SGLang worker in a kvshare cluster: the server, its registration, its KV events.

:class:`SglangWorker` starts an SGLang server (:mod:`kvshare.sglang.launch`) with HiCache and
kvshare as its storage tier, using this node's pool; registers it with the index like a vLLM
worker (:class:`~kvshare.vllm.server.presence.Presence`, under the lease its ``/metrics`` load
renews: :class:`~kvshare.sglang.load.SglangLoad`), and feeds SGLang's radix-cache KV events
(device pages ``GPU``, HiCache host pages ``CPU_PINNED``; the same wire format as vLLM's) into
the index as the worker's gpu and host tiers
(:class:`~kvshare.vllm.events.consumer.KVEventsConsumer`), hashed as a gateway hashes
prompts (:class:`~kvshare.vllm.server.worker.VllmKeys`). The registration's ``meta`` says
``engine=sglang``: a gateway forwards token ids and ``cache_salt`` the way SGLang takes them.

What routing sees of SGLang's cache: its L1/L2 pages, per prompt block, through those events;
its L3 (kvshare's pools) only as pages keyed by SGLang's own page names, which a gateway cannot
compute from a prompt, so storage hits reach routing as counts (``cached_tokens`` per source in
:meth:`SglangWorker.stats`), not per block. Plain class: ``kvshare.actors.sglang_workers``
wraps it in a Ray actor pinned to a node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from kvshare.sglang.launch import SglangProcess, SglangSpec
from kvshare.sglang.load import SglangLoad
from kvshare.types import NodeId, WorkerId
from kvshare.vllm.events.consumer import EventsConfig, KVEventsConsumer
from kvshare.vllm.server.presence import IndexSink, Presence
from kvshare.vllm.server.worker import VllmKeys
from kvshare.workers import META_GPU_PRIVATE, WorkerInfo, WorkerLoad


@dataclass(frozen=True)
class SglangWorkerConfig:
    """One worker: ``spec`` (the SGLang server; its ``page_size`` is the namespace's
    ``--block-tokens``), the kvshare ``namespace``, the node whose pool its storage backend
    uses, and the Ray cluster the backend joins (``ray_address``; the launcher fills it)."""

    worker_id: str
    node: str
    namespace: str
    spec: SglangSpec
    dtype: str = ""
    ray_namespace: str = "kvshare"
    ray_address: str = ""

    def storage_settings(self) -> dict[str, Any]:
        """The kvshare backend's keys (:class:`~kvshare.sglang.settings.StorageSettings`)."""
        out: dict[str, Any] = {**self.spec.storage_settings, "namespace": self.namespace,
                               "ray_namespace": self.ray_namespace, "node": self.node}
        if self.ray_address:
            out["ray_address"] = self.ray_address
        return out


class SglangWorker:
    """Start, register and feed one SGLang server; :meth:`stop` ends all of it."""

    def __init__(self, config: SglangWorkerConfig, index: IndexSink) -> None:
        self.config = config
        page = config.spec.page_size
        self.keys = VllmKeys.from_model(config.spec.model, page, config.dtype)
        spec = config.spec.on_this_node()  # its address, port and events dir: this node's
        if spec.storage == "kvshare":
            spec = replace(spec, storage_settings=config.storage_settings())
        self.spec = spec
        self.info = WorkerInfo(WorkerId(config.worker_id), NodeId(config.node),
                               (config.namespace,), spec.endpoint, 1,
                               self.keys.layout.fingerprint(), self._meta(spec))
        self.index = index
        self.process = SglangProcess(spec)
        self.load: SglangLoad | None = None
        self.presence: Presence | None = None
        self.consumer: KVEventsConsumer | None = None

    def _meta(self, spec: SglangSpec) -> dict[str, str]:
        """What routers read from the registration (as :class:`VllmWorker`'s, ``engine``
        ``sglang``): how prompts hash, that its gpu tier is its own, the events sockets."""
        layout = self.keys.layout
        return {"engine": "sglang", "model": spec.served_name or spec.model,
                META_GPU_PRIVATE: "1",
                "block_size": str(spec.page_size),
                "root_hex": self.keys.hasher().root.hex(),
                "block_tokens": str(spec.page_size),
                "bytes_per_token": str(layout.bytes_per_token),
                "tokenizer": json.dumps({"kind": "hf", "path": spec.model}),
                "storage": spec.storage or "none",
                "kv_events_endpoint": spec.events_endpoint,
                "kv_replay_endpoint": spec.replay_endpoint}

    def start(self, timeout_s: float = 300.0) -> str:
        """Start SGLang, wait until it serves, register, follow its events; returns its URL."""
        self.process.start()
        self.process.wait_ready(timeout_s)
        self.load = SglangLoad(self.info.worker_id, self.spec.endpoint)
        self.presence = Presence(self.info, self.index, self._load, alive_fn=self.process.alive)
        events = EventsConfig(self.spec.events_endpoint, self.config.namespace,
                              self.spec.page_size, self.spec.page_size,
                              replay_endpoint=self.spec.replay_endpoint)
        self.consumer = KVEventsConsumer(events, self.presence, self.keys.hasher()).start()
        self.presence.start()
        return self.spec.endpoint

    def _load(self) -> WorkerLoad | None:
        load = self.load.load() if self.load is not None else None
        if load is None or self.consumer is None:
            return load
        return replace(load, cache_epoch=self.consumer.cache_epoch)

    def stats(self) -> dict[str, Any]:
        """Liveness, the events consumer's and lease's counters, and the prompt tokens each
        cache source supplied (``cached_tokens``: ``device``, ``host``, ``storage``)."""
        proc = self.process.proc
        return {"worker_id": self.info.worker_id, "endpoint": self.spec.endpoint,
                "alive": self.process.alive(),
                "pid": proc.pid if proc is not None else None,
                "cached_tokens": self.load.cached_tokens() if self.load else {},
                "events": self.consumer.stats() if self.consumer else {},
                "lease": dict(self.presence.counters) if self.presence else {}}

    def stop(self) -> None:
        """Unregister (its entries go), stop following events, stop SGLang."""
        if self.presence is not None:
            self.presence.stop()
        if self.consumer is not None:
            self.consumer.stop()
        if self.load is not None:
            self.load.close()
        self.process.stop()
