"""One vLLM worker in a kvshare cluster: the server, its registration, its KV events.

:class:`VllmWorker` starts a vLLM OpenAI server (:mod:`kvshare.vllm.server.launch`) with the KV-events
publisher (and, when asked, the kvshare KV connector), registers it with the index
(:class:`~kvshare.vllm.server.presence.Presence`: worker id, node, endpoint, namespace, layout, under
the lease its ``/metrics`` load renews) and feeds its prefix cache into the index as the
worker's gpu tier (:class:`~kvshare.vllm.events.consumer.KVEventsConsumer`). The registration's
``meta`` says ``engine=vllm`` so a gateway forwards token ids and ``cache_salt`` the way vLLM
takes them. Plain class: ``actors.vllm_worker`` wraps it in a Ray actor pinned to a node.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from kvshare.hasher import Hasher
from kvshare.identity import path_identity
from kvshare.layout import KVLayout, normalize_dtype
from kvshare.types import NodeId, WorkerId
from kvshare.vllm.connector.config import ConnectorSettings, refuse_kind
from kvshare.vllm.events.consumer import EventsConfig, KVEventsConsumer
from kvshare.vllm.server.launch import VllmProcess, VllmSpec
from kvshare.vllm.server.load import MetricsLoad
from kvshare.vllm.server.presence import IndexSink, Presence
from kvshare.workers import META_GPU_PRIVATE, WorkerInfo, WorkerLoad


@dataclass(frozen=True)
class VllmKeys:
    """What a vLLM worker's share blocks are keyed by: the model identity (config, weights,
    tokenizer, dtype; :func:`kvshare.identity.path_identity`) and the KV layout.
    A gateway routing to the worker must hash with the same keys (:meth:`from_model`)."""

    identity: str
    layout: KVLayout

    @classmethod
    def from_model(cls, model_dir: str, block_tokens: int, dtype: str = "") -> VllmKeys:
        """Keys of the model in ``model_dir`` served in ``dtype`` (default: its config's);
        ValueError for attention kinds the vLLM side does not share yet (:func:`refuse_kind`)."""
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        dt = normalize_dtype(dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
        layout = KVLayout.from_hf_config(os.path.join(model_dir, "config.json"), dtype=dt,
                                         block_tokens=block_tokens)
        refuse_kind(layout, model_dir)
        return cls(path_identity(model_dir, f"model={dt};kv={dt}"), layout)

    def hasher(self) -> Hasher:
        return Hasher.for_layout(self.identity, self.layout)


@dataclass(frozen=True)
class VllmWorkerConfig:
    """One worker: ``spec`` (the vLLM server), the kvshare ``namespace`` and share block size,
    and whether vLLM loads/stores through the kvshare connector (``connector``; it joins the
    Ray cluster at ``ray_address`` and uses ``node``'s pool). ``connector_settings``: more
    ``kv_connector_extra_config`` keys (:class:`~kvshare.vllm.connector.config.ConnectorSettings`, e.g.
    ``{"sync_save_mib": 0}``), checked here; the keys this config sets itself are refused."""

    worker_id: str
    node: str
    namespace: str
    spec: VllmSpec
    block_tokens: int = 256
    dtype: str = ""
    connector: bool = False
    ray_namespace: str = "kvshare"
    ray_address: str = ""
    connector_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        owned = sorted(set(self.connector_settings) & set(self._owned_settings()))
        if owned:
            raise ValueError(f"connector_settings: {owned} are set from the worker's own "
                             "config (namespace, block_tokens, node, ...): leave them out")
        if self.connector_settings and not self.connector:
            raise ValueError("connector_settings given for a worker without the connector "
                             "(connector=False): drop them or set connector=True")
        ConnectorSettings.from_extra({**self.connector_settings,
                                      **self._owned_settings()})  # a bad key or value: here
        if self.block_tokens % self.spec.block_size:
            raise ValueError(
                f"block_tokens {self.block_tokens} must be a multiple of vLLM's --block-size "
                f"{self.spec.block_size}")

    def _owned_settings(self) -> dict[str, Any]:
        """The connector keys this config sets (its pool: this worker's node's)."""
        extra: dict[str, Any] = {"namespace": self.namespace, "block_tokens": self.block_tokens,
                                 "ray_namespace": self.ray_namespace, "node": self.node}
        if self.ray_address:
            extra["ray_address"] = self.ray_address
        return extra

    def extra_config(self) -> dict[str, Any]:
        """The connector's ``kv_connector_extra_config``."""
        return {**self.connector_settings, **self._owned_settings()}


class VllmWorker:
    """Start, register and feed one vLLM server; :meth:`stop` ends all of it."""

    def __init__(self, config: VllmWorkerConfig, index: IndexSink) -> None:
        self.config = config
        self.keys = VllmKeys.from_model(config.spec.model, config.block_tokens, config.dtype)
        spec = config.spec.on_this_node()  # its address, port and events dir: this node's
        if config.connector:
            extra = config.extra_config()
            spec = VllmSpec(**{**spec.__dict__, "kv_transfer_config": {
                "kv_connector": "KVShareConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "kvshare.vllm.connector",
                "kv_connector_extra_config": extra}})
        if config.dtype:
            spec = VllmSpec(**{**spec.__dict__, "extra_args": (*spec.extra_args, "--dtype",
                                                                config.dtype)})
        self.spec = spec
        self.info = WorkerInfo(WorkerId(config.worker_id), NodeId(config.node),
                               (config.namespace,), spec.endpoint, 1,
                               self.keys.layout.fingerprint(),
                               self._meta(spec))
        self.index = index
        self.process = VllmProcess(spec)
        self.load: MetricsLoad | None = None
        self.presence: Presence | None = None
        self.consumer: KVEventsConsumer | None = None

    def _meta(self, spec: VllmSpec) -> dict[str, str]:
        """What routers read from the registration: the engine (a gateway forwards vLLM's own
        fields), how prompts hash (the keys of ``kvshare.router.serve.request``'s ``WorkerHashing``:
        ``root_hex``, ``block_tokens``, ``bytes_per_token``, ``tokenizer``, so a Serve router
        hashes exactly what this worker's events publish), that its gpu tier is its own
        (:data:`~kvshare.workers.META_GPU_PRIVATE`) and the KV-events sockets (what Ray Serve
        LLM's KV-aware router subscribes to)."""
        layout = self.keys.layout
        return {"engine": "vllm", "model": spec.served_name or spec.model,
                META_GPU_PRIVATE: "1",  # vLLM's own cache: no other worker can read it
                "block_size": str(spec.block_size),
                "root_hex": self.keys.hasher().root.hex(),
                "block_tokens": str(self.config.block_tokens),
                "bytes_per_token": str(layout.bytes_per_token),
                "tokenizer": json.dumps({"kind": "hf", "path": spec.model}),
                "kv_events_endpoint": spec.events_endpoint,
                "kv_replay_endpoint": spec.replay_endpoint}

    def start(self, timeout_s: float = 300.0) -> str:
        """Start vLLM, wait until it serves, register, follow its events; returns its URL."""
        self.process.start()
        self.process.wait_ready(timeout_s)
        self.load = MetricsLoad(self.info.worker_id, self.spec.endpoint)
        self.presence = Presence(self.info, self.index, self._load, alive_fn=self.process.alive)
        events = EventsConfig(self.spec.events_endpoint, self.config.namespace,
                              self.config.block_tokens, self.spec.block_size,
                              replay_endpoint=self.spec.replay_endpoint)
        self.consumer = KVEventsConsumer(events, self.presence, self.keys.hasher()).start()
        self.presence.start()
        return self.spec.endpoint

    def _load(self) -> WorkerLoad | None:
        """The engine's load report, stamped with how many times its cache was emptied (as its
        KV events tell: routers then forget what they expected it to hold)."""
        load = self.load.load() if self.load is not None else None
        if load is None or self.consumer is None:
            return load
        return replace(load, cache_epoch=self.consumer.cache_epoch)

    def stats(self) -> dict[str, Any]:
        proc = self.process.proc
        return {"worker_id": self.info.worker_id, "endpoint": self.spec.endpoint,
                "alive": self.process.alive(),
                "pid": proc.pid if proc is not None else None,  # (its process group's too)
                "events": self.consumer.stats() if self.consumer else {},
                "lease": dict(self.presence.counters) if self.presence else {}}

    def stop(self) -> None:
        """Unregister (its entries go), stop following events, stop vLLM."""
        if self.presence is not None:
            self.presence.stop()
        if self.consumer is not None:
            self.consumer.stop()
        if self.load is not None:
            self.load.close()
        self.process.stop()
