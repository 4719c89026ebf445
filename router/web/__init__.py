"""The live cluster page (``/dashboard``) served by the gateway and ``kvshare status --web``."""

from kvshare.router.web.routes import add_web_routes, status_app

__all__ = ["add_web_routes", "status_app"]
