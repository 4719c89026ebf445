"""A vLLM server in a kvshare cluster: launching it (:mod:`~kvshare.vllm.server.launch`), reading its
load (:mod:`~kvshare.vllm.server.load`), registering it (:mod:`~kvshare.vllm.server.presence`),
the whole worker (:mod:`~kvshare.vllm.server.worker`) and an in-process engine
(:mod:`~kvshare.vllm.server.offline`).
"""
