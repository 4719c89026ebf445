"""The OpenAI-compatible gateway (FastAPI), from a client's request to a worker's answer:

- ``app``: :func:`create_app`, the FastAPI app whose routes are a ``Gateway``'s methods.
- ``gateway``: ``Gateway``: the caller's tenant and body, admission, routing, sending, and a
  worker's whole answer; ``relay``: a streamed answer, resumed on another worker mid-stream.
- ``upstream``: sending to a worker, and to another while nothing reached the client;
  ``stream_resume``: what a client has of a stream, skipped in the resumed one.
- ``forward``: the body a worker gets, by engine; ``timing``: the TTFT breakdown in the answer.
- ``api_keys``, ``admission``, ``limits``, ``requests``: tenants, requests in flight, bounds on
  a body, and the bodies' models; ``errors``: OpenAI-style error answers.
- ``admin_routes``: ``/v1/kvshare/*``; ``cli``: ``kvshare gateway``; ``sse_stream``: reading
  a worker's server-sent events (for other front ends).
"""

from __future__ import annotations

from kvshare.lazy import lazy_exports

_EXPORTS = {
    "create_app": "kvshare.router.gateway.app",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
