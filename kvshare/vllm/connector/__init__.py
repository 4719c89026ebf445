"""vLLM's KV connector over the kvshare cluster, split by role.

Loaded by vLLM as ``--kv-transfer-config '{"kv_connector": "KVShareConnector",
"kv_connector_module_path": "kvshare.vllm.connector", ...}'``. Importing this package imports
no vLLM; :class:`KVShareConnector` (:mod:`~kvshare.vllm.connector.kv_connector`) does, on first use.
The scheduler side (:mod:`~kvshare.vllm.connector.scheduler_side`) finds and plans; the worker
side (:mod:`~kvshare.vllm.connector.worker_side`) copies between vLLM's pages
(:mod:`~kvshare.vllm.connector.paged`) and the cluster; settings in
:mod:`~kvshare.vllm.connector.config`.
"""

from __future__ import annotations

from kvshare.lazy import lazy_exports

_EXPORTS = {
    "KVShareConnector": "kvshare.vllm.connector.kv_connector",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
