"""Routes served on loopback the way egressd's control server serves them, for the approval tests.

``control_server(routes, sock)`` serves ``routes`` (the broker's and its
channels': ``ApprovalBroker.routes``) on ``sock``, already listening, and
yields its base URL. With ``tokens`` (bearer token → ``Scope``) every route
but a public one needs one of those tokens, and its handler finds the
caller's scope on the request, as behind the real control API's token check
(``egressd.control.api``); without, nothing is checked (enough for the public
webhook callback and Slack endpoint).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from aiohttp import web

from egressd.approvals.control import SCOPE, Scope
from egressd.approvals.interface import Route
from egressd.approvals.webcontrol import CONTROL_VIEW, ControlView


def _token_check(tokens: Mapping[str, Scope], public: set[str]) -> Callable[..., object]:
    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], object]) -> web.StreamResponse:
        if request.path not in public:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            scope = tokens.get(given.strip()) if scheme.lower() == "bearer" else None
            if scope is None:
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
            request[SCOPE] = scope
        return await handler(request)  # type: ignore[misc,no-any-return]

    return check


@asynccontextmanager
async def control_server(
    routes: Callable[[], Sequence[Route]],
    sock: socket.socket,
    *,
    tokens: Mapping[str, Scope] | None = None,
    view: ControlView | None = None,
) -> AsyncIterator[str]:
    """Serve routes on ``sock`` (already listening) the way the control API would; yields the base URL.

    ``view``: what the approvals page reads of the control server (its sign-in, runs, egress records).
    """
    served = list(routes())
    public = {route.path for route in served if route.public}
    app = web.Application(middlewares=[_token_check(tokens, public)] if tokens is not None else [])
    if view is not None:
        app[CONTROL_VIEW] = view
    for route in served:
        app.router.add_route(route.method, route.path, route.handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()
