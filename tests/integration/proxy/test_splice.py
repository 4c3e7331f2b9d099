"""Spliced tunnels (issue 30, step 5): once a tunnel's ClientHello is checked, its bytes move in the kernel.

Each behaviour is held to the copying relay's (``--no-splice``): the same
bytes, the same exact counts, back-pressure that keeps the bytes in the
kernel when a client stops reading, half-closes passed on, the idle timeout.
What must never be spliced is not: a tunnel whose plain HTTP is read
request by request, and one an upload budget counts (the budget's and the
request watch's own tests run with splicing on, the default). Pipes are
taken per burst and given back, so idle tunnels hold none and nothing leaks;
a tunnel goes to the kernel only once ``SPLICE_AFTER`` bytes have moved.
"""

from __future__ import annotations

import asyncio
import os
import struct

import pytest

from egressd.proxy.net import kernelrelay
from egressd.proxy.net.tunnel import SPLICE_AFTER
from egressd.vocabulary.reasons import Answer
from tests.conftest import Listener, _start
from tests.fakes.hellos import client_hello, server_hello
from tests.harness import ORIGIN, connect_via, egress, wait_until

pytestmark = pytest.mark.skipif(not kernelrelay.AVAILABLE, reason="splice(2) is Linux's")

SPLICE = [pytest.param(True, id="spliced"), pytest.param(False, id="copied")]


async def _read_record(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(5)
    return header + await reader.readexactly(struct.unpack("!H", header[3:5])[0])


class TlsOrigin:
    """Reads a ClientHello record, answers a ServerHello, then does what the test asks."""

    def __init__(self) -> None:
        self.listener = Listener(ORIGIN)
        self.hello = server_hello()
        self.after: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.done: asyncio.Future[None] | None = None

    async def start(self) -> TlsOrigin:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_record(reader)
            writer.write(self.hello)
            await writer.drain()
            done = asyncio.get_running_loop().create_future()
            await self.after.put((reader, writer))
            self.done = done
            await done  # the test drives the connection; it ends when the test says

        await _start(self.listener, handler)
        return self

    async def close(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)
        assert self.listener.server is not None
        self.listener.server.close()
        await self.listener.server.wait_closed()


@pytest.fixture
async def tls_origin() -> TlsOrigin:
    origin = await TlsOrigin().start()
    yield origin  # type: ignore[misc]
    await origin.close()


async def _tunnel(svc, origin: TlsOrigin, *, warm: bool = True):  # type: ignore[no-untyped-def]
    """A CONNECT through ``svc`` whose ClientHello was checked and ServerHello came back; ``warm``: then
    ``SPLICE_AFTER`` bytes up, what a tunnel moves before it is handed to the kernel. Returns the client's
    and the origin's streams and the bytes sent up so far."""
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{origin.listener.port}")
    assert status == 200
    hello = client_hello("origin.test")
    writer.write(hello)
    await writer.drain()
    assert await asyncio.wait_for(_read_record(reader), 5) == origin.hello
    o_reader, o_writer = await asyncio.wait_for(origin.after.get(), 5)
    sent = len(hello)
    if warm:
        writer.write(b"w" * SPLICE_AFTER)
        await writer.drain()
        await asyncio.wait_for(o_reader.readexactly(SPLICE_AFTER), 5)
        sent += SPLICE_AFTER
    return reader, writer, o_reader, o_writer, sent


def _spliced(svc) -> list[bool]:  # type: ignore[no-untyped-def]
    return [t.spliced for t in svc.proxy.tunnels]


@pytest.mark.parametrize("splice", SPLICE)
async def test_a_checked_tunnel_relays_both_ways_with_exact_counts(make_egressd, tls_origin, splice: bool) -> None:
    svc = await make_egressd(allow=["origin.test:*"], splice=splice)
    reader, writer, o_reader, o_writer, sent_up = await _tunnel(svc, tls_origin)
    assert _spliced(svc) == [splice]
    up, down = os.urandom(3 * 1024 * 1024 + 7), os.urandom(5 * 1024 * 1024 + 3)

    async def origin_side() -> bytes:
        o_writer.write(down)
        await o_writer.drain()
        got = await o_reader.readexactly(len(up))
        o_writer.close()
        return got

    origin_task = asyncio.create_task(origin_side())
    writer.write(up)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(len(down)), 20) == down
    assert await asyncio.wait_for(origin_task, 20) == up
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the origin's close passed on
    writer.close()
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["bytes_up"], record["bytes_down"]) == (sent_up + len(up), len(tls_origin.hello) + len(down))
    assert record["end"] == "closed"
    assert svc.path.recorder.metrics.tunnels_spliced == (1 if splice else 0)


@pytest.mark.parametrize("splice", SPLICE)
async def test_a_client_that_stops_reading_holds_the_origin_back(make_egressd, tls_origin, splice: bool) -> None:
    svc = await make_egressd(allow=["origin.test:*"], splice=splice)
    reader, writer, o_reader, o_writer, _ = await _tunnel(svc, tls_origin)
    total, chunk = 64 * 1024 * 1024, os.urandom(256 * 1024)
    written = 0

    async def flood() -> None:
        nonlocal written
        while written < total:
            o_writer.write(chunk)
            await o_writer.drain()
            written += len(chunk)
        o_writer.close()

    flooding = asyncio.create_task(flood())
    await asyncio.sleep(1.0)  # the client reads nothing meanwhile
    [tunnel] = svc.proxy.tunnels
    held_back = written
    assert held_back < 40 * 1024 * 1024, held_back  # bounded by the sockets' and one pipe's buffers
    assert tunnel.bytes_down <= held_back
    received = 0
    while data := await asyncio.wait_for(reader.read(1 << 20), 20):
        received += len(data)
    await asyncio.wait_for(flooding, 20)
    assert received == total
    writer.close()
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["bytes_down"] == len(tls_origin.hello) + total


@pytest.mark.parametrize("splice", SPLICE)
async def test_a_half_close_is_passed_on_and_the_other_way_still_flows(make_egressd, tls_origin, splice: bool) -> None:
    svc = await make_egressd(allow=["origin.test:*"], splice=splice)
    reader, writer, o_reader, o_writer, _ = await _tunnel(svc, tls_origin)
    writer.write(b"last words")
    writer.write_eof()
    assert await asyncio.wait_for(o_reader.read(), 5) == b"last words"  # then the EOF
    assert _spliced(svc) == [splice]
    o_writer.write(b"a late answer")
    await o_writer.drain()
    o_writer.close()
    assert await asyncio.wait_for(reader.read(), 5) == b"a late answer"
    writer.close()
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["end"] == "closed"


@pytest.mark.parametrize("splice", SPLICE)
async def test_an_idle_spliced_tunnel_times_out(make_egressd, tls_origin, splice: bool) -> None:
    svc = await make_egressd(allow=["origin.test:*"], splice=splice, idle_timeout_s=0.6)
    reader, writer, o_reader, o_writer, _ = await _tunnel(svc, tls_origin)
    writer.write(b"x")
    assert await asyncio.wait_for(o_reader.readexactly(1), 5) == b"x"
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by egressd, nothing having moved for 0.6 s
    assert await asyncio.wait_for(o_reader.read(), 5) == b""
    writer.close()
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["end"] == "idle_timeout"


async def test_a_short_tunnel_stays_with_the_copying_relay(make_egressd, tls_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    reader, writer, o_reader, o_writer, _ = await _tunnel(svc, tls_origin, warm=False)
    writer.write(b"ping")
    assert await asyncio.wait_for(o_reader.readexactly(4), 5) == b"ping"
    o_writer.write(b"pong")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"pong"
    assert _spliced(svc) == [False]  # under SPLICE_AFTER: not worth the hand-over
    writer.write(b"w" * SPLICE_AFTER)
    await asyncio.wait_for(o_reader.readexactly(SPLICE_AFTER), 5)
    assert _spliced(svc) == [True]
    writer.close()
    o_writer.close()


async def test_plain_http_in_a_tunnel_is_never_spliced_and_each_request_is_still_checked(
    make_egressd, echo_origin
) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200
    writer.write(f"GET / HTTP/1.1\r\nHost: origin.test:{echo_origin.port}\r\n\r\n".encode())
    await writer.drain()
    await asyncio.wait_for(reader.readexactly(10), 5)  # the echo of the head's first bytes
    assert _spliced(svc) == [False]
    writer.write(b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n")  # a second request, to another host
    await writer.drain()
    while await asyncio.wait_for(reader.read(65536), 5):
        pass  # refused: the tunnel ends
    writer.close()
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["reason"] == "sni_mismatch"


async def test_idle_spliced_tunnels_hold_no_pipe_and_ended_ones_leak_no_descriptor(make_egressd, tls_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    fds_before = len(os.listdir("/proc/self/fd"))
    for round_ in range(2):
        opened = []
        for _ in range(20):
            reader, writer, o_reader, o_writer, _ = await _tunnel(svc, tls_origin)
            writer.write(b"ping")
            assert await asyncio.wait_for(o_reader.readexactly(4), 5) == b"ping"
            opened.append((writer, o_writer))
        assert _spliced(svc) == [True] * 20
        # Idle, every one of them: no pipe held.
        assert all(way.pipe is None for t in svc.proxy.tunnels for way in t._kernel._ways)
        for writer, o_writer in opened:
            writer.close()
            o_writer.close()
        await wait_until(lambda: not svc.proxy.tunnels)
        if round_ == 0:
            fds_after_first = len(os.listdir("/proc/self/fd"))
    fds_after = len(os.listdir("/proc/self/fd"))
    # The pool keeps a few empty pipes for the next burst; a second round adds nothing.
    assert fds_after - fds_before <= 2 * 16 and fds_after == fds_after_first, (fds_before, fds_after_first, fds_after)


async def test_a_tls_tunnel_an_upload_budget_counts_is_never_spliced_and_is_held_at_the_budget(
    make_egressd, tls_origin
) -> None:
    """The attack: a checked TLS tunnel would move in the kernel, past every count; with a budget it must not."""
    from tests.integration.proxy.test_upload_budget import BUDGET, BUDGET_MB, PAST_EVERY_BUFFER, Reviewer, _write

    reviewer = Reviewer()
    svc = await make_egressd(allow=["origin.test:*"], upload_budget_mb=BUDGET_MB, approver=reviewer)
    reader, writer, o_reader, o_writer, _ = await _tunnel(svc, tls_origin, warm=False)
    assert _spliced(svc) == [False]
    received = [0]

    async def count() -> None:
        while data := await o_reader.read(65536):
            received[0] += len(data)

    counting = asyncio.create_task(count())
    writing = asyncio.ensure_future(_write(writer, b"x" * 16384, PAST_EVERY_BUFFER))
    await wait_until(lambda: len(reviewer.asked) == 1, 10)
    await asyncio.sleep(0.5)
    assert received[0] <= BUDGET + 256 * 1024, received[0]  # nothing more went through while held
    assert not writing.done()
    reviewer.answers.put_nowait(Answer.DENY)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(writing, 10)
    counting.cancel()
    await wait_until(lambda: any(r.get("event") == "egress.end" for r in svc.audit_records))
    (end,) = [r for r in svc.audit_records if r.get("event") == "egress.end"]
    assert end["end"] == "denied" and "upload budget" in end["detail"], end
