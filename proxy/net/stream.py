"""A connection as seen by the listeners: an asyncio protocol with a read buffer.

Why a protocol and not ``loop.sock_recv``: the transport keeps its socket
registered with the event loop for the connection's whole life, so reading
costs no per-call (un)registration, and on uvloop the reads and writes are
done in C. Coroutines wait on the buffer (``fill``, ``read_head``,
``relay_body``) while a request head or body is being handled; once a
tunnel is spliced (``tunnel``), bytes go from one transport to the other in
``data_received`` without waking any coroutine.

Nothing here knows HTTP: ``read_head`` asks a parser where a head ends, and
``relay_body`` a framer (``exchange``) where a body ends; this module only
moves the bytes they point at.

Flow control both ways: a buffer holding more than ``HIGH_WATER`` unread
bytes pauses reading from that peer, and a peer whose outgoing buffer is
full makes ``send`` wait (``pause_writing``/``resume_writing``).

``relay_body`` takes ``idle_s``: when no byte of the body moves for
that long (the source sends nothing, or the destination takes nothing), they
raise ``IdleTimeout``, saying how many body bytes had gone through.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from egressd.proxy.core.commands import PeerClosed

# Unread bytes a peer may hold before we stop reading from it: one large
# request head plus some body, and no more.
HIGH_WATER = 256 * 1024

H = TypeVar("H")  # a parsed message head (request or response)


class Framing(Protocol):
    """Where a body ends (``exchange.LengthBody``, ``exchange.ChunkedBody``, ``exchange.UntilClose``)."""

    @property
    def done(self) -> bool:
        """The body is through."""

    @property
    def passes_on(self) -> bool:
        """Feeding never fails: bytes may go on from the transport's callbacks."""

    @property
    def ends_at_close(self) -> bool:
        """The peer closing ends the body (else it cuts it short)."""

    def feed(self, data: bytes | bytearray) -> int:
        """How many leading bytes of ``data`` belong to the body."""
        ...


# What ``GoneCancels`` raises with.
GONE = "the client went away while its request was held"


class IdleTimeout(TimeoutError):
    """A body moved no byte for the idle timeout; ``moved`` body bytes had gone through."""

    def __init__(self, moved: int) -> None:
        super().__init__(f"no byte moved for the idle timeout after {moved} body bytes")
        self.moved = moved


class OverAllowance(Exception):
    """A body reached the bytes it was allowed (``relay_body``'s ``allowance``) before its end; ``moved``
    body bytes had gone through, and reading from the source is held until the body is relayed again."""

    def __init__(self, moved: int) -> None:
        super().__init__(f"the body reached its allowance after {moved} bytes")
        self.moved = moved


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
                 "_write_paused", "_read_paused", "relay", "_on_gone", "loop", "_read_deadline", "_timer",
                 "_timer_at", "half_open")

    def __init__(
        self, on_connect: Callable[[Peer], None] | None = None, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """``loop``: the event loop the connection is on, when the caller knows it (else the running one:
        on Python 3.11 every ``asyncio.get_running_loop()`` is a ``getpid`` system call, so it is asked once)."""
        self.loop: asyncio.AbstractEventLoop = loop if loop is not None else asyncio.get_running_loop()
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
        # Set inside ``gone_cancels``: what the peer leaving does to the waiting task.
        self._on_gone: Callable[[bool], None] | None = None
        # ``fill``'s deadline (the loop's clock), and the one timer that enforces it, armed at
        # ``_timer_at`` (at or before the deadline): kept from one wait to the next, so a
        # connection's requests do not each arm and cancel their own (see ``_read_timer``).
        self._read_deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # A peer's FIN leaves our side open (a half-closed peer may still read); not over TLS,
        # which cannot half-close (the runner clears it when it takes over the client's TLS).
        self.half_open = True

    # -- protocol callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        if self._on_connect is not None:
            self._on_connect(self)

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.forward(self, data)
            return
        # ``keep``, inline: every read of a request or response head comes here.
        buf = self.buf
        buf += data
        if len(buf) > HIGH_WATER:
            self.hold_reading()
        waiter = self._read_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def keep(self, data: bytes) -> None:
        """Add ``data`` to the read buffer (pausing the peer past ``HIGH_WATER``) and wake its reader."""
        self.buf += data
        if len(self.buf) > HIGH_WATER:
            self.hold_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        if self._on_gone is not None:
            self._on_gone(False)
        if self.relay is not None:
            self.relay.peer_eof(self)
        if self._read_waiter is not None:
            self._wake_reader()
        return self.half_open  # keep our side open: a half-closed peer may still read

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.eof = True
        if self._timer is not None:
            self.stop_timer()
        if self._on_gone is not None:
            self._on_gone(True)
        if self.relay is not None:
            self.relay.peer_lost(self, exc)
        # Each wake is called only when a coroutine waits: a spliced peer's (most) has none.
        if self._read_waiter is not None:
            self._wake_reader()
        if self._write_waiter is not None:
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

    # -- flow control, for the relays too ------------------------------------------

    @property
    def backed_up(self) -> bool:
        """Our outgoing buffer is past its high-water mark (``pause_writing``): write no more for now."""
        return self._write_paused

    def hold_reading(self) -> None:
        """Stop reading from this peer (its bytes wait in the kernel) until ``read_again``."""
        if not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def read_again(self) -> None:
        """Undo ``hold_reading`` (or the pause past ``HIGH_WATER``), if any."""
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    # -- what coroutines use -----------------------------------------------------

    @property
    def peername(self) -> Any:
        """The other end's address (a system call, so asked only where it is needed: clients)."""
        return self.transport.get_extra_info("peername") if self.transport is not None else None

    def new_peer(self) -> Peer:
        """A new peer on this one's loop: the protocol factory for dialling its upstream."""
        return Peer(loop=self.loop)

    async def fill(self, deadline: float | None = None) -> bool:
        """Wait for more bytes in the buffer; False at EOF (nothing more will come).

        ``deadline`` (the loop's clock) raises TimeoutError if nothing came by
        then. A timer is armed only when there is something to wait for, and
        it is the peer's one loop timer, not an ``asyncio.timeout`` (which
        costs several times more): a wait that ends leaves it armed, and the
        next wait with a later deadline reuses it (``_read_timer``).
        """
        if self.eof:
            return False
        size = len(self.buf)
        while len(self.buf) == size and not self.eof:
            try:
                await self._wait_bytes(deadline)
            finally:
                self._read_waiter = None
                self._read_deadline = None
        return len(self.buf) > size

    def _wait_bytes(self, deadline: float | None) -> asyncio.Future[None]:
        """What a reader awaits for the next bytes (or the EOF); the awaiter clears
        ``_read_waiter`` and ``_read_deadline`` once it resumes."""
        if self._read_paused:
            self.read_again()
        waiter = self._read_waiter = self.loop.create_future()
        if deadline is not None:
            self._read_deadline = deadline
            if self._timer is None or self._timer_at > deadline:
                self._arm(self.loop, deadline)
        return waiter

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(at, self._read_timer)
        self._timer_at = at

    def _read_timer(self) -> None:
        """The timer is due: a wait past its deadline ends with TimeoutError; one with a later deadline re-arms it."""
        self._timer = None
        waiter, deadline = self._read_waiter, self._read_deadline
        if waiter is None or deadline is None or waiter.done():
            return  # no wait under way, or none with a deadline: the next one arms its own
        loop = self.loop
        if loop.time() >= deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(loop, deadline)

    def splice(self, relay: Relay) -> None:
        """From now on ``relay`` takes this peer's callbacks, and no coroutine waits on it again:
        reading resumes (a coroutine may have paused it) and the read timer stops."""
        self.relay = relay
        if self._read_paused:
            self.read_again()
        if self._timer is not None:
            self.stop_timer()

    def stop_timer(self) -> None:
        """Cancel the read timer (the connection is closed or spliced: no ``fill`` will wait again)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def send(self, data: bytes | bytearray | memoryview, deadline: float | None = None) -> None:
        """Write ``data``, then wait while our outgoing buffer is full (TimeoutError past ``deadline``)."""
        if self.write(data):
            await self.drain(deadline)

    def write(self, data: bytes | bytearray | memoryview) -> bool:
        """``send`` without the wait: write ``data`` now (PeerClosed if the connection is closed);
        True when the caller must ``drain`` before going on (our outgoing buffer is full, or the
        peer went: then ``drain`` raises PeerClosed). A plain call, not a coroutine: most writes
        never wait."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            raise PeerClosed("connection closed")
        transport.write(data)
        return self._write_paused or self.closed

    async def drain(self, deadline: float | None = None) -> None:
        """Wait while our outgoing buffer is over its high-water mark; PeerClosed if the peer went.

        ``deadline`` (the loop's clock) raises TimeoutError if the buffer is still full then.
        """
        while self._write_paused and not self.closed:
            loop = self.loop
            waiter = self._write_waiter = loop.create_future()
            timer = loop.call_at(deadline, expire, waiter) if deadline is not None else None
            try:
                await waiter
            finally:
                self._write_waiter = None
                if timer is not None:
                    timer.cancel()
        if self.closed:
            raise PeerClosed("connection closed")

    def gone_cancels(self, *, on_eof: bool) -> GoneCancels:
        """Inside, the peer going away cancels the current task: PeerClosed comes out.

        For a request held while a person is asked: a client that gave up
        stops waiting, and nothing is dialled for it. Going away is the
        connection lost (closed or reset) and, with ``on_eof``, the peer's
        FIN too (a CONNECT cannot go on without sending; a plain HTTP client
        may half-close after its request and still read the answer). A
        cancellation from elsewhere passes through unchanged (counted as
        ``asyncio.timeout`` counts its own).
        """
        return GoneCancels(self, on_eof)

    def take(self, n: int | None = None) -> bytes:
        n = len(self.buf) if n is None else n
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def read_head(
        self, parse: Callable[[bytearray, bool], tuple[H | None, int]], deadline: float | None = None
    ) -> H | None:
        """The next head, or None when the peer closed without one; TimeoutError past ``deadline``.

        ``parse(buf, closed)`` says where the head at the start of the buffer
        ends: ``(head, used)``, or ``(None, used)`` to read more (``used``
        bytes, such as skipped interim heads, are dropped either way);
        ``closed``: nothing more will come, so ``(None, _)`` is the end.
        """
        while True:
            if self.buf or self.eof:
                head, used = parse(self.buf, self.eof)
                if used:
                    del self.buf[:used]
                if head is not None or self.eof:
                    return head
            # ``fill``'s wait, inline (a coroutine less per head): a reader is woken only by new
            # bytes or the EOF, so each turn has something new to parse.
            try:
                await self._wait_bytes(deadline)
            finally:
                self._read_waiter = None
                self._read_deadline = None

    async def relay_body(
        self, body: Framing, dst: Peer, *, head: bytes = b"", idle_s: float | None = None,
        allowance: int | None = None,
    ) -> int:
        """Copy a body to ``dst`` until ``body`` says it is done, after ``head`` (one write when it can be).

        The body bytes moved are returned. This peer closing cuts the body
        short (PeerClosed) unless ``body.ends_at_close``; ``body.feed``'s
        errors come out as they are, after ``head`` has been sent. ``idle_s``:
        IdleTimeout when no byte moves for that long. ``allowance``: at most
        that many body bytes move, then OverAllowance with this peer no longer
        read (call again, with another allowance, to go on: the body's state
        and the bytes not moved are kept).
        """
        moved = 0
        passing: _PassOn | None = None
        try:
            if head:
                try:
                    n = body.feed(self._allowed(allowance)) if self.buf else 0
                except Exception:
                    await dst.send(head, self._deadline(idle_s))
                    raise
                if dst.write(head + self.take(n) if n else head):
                    await dst.drain(self._deadline(idle_s))
                moved += n
            while not body.done:
                if allowance is not None and moved >= allowance:
                    self.hold_reading()
                    raise OverAllowance(moved)
                room = None if allowance is None else allowance - moved
                if not self.buf:
                    if body.passes_on:
                        # Nothing buffered: pass what arrives straight on, from the
                        # callbacks, until the body is done or ``dst`` is full.
                        passing = _PassOn(self.loop, dst, body, idle_s, room)
                        await self._pass_on(passing)
                        moved += passing.moved
                        passing = None
                        continue
                    if not await self.fill(self._deadline(idle_s)):
                        if body.ends_at_close:
                            return moved
                        raise PeerClosed("peer closed inside a body")
                n = body.feed(self.buf if room is None else self._allowed(room))
                if dst.write(self.take(n)):
                    await dst.drain(self._deadline(idle_s))
                moved += n
        except TimeoutError:
            raise IdleTimeout(moved + (passing.moved if passing is not None else 0)) from None
        except OverAllowance:
            raise
        except PeerClosed as exc:
            exc.moved = moved + (passing.moved if passing is not None else 0)
            raise
        return moved

    def _allowed(self, room: int | None) -> bytearray:
        """The buffer, or its first ``room`` bytes (what a body with an allowance may still take)."""
        buf = self.buf
        return buf if room is None or len(buf) <= room else buf[:room]

    async def _pass_on(self, passing: _PassOn) -> None:
        """Write the next bytes of ``passing.body`` to its ``dst`` as they arrive.

        Returns once the body is done or ``dst``'s buffer is full (the caller
        then waits for it through ``send``), ``passing.moved`` the bytes that
        went; no coroutine wakes per chunk, and a chunk is written as
        received, never copied into our buffer.
        """
        await passing.dst.drain(self._deadline(passing.idle_s))
        if self.buf:
            return  # bytes came while we waited: they go first, from the buffer
        if self.eof:
            raise PeerClosed("peer closed inside a body")
        self.read_again()
        self.relay = passing
        passing.start()
        try:
            await passing.done
        finally:
            self.relay = None
            passing.stop()

    def _deadline(self, idle_s: float | None) -> float | None:
        """The loop-clock deadline ``idle_s`` from now (None: no limit)."""
        return None if idle_s is None else self.loop.time() + idle_s

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
    """``Peer._pass_on``'s relay: the source's bytes go to ``dst`` until ``body`` is done or ``dst`` is full.

    With ``idle_s``, one loop timer (not one per chunk) ends it with
    TimeoutError once no byte has come for that long.
    """

    __slots__ = ("dst", "body", "moved", "room", "done", "idle_s", "_last", "_timer", "_loop")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, dst: Peer, body: Framing, idle_s: float | None = None,
        room: int | None = None,
    ) -> None:
        self._loop = loop
        self.dst = dst
        self.body = body
        self.moved = 0
        self.room = room  # body bytes it may still pass on (None: no limit)
        self.idle_s = idle_s
        self.done: asyncio.Future[None] = loop.create_future()
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.idle_s is not None:
            self._last = time.monotonic()
            self._timer = self._loop.call_later(self.idle_s, self._check_idle)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_idle(self) -> None:
        assert self.idle_s is not None
        idle = time.monotonic() - self._last
        if self.done.done():
            self._timer = None
        elif idle >= self.idle_s:
            self._timer = None
            self.done.set_exception(TimeoutError())
        else:
            self._timer = self._loop.call_later(self.idle_s - idle, self._check_idle)

    def forward(self, source: Peer, data: bytes) -> None:
        dst = self.dst
        if self.done.done():
            source.keep(data)  # between the end and the coroutine's resumption
            return
        if dst.closed or dst.transport is None:
            source.keep(data)
            self.done.set_exception(PeerClosed("connection closed"))
            return
        room = self.room
        n = self.body.feed(data if room is None or len(data) <= room - self.moved else data[: room - self.moved])
        if n < len(data):
            # The body ends inside this chunk (the rest is the next message's), or reached its allowance.
            source.keep(data[n:])
            data = data[:n]
        dst.transport.write(data)
        self.moved += n
        if self._timer is not None:
            self._last = time.monotonic()
        done = self.body.done
        backed_up = dst.backed_up or (room is not None and self.moved >= room)
        if backed_up and not done:
            # Leave the rest in the kernel rather than in our buffer: the
            # coroutine resumes reading once ``dst`` has drained.
            source.hold_reading()
        if done or backed_up:
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


class GoneCancels:
    """``Peer.gone_cancels``: a class, not a generator, since every request enters one (half the cost).

    It may be entered again, one ``with`` after another, by the task that entered it first (a
    connection's requests: one object per connection, its task asked for once); ``on_eof`` may
    change between them.
    """

    __slots__ = ("_peer", "on_eof", "_task", "_cancelling", "_fired")

    def __init__(self, peer: Peer, on_eof: bool) -> None:
        self._peer = peer
        self.on_eof = on_eof
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._fired = False

    def __enter__(self) -> None:
        peer = self._peer
        if peer.closed or (self.on_eof and peer.eof):
            raise PeerClosed(GONE)
        task = self._task
        if task is None:
            task = self._task = asyncio.current_task(peer.loop)
            assert task is not None
        self._cancelling = task.cancelling()  # cancellations requested before ours are not ours
        self._fired = False
        peer._on_gone = self._gone

    def _gone(self, lost: bool) -> None:
        task = self._task
        if task is not None and not self._fired and (lost or self.on_eof):
            self._fired = True
            task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._peer._on_gone = None
        if not self._fired or self._task is None:
            return
        # Ours to take back, whether it reached the block or the block ended first.
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise PeerClosed(GONE) from None


def expire(waiter: asyncio.Future[None]) -> None:
    """A wait's deadline came: it ends with TimeoutError (unless it ended already)."""
    if not waiter.done():
        waiter.set_exception(TimeoutError())
