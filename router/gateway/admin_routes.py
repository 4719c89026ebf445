"""Gateway admin endpoints: ``POST /v1/kvshare/lookup | pin | unpin | prefetch``.

The body names a prefix the way a completion does, ``prompt`` (text or token ids) or
``messages``; the gateway tokenizes and hashes it exactly as routing does, under the caller's
tenant salt (API key), so an operator pins or prefetches what requests of that tenant will
hit. Extra fields: ``ttl_s`` and ``name`` (pin), ``name`` (unpin), ``node`` (prefetch;
``nodes``, a list, narrows pin/unpin), ``deadline_s`` (prefetch). Pin names are scoped by
tenant (holder ``admin:<tenant>/<name>``). ``pin``, ``unpin`` and ``prefetch`` need a key marked
``"admin": true`` (403 otherwise) when the gateway has API keys; ``lookup`` only needs a key. The work is done by :class:`kvshare.actors.admin.ClusterAdmin`
in a thread, so the event loop keeps routing meanwhile. Without a cluster (static workers)
every admin call answers 501.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvshare.router.core.embed import CacheAwareRouter, Tenant
from kvshare.router.gateway.limits import BadRequest, Limits, read_json
from kvshare.router.gateway.requests import AdminRequest, validate

Fail = Callable[..., JSONResponse]
OPS = ("lookup", "pin", "unpin", "prefetch")
PRIVILEGED = ("pin", "unpin", "prefetch")  # need an admin key when the gateway has API keys


async def json_object(request: Request, fail: Fail, limits: Limits) -> dict[str, Any] | JSONResponse:
    """The request body as a JSON object within ``limits`` (size, nesting, no NaN), or the
    4xx answer saying why it is not one (the completion endpoints use it too)."""
    try:
        body = await read_json(request, limits)
    except BadRequest as exc:
        return fail(exc.status, str(exc))
    if not isinstance(body, dict):
        return fail(400, "the request body must be a JSON object")
    return body


def checked_body(model: Any, body: dict[str, Any], limits: Limits, fail: Fail) -> Any:
    """``body`` validated as ``model`` (:func:`kvshare.router.gateway.requests.validate`) or the 400 answer."""
    try:
        return validate(model, body, limits)
    except BadRequest as exc:
        return fail(exc.status, str(exc))


def add_admin_routes(app: FastAPI, router: CacheAwareRouter,
                     tenant_of: Callable[[Request], Tenant | JSONResponse], fail: Fail,
                     admin: Any | None, limits: Limits) -> None:
    """Register the admin endpoints on ``app``; ``admin`` is a ClusterAdmin or None."""

    @app.post("/v1/kvshare/{op}")
    async def kvshare_admin(op: str, request: Request) -> Response:
        if op not in OPS:
            return fail(404, f"unknown admin operation {op!r}: use one of {list(OPS)}",
                        "not_found_error")
        tenant = tenant_of(request)
        if isinstance(tenant, JSONResponse):
            return tenant
        if op in PRIVILEGED and not tenant.admin:
            return fail(403, f"{op} changes what the cluster keeps: use an API key marked "
                        '"admin": true in --api-keys', "permission_error", "not_admin")
        body = await json_object(request, fail, limits)
        if isinstance(body, JSONResponse):
            return body
        checked = checked_body(AdminRequest, body, limits, fail)
        if isinstance(checked, JSONResponse):
            return checked
        if admin is None:
            return fail(501, "kvshare admin operations need the gateway to run against a kvshare "
                        "cluster: start it with --address", "not_implemented", "no_cluster")
        try:
            call = _call(op, body, router, tenant, admin)
        except (ValueError, TypeError) as exc:
            return fail(400, str(exc))
        try:
            result = await asyncio.to_thread(call)
        except (ValueError, KeyError) as exc:
            return fail(400, str(exc).strip("'\""))
        except Exception as exc:  # the cluster did not answer (Ray errors, timeouts)
            return fail(503, f"the kvshare cluster did not answer: {type(exc).__name__}: "
                        f"{str(exc)[:200]}", "service_unavailable", "cluster_unavailable")
        return JSONResponse({"object": f"kvshare.{op}", "namespace": router.config.namespace,
                             "tenant": tenant.name, **result})


def _call(op: str, body: dict[str, Any], router: CacheAwareRouter, tenant: Tenant,
          admin: Any) -> Callable[[], dict[str, Any]]:
    """Validate ``body`` and return the blocking admin call; ValueError for bad input."""
    ns = router.config.namespace
    name = body.get("name")
    nodes = body.get("nodes")
    if nodes is not None and (not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes)):
        raise ValueError("'nodes' must be a list of node ids")
    if op in ("pin", "unpin"):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"'name' (a non-empty string naming the pin) is required for {op}")
        name = f"{tenant.name}/{name}"
    if op == "unpin":
        return lambda: {"name": body["name"], "released": admin.unpin_prefix(ns, name, nodes)}
    if "messages" in body:
        ids = router.tokenize(messages=body["messages"])
    elif "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        ids = router.tokenize(prompt=prompt)
    else:
        raise ValueError(f"'prompt' or 'messages' is required for {op}")
    hashes = router.hashes(ids, tenant)
    if not hashes:
        raise ValueError(f"the prompt has {len(ids)} tokens, fewer than one block "
                         f"({router.config.block_tokens} tokens): nothing to {op}")
    head = {"num_tokens": len(ids), "num_blocks": len(hashes)}
    if op == "lookup":
        return lambda: {**head, "nodes": admin.lookup(ns, hashes)}
    if op == "pin":
        ttl = body.get("ttl_s")
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
            raise ValueError(f"'ttl_s' must be positive seconds, got {ttl!r}")
        return lambda: {**head, "name": body["name"], "ttl_s": ttl,
                        "pinned": admin.pin_prefix(ns, hashes, ttl, name, nodes)}
    node = body.get("node")
    if not isinstance(node, str) or not node:
        raise ValueError("'node' (the node id to prefetch to; `kvshare status` lists them) is required")
    deadline = body.get("deadline_s", 10.0)
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not deadline > 0:
        raise ValueError(f"'deadline_s' must be positive seconds, got {deadline!r}")
    return lambda: {**head, **admin.prefetch(ns, hashes, node, deadline_s=float(deadline))}
