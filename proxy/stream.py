"""A connection as seen by the listeners: an asyncio protocol with a read buffer.

Why a protocol and not ``loop.sock_recv``: the transport keeps its socket
registered with the event loop for the connection's whole life, so reading
costs no per-call (un)registration, and on uvloop the reads and writes are
done in C. Coroutines wait on the buffer (``fill``, ``read_head``, the
``relay_*`` helpers) while a request head or body is being handled; once a
tunnel is spliced (``tunnel``), bytes go from one transport to the other in
``data_received`` without waking any coroutine.

Flow control both ways: a buffer holding more than ``HIGH_WATER`` unread
bytes pauses reading from that peer, and a peer whose outgoing buffer is
full makes ``send`` wait (``pause_writing``/``resume_writing``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from .http1 import ChunkedScanner, HttpError

# Unread bytes a peer may hold before we stop reading from it: one large
# request head plus some body, and no more.
HIGH_WATER = 256 * 1024


class PeerClosed(Exception):
    """The peer closed or broke the connection; nothing more to say to it."""


class Relay(Protocol):
    """What takes a peer's callbacks while it is set as ``Peer.relay``: a spliced
    tunnel (``tunnel.Tunnel``) or a body being passed on (``_PassOn``)."""

    def forward(self, source: Peer, data: bytes) -> None: ...

    def peer_eof(self, source: Peer) -> None: ...

    def peer_lost(self, source: Peer, exc: Exception | None) -> None: ...

    def pause_from(self, target: Peer) -> None: ...

    def resume_from(self, target: Peer) -> None: ...


class Peer(asyncio.Protocol):
    """One TCP connection (client or upstream) with a read buffer."""

    # Thousands of these are alive at once (two per tunnel): no per-instance dict.
    __slots__ = ("transport", "buf", "eof", "closed", "_on_connect", "_read_waiter", "_write_waiter",
                 "_write_paused", "_read_paused", "relay", "dialled", "pooled")

    def __init__(self, on_connect: Callable[[Peer], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.closed = False
        self._on_connect = on_connect
        self._read_waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._read_paused = False
        # Set while spliced or passing a body on: bytes go straight to the other peer.
        self.relay: Relay | None = None
        # Plain HTTP: the address an upstream peer was dialled at, and the
        # upstream a client connection keeps for its next request.
        self.dialled: str | None = None
        self.pooled: tuple[tuple[str, int], Peer] | None = None

    # -- protocol callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        if self._on_connect is not None:
            self._on_connect(self)

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.forward(self, data)
            return
        self.keep(data)

    def keep(self, data: bytes) -> None:
        """Add ``data`` to the read buffer (pausing the peer past ``HIGH_WATER``) and wake its reader."""
        self.buf += data
        if len(self.buf) > HIGH_WATER and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        if self.relay is not None:
            self.relay.peer_eof(self)
        self._wake_reader()
        return True  # keep our side open: a half-closed peer may still read

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.eof = True
        if self.relay is not None:
            self.relay.peer_lost(self, exc)
        self._wake_reader()
        self._wake_writer()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.relay is not None:
            self.relay.pause_from(self)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.relay is not None:
            self.relay.resume_from(self)
        self._wake_writer()

    # -- what coroutines use -----------------------------------------------------

    @property
    def peername(self) -> Any:
        """The other end's address (a system call, so asked only where it is needed: clients)."""
        return self.transport.get_extra_info("peername") if self.transport is not None else None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def fill(self, deadline: float | None = None) -> bool:
        """Wait for more bytes in the buffer; False at EOF (nothing more will come).

        ``deadline`` (the loop's clock) raises TimeoutError if nothing came by
        then. A timer is armed only when there is something to wait for, and
        it is one loop timer, not an ``asyncio.timeout`` (which costs several
        times more, once or twice per request).
        """
        if self.eof:
            return False
        size = len(self.buf)
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        while len(self.buf) == size and not self.eof:
            loop = asyncio.get_running_loop()
            waiter = self._read_waiter = loop.create_future()
            timer = loop.call_at(deadline, _expire, waiter) if deadline is not None else None
            try:
                await waiter
            finally:
                self._read_waiter = None
                if timer is not None:
                    timer.cancel()
        return len(self.buf) > size

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise PeerClosed("connection closed")
        self.transport.write(data)
        await self.drain()

    async def drain(self) -> None:
        """Wait while our outgoing buffer is over its high-water mark; PeerClosed if the peer went."""
        while self._write_paused and not self.closed:
            self._write_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._write_waiter
            finally:
                self._write_waiter = None
        if self.closed:
            raise PeerClosed("connection closed")

    def take(self, n: int | None = None) -> bytes:
        n = len(self.buf) if n is None else n
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def read_head(self, parse: Callable, max_bytes: int, deadline: float | None = None):  # type: ignore[no-untyped-def]
        """The next head, or None on a clean EOF before any byte of it; TimeoutError past ``deadline``."""
        while True:
            if self.buf:
                parsed = parse(self.buf, max_bytes)
                if parsed is not None:
                    head, used = parsed
                    del self.buf[:used]
                    return head
            if not await self.fill(deadline):
                if self.buf:
                    raise HttpError(400, "connection closed inside a message head")
                return None

    async def relay_exact(self, n: int, dst: Peer, *, head: bytes = b"") -> int:
        """Copy exactly ``n`` body bytes to ``dst``, after ``head`` (sent in the same write when it can be)."""
        left = n
        if head:
            chunk = self.take(min(left, len(self.buf)))
            await dst.send(head + chunk if chunk else head)
            left -= len(chunk)
        while left:
            if not self.buf:
                # Nothing buffered: pass what arrives straight on, from the
                # callbacks, until the body is done or ``dst`` is full.
                left = await self._pass_on(left, dst)
                continue
            chunk = self.take(min(left, len(self.buf)))
            await dst.send(chunk)
            left -= len(chunk)
        return n

    async def _pass_on(self, left: int, dst: Peer) -> int:
        """Write the next of ``left`` body bytes to ``dst`` as they arrive; the bytes still to come.

        Returns once the body is done or ``dst``'s buffer is full (the caller
        then waits for it through ``send``); no coroutine wakes per chunk,
        and a chunk is written as received, never copied into our buffer.
        """
        await dst.drain()
        if self.buf:
            return left  # bytes came while we waited: they go first, from the buffer
        if self.eof:
            raise PeerClosed("peer closed inside a body")
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        passing = _PassOn(dst, left)
        self.relay = passing
        try:
            await passing.done
        finally:
            self.relay = None
        return passing.left

    async def relay_chunked(self, dst: Peer, *, error_status: int = 400) -> int:
        """Copy a chunked body unchanged, up to and including its last CRLF.

        ``error_status`` is the status of the HttpError for a malformed body:
        400 when the client sent it, 502 when the upstream did.
        """
        scanner = ChunkedScanner(error_status=error_status)
        total = 0
        while not scanner.done:
            if not self.buf and not await self.fill():
                raise PeerClosed("peer closed inside a chunked body")
            n = scanner.feed(bytes(self.buf))
            await dst.send(self.take(n))
            total += n
        return total

    async def relay_until_eof(self, dst: Peer) -> int:
        total = 0
        while True:
            if self.buf:
                chunk = self.take()
                await dst.send(chunk)
                total += len(chunk)
            if not await self.fill():
                return total

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _wake_reader(self) -> None:
        waiter = self._read_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_writer(self) -> None:
        waiter = self._write_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _PassOn:
    """``Peer._pass_on``'s relay: the source's bytes go to ``dst`` until ``left`` reaches 0 or ``dst`` is full."""

    __slots__ = ("dst", "left", "done")

    def __init__(self, dst: Peer, left: int) -> None:
        self.dst = dst
        self.left = left
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def forward(self, source: Peer, data: bytes) -> None:
        dst = self.dst
        if self.done.done():
            source.keep(data)  # between the end and the coroutine's resumption
            return
        if dst.closed or dst.transport is None:
            source.keep(data)
            self.done.set_exception(PeerClosed("connection closed"))
            return
        if len(data) > self.left:
            # The body ends inside this chunk: the rest is the next message's.
            source.keep(data[self.left :])
            data = data[: self.left]
        dst.transport.write(data)
        self.left -= len(data)
        if dst._write_paused and self.left:
            # Leave the rest in the kernel rather than in our buffer: the
            # coroutine resumes reading once ``dst`` has drained.
            source._read_paused = True
            source.transport.pause_reading()  # type: ignore[union-attr]
        if not self.left or dst._write_paused:
            source.relay = None
            self.done.set_result(None)

    def peer_eof(self, source: Peer) -> None:
        if not self.done.done():
            self.done.set_exception(PeerClosed("peer closed inside a body"))

    def peer_lost(self, source: Peer, exc: Exception | None) -> None:
        self.peer_eof(source)

    def pause_from(self, target: Peer) -> None:
        pass  # the source's own sending; nothing of ours

    def resume_from(self, target: Peer) -> None:
        pass


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
