"""vLLM workers on emulated hosts behind a gateway: the stack ``benchmarks/partition.py`` and
the cross-host vLLM tests (``tests/kvshare/vllm/test_vllm_hosts.py``) share (root only, like
:mod:`kvshare.testing.hosts`). It composes the whole stack (actors, router), so it lives here,
not in ``kvshare.testing``, which the library's layering keeps below them.

:func:`vllm_hosts_stack` starts N emulated hosts with Ray, deploys kvshare (index and watcher
on the head, in the root namespace; one pool per host), starts one vLLM-CPU server with the
kvshare connector per host by ``kvshare vllm start``'s code path
(:func:`kvshare.actors.vllm_workers.start_workers`: each registers its host's address) and
serves the gateway from a thread of this process (the root namespace, reaching the hosts over
the bridge). The connector loads everything it finds (``cut=all``) unless told otherwise: with
a tiny model the cost model recomputes rather than cross a link, and these runs are about the
path across hosts.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvshare.testing.hosts import EmulatedHosts, Host


@dataclass
class VllmHostsStack:
    """What :func:`vllm_hosts_stack` yields. ``infos``: each host's worker
    (:meth:`kvshare.actors.vllm_workers.VllmWorkerService.info`) by host name."""

    hosts: EmulatedHosts
    model: str
    namespace: str
    ray_namespace: str
    keys: Any  # kvshare.vllm.server.worker.VllmKeys
    index: Any  # kvshare.actors.index.client.IndexClient
    infos: dict[str, dict[str, Any]]
    router: Any  # kvshare.router.core.embed.CacheAwareRouter
    url: str  # the gateway

    def worker(self, host: Host) -> dict[str, Any]:
        return self.infos[host.name]

    def host_of(self, worker_id: str) -> Host:
        return next(h for h in self.hosts.hosts if self.infos[h.name]["worker_id"] == worker_id)

    def node_of(self, host: Host) -> str:
        """The Ray node id of ``host``'s live node."""
        import ray

        nodes = ray.nodes()  # type: ignore[no-untyped-call]
        return str(next(n["NodeID"] for n in nodes if n["Alive"] and host.name in n["Resources"]))

    def start_worker(self, host: Host, **kwargs: Any) -> dict[str, Any]:
        """Start a vLLM worker on ``host``'s node as the stack's were (e.g. to replace one
        lost with its node); recorded in :attr:`infos`."""
        from kvshare.actors.vllm_workers import start_workers

        info = start_workers(self.model, [self.node_of(host)], **{**self.worker_kwargs,
                                                                  **kwargs})[0]
        self.infos[host.name] = info
        return info

    worker_kwargs: dict[str, Any]


@contextmanager
def vllm_hosts_stack(model: str, *, n: int = 2, namespace: str = "tiny-hosts",
                     ray_namespace: str = "kvshare-vllm-hosts", block_tokens: int = 128,
                     dtype: str = "float32", index_timeout_s: float = 10.0,
                     connector_settings: Mapping[str, Any] | None = None,
                     system_config: Mapping[str, Any] | None = None,
                     base_dir: str | os.PathLike[str] | None = None,
                     max_model_len: int = 2048) -> Iterator[VllmHostsStack]:
    """The stack of the module docstring for ``model`` (a path every host reads: ``/tmp`` is
    one disk for all of them); torn down on exit. ``system_config``: Ray's, e.g. shorter
    health checks so a cut-off host's node is declared dead sooner."""
    import ray
    import uvicorn

    from kvshare.actors.config import NamespaceSpec
    from kvshare.actors.deploy import deploy, get_index_client, shutdown
    from kvshare.actors.vllm_workers import start_workers, stop_workers
    from kvshare.engines.server import listening_socket
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers
    from kvshare.router.gateway.app import create_app
    from kvshare.tokenizer import HFTokenizer
    from kvshare.vllm.server.worker import VllmKeys

    with EmulatedHosts(n, ray=True, base_dir=base_dir, system_config=system_config) as hs:
        hs.connect_ray(ray_namespace)
        server: Any = None
        try:
            keys = VllmKeys.from_model(model, block_tokens, dtype)
            deploy(namespaces=[NamespaceSpec(namespace, keys.layout,
                                             host_bytes=64 * keys.layout.bytes_per_block)],
                   ray_namespace=ray_namespace)
            kwargs: dict[str, Any] = {
                "namespace": namespace, "block_tokens": block_tokens, "max_model_len": max_model_len,
                "kv_cache_gb": 1, "connector": True, "dtype": dtype,
                "ray_namespace": ray_namespace,
                "connector_settings": {"cut": "all", **(connector_settings or {})}}
            stack = VllmHostsStack(hs, model, namespace, ray_namespace, keys,
                                   get_index_client(ray_namespace), {}, None, "", kwargs)
            nodes = [stack.node_of(h) for h in hs.hosts]
            infos = {i["node"]: i for i in start_workers(model, nodes, **kwargs)}
            stack.infos = {h.name: infos[node] for h, node in zip(hs.hosts, nodes, strict=True)}
            cfg = RouterConfig.from_model_keys(keys, namespace=namespace, policy="cost",
                                               index_timeout_s=index_timeout_s)
            stack.router = CacheAwareRouter(stack.index, IndexWorkers(stack.index), cfg,
                                            HFTokenizer(model))
            sock = listening_socket("127.0.0.1", 0)  # held until uvicorn serves on it
            port = int(sock.getsockname()[1])
            server = uvicorn.Server(uvicorn.Config(create_app(stack.router), host="127.0.0.1",
                                                   port=port, log_level="warning",
                                                   access_log=False))
            threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
            deadline = time.monotonic() + 30
            while not server.started:
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not start within 30 s")
                time.sleep(0.02)
            stack.url = f"http://127.0.0.1:{port}"
            yield stack
        finally:
            if server is not None:
                server.should_exit = True
            stop_workers(ray_namespace)
            shutdown(ray_namespace)
            ray.shutdown()
