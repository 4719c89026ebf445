"""Real HTTP on loopback for tests: an ASGI app served by uvicorn in a thread, and a stub worker
that speaks the OpenAI completions API and registers itself in the cluster index the way the
reference worker does (register, renew every 0.1 s, register again when the index forgot it)."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvshare.engines.server import listening_socket


class Served:
    """``app`` on ``http://127.0.0.1:<free port>`` until :meth:`stop`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.socket = listening_socket("127.0.0.1", 0)  # held: no other process can take it
        self.port = int(self.socket.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"{self.url} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


def serve_app(app: Any) -> Served:
    return Served(app)


def stub_app(name: str) -> FastAPI:
    """Answers ``/v1/completions`` and ``/v1/chat/completions`` with who served and how many
    token ids it was sent."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        ids = (body.get("kvshare") or {}).get("token_ids", [])
        return JSONResponse({"object": "text_completion", "worker": name, "choices": [
            {"index": 0, "text": f"{name}:{len(ids)}", "finish_reason": "stop"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        ids = (body.get("kvshare") or {}).get("token_ids", [])
        return JSONResponse({"object": "chat.completion", "worker": name, "choices": [
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": f"{name}:{len(ids)}"}}]})

    return app


class StubWorker:
    """A :func:`stub_app` served on loopback and registered in the index under ``name``."""

    def __init__(self, name: str, index: Any, namespace: str, node: str) -> None:
        from kvshare.types import NodeId, WorkerId
        from kvshare.workers import WorkerInfo

        self.served = serve_app(stub_app(name))
        self.index = index
        self.info = WorkerInfo(WorkerId(name), NodeId(node), (namespace,), self.served.url)
        self.registrations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._report, daemon=True)
        self._thread.start()

    def _report(self) -> None:
        from kvshare.workers import WorkerLoad

        registered = False
        while not self._stop.wait(0.1):
            try:
                if not registered:
                    self.index.register_worker(self.info)
                    self.registrations += 1
                    registered = True
                load = WorkerLoad(self.info.worker_id, 0, 0, 1000.0, time.time())
                registered = self.index.report_load(load) is not False
            except Exception:
                registered = False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.served.stop()


def wait_idle(index: Any, worker_ids: list[str], since: float, timeout_s: float = 30.0) -> None:
    """Until every worker's load report in ``index`` (an IndexClient) is newer than ``since``
    (wall clock) and shows nothing running, waiting or queued: a routing test's precondition,
    so a report taken while an earlier prefill still ran cannot make its holder look busy."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = index.loads()
        if all((load := loads.get(w)) is not None and load.ts > since and load.running == 0
               and load.waiting == 0 and load.queued_prefill_tokens == 0 for w in worker_ids):
            return
        assert time.monotonic() < deadline, f"workers not idle within {timeout_s} s: {loads}"
        time.sleep(0.1)
