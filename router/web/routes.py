"""The live cluster page: ``GET /dashboard`` (one self-contained HTML page) and
``GET /dashboard/state`` (the JSON it polls every second).

One route set for both hosts: the gateway mounts it with :func:`add_web_routes` (cluster,
router and its API keys), and ``kvshare status --web`` serves it alone (:func:`status_app`,
cluster only). The page fetches nothing from the internet: its CSS and script are inline.

Access: the HTML carries no data. ``/dashboard/state`` needs an API key where the host has
keys (``Authorization: Bearer KEY``; the page takes it from ``/dashboard#key=KEY`` or asks,
and keeps it in the tab's sessionStorage); any key sees the cluster and its own tenant's
recent decisions, an ``"admin": true`` key also sees every tenant's decisions and usage.
Cluster snapshots are shared by concurrent viewers for ``refresh_s`` and bounded by
``timeout_s`` per pool, so a dead node is shown as down instead of stalling the page.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from kvshare.router.core.embed import Tenant
from kvshare.router.web.view import (
    NODE_DOWN,
    cluster_view,
    merge_workers,
    router_view,
    tenants_view,
)

PAGE = Path(__file__).with_name("page.html")
FORGET_S = 600.0  # a node that left the cluster is shown down this long, then dropped
TenantOf = Callable[[Request], "Tenant | JSONResponse"]


class ClusterStatus(Protocol):
    """The cluster's status snapshot and node liveness (:class:`kvshare.actors.admin.ClusterAdmin`)."""

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]: ...

    def node_liveness(self) -> dict[str, bool]: ...


def _unavailable(error: str) -> dict[str, Any]:
    return {"available": False, "nodes": [], "index": [], "workers": [], "index_error": "",
            "error": error}


class Snapshots:
    """The latest cluster view for every viewer, never waiting on a slow actor.

    A full status (every pool's and shard's stats) is re-read in the background at most
    every ``refresh_s``; a viewer gets the last one at once (``age_s`` says how old), with
    Ray's node liveness (one cheap GCS call) laid over it, so a node that died is shown
    ``down`` within about ``refresh_s`` even while the status of its pool still times out.
    A node that was seen and then left the status entirely is shown ``down`` for
    ``FORGET_S``.
    """

    def __init__(self, cluster: ClusterStatus | None, refresh_s: float = 0.5,
                 timeout_s: float = 1.0) -> None:
        self.cluster = cluster
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self._view: dict[str, Any] | None = None
        self._read_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._seen: dict[str, tuple[float, dict[str, Any]]] = {}  # node -> (when, entry)

    async def _refresh(self) -> None:
        assert self.cluster is not None
        try:
            st = await asyncio.to_thread(self.cluster.status, timeout_s=self.timeout_s)
            self._view = cluster_view(st)
        except Exception as exc:  # Ray gone: say so on the page, keep serving
            self._view = _unavailable(f"{type(exc).__name__}: {exc}"[:300])
        self._read_at = time.time()

    async def get(self) -> dict[str, Any]:
        if self.cluster is None:
            return _unavailable("no kvshare cluster (static workers)")
        stale = time.time() - self._read_at >= self.refresh_s
        if (self._task is None or self._task.done()) and (stale or self._view is None):
            self._task = asyncio.create_task(self._refresh())
        if self._view is None and self._task is not None:
            await asyncio.shield(self._task)  # the first viewer waits for the first status
        assert self._view is not None
        view = {**self._view, "age_s": max(0.0, time.time() - self._read_at)}
        if not view["available"]:
            return view
        try:
            alive = await asyncio.wait_for(asyncio.to_thread(self.cluster.node_liveness),
                                           self.timeout_s)
        except Exception:  # noqa: BLE001 - no fresher liveness: the status's own flags
            alive = {}
        return self._overlay(view, alive)

    def _overlay(self, view: dict[str, Any], alive: dict[str, bool]) -> dict[str, Any]:
        nodes = []
        for n in view["nodes"]:
            if alive.get(n["node_id"], True) is False and n["state"] != NODE_DOWN:
                n = {**n, "state": NODE_DOWN, "error": "Ray reports the node dead"}
            if n["tiers"]:
                self._seen[n["node_id"]] = (time.time(), n)
            nodes.append(n)
        present = {n["node_id"] for n in nodes}
        cutoff = time.time() - FORGET_S
        self._seen = {nid: seen for nid, seen in self._seen.items() if seen[0] > cutoff}
        for nid, (_, last) in self._seen.items():
            if nid not in present:
                nodes.append({**last, "state": NODE_DOWN, "error": "node left the cluster"})
        down = {n["node_id"] for n in nodes if n["state"] == NODE_DOWN}
        workers = [{**w, "state": NODE_DOWN} if w["node"] in down else w
                   for w in view["workers"]]
        return {**view, "nodes": nodes, "workers": workers}


def add_web_routes(app: FastAPI, router: Any | None, tenant_of: TenantOf,
                   cluster: ClusterStatus | None, title: str = "kvshare") -> None:
    """Register ``/dashboard`` and ``/dashboard/state`` on ``app``; ``router`` (a
    CacheAwareRouter) adds the routing side, ``cluster`` the nodes, index and workers."""
    snapshots = Snapshots(cluster)
    html = PAGE.read_text(encoding="utf-8").replace("{{TITLE}}", title)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return HTMLResponse(html, headers={"cache-control": "no-store"})

    @app.get("/dashboard/state")
    async def dashboard_state(request: Request) -> Response:
        """The page's data (see router/web/view.py); 401 without a valid key."""
        tenant = tenant_of(request)
        if isinstance(tenant, JSONResponse):
            return tenant
        state: dict[str, Any] = {"at": time.time(), "title": title, "tenant": tenant.name,
                                 "admin": tenant.admin, "cluster": await snapshots.get(),
                                 "router": None, "tenants": None}
        if router is not None:
            try:
                infos, loads = await asyncio.wait_for(router.workers.snapshot(), 1.0)
            except Exception as exc:  # index restarting: the status's workers, no loads
                infos, loads = [], {}
                state["cluster"]["index_error"] = (state["cluster"]["index_error"] or
                                                   f"{type(exc).__name__}: {exc}"[:300])
            state["cluster"]["workers"] = merge_workers(
                state["cluster"]["workers"], infos, loads, time.time())
            state["router"] = router_view(router, None if tenant.admin else tenant.name)
            if tenant.admin:
                state["tenants"] = tenants_view(router)
        return JSONResponse(state, headers={"cache-control": "no-store"})


def status_app(cluster: ClusterStatus) -> FastAPI:
    """``kvshare status --web``: the page for the cluster alone (no router, no keys: bind it
    to loopback or put it behind your own access control)."""
    app = FastAPI(title="kvshare status", docs_url=None, redoc_url=None)

    def operator(_: Request) -> Tenant:
        return Tenant(admin=True)

    add_web_routes(app, None, operator, cluster, title="kvshare status")

    @app.get("/")
    async def root() -> Response:
        return HTMLResponse('<meta http-equiv="refresh" content="0; url=/dashboard">')

    return app
