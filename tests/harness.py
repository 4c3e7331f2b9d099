"""Small clients and constants the integration tests share (fixtures are in conftest)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import select
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest

from egressd.audit.query import join_ends
from egressd.cli.wiring.service import EgressService

# --- the addresses of this test session ------------------------------------------------------------
#
# Some listeners need a fixed port: the transparent listeners dial the port a client dialled (443, 80), so
# the TLS origin must be ORIGIN:443 and the leak detectors LEAK:443 and LEAK:80. A fixed address as well
# would make two test sessions on one machine (two worktrees, CI jobs sharing a host) take each other's
# ports. So each session (each pytest process) takes its own /24 inside 127.0.0.0/8, chosen at random once,
# here, and every address and every other spelling of one that the tests use is derived from it.
#
# Chosen from 127.16.1.0 to 127.239.254.0: clear of 127.0.0.0/16 (127.0.0.1, where egressd and the fakes
# listen on ports the kernel picks, the literal 127.0.0.x of hand-written tests, 127.0.1.1 of
# /etc/hosts), of the few 127.N.x.y literals tests name (127.5.6.7, 127.8.9.10, 127.255.0.9) and of the
# loopback broadcast 127.255.255.255; no octet is 0 or 255. egressd itself treats no loopback address
# specially but 127.0.0.1 (its defaults) and its own listeners; its sandboxes use 169.254.40.0/22
# (bubblewrap) and 169.254.64.0/18 (Docker).
# Linux routes all of 127.0.0.0/8 to lo, in every network namespace: nothing to configure.
# EGRESSD_TEST_NET=127.A.B picks the /24 by hand (to rerun a failure on the same addresses).


def session_net(choice: str | None = None) -> IPv4Network:
    """This session's /24: ``choice`` ("127.A.B") if given, else a random one (SystemRandom: a seeded
    ``random``, as some pytest plugins seed it, would give two sessions the same one)."""
    if choice:
        net = IPv4Network(f"{choice.strip()}.0/24")
        a, b = net.network_address.packed[1:3]
        if not (net.subnet_of(IPv4Network("127.0.0.0/8")) and 1 <= a <= 254 and 1 <= b <= 254):
            raise ValueError(f"EGRESSD_TEST_NET={choice}: not 127.A.B with A and B from 1 to 254")
        return net
    rng = random.SystemRandom()
    return IPv4Network(f"127.{rng.randrange(16, 240)}.{rng.randrange(1, 255)}.0/24")


def spellings(address: str) -> dict[str, str]:
    """Other ways to write the IPv4 ``address`` in a URL's or CONNECT's host, as lenient parsers
    (inet_aton, browsers' WHATWG URL) read them, by a name that stays the same from session to session:
    one integer, hex, octal, the short forms, the IPv4-mapped IPv6 forms (bracketed). Each reads back
    as ``address`` (tests/unit/test_harness_addresses.py)."""
    ip = IPv4Address(address)
    value, (a, b, c, d) = int(ip), ip.packed
    mapped_dotted, mapped_hex = mapped(address)
    return {
        "integer": str(value),
        "hex-integer": f"0x{value:08x}",
        "octal-parts": ".".join(f"0{x:o}" if x else "0" for x in (a, b, c, d)),
        "three-parts": f"{a}.{b}.{c << 8 | d}",  # the last part 16 bits
        "two-parts": f"{a}.{b << 16 | c << 8 | d}",  # the last part 24 bits
        "hex-and-decimal-parts": f"0x{a:x}.{b}.{c}.0x{d:x}",
        "mapped-dotted": f"[{mapped_dotted}]",
        "mapped-hex": f"[{mapped_hex}]",
    }


def mapped(address: str) -> tuple[str, str]:
    """``address`` as an IPv4-mapped IPv6 address, two ways: ``::ffff:a.b.c.d`` and ``::ffff:hhhh:hhhh``."""
    value = int(IPv4Address(address))
    return f"::ffff:{address}", f"::ffff:{value >> 16:x}:{value & 0xFFFF:x}"


NET = session_net(os.environ.get("EGRESSD_TEST_NET"))
ORIGIN = str(NET[2])  # the origins: echo, HTTP, and TLS on ORIGIN:443, HTTP on ORIGIN:80
ORIGIN_RANGE = f"{ORIGIN}/32"  # what the tests' --allow-private names: ORIGIN only
LEAK = str(NET[66])  # leak detectors: outside every allowed range; a correct egressd never connects here
# LEAK written every way, for pytest.mark.parametrize (ids by name: the same in every session)
LEAK_SPELLINGS = [pytest.param(LEAK, id="dotted")] + [pytest.param(v, id=k) for k, v in spellings(LEAK).items()]
SANDBOX_FACING = str(NET[43])  # where a transparent listener sits on 443 and egressd's DNS answers
SANDBOX_FACING_CLI = str(NET[44])  # the same for an ``egressd serve`` child

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


async def connect_status(port: int, authority: str) -> int:
    """The status a proxy on 127.0.0.1:``port`` answers ``CONNECT authority`` with (an egressd process's)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        return int(head.split(b" ")[1])
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


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
    transparent = re.search(r"sandbox-facing: (.*)", text)
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


def copy_checkout(copy: Path) -> Path:
    """The checkout's committed and new files (not the ignored: no .venv, no build/) copied to ``copy``:
    what a fresh clone would hold, for a test that installs or builds without writing into the repository."""
    from tests import REPO

    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True, timeout=60)  # fmt: skip
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return copy
