"""Everything one reference worker process runs: engine, SDK client, HTTP server, load reports.

A plain class; run it as a Ray actor with a one-line wrapper (the cluster layer and the demo do
``ray.remote(WorkerService).options(resources={...}).remote(...)``)::

    svc = WorkerService("tiny", EngineConfig(), worker_id="w0")
    svc.endpoint()          # http://NODE_IP:PORT, registered with the index

It listens on its node's address (:func:`kvshare.addresses.node_ip`: Ray's node IP inside a
cluster; ``host`` overrides it) on a port it binds itself (``port=0``), so what it registers is
reachable from the other hosts.

Inside Ray the SDK connects to the deployment (index + node pools) with
:meth:`KVShareClient.connect`; ``connect=False`` runs without any cache (the cold baseline).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Any

from kvshare.addresses import node_ip
from kvshare.auth import WorkerAuth, cluster_secret
from kvshare.breakdown import breakdown_of
from kvshare.client.sdk import CutPolicy, KVShareClient
from kvshare.client.types import TRANSPORT_AUTO
from kvshare.engines.hf import EngineConfig, HFEngine
from kvshare.engines.runtime import CUT_POLICIES, choose_cut
from kvshare.engines.server import WorkerServer
from kvshare.engines.worker import Completion, ReferenceWorker
from kvshare.types import BlockHash, NodeId, WorkerId
from kvshare.workers import WorkerInfo, WorkerRegistrar


def completion_dict(c: Completion, with_logits: bool = False) -> dict[str, Any]:
    """A JSON/pickle-friendly view of a completion (logits as a float list if asked)."""
    s = c.stats
    out: dict[str, Any] = {
        "tokens": list(c.tokens), "prompt_tokens": s.prompt_tokens,
        "reused_tokens": s.reused_tokens, "computed_tokens": s.computed_tokens,
        "planned_blocks": s.planned_blocks, "loaded_blocks": s.loaded_blocks,
        "ttft_s": s.ttft_s, "lookup_s": s.lookup_s, "load_s": s.load_s, "prefill_s": s.prefill_s,
        "bytes_by_transport": dict(s.bytes_by_transport), "bytes_by_tier": dict(s.bytes_by_tier),
        "tokens_by_source": dict(s.tokens_by_source),
        "misses": dict(s.misses),
        "plan": dict(s.plan),
        "breakdown": breakdown_of(s),
    }
    if with_logits and c.first_logits is not None:
        out["first_logits"] = c.first_logits.numpy().copy()
    return out


class WorkerService:
    """One reference worker: builds the engine, connects the SDK, serves HTTP, reports load."""

    def __init__(
        self,
        namespace: str,
        engine: EngineConfig | None = None,
        *,
        worker_id: str | None = None,
        connect: bool = True,
        serve_http: bool = True,
        remote: str = TRANSPORT_AUTO,
        cut_policy: CutPolicy | str = "cost",
        model_name: str = "",
        host: str | None = None,
        port: int = 0,
    ) -> None:
        if isinstance(cut_policy, str) and cut_policy not in CUT_POLICIES:
            raise ValueError(f"cut_policy must be one of {CUT_POLICIES} or a callable, "
                             f"got {cut_policy!r}")
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.namespace = namespace
        self.worker_id = worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.engine = HFEngine(engine or EngineConfig())
        self.client: KVShareClient | None = None
        node = "local"
        if connect:
            self.client = KVShareClient.connect(
                namespace, self.engine.layout, self.engine.hasher, worker_id=self.worker_id,
                remote=remote, cut_policy=choose_cut(self.engine, cut_policy),
            )
            node = self.client.node
        self.worker = ReferenceWorker(self.engine, self.client)
        self.info = WorkerInfo(
            WorkerId(self.worker_id), NodeId(node), (namespace,),
            layout_fingerprint=self.engine.layout.fingerprint(),
            meta={"model": model_name or self.engine.identity, "identity": self.engine.identity},
        )
        self.server: WorkerServer | None = None
        if serve_http:
            index = self.client.index if self.client is not None else None
            registrar = index if isinstance(index, WorkerRegistrar) else None
            self.server = WorkerServer(
                self.worker, self.info, model_name=model_name or namespace,
                registrar=registrar, host=host or node_ip(), port=port,
                auth=WorkerAuth.from_secret(cluster_secret()),  # on a cluster: its token only
            )
            self.server.start()
            self.info = self.server.info

    def ready(self) -> dict[str, Any]:
        """Worker id, node, endpoint, namespace, model identity; ``nixl``: the remote transport
        in use (``nixl``/``objstore``; ``remote="auto"`` picks the faster measured one)."""
        return {"worker_id": self.worker_id, "node": str(self.info.node),
                "endpoint": self.info.endpoint, "namespace": self.namespace,
                "identity": self.engine.identity, "layout": self.engine.layout.to_dict(),
                "nixl": self.client.remote if self.client is not None else "",
                "bandwidths_bytes_per_s": dict(self.client.bandwidths) if self.client is not None else {}}

    def endpoint(self) -> str:
        return self.info.endpoint

    def generate(
        self, tokens: Sequence[int], max_new_tokens: int = 16, *,
        hashes_hex: Sequence[str] | None = None, with_logits: bool = False,
        wait_store: bool = True,
    ) -> dict[str, Any]:
        """Greedy completion (no HTTP); ``wait_store`` waits for the write-through."""
        hashes = [BlockHash(bytes.fromhex(h)) for h in hashes_hex] if hashes_hex else None
        c = self.worker.generate(list(tokens), max_new_tokens, hashes=hashes, stop_ids=())
        if wait_store:
            for f in c.stores:
                f.result(timeout=60)
        return completion_dict(c, with_logits)

    def stats(self) -> dict[str, Any]:
        """Worker counters, SDK counters, and the server's current load."""
        out: dict[str, Any] = {"worker": self.worker.counters.snapshot(),
                               "client": self.client.counters if self.client else {}}
        if self.server is not None:
            out["load"] = self.server.load.as_dict()
            out["report_errors"] = self.server.report_errors
        return out

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.client is not None:
            self.client.close()
