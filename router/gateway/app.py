"""OpenAI-compatible cache-aware gateway (FastAPI): route with CacheAwareRouter, proxy to workers.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` is
passed through as server-sent events), ``POST /v1/route`` (the decision only, for other
gateways), ``POST /v1/kvshare/lookup|pin|unpin|prefetch`` (admin, :mod:`kvshare.router.gateway.admin_routes`;
``--address`` only), ``GET /dashboard`` (the live page, :mod:`kvshare.router.web`), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). ``kvshare gateway``: :mod:`kvshare.router.gateway.cli`.

The gateway tokenizes once and forwards the body plus ``kvshare: {token_ids, namespace,
hashes_hex, tenant[, cache_salt]}``, so the worker never re-tokenizes. API keys
(``Authorization: Bearer KEY``, :mod:`kvshare.router.gateway.api_keys`) map to tenants; a tenant's salt roots its block hashes, so one
tenant can never be routed by, or hit, another's blocks. With no keys configured every request
is tenant ``default``. Errors are OpenAI-style JSON (``{"error": {message, type, code}}``)
with 4xx codes for bad input, 401 for a bad key, 502/503 when no worker can answer; never a
traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvshare.auth import WorkerAuth
from kvshare.router.core.embed import CacheAwareRouter, Tenant
from kvshare.router.gateway.admin_routes import add_admin_routes
from kvshare.router.gateway.admission import AdmissionConfig
from kvshare.router.gateway.gateway import Gateway
from kvshare.router.gateway.limits import BodyLimit, Limits
from kvshare.router.gateway.requests import (
    AdminRequest,
    ChatRequest,
    CompletionRequest,
    RouteRequest,
    document,
)
from kvshare.router.web import add_web_routes


def create_app(
    router: CacheAwareRouter,
    api_keys: Mapping[str, Tenant] | None = None,
    upstream_timeout_s: float = 300.0,
    admin: Any | None = None,
    limits: Limits | None = None,
    worker_auth: WorkerAuth | None = None,
    admission: AdmissionConfig | None = None,
    no_worker_wait_s: float = 10.0,
) -> FastAPI:
    """The gateway app around ``router``; ``api_keys`` empty = open (tenant ``default``);
    ``admin`` (an :class:`kvshare.actors.admin.ClusterAdmin`) serves ``/v1/kvshare/*`` (501 without);
    ``limits`` bound every request body (:mod:`kvshare.router.gateway.limits`, :mod:`kvshare.router.gateway.requests`);
    ``admission`` bounds requests in flight, in all and per tenant (:mod:`kvshare.router.gateway.admission`).
    A request that finds no worker serving its namespace waits up to ``no_worker_wait_s`` for
    one to appear (workers still starting, a lease that lapsed on a loaded host and is being
    renewed) before its 503, as Ray Serve holds requests while it has no replica.
    ``worker_auth`` (default: the connected cluster's token, if any) signs requests to workers.
    The app's ``state`` has ``router`` and ``admission``."""
    gw = Gateway(router, api_keys, upstream_timeout_s=upstream_timeout_s, limits=limits,
                 worker_auth=worker_auth, admission=admission, no_worker_wait_s=no_worker_wait_s)
    app = FastAPI(title="kvshare gateway", lifespan=gw.lifespan)
    app.state.router = router
    app.state.admission = gw.admission
    app.exception_handler(RequestValidationError)(gw.errors.invalid)
    app.exception_handler(StarletteHTTPException)(gw.errors.http_error)
    app.exception_handler(Exception)(gw.errors.crash)
    # (the order of registration is the order of the OpenAPI spec's paths)
    app.post("/v1/completions")(gw.completions)
    app.post("/v1/chat/completions")(gw.chat_completions)
    app.post("/v1/route")(gw.route)
    add_admin_routes(app, router, gw.tenant_of, gw.errors.fail, admin, gw.limits)
    add_web_routes(app, router, gw.tenant_of, admin)  # GET /dashboard: the live page (router/web)
    app.add_middleware(BodyLimit, max_bytes=gw.limits.max_body_bytes,
                       on_reject=lambda status: gw.metrics.errors.labels(str(status)).inc())
    document(app, {("post", "/v1/completions"): CompletionRequest,
                   ("post", "/v1/chat/completions"): ChatRequest,
                   ("post", "/v1/route"): RouteRequest,
                   ("post", "/v1/kvshare/{op}"): AdminRequest})
    app.get("/v1/models")(gw.models)
    app.get("/health")(gw.health)
    app.get("/metrics")(gw.prom)
    return app
