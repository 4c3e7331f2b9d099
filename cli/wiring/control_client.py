"""One client for egressd's control API, for every command that asks a running egressd.

``egressd pending|allow|deny`` reach it by its ``--control`` setting
(``ControlClient.for_control``: a unix socket or loopback TCP), a Docker run
by URL (``for_url``: its sidecar's published port, or ``--connect``). Either
way the bearer token goes only to an endpoint ``controltoken`` trusts,
checked on each connection before a byte is sent, never through a proxy from
the environment, never after a redirect; every call is bounded in time.
What goes wrong is one ``ControlError`` whose message says why.
"""

from __future__ import annotations

import json
from typing import Any, Self

import aiohttp

from .controltoken import UntrustedEndpoint, connector, url_connector

# The control API answers at once; anything slower means it is not there.
DEFAULT_TIMEOUT_S = 10.0


class ControlError(Exception):
    """The control API could not be asked (untrusted, unreachable) or refused the call."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ControlClient:
    """egressd's control API with its bearer token."""

    def __init__(self, http_connector: aiohttp.BaseConnector, base: str, token: str, *, shown: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:  # fmt: skip
        self.url = base.rstrip("/")
        self._shown = shown  # how the endpoint is named in messages: the setting or URL given
        self._token = token
        # trust_env=False: the control API is local; a proxy from the environment must never see the token.
        self._http = aiohttp.ClientSession(
            connector=http_connector, timeout=aiohttp.ClientTimeout(total=timeout_s), trust_env=False
        )

    @classmethod
    def for_control(cls, control: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Self:
        """The egressd a ``--control`` setting names (``HOST:PORT`` or ``unix:PATH``)."""
        try:
            checked, base = connector(control)
        except UntrustedEndpoint as exc:
            raise ControlError(f"not sending the control token: {exc}") from None
        return cls(checked, base, token, shown=control, timeout_s=timeout_s)

    @classmethod
    def for_url(cls, url: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Self:
        """The egressd at ``url`` (https, or http to a loopback socket that is ours)."""
        try:
            checked = url_connector(url.rstrip("/"))
        except UntrustedEndpoint as exc:
            raise ControlError(f"not sending the control token to {url}: {exc}") from None
        return cls(checked, url, token, shown=url.rstrip("/"), timeout_s=timeout_s)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connections and forget the token (a closed client is never used again)."""
        self._token = ""
        await self._http.close()

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, the JSON body or None): any status; ``ControlError`` only when egressd could not be asked."""
        status, text = await self.request_text(method, path, body)
        try:
            return status, (json.loads(text) if text else None)
        except ValueError:
            return status, None

    async def request_text(self, method: str, path: str, body: Any = None) -> tuple[int, str]:
        """(status, the body as text): for what is not JSON (a run's CA certificate, PEM)."""
        try:
            async with self._http.request(
                method, self.url + path, json=body, headers={"Authorization": f"Bearer {self._token}"},
                allow_redirects=False,  # the token goes to the endpoint checked, and nowhere it points to
            ) as resp:
                text = await resp.text()
        except UntrustedEndpoint as exc:
            raise ControlError(f"not sending the control token to {self._shown}: {exc}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            why = exc or type(exc).__name__
            raise ControlError(f"cannot reach egressd's control API at {self._shown}: {why}") from None
        return resp.status, text

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        """The JSON body of a successful call; ``ControlError`` (with ``status``) for a refusal too."""
        status, data = await self.request(method, path, body)
        if status >= 400:
            error = data.get("error") if isinstance(data, dict) else data
            raise ControlError(f"egressd's control API refused {method} {path}: {status} {error}", status)
        return data
