"""Relay bytes both ways between two connected non-blocking sockets.

The relay is driven by readiness callbacks, not by tasks: an idle tunnel
costs two registered file descriptors and one small object, no coroutine
frames and no buffers. Each direction reads a chunk, writes what the other
side accepts, and while a remainder is pending it stops reading (backpressure:
a slow reader slows the writer, memory stays bounded by one chunk per
direction). An EOF in one direction is passed on as a half-close
(``shutdown(SHUT_WR)``), so protocols that half-close keep working; the tunnel
ends when both directions have ended, on any error, or after
``idle_timeout_s`` with no byte in either direction.
"""

from __future__ import annotations

import asyncio
import socket
import time

# One read's worth per direction: large enough that a bulk transfer is a few
# syscalls per MiB, small enough that a stalled direction holds little memory.
CHUNK = 256 * 1024


class _Direction:
    __slots__ = ("src", "dst", "pending", "done", "count")

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src = src
        self.dst = dst
        self.pending: memoryview | None = None
        self.done = False
        self.count = 0


class Tunnel:
    """A running relay; ``await tunnel.wait()`` until it has ended."""

    def __init__(
        self,
        client: socket.socket,
        upstream: socket.socket,
        *,
        idle_timeout_s: float,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._up = _Direction(client, upstream)
        self._down = _Direction(upstream, client)
        self._idle_timeout_s = idle_timeout_s
        self._last = time.monotonic()
        self._ended: asyncio.Future[None] = self._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self.error: OSError | None = None
        self.idle_expired = False

    @property
    def bytes_up(self) -> int:
        return self._up.count

    @property
    def bytes_down(self) -> int:
        return self._down.count

    def start(self, first_up: bytes = b"", first_down: bytes = b"") -> None:
        """Begin relaying; ``first_up``/``first_down`` are bytes already read."""
        for direction, data in ((self._up, first_up), (self._down, first_down)):
            if data:
                self._write(direction, memoryview(data))
            elif not direction.done:
                self._loop.add_reader(direction.src.fileno(), self._on_readable, direction)
        self._timer = self._loop.call_later(self._idle_timeout_s, self._check_idle)

    async def wait(self) -> None:
        try:
            await asyncio.shield(self._ended)
        except asyncio.CancelledError:
            self.close()
            raise

    def close(self) -> None:
        """End the tunnel now (shutdown, cancellation); idempotent."""
        if self._ended.done():
            return
        for fd in {self._up.src.fileno(), self._down.src.fileno()}:
            if fd >= 0:
                self._loop.remove_reader(fd)
                self._loop.remove_writer(fd)
        if self._timer is not None:
            self._timer.cancel()
        self._ended.set_result(None)

    def _on_readable(self, d: _Direction) -> None:
        try:
            data = d.src.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        if not data:
            self._loop.remove_reader(d.src.fileno())
            self._end_direction(d)
            return
        self._last = time.monotonic()
        self._write(d, memoryview(data))

    def _write(self, d: _Direction, view: memoryview) -> None:
        try:
            sent = d.dst.send(view)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._fail(exc)
            return
        d.count += sent
        if sent == len(view):
            d.pending = None
            self._loop.add_reader(d.src.fileno(), self._on_readable, d)
            return
        # The other side is slower: stop reading until it has taken the rest.
        d.pending = view[sent:]
        self._loop.remove_reader(d.src.fileno())
        self._loop.add_writer(d.dst.fileno(), self._on_writable, d)

    def _on_writable(self, d: _Direction) -> None:
        assert d.pending is not None
        try:
            sent = d.dst.send(d.pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        d.count += sent
        self._last = time.monotonic()
        if sent < len(d.pending):
            d.pending = d.pending[sent:]
            return
        d.pending = None
        self._loop.remove_writer(d.dst.fileno())
        self._loop.add_reader(d.src.fileno(), self._on_readable, d)

    def _end_direction(self, d: _Direction) -> None:
        d.done = True
        try:
            d.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the peer is already gone; the other direction will notice
        if self._up.done and self._down.done:
            self.close()

    def _fail(self, exc: OSError) -> None:
        self.error = exc
        self.close()

    def _check_idle(self) -> None:
        idle = time.monotonic() - self._last
        if idle >= self._idle_timeout_s:
            self.idle_expired = True
            self.close()
        else:
            self._timer = self._loop.call_later(self._idle_timeout_s - idle, self._check_idle)
