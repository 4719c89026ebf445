"""kvshare inside vLLM, by role.

- :mod:`kvshare.vllm.connector`: the KV connector vLLM loads (``--kv-transfer-config``), its
  scheduler and worker sides and settings;
- :mod:`kvshare.vllm.events`: vLLM's KV events re-hashed into share blocks, as the worker's
  gpu tier;
- :mod:`kvshare.vllm.server`: a vLLM server in the cluster (launch, load, registration);
- :mod:`kvshare.vllm.router_hint`: what a kvshare router tells the engine about a request.

Nothing here imports vLLM at package import time; the connector class does, when vLLM loads it.
"""
