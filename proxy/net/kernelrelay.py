"""A tunnel's bytes moved in the kernel: ``splice(2)`` from one socket into a pipe and on into the other.

Once a tunnel has nothing left to look at (its TLS server name is checked,
no upload budget counts it) and has moved ``tunnel.SPLICE_AFTER`` bytes,
``Tunnel`` hands both connections here: their
sockets are taken from the event loop's transports (``take``: a duplicate
of the descriptor, then the transport closed; the connection itself stays
open, as the duplicate still holds it) and each direction is a pair of
``splice`` calls, socket → pipe → socket, with no byte copied into Python.

What the copying relay does, this does too:

- **exact counts**: a byte counts once it has gone into the other socket;
- **back-pressure**: when the other socket takes no more (``EAGAIN``), the
  bytes wait in the pipe, the source is no longer read, and the other
  socket's writability resumes it; memory stays bounded by a pipe per
  direction in flight;
- **half-close**: an EOF is passed on as ``shutdown(SHUT_WR)`` once what came
  before it is through; the tunnel ends when both directions have;
- **idleness**: every move stamps the tunnel's ``last``, which its idle
  timer reads.

Pipes are taken when bytes arrive and given back, empty, when they are
through (``_Pipes``), so an idle tunnel holds none. A failure (a reset, a
broken pipe) ends the tunnel with the error, as a lost connection does.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import time
from typing import Any, Protocol

__all__ = ["AVAILABLE", "KernelRelay", "take"]

# splice(2) is Linux's; elsewhere tunnels copy, as before.
AVAILABLE = hasattr(os, "splice")
_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
# A pipe's capacity, asked for when it is made (F_SETPIPE_SZ; the kernel's pipe-max-size allows 1 MiB to
# anyone by default), and what one splice call moves at most: 16 times the default's 64 KiB, 16 times fewer
# wake-ups per GiB. Where the kernel gives less, a call moves what the pipe holds.
_PIPE_BYTES = 1024 * 1024
_CHUNK = _PIPE_BYTES
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class _Ends(Protocol):
    """What the relay reports to: the tunnel's counts, its clock of the last move, and its end."""

    bytes_up: int
    bytes_down: int
    last: float

    def kernel_ended(self, error: Exception | None) -> None: ...


def take(transport: Any) -> socket.socket:
    """The connection under ``transport``, as a socket of our own; the transport is closed.

    The caller has made sure nothing waits in the transport's write buffer.
    Reading stops first, so no byte is read into the transport that the
    descriptor's reader would not see. Closing the transport closes its own
    descriptor only: the connection stays open while the duplicate holds it
    (no FIN, no reset).
    """
    sock = transport.get_extra_info("socket")
    # A duplicate (non-inheritable, as every descriptor Python makes); the kind given, not asked again.
    ours = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
    transport.pause_reading()
    transport.close()
    return ours


class _Pipes:
    """Empty pipes kept for the next burst: a tunnel holds one only while bytes are in it."""

    def __init__(self, keep: int = 16) -> None:
        self._free: list[tuple[int, int]] = []
        self._keep = keep

    def get(self) -> tuple[int, int]:
        if self._free:
            return self._free.pop()
        pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # EPERM past pipe-max-size, or a user's pipe quota: the default size
            fcntl.fcntl(pipe[1], _F_SETPIPE_SZ, _PIPE_BYTES)
        return pipe

    def put(self, pipe: tuple[int, int]) -> None:
        """Keep an empty pipe for later (or close it when enough are kept)."""
        if len(self._free) < self._keep:
            self._free.append(pipe)
        else:
            os.close(pipe[0])
            os.close(pipe[1])

    def close(self) -> None:
        free, self._free = self._free, []
        for read_end, write_end in free:
            os.close(read_end)
            os.close(write_end)


PIPES = _Pipes()


class _Way:
    """One direction: bytes read from ``src`` go into ``dst``."""

    __slots__ = ("src", "dst", "pipe", "pending", "done", "up")

    def __init__(self, src: int, dst: int, up: bool) -> None:
        self.src = src
        self.dst = dst
        self.pipe: tuple[int, int] | None = None  # (read end, write end), while bytes are in it
        self.pending = 0  # bytes in the pipe, not yet in ``dst``
        self.done = False  # the source's EOF has been passed on
        self.up = up  # client to upstream


class KernelRelay:
    """Both directions of a tunnel, moved by ``splice`` on the loop's readiness callbacks."""

    __slots__ = ("_loop", "_tunnel", "_client", "_upstream", "_ways", "_stopped")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, tunnel: _Ends, client: socket.socket, upstream: socket.socket
    ) -> None:
        self._loop = loop
        self._tunnel = tunnel
        self._client = client
        self._upstream = upstream
        client_fd, upstream_fd = client.fileno(), upstream.fileno()
        self._ways = (_Way(client_fd, upstream_fd, True), _Way(upstream_fd, client_fd, False))
        self._stopped = False

    def start(self) -> None:
        for way in self._ways:
            self._loop.add_reader(way.src, self._readable, way)

    def stop(self) -> None:
        """Stop moving bytes and close both connections; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        loop = self._loop
        for way in self._ways:
            loop.remove_reader(way.src)
            loop.remove_writer(way.src)
            pipe, way.pipe = way.pipe, None
            if pipe is not None:  # bytes still in it: not a pipe to hand to another tunnel
                os.close(pipe[0])
                os.close(pipe[1])
        self._client.close()
        self._upstream.close()

    # -- readiness -----------------------------------------------------------------------------

    def _readable(self, way: _Way) -> None:
        pipe = way.pipe
        if pipe is None:
            pipe = way.pipe = PIPES.get()
        try:
            n = os.splice(way.src, pipe[1], _CHUNK, flags=_FLAGS)
        except BlockingIOError:
            self._give_back(way)
            return
        except OSError as exc:
            self._fail(exc)
            return
        if n == 0:
            self._give_back(way)
            self._eof(way)
            return
        way.pending = n
        self._drain(way)

    def _writable(self, way: _Way) -> None:
        self._loop.remove_writer(way.dst)
        if self._drain(way) and not way.done:
            self._loop.add_reader(way.src, self._readable, way)

    def _drain(self, way: _Way) -> bool:
        """Move what is in the way's pipe into its destination; False: it takes no more for now."""
        pipe = way.pipe
        assert pipe is not None
        while way.pending:
            try:
                moved = os.splice(pipe[0], way.dst, way.pending, flags=_FLAGS)
            except BlockingIOError:
                # The destination is full: stop reading the source until it can take more.
                self._loop.remove_reader(way.src)
                self._loop.add_writer(way.dst, self._writable, way)
                return False
            except OSError as exc:
                self._fail(exc)
                return False
            way.pending -= moved
            tunnel = self._tunnel
            if way.up:
                tunnel.bytes_up += moved
            else:
                tunnel.bytes_down += moved
            tunnel.last = time.monotonic()
        self._give_back(way)
        return True

    def _give_back(self, way: _Way) -> None:
        pipe, way.pipe = way.pipe, None
        if pipe is not None:
            PIPES.put(pipe)

    def _eof(self, way: _Way) -> None:
        """The source said it is done: pass the half-close on; both ways done ends the tunnel."""
        way.done = True
        self._loop.remove_reader(way.src)
        try:
            (self._upstream if way.up else self._client).shutdown(socket.SHUT_WR)
        except OSError as exc:
            if not self._ways[0].done or not self._ways[1].done:
                self._fail(exc)
                return
        if self._ways[0].done and self._ways[1].done:
            self._tunnel.kernel_ended(None)

    def _fail(self, exc: OSError) -> None:
        self._tunnel.kernel_ended(exc)
