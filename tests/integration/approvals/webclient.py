"""A browser's requests to the approvals page, over real sockets: sign in, read the page, post forms, read events."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp

TOKEN = "test-token"


class PageClient:
    """One browser: a cookie jar, the page's origin and path, the CSRF token read from the page.

    Paths not starting with ``/`` are the page's own (under ``prefix``, its
    random ``/web/…``); ``local_address``: the source address to connect from.
    """

    def __init__(self, base: str, prefix: str = "/web", *, local_address: str | None = None) -> None:
        self.base = base
        self.prefix = prefix
        connector = aiohttp.TCPConnector(local_addr=(local_address, 0)) if local_address else None
        # unsafe: a cookie jar keeps cookies of IP-address hosts only when told to (127.0.0.1 is one).
        self.http = aiohttp.ClientSession(
            trust_env=False, cookie_jar=aiohttp.CookieJar(unsafe=True), connector=connector
        )
        self.csrf: str | None = None

    def url(self, path: str = "") -> str:
        """The address of ``path``: the page's own (``answer``) unless it starts with ``/``."""
        return self.base + (path if path.startswith("/") else f"{self.prefix}/{path}")

    async def close(self) -> None:
        await self.http.close()

    async def __aenter__(self) -> PageClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def get(self, path: str = "", headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
        async with self.http.get(self.url(path), headers=headers or {}, allow_redirects=False) as resp:
            text = await resp.text()
            found = re.search(r'<meta name="csrf" content="([^"]+)">', text)
            if found:
                self.csrf = found.group(1)
            return resp.status, resp.headers, text

    async def post(
        self, path: str, form: dict[str, str], *, origin: str | None = "", headers: dict[str, str] | None = None
    ) -> tuple[int, Any, str]:
        sent = dict(headers or {})
        if origin is not None:
            sent["Origin"] = origin or self.base
        async with self.http.post(self.url(path), data=form, headers=sent, allow_redirects=False) as resp:
            return resp.status, resp.headers, await resp.text()

    async def sign_in(self, token: str = TOKEN, name: str = "alice") -> tuple[int, Any, str]:
        result = await self.post("signin", {"token": token, "name": name})
        await self.get()
        return result

    async def answer(
        self, approval_id: str, decision: str, headers: dict[str, str] | None = None, **form: str
    ) -> tuple[int, Any, str]:
        assert self.csrf is not None
        form = {"csrf": self.csrf, "id": approval_id, "decision": decision, **form}
        return await self.post("answer", form, headers=headers)


class EventReader:
    """The page's event stream (``GET <page>/events``), read event by event."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.seen: list[tuple[str, Any]] = []

    async def next(self, timeout_s: float = 5.0) -> tuple[str, Any]:
        async def one() -> tuple[str, Any]:
            event, data = "message", None
            while True:
                line = (await self.resp.content.readline()).decode()
                if not line:
                    raise AssertionError("the event stream ended")
                line = line.rstrip("\n")
                if line == "":
                    if data is not None:
                        return event, data
                    continue
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    data = json.loads(line.removeprefix("data: "))

        # asyncio.timeout, not wait_for: no inner task, so cancelling the reader ends the read at once.
        async with asyncio.timeout(timeout_s):
            found = await one()
        self.seen.append(found)
        return found

    async def until(self, name: str, timeout_s: float = 5.0) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            event, data = await self.next(max(0.01, deadline - loop.time()))
            if event == name:
                return data
