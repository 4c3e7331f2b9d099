"""``egressd.proxy.net.stream.Peer`` on real loopback sockets: writes, head reads, the read pause, splicing.

Two peers connected over 127.0.0.1 (a port the kernel picks); nothing else listens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from egressd.proxy.core.commands import PeerClosed
from egressd.proxy.net.stream import HIGH_WATER, Peer

HEAD_END = b"\n\n"


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Peer, Peer]]:
    """(ours, theirs): two ends of one loopback TCP connection, each a Peer."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[Peer] = loop.create_future()
    server = await loop.create_server(lambda: Peer(on_connect=accepted.set_result, loop=loop), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, theirs = await loop.create_connection(lambda: Peer(loop=loop), "127.0.0.1", port)
    ours = await asyncio.wait_for(accepted, 5)
    yield ours, theirs
    ours.close()
    theirs.close()
    server.close()
    await server.wait_closed()


def _until_blank_line(buf: bytearray, closed: bool) -> tuple[bytes | None, int]:
    """A toy head parser: everything up to a blank line; at a close, what is left (or None)."""
    end = buf.find(HEAD_END)
    if end >= 0:
        return bytes(buf[:end]), end + len(HEAD_END)
    if closed:
        return (bytes(buf) or None), len(buf)
    return None, 0


async def _drained(peer: Peer, n: int) -> bytes:
    # ``fill`` waits for bytes past those buffered when it starts: awaited in this task, not
    # wrapped in a task of its own (``wait_for``) that bytes could beat to the buffer.
    async with asyncio.timeout(5):
        while len(peer.buf) < n:
            assert await peer.fill()
    return peer.take(n)


async def test_write_sends_at_once_and_asks_for_no_wait_while_there_is_room(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    assert ours.write(b"hello") is False
    assert await _drained(theirs, 5) == b"hello"


async def test_write_asks_for_a_drain_once_the_outgoing_buffer_is_full(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    assert ours.transport is not None and theirs.transport is not None
    theirs.hold_reading()  # nothing is read at their end: the kernel's buffers fill, then ours
    ours.transport.set_write_buffer_limits(high=64 * 1024)
    big = b"x" * (16 * 1024 * 1024)
    assert ours.write(big) is True
    assert ours.backed_up
    theirs.read_again()
    drained = asyncio.ensure_future(ours.drain(asyncio.get_running_loop().time() + 10))
    assert await _drained(theirs, len(big)) == big
    await asyncio.wait_for(drained, 5)
    assert not ours.backed_up


async def test_write_to_a_closed_connection_raises_peer_closed(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    ours.close()
    with pytest.raises(PeerClosed):
        ours.write(b"late")
    theirs.close()
    await asyncio.sleep(0.05)
    assert theirs.closed
    with pytest.raises(PeerClosed):
        theirs.write(b"late")
    with pytest.raises(PeerClosed):
        await theirs.send(b"late")


async def test_read_head_waits_for_a_head_sent_in_pieces_and_leaves_the_rest(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    loop = asyncio.get_running_loop()
    reading = asyncio.ensure_future(ours.read_head(_until_blank_line, loop.time() + 5))
    for piece in (b"GET /", b" x\n", b"\nnext"):
        await asyncio.sleep(0.01)
        assert not reading.done()
        theirs.write(piece)
    assert await asyncio.wait_for(reading, 5) == b"GET / x"
    assert ours.buf == b"next"
    assert ours._read_waiter is None and ours._read_deadline is None  # the wait cleaned up after itself


async def test_read_head_gives_a_head_already_buffered_without_waiting(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    theirs.write(b"one\n\ntwo\n\n")
    assert await asyncio.wait_for(ours.read_head(_until_blank_line), 5) == b"one"
    ours.transport.pause_reading()  # type: ignore[union-attr]  # no new bytes: the second comes from the buffer
    assert await asyncio.wait_for(ours.read_head(_until_blank_line), 5) == b"two"


async def test_read_head_at_the_eof_parses_what_is_left_as_closed(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    theirs.write(b"cut sho")
    assert theirs.transport is not None
    theirs.transport.write_eof()
    assert await asyncio.wait_for(ours.read_head(_until_blank_line), 5) == b"cut sho"
    assert await asyncio.wait_for(ours.read_head(_until_blank_line), 5) is None


async def test_read_head_past_its_deadline_raises_timeout(pair: tuple[Peer, Peer]) -> None:
    ours, _ = pair
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(ours.read_head(_until_blank_line, loop.time() + 0.05), 5)
    assert ours._read_waiter is None


async def test_a_peer_holding_more_than_high_water_stops_reading_until_read_again(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    theirs.write(b"y" * (HIGH_WATER + 1024))
    async with asyncio.timeout(5):
        while not ours._read_paused:
            assert await ours.fill()
    held = len(ours.buf)
    assert held > HIGH_WATER
    await asyncio.sleep(0.05)
    assert len(ours.buf) == held  # paused: nothing more is taken from the kernel
    ours.take()
    await asyncio.wait_for(_drained(ours, HIGH_WATER + 1024 - held), 5)  # fill reads again


class _Collect:
    """A relay that keeps what it is given."""

    def __init__(self) -> None:
        self.got = bytearray()
        self.ended = asyncio.get_running_loop().create_future()

    def forward(self, source: Peer, data: bytes) -> None:
        self.got += data

    def peer_eof(self, source: Peer) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    def peer_lost(self, source: Peer, exc: Exception | None) -> None:
        self.peer_eof(source)

    def pause_from(self, target: Peer) -> None:
        pass

    def resume_from(self, target: Peer) -> None:
        pass


async def test_splice_reads_again_stops_the_read_timer_and_hands_bytes_to_the_relay(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    loop = asyncio.get_running_loop()
    reading = asyncio.ensure_future(ours.read_head(_until_blank_line, loop.time() + 300))
    await asyncio.sleep(0.01)  # waiting, with its deadline's timer armed
    theirs.write(b"head\n\n")
    assert await asyncio.wait_for(reading, 5) == b"head"
    assert ours._timer is not None  # left armed for the next wait
    ours.hold_reading()
    relay = _Collect()
    ours.splice(relay)
    assert ours.relay is relay
    assert ours._timer is None
    assert not ours._read_paused
    theirs.write(b"spliced")
    assert theirs.transport is not None
    theirs.transport.write_eof()
    await asyncio.wait_for(relay.ended, 5)
    assert relay.got == b"spliced"
    assert not ours.buf


async def test_gone_cancels_is_entered_again_by_its_task_each_time_as_on_eof_says(pair: tuple[Peer, Peer]) -> None:
    ours, theirs = pair
    assert theirs.transport is not None
    gone = ours.gone_cancels(on_eof=False)
    with gone:  # a plain HTTP client's FIN: it may still read the answer, so the wait goes on
        theirs.transport.write_eof()
        await asyncio.sleep(0.1)
    assert ours.eof
    gone.on_eof = True  # a CONNECT's: it cannot go on without sending, so it is gone already
    with pytest.raises(PeerClosed), gone:
        pytest.fail("entered after the FIN")
    gone.on_eof = False
    with pytest.raises(PeerClosed), gone:  # the connection lost (here, closed at our end): the wait is cancelled
        ours.close()
        await asyncio.sleep(5)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the cancellation was taken back, not left pending
