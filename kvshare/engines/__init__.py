"""Reference inference worker(s) built on the kvshare SDK (Hugging Face transformers first).

- :mod:`kvshare.engines.hf`: ``HFEngine`` (prefill from a cached prefix, greedy decode) and
  ``model_keys`` (identity, layout, namespace root, tokenizer without building the model).
- :mod:`kvshare.engines.worker`: ``ReferenceWorker`` = engine + SDK (plan, load, compute the
  rest, store back; faults are counted misses).
- :mod:`kvshare.engines.server`: the OpenAI-compatible HTTP server; ``WorkerServer`` also
  registers with the index and reports load every 100 ms.
- :mod:`kvshare.engines.service`: ``WorkerService``, everything one worker process runs (wrap
  it with ``ray.remote`` to place workers on nodes); ``python -m kvshare.engines`` runs one.
- :mod:`kvshare.engines.kv_convert`, :mod:`~kvshare.engines.tokenizer`,
  :mod:`~kvshare.engines.identity`, :mod:`~kvshare.engines.openai_api`,
  :mod:`~kvshare.engines.cost_cut`: the pieces.

Importing this package imports nothing heavy; import the modules you need.
"""
