"""kvshare: cluster-wide KV-cache sharing for LLM inference on Ray.

The library (hashing, layout, tiers, pool, transports, KV conversion, tokenizers, model
identity, the worker SDK and runtime) lives here and imports nothing from the layers above
it: the Ray actors (``actors``; start a deployment with :func:`kvshare.actors.deploy.deploy`) and
routing (``router``). :mod:`kvshare.discovery` names what a deployment registers in Ray, so
an engine process finds it without importing ``actors``.
"""

from __future__ import annotations

__version__ = "0.1.0"
