"""Small clients and constants the integration tests share (fixtures are in conftest)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from typing import Any

import pytest

from cli.service import EgressService

ORIGIN = "127.0.0.2"
LEAK = "127.0.0.66"
ORIGIN_RANGE = "127.0.0.2/32"

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, why: str) -> None:
    """Skip on a developer's machine that lacks something; fail in CI, which has it all."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI must provide this: {why}")
    pytest.skip(why)



async def open_proxy(service: EgressService) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = service.proxy_address
    return await asyncio.open_connection(host, port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP/1.1 response with a Content-Length (or until close)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
    elif status == 200 and lines[0].endswith("Connection established"):
        body = b""
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return status, headers, body


async def connect_via(
    service: EgressService, authority: str, extra: str = ""
) -> tuple[int, dict[str, str], bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """Send ``CONNECT authority`` and read the answer."""
    reader, writer = await open_proxy(service)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode())
    await writer.drain()
    status, headers, body = await read_response(reader)
    return status, headers, body, reader, writer


def egress(service: EgressService) -> list[dict[str, Any]]:
    return [r for r in service.audit_records if r.get("event") == "egress"]  # type: ignore[attr-defined]


def have(binary: str) -> bool:
    return shutil.which(binary) is not None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def wait_until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until true; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
