"""KVShareConnector: vLLM's KV connector (V1) over the kvshare cluster, built on the SDK.

Load it with::

    python -m vllm.entrypoints.openai.api_server --model DIR --block-size 32 \\
      --kv-transfer-config '{"kv_connector": "KVShareConnector",
        "kv_connector_module_path": "kvshare.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"namespace": "NAME", "ray_address": "auto"}}'

(extra config keys: :mod:`kvshare.vllm.connector.config`). The scheduler role (EngineCore process) is
:class:`~kvshare.vllm.connector.scheduler_side.SchedulerSide`, the worker role (each worker process)
:class:`~kvshare.vllm.connector.worker_side.WorkerSide`; both talk to the cluster through one
:class:`kvshare.client.sdk.KVShareClient` per process (:func:`shared_client`). Everything that can
be wrong with the set-up (namespace not deployed or with another layout, block sizes that do
not divide, an attention kind or KV dtype kvshare cannot share, no Ray cluster) is a
ValueError at engine start-up that names the fix.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvshare.client.join import check_deployed, join_ray
from kvshare.types import BlockHash
from kvshare.vllm.connector.config import ConnectorSettings, ModelKeys, model_keys
from kvshare.vllm.connector.groups import EngineGroups
from kvshare.vllm.connector.lookup import Lookups
from kvshare.vllm.connector.metadata import KVShareMetadata
from kvshare.vllm.connector.scheduler_side import SchedulerSide
from kvshare.vllm.connector.stats import (
    CounterDelta,
    KVSharePromMetrics,
    KVShareStats,
    backlog_counters,
    byte_counters,
    lookup_counters,
    save_counters,
    wait_counters,
)
from kvshare.vllm.connector.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

STARTUP_S = 60.0  # how long an engine's start waits for the index to answer
_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_SIDES: list[SchedulerSide | WorkerSide] = []
_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "p2p": CacheHitSource.P2P}


def connect_ray(settings: ConnectorSettings) -> None:
    """Join the Ray cluster (unless this process already runs inside Ray)."""
    join_ray(settings.ray_address, settings.ray_namespace, "KVShareConnector",
             "kv_connector_extra_config")


def check_namespace(index: Any, settings: ConnectorSettings, keys: ModelKeys,
                    startup_s: float = STARTUP_S) -> None:
    """ValueError naming the fix unless the deployment serves this namespace with our layout
    (:func:`kvshare.client.join.check_deployed`)."""
    check_deployed(index, settings.namespace, keys.layout, "KVShareConnector", startup_s)


def shared_client(settings: ConnectorSettings, keys: ModelKeys) -> Any:
    """This process's KVShareClient for the namespace (scheduler and worker roles share it
    when they run in one process)."""
    key = (settings, keys.layout, keys.identity)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is not None:
            return client
        connect_ray(settings)
        from kvshare.client.sdk import KVShareClient
        from kvshare.cost_cut import CostCut

        root = BlockHash(keys.root(None))
        cut = CostCut(keys.layout) if settings.cut == "cost" else None
        extra: dict[str, Any] = {"cut_policy": cut} if cut is not None else {}
        client = KVShareClient.connect(
            settings.namespace, keys.layout, root, index_timeout_s=settings.index_timeout_s,
            ray_namespace=settings.ray_namespace, remote=settings.remote,
            load_deadline_s=settings.load_deadline_s, store_deadline_s=settings.store_deadline_s,
            worker_id=f"vllm-{os.getpid()}", node=settings.node or None, **extra)
        check_namespace(client.index, settings, keys)
        _CLIENTS[key] = client
        return client


def refresh_bandwidths() -> list[dict[str, Any]]:
    """Every kvshare client of this process re-reads its node pool's bandwidth figures (after
    the pool re-probed its peers, e.g. a link changed): per client the remote transport it
    chose, the bytes/s per transport and per peer its cut now prices with, and the prefill
    speed its cost cut assumes (0 for another cut)."""
    out = []
    for c in list(_CLIENTS.values()):
        c.choose_remote()
        model = getattr(getattr(c, "cut_policy", None), "model", None)
        out.append({"remote": c.remote, "bandwidths": dict(c.bandwidths),
                    "peer_bandwidths": dict(c.choice.peer_bandwidths),
                    "prefill_tokens_per_s": model.prefill.tokens_per_s if model else 0.0})
    return out


def process_counters() -> dict[str, float]:
    """Counters of every kvshare client and connector side in this process, summed."""
    out: dict[str, float] = {}
    parts = [dict(c.counters) for c in _CLIENTS.values()] + [dict(s.counters) for s in _SIDES]
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


class KVShareConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector V1 backed by the kvshare cluster (see the module docstring).

    ``SupportsHMA``: with vLLM's hybrid allocator (a sliding-window hybrid) every call gets and
    passes one page list per KV-cache group (:mod:`kvshare.vllm.connector.groups`)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # vLLM's default ("fail") turns a failed load into a failed request; for kvshare a
            # failed load is a cache miss: the scheduler reads the policy after this call.
            log.info("KVShareConnector: kv_load_failure_policy set to 'recompute'")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra(extra)
        self.keys = model_keys(vllm_config, self.settings)
        page = int(vllm_config.cache_config.block_size)
        self.groups = (EngineGroups.from_vllm(kv_cache_config, self.keys.layout,
                                              str(vllm_config.model_config.model))
                       if kv_cache_config is not None
                       else EngineGroups.single(self.keys.layout.num_layers))
        # the group whose page list stands for the request's pages (a full-attention one)
        self._primary = next((i for i, w in enumerate(self.groups.windows) if w is None), 0)
        client = self._make_client()
        self._client = client
        self._moved = CounterDelta()  # bytes per transport since the last stats report
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            st = self.settings
            self._sched = SchedulerSide(client, self.keys, page, save=st.save,
                                        sync_local_bytes=int(st.sync_local_mib * 2**20),
                                        lookups=Lookups(st.lookup_threads, priced=st.price_lookups),
                                        router_hints=st.router_hints,
                                        hint_max_age_s=st.router_hint_max_age_s,
                                        sync_save_bytes=int(st.sync_save_mib * 2**20),
                                        groups=self.groups)
            _SIDES.append(self._sched)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self._worker = WorkerSide(client, self.keys, page,
                                      tp_rank=get_tensor_model_parallel_rank(),
                                      tp_size=get_tensor_model_parallel_world_size(),
                                      groups=self.groups)
            _SIDES.append(self._worker)

    def _make_client(self) -> Any:
        """The SDK client (tests may override to use an in-process pool)."""
        return shared_client(self.settings, self.keys)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never a lost request

    @property
    def counters(self) -> dict[str, float]:
        side = self._sched or self._worker
        return dict(side.counters) if side is not None else {}

    # ------------------------------------------------------------------ stats (kvshare.vllm.connector.stats)
    def get_kv_connector_stats(self) -> KVShareStats | None:
        """Since the last call: worker role, bytes loaded per transport and stored, and load
        waits and steps held for their saves; scheduler role, lookup waits, skipped lookups,
        finishes held for saves and the prefill backlog."""
        if self._sched is not None:
            moved = self._moved.take({**lookup_counters(self._sched.counters),
                                      **save_counters(self._sched.counters),
                                      **backlog_counters(self._sched.backlog.counters)})
        elif self._worker is not None:
            moved = self._moved.take({**byte_counters(self._client.counters),
                                      **wait_counters(self._worker.counters),
                                      **save_counters(self._worker.counters)})
        else:
            return None
        return KVShareStats(data=moved) if moved else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVShareStats:
        return KVShareStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVSharePromMetrics:
        return KVSharePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler role
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        assert self._sched is not None
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()
            self._sched.update_state_after_alloc(request, ids[self._primary], num_external_tokens,
                                                 ids if self.groups.grouped else ())

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        assert self._sched is not None
        got = self._sched.hit_sources(request, num_external_tokens)
        if not got:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {_SOURCES[k]: v for k, v in got.items()}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        manager = self._kv_cache_manager

        def pages(rid: str) -> list[int]:
            assert manager is not None
            return list(manager.get_block_ids(rid)[self._primary])

        def group_pages(rid: str) -> tuple[list[int], ...]:
            assert manager is not None
            return tuple(manager.get_block_ids(rid))

        return self._sched.build_meta(dict(scheduler_output.num_scheduled_tokens),
                                      list(scheduler_output.preempted_req_ids or ()), pages,
                                      group_pages if self.groups.grouped else None)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(set(connector_output.finished_recving or ()),
                                            set(connector_output.invalid_block_ids or ()),
                                            set(getattr(connector_output, "failed_recving",
                                                        None) or ()))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: once per request, every group's pages (the saves already hold
        what they need: the pages they read were copied in the step that computed them)."""
        assert self._sched is not None
        return self._sched.request_finished(request), None

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def _meta(self) -> KVShareMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVShareMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its load is done

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
                      ) -> None:
        return  # blocks are saved whole after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.submit_saves(meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVShareMetadata):
            self._worker.wait_preempted(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sending, recving = self._worker.finished(finished_req_ids, self._meta())
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished`` plus, with several KV-cache groups, the requests whose load
        failed (``failed_recving``: vLLM recomputes them; page ids are only unique within a
        group, so vLLM takes no invalid page ids from such an engine)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()
