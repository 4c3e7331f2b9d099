"""Small clients and constants the integration tests share (fixtures are in conftest)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egressd.audit.query import join_ends
from egressd.cli.wiring.service import EgressService

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
    """The attempts that have finished, one record each: an allowed connection's
    write-ahead ``egress`` record joined with its ``egress.end`` (as ``egressd audit``
    shows them); one still open is left out. test_write_ahead.py checks the raw pair."""
    records = join_ends(service.audit_records)  # type: ignore[attr-defined]
    return [r for r in records if r.get("event") == "egress" and r.get("end") != "open"]


def have(binary: str) -> bool:
    return shutil.which(binary) is not None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listened on a moment ago: only for a refused connection, never to bind later (a race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port where a connection is refused for as long as the block lasts: bound, never listening.

    Held, not merely seen free: nobody else can start listening there meanwhile.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        yield int(sock.getsockname()[1])


def listening_socket(host: str = "127.0.0.1", *, freebind: bool = False) -> socket.socket:
    """A TCP socket bound to a port the kernel chose and listening now: hand it to the server, never its number.

    ``freebind``: ``host`` need not be configured yet (IP_FREEBIND), e.g. the gateway of a Docker network
    made later; connections arrive once the address exists, and the port is ours meanwhile.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if freebind:
        sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_FREEBIND", 15), 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def serve_ports(text: str) -> dict[str, int] | None:
    """The ports ``egressd serve`` says it bound, from its stderr; None until its "serving:" line is whole.

    Keys: ``proxy``, ``control`` (when on TCP), and ``dns``, ``tls``, ``http`` for the transparent listeners.
    """
    text = text[: text.rfind("\n") + 1]  # a line still being written is not read
    serving = re.search(r"serving: proxy (\S+), control (\S+?),", text)
    if serving is None:
        return None
    ports = {"proxy": int(serving[1].rsplit(":", 1)[1])}
    if serving[2].startswith("http"):
        ports["control"] = int(serving[2].rsplit(":", 1)[1])
    transparent = re.search(r"transparent: (.*)", text)
    for part in transparent[1].split(", ") if transparent else ():
        name, address = part.split(" ")
        ports[name] = int(address.rsplit(":", 1)[1])
    return ports


def wait_serve_ports(proc: subprocess.Popen, timeout_s: float = 15.0) -> dict[str, int]:  # type: ignore[type-arg]
    """Read an ``egressd serve`` child's stderr pipe until it reports its bound ports (bounded wait)."""
    assert proc.stderr is not None
    fd, seen = proc.stderr.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while (ports := serve_ports(seen.decode(errors="replace"))) is None:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"egressd did not report its ports in time: {seen.decode(errors='replace')}")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise AssertionError(f"egressd exited before serving: {seen.decode(errors='replace')}")
        seen += chunk
    return ports


def wait_serve_ports_in(path: Path, proc: subprocess.Popen, timeout_s: float = 15.0) -> dict[str, int]:  # type: ignore[type-arg]
    """The same for a child whose stderr goes to the file ``path``."""
    deadline = time.monotonic() + timeout_s
    while (ports := serve_ports(path.read_text(errors="replace") if path.exists() else "")) is None:
        assert proc.poll() is None, f"egressd exited before serving: {path.read_text(errors='replace')}"
        assert time.monotonic() < deadline, f"egressd did not report its ports in time: {path.read_text()}"
        time.sleep(0.02)
    return ports


async def aserve_ports(
    stderr: asyncio.StreamReader, timeout_s: float = 15.0, *, read: list[str] | None = None
) -> dict[str, int]:
    """The same for an asyncio child's stderr pipe: read lines until the "serving:" one (appended to ``read``)."""
    seen = ""

    async def lines() -> dict[str, int]:
        nonlocal seen
        while (ports := serve_ports(seen)) is None:
            line = await stderr.readline()
            if not line:
                raise AssertionError(f"egressd exited before serving: {seen}")
            seen += line.decode(errors="replace")
        return ports

    try:
        return await asyncio.wait_for(lines(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"egressd did not report its ports in time: {seen}") from None
    finally:
        if read is not None:
            read.append(seen)


async def wait_until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until true; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
