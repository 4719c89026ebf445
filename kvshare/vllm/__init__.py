"""kvshare inside vLLM: the KV connector (``kvshare.vllm.connector``) and a tiny test model.

Nothing here imports vLLM at package import time; ``kvshare.vllm.connector`` does (it is only
loaded by vLLM's ``--kv-transfer-config``).
"""
