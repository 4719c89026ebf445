"""Reference inference worker(s) built on the kvshare SDK (Hugging Face transformers first).

- :mod:`kvshare.engines.hf`: ``HFEngine`` (prefill from a cached prefix, greedy decode) and
  ``model_keys`` (identity, layout, namespace root, tokenizer without building the model).
- :mod:`kvshare.engines.worker`: ``ReferenceWorker`` = engine + SDK (plan, load, compute the
  rest, store back; faults are counted misses).
- :mod:`kvshare.engines.server`: the OpenAI-compatible HTTP server; ``WorkerServer`` also
  registers with the index and reports load every 100 ms.
- :mod:`kvshare.engines.service`: ``WorkerService``, everything one worker process runs (wrap
  it with ``ray.remote`` to place workers on nodes); ``python -m kvshare.engines`` runs one.
- :mod:`kvshare.engines.runtime`: ``WorkerRuntime`` (admission and hash check, load
  tracking, finish reasons), ``LoadReporter`` (register + load reports) and ``choose_cut``,
  shared by the HTTP server and the Ray Serve deployment (:mod:`kvshare.router.serve.app`).
- :mod:`~kvshare.engines.openai_api`: the OpenAI request parsing. The cut policy is the
  library's :mod:`kvshare.cost_cut`.

This package sits on top of the SDK like any other engine: KV conversion
(:mod:`kvshare.kv_convert`), tokenizers (:mod:`kvshare.tokenizer`) and model identity
(:mod:`kvshare.identity`) are the library's.

Importing this package imports nothing heavy; import the modules you need.
"""
