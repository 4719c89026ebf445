"""kvshare on Ray Serve: reference workers behind an OpenAI API, routed by kvshare.

Run it on a Ray cluster (``kvshare up`` first to size the pools; without it the first replica
deploys kvshare with defaults)::

    serve run examples.serve_app:app          # OpenAI API on http://127.0.0.1:8000/v1

The one line that turns on kvshare routing in a Serve deployment of your own::

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class="kvshare.router.serve:KVShareRequestRouter"))

:func:`kvshare.router.serve.app.build_app` builds the whole application (the ingress that tokenizes
and hashes once, the worker replicas that register with the index and report their load);
``build_app(router="default")`` keeps Serve's power-of-two router (the baseline).
"""

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from kvshare.router.serve.app import build_app  # noqa: E402

app = build_app(
    num_replicas=2,             # one replica per node (max_replicas_per_node=1)
    router="kvshare",           # or "default": Serve's power of two
    namespace="default",        # the kvshare namespace the replicas share
    sharing="global",           # "local": a replica loads only its own node's blocks
    engine={},                  # kvshare.engines.hf.EngineConfig fields (model_path=..., ...)
)
"""``serve run examples.serve_app:app``: two kvshare-routed replicas of the tiny model."""
