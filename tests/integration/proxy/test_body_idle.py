"""Plain-HTTP bodies have an idle limit: a side that stops sending (or reading)
mid-body cannot hold its connection slot for ever.

Each test sets ``idle_timeout_s`` short and lets a client or an origin (real
sockets on loopback) stall in the middle of a body. egressd must close both
sides within a fraction of a second of the limit, release the connection's
slot (the open-connection gauge and the run's count go back to 0) and note
``end: idle_timeout`` in the audit record, as it does for an idle tunnel. A
body that keeps moving, however slowly, is not cut.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from tests.harness import ORIGIN, connect_via, egress, open_proxy, wait_until

IDLE_S = 0.3


@dataclass
class Origin:
    port: int = 0
    connections: int = 0
    received: bytearray = field(default_factory=bytearray)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # egressd closed its side


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Origin], Awaitable[None]]


@contextlib.asynccontextmanager
async def origin(handler: Handler) -> AsyncIterator[Origin]:
    """An origin on ORIGIN running ``handler``; then it reads to EOF, which sets ``closed``."""
    state = Origin()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            await handler(reader, writer, state)
            while data := await reader.read(65536):
                state.received += data
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            state.closed.set()
            writer.close()

    server = await asyncio.start_server(serve, ORIGIN, 0)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


async def read_head(reader: asyncio.StreamReader, state: Origin) -> None:
    state.received += await reader.readuntil(b"\r\n\r\n")


async def read_to_close(reader: asyncio.StreamReader, limit_s: float = 3.0) -> bytes:
    """Everything until egressd closes the connection; fails if it is still open after ``limit_s``."""
    got = bytearray()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    try:
        while data := await asyncio.wait_for(reader.read(65536), max(0.0, deadline - loop.time())):
            got += data
    except ConnectionError:
        pass
    return bytes(got)


async def assert_released(svc, state: Origin) -> dict:  # type: ignore[no-untyped-def]
    """Both sides closed, the slot given back, the record says why; the record."""
    await asyncio.wait_for(state.closed.wait(), 3)
    await wait_until(lambda: svc.path.recorder.metrics.connections_open == 0, 3)
    assert svc.default_run.open_connections == 0
    await wait_until(lambda: egress(svc), 3)
    record = egress(svc)[-1]
    assert (record["decision"], record.get("end")) == ("allow", "idle_timeout"), record
    return record


# --- the client stops sending its request body ------------------------------------------------


@pytest.mark.parametrize(
    ("framing", "sent"),
    [("Content-Length: 100", b"x" * 40), ("Transfer-Encoding: chunked", b"5\r\nhello\r\n3\r\nab")],
    ids=["content-length", "chunked"],
)
async def test_a_request_body_that_stalls_is_closed_after_the_idle_timeout(make_egressd, framing, sent) -> None:
    async def wait_for_body(reader, writer, state):  # type: ignore[no-untyped-def]
        await read_head(reader, state)

    async with origin(wait_for_body) as state:
        svc = await make_egressd(allow=["origin.test:*"], idle_timeout_s=IDLE_S)
        reader, writer = await open_proxy(svc)
        writer.write(f"POST http://origin.test:{state.port}/up HTTP/1.1\r\n{framing}\r\n\r\n".encode() + sent)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await read_to_close(reader) == b""  # no answer: the request never ended
        assert loop.time() - started >= IDLE_S * 0.9
        writer.close()
        record = await assert_released(svc, state)
        assert state.received.endswith(sent)  # what came was passed on
        assert record["bytes_up"] >= len(sent)


# --- the origin stops sending its response body -------------------------------------------------


RESPONSES = {
    "content-length": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"y" * 40,
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nyyyy\r\n10\r\nyyy",
    "until-close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"y" * 40,
}


@pytest.mark.parametrize("kind", list(RESPONSES))
async def test_a_response_body_that_stalls_is_closed_after_the_idle_timeout(make_egressd, kind) -> None:
    async def answer_part(reader, writer, state):  # type: ignore[no-untyped-def]
        await read_head(reader, state)
        writer.write(RESPONSES[kind])
        await writer.drain()

    async with origin(answer_part) as state:
        svc = await make_egressd(allow=["origin.test:*"], idle_timeout_s=IDLE_S)
        reader, writer = await open_proxy(svc)
        writer.write(f"GET http://origin.test:{state.port}/down HTTP/1.1\r\n\r\n".encode())
        got = await read_to_close(reader)
        writer.close()
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"yyy")
        record = await assert_released(svc, state)
        assert record["status"] == 200 and record["bytes_down"] == len(got)


async def test_a_client_that_stops_reading_a_response_is_closed_after_the_idle_timeout(make_egressd) -> None:
    """Nothing moves when the client reads nothing and every buffer is full: that is idle too."""
    total = 64 << 20

    async def flood(reader, writer, state):  # type: ignore[no-untyped-def]
        await read_head(reader, state)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        chunk = b"z" * (1 << 20)
        for _ in range(total >> 20):
            writer.write(chunk)
            await writer.drain()

    async with origin(flood) as state:
        svc = await make_egressd(allow=["origin.test:*"], idle_timeout_s=IDLE_S)
        reader, writer = await open_proxy(svc)
        writer.transport.pause_reading()
        writer.write(f"GET http://origin.test:{state.port}/big HTTP/1.1\r\n\r\n".encode())
        await assert_released(svc, state)
        writer.close()


# --- a slow body is not an idle one ---------------------------------------------------------------


async def test_a_response_body_that_trickles_slower_than_the_timeout_overall_arrives_whole(make_egressd) -> None:
    pieces = 8

    async def trickle(reader, writer, state):  # type: ignore[no-untyped-def]
        await read_head(reader, state)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (pieces * 10))
        for _ in range(pieces):
            await asyncio.sleep(IDLE_S / 3)
            writer.write(b"t" * 10)
            await writer.drain()

    async with origin(trickle) as state:
        svc = await make_egressd(allow=["origin.test:*"], idle_timeout_s=IDLE_S)
        reader, writer = await open_proxy(svc)
        writer.write(f"GET http://origin.test:{state.port}/slow HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
        got = await read_to_close(reader, 5)
        writer.close()
        assert got.endswith(b"\r\n\r\n" + b"t" * pieces * 10)  # longer than IDLE_S in all, never idle that long
        await wait_until(lambda: egress(svc))
        assert egress(svc)[-1]["end"] == "closed"


async def test_a_request_body_that_trickles_arrives_whole(make_egressd) -> None:
    pieces = 8

    async def take_body(reader, writer, state):  # type: ignore[no-untyped-def]
        await read_head(reader, state)
        state.received += await reader.readexactly(pieces * 10)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with origin(take_body) as state:
        svc = await make_egressd(allow=["origin.test:*"], idle_timeout_s=IDLE_S)
        reader, writer = await open_proxy(svc)
        writer.write(
            f"POST http://origin.test:{state.port}/up HTTP/1.1\r\nContent-Length: {pieces * 10}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        for _ in range(pieces):
            await asyncio.sleep(IDLE_S / 3)
            writer.write(b"u" * 10)
            await writer.drain()
        got = await read_to_close(reader, 5)
        writer.close()
        assert got.endswith(b"\r\n\r\nok") and state.received.endswith(b"u" * pieces * 10)


# --- the tunnel's idle timeout is recorded the same way ------------------------------------------


async def test_an_idle_tunnel_is_recorded_as_ended_by_the_idle_timeout(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"], idle_timeout_s=IDLE_S)
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 3) == b"ping"
    assert await read_to_close(reader) == b""
    writer.close()
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["decision"], record.get("end"), record["bytes_up"]) == ("allow", "idle_timeout", 4)
    await wait_until(lambda: svc.path.recorder.metrics.connections_open == 0)
