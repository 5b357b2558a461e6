"""The Prefect server app that `ppo serve` runs: Prefect's own, behind a host and origin guard.

Whoever can send the Prefect API a request can make the worker run code (a
flow run's job variables are its command). Prefect checks neither the Host nor
the Origin header, so a web page the user opens could reach a loopback server
through DNS rebinding (its own name, resolving to 127.0.0.1: same origin for
the browser, so CORS does not apply) or post to it cross-site. The guard
refuses, before Prefect sees it, every request whose Host is not one the server
was started for and every request carrying an Origin other than the server's
own. CLI clients and workers send no Origin and the right Host, so they pass.

Run as ``uvicorn --factory flows.prefect_app:create_app`` with the allowed
hosts and origins in ``PPO_SERVE_ALLOWED_HOSTS`` / ``PPO_SERVE_ALLOWED_ORIGINS``
(comma-separated), which ``flows.serve`` sets.
"""

from __future__ import annotations

import os
from typing import Any, Awaitable, Callable

HOSTS_ENV = "PPO_SERVE_ALLOWED_HOSTS"
ORIGINS_ENV = "PPO_SERVE_ALLOWED_ORIGINS"

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


class HostOriginGuard:
    """ASGI middleware: 403 for a foreign Host or Origin header (HTTP and websockets)."""

    def __init__(self, app: ASGIApp, hosts: set[str], origins: set[str]):
        self.app, self.hosts, self.origins = app, {h.lower() for h in hosts}, {o.lower() for o in origins}

    def refusal(self, scope: Scope) -> str | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "").lower()
        if host not in self.hosts:
            return f"host {host!r} is not one this server was started for"
        origin = headers.get("origin")
        if origin is not None and origin.lower() not in self.origins:
            return f"cross-origin request from {origin!r} refused"
        return None

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        reason = self.refusal(scope)
        if reason is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": reason})
            return None
        body = reason.encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return None


def _list(env: str) -> set[str]:
    return {x.strip() for x in os.environ.get(env, "").split(",") if x.strip()}


def create_app() -> HostOriginGuard:
    from prefect.server.api.server import create_app as prefect_app

    hosts, origins = _list(HOSTS_ENV), _list(ORIGINS_ENV)
    if not hosts:
        raise RuntimeError(f"{HOSTS_ENV} is empty: start the server with `ppo serve`")
    return HostOriginGuard(prefect_app(final=True), hosts, origins)
