"""vLLM's KV events as the worker's gpu tier: the wire format
(:mod:`~kvshare.vllm.events.wire`), pages re-hashed into share blocks
(:mod:`~kvshare.vllm.events.share_blocks`) and the ZMQ consumer that publishes them
(:mod:`~kvshare.vllm.events.consumer`).
"""
