"""The gateway's error answers: OpenAI-style JSON (``{"error": {message, type, param, code}}``),
each counted by status in the router's ``errors`` metric, and the app's exception handlers
that turn every exception into one (never a traceback)."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvshare.router.core.metrics import RouterMetrics

log = logging.getLogger(__name__)


def error(status: int, message: str, etype: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    body = {"error": {"message": message, "type": etype, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class Errors:
    """Error answers, each counted in ``metrics.errors`` by its status."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def fail(self, status: int, message: str, etype: str = "invalid_request_error",
             code: str | None = None) -> JSONResponse:
        """:func:`error`, counted."""
        self.metrics.errors.labels(str(status)).inc()
        return error(status, message, etype, code)

    def busy(self, message: str, code: str, retry_after_s: int) -> JSONResponse:
        """A 429 with ``Retry-After``."""
        answer = self.fail(429, message, "rate_limit_error", code)
        answer.headers["Retry-After"] = str(retry_after_s)
        return answer

    def gone(self) -> None:
        """Count a request whose client went away before its answer (499, no body)."""
        self.metrics.errors.labels("499").inc()

    async def invalid(self, _: Request, exc: RequestValidationError) -> JSONResponse:
        """Handler: a body or parameter FastAPI could not validate (400)."""
        return self.fail(400, f"invalid request: {exc.errors()}")

    async def http_error(self, _: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Handler: Starlette's HTTP errors (404, 405 with its ``Allow``...)."""
        etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        answer = self.fail(exc.status_code, str(exc.detail), etype)
        answer.headers.update(exc.headers or {})  # 405 keeps its Allow
        return answer

    async def crash(self, _: Request, exc: Exception) -> JSONResponse:
        """Handler: any other exception, logged; a 500 naming only its type."""
        log.exception("gateway error")
        return self.fail(500, f"internal gateway error ({type(exc).__name__})", "server_error")
