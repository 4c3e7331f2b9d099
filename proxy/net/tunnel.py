"""Relay bytes both ways between two connected peers (a spliced tunnel).

Once spliced, each peer's ``data_received`` hands its bytes straight to the
other transport's ``write``: no coroutine wakes per chunk, and on uvloop the
whole path is C. Backpressure: when one side's outgoing buffer passes its
high-water mark (``pause_writing``), we stop reading from the other side
until it drains (``resume_writing``), so memory stays bounded by the
transports' buffers. An EOF in one direction is passed on as a half-close
(``write_eof``), so protocols that half-close keep working; the tunnel ends
when both directions have ended, when either connection is lost, or after
``idle_timeout_s`` with no byte either way.

A tunnel may start with a ``ClientCheck``: while it lasts, the client's
bytes are held (not relayed) and shown to it; it says how many of them may
go on, holds the rest until more arrive, or refuses and ends the tunnel. The
upstream's bytes are relayed as they come, and shown to it first, so it can
say when it is over. Once over (the check says so, or a side half-closes
and the check agrees), what was held goes on and bytes pass with no
inspection. (The listeners check the server name of every TLS ClientHello
until the server has settled the handshake this way, and the host every
plain HTTP request names for as long as the tunnel lasts.)

With ``splice``, once nothing is left to look at (the check is over, no
upload budget counts the bytes) and ``SPLICE_AFTER`` bytes have moved (a
short or idle tunnel is not worth the hand-over), both connections are handed to the kernel
(``kernelrelay``: ``splice(2)``, no byte copied into Python), with the same
counts, back-pressure, half-closes and idle timeout.

A tunnel runs on callbacks alone: no task waits for it. Whoever spliced it
passes ``on_end``, which runs once when it ends, so the thousands of idle
tunnels a build can hold cost two transports, two peers and this object,
not a suspended coroutine chain each.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from egressd.proxy.core.budget import Budget
from egressd.proxy.net.kernelrelay import AVAILABLE, KernelRelay, take
from egressd.proxy.net.stream import Peer

# A checked tunnel goes to the kernel once this much has moved: a short or idle one stays as it is (the
# hand-over costs system calls, and a spliced connection's objects take more memory than it saves).
SPLICE_AFTER = 64 * 1024


class ClientCheck(Protocol):
    """Looks at a tunnel's client bytes (``tunnel.client.buf``, held) before they are relayed."""

    # Whether ``upstream`` is to see the upstream's bytes now (False: relayed with no call).
    wants_upstream: bool

    def client(self, tunnel: Tunnel) -> int | None:
        """How many of the held bytes may go on now (the rest stay held); None: the check is over.

        May end the tunnel (a refusal); what it returns then does not matter.
        """
        ...

    def upstream(self, tunnel: Tunnel, data: bytes) -> bool:
        """The upstream's next bytes, about to be relayed; True: the check is over."""
        ...

    def expired(self, tunnel: Tunnel) -> None:
        """Bytes stayed held for the check's timeout (counted from when holding began)."""
        ...

    def eof(self, tunnel: Tunnel, source: Peer) -> bool:
        """``source`` half-closed; True: the check is over (what is held goes on, then the EOF).

        False: it goes on (what it held of the client's may be dropped: never relayed).
        """
        ...


class Tunnel:
    """A running relay between ``client`` and ``upstream``; ``on_end(tunnel)`` runs once when it ends."""

    __slots__ = ("client", "upstream", "bytes_up", "bytes_down", "_client_eof", "_upstream_eof", "ended",
                 "_on_end", "_timer", "_idle_timeout_s", "last", "_loop", "error", "idle_expired",
                 "_check", "_check_timeout_s", "_check_timer", "budget", "on_over_budget", "held_for_budget",
                 "_unsent", "_kernel", "_kernel_wanted", "spliced")

    def __init__(self, client: Peer, upstream: Peer, *, idle_timeout_s: float,
                 on_end: Callable[[Tunnel], None] | None = None,
                 check: ClientCheck | None = None, check_timeout_s: float = 0.0,
                 loop: asyncio.AbstractEventLoop | None = None, splice: bool = False) -> None:
        self.client = client
        self.upstream = upstream
        self.bytes_up = 0
        self.bytes_down = 0
        self._client_eof = False
        self._upstream_eof = False
        self.ended = False
        self._on_end = on_end
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._idle_timeout_s = idle_timeout_s
        self.last = time.monotonic()
        self.error: Exception | None = None
        self.idle_expired = False
        self._check = check
        self._check_timeout_s = check_timeout_s
        self._check_timer: asyncio.TimerHandle | None = None
        # An upload budget (``budget.Budget``): past it the client is no longer read and
        # ``on_over_budget(tunnel)`` asks; ``release_budget`` reads it again.
        self.budget: Budget | None = None
        self.on_over_budget: Callable[[Tunnel], None] | None = None
        self.held_for_budget = False
        # The client's bytes read but past the budget: sent when the answer lets the run go on. One read
        # at most (the client is not read while held): the budget is never passed, whatever the client does.
        self._unsent = b""
        # splice: once nothing is left to look at, the bytes move in the kernel (``kernelrelay``).
        self._kernel: KernelRelay | None = None
        self._kernel_wanted = splice and AVAILABLE
        self.spliced = False  # handed to the kernel (and still there, or until it ended)

    def start(self) -> None:
        """Begin relaying; bytes already buffered on either side go first (or to the check)."""
        self.client.splice(self)
        self.upstream.splice(self)
        if self.upstream.buf:
            self.forward(self.upstream, self.upstream.take())  # the upstream spoke first
        if self.client.buf and not self.ended:
            if self._check is not None:
                self._look()
            else:
                self.forward(self.client, self.client.take())
        if self.ended:
            return
        for peer in (self.client, self.upstream):
            if peer.closed:
                self.peer_lost(peer, None)
                return
            if peer.eof:
                self.peer_eof(peer)
                if self.ended:
                    return
        self._timer = self._loop.call_later(self._idle_timeout_s, self._check_idle)

    def close(self) -> None:
        """End the tunnel now (shutdown, idle, a peer gone); idempotent. Runs ``on_end`` once."""
        if self.ended:
            return
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._check_timer is not None:
            self._check_timer.cancel()
            self._check_timer = None
        self._check = None
        self.client.relay = None
        self.upstream.relay = None
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            kernel.stop()  # closes both connections (the transports were closed at the hand-over)
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(self)

    # -- called by the peers ------------------------------------------------------

    def forward(self, source: Peer, data: bytes) -> None:
        check = self._check
        if check is not None:
            if source is self.client:
                source.buf += data  # held until the check lets it go
                self.last = time.monotonic()
                self._look()
                if self._kernel_wanted and self._check is None and self.bytes_up + self.bytes_down >= SPLICE_AFTER:
                    self._to_kernel()
                return
            if check.wants_upstream:
                if check.upstream(self, data):
                    self._release()
                elif self.ended:
                    return  # the check refused what the upstream said
        self._send(source, data)
        if self._kernel_wanted and self._check is None and self.bytes_up + self.bytes_down >= SPLICE_AFTER:
            self._to_kernel()

    def _send(self, source: Peer, data: bytes) -> None:
        target = self.upstream if source is self.client else self.client
        if target.closed or target.transport is None:
            return
        if source is self.client:
            budget = self.budget
            if budget is not None:
                if self.held_for_budget:
                    self._unsent += data
                    return
                room = budget.limit - budget.sent
                if len(data) > room:
                    # What fits goes; the rest waits for the answer, and the client is not read meanwhile.
                    room = max(0, room)
                    self._unsent = data[room:]
                    data = data[:room]
                    if data:
                        target.transport.write(data)
                        self.bytes_up += len(data)
                        budget.spend(len(data))
                    self._hold_for_budget()
                    return
                budget.spend(len(data))
            target.transport.write(data)
            self.bytes_up += len(data)
        else:
            target.transport.write(data)
            self.bytes_down += len(data)
        self.last = time.monotonic()

    def _hold_for_budget(self) -> None:
        """At the run's upload budget: stop reading from the client until a person answers."""
        self.held_for_budget = True
        if self.client.transport is not None and not self.client.closed:
            self.client.transport.pause_reading()
        if self.on_over_budget is not None:
            self.on_over_budget(self)

    def release_budget(self) -> None:
        """The run may go on: what waited goes first, then the client is read again (unless its side is over)."""
        self.held_for_budget = False
        unsent, self._unsent = self._unsent, b""
        if unsent:
            self._send(self.client, unsent)
            if self.held_for_budget:  # past the budget again at once: asked again
                return
        if self._client_eof:
            self._forward_eof(self.upstream)  # it came while the last bytes waited
            return
        if not self.ended and self.client.transport is not None and not self.client.closed:
            self.client.transport.resume_reading()

    def peer_eof(self, source: Peer) -> None:
        if self._check is not None and self._check.eof(self, source):
            self._release()  # a half-close ends the check: relay what there is, then the EOF
        if source is self.client:
            self._client_eof = True
            if self.held_for_budget:
                return  # its last bytes wait for the answer: the EOF goes after them (``release_budget``)
            target = self.upstream
        else:
            self._upstream_eof = True
            target = self.client
        self._forward_eof(target)

    def _forward_eof(self, target: Peer) -> None:
        if target.transport is not None and not target.transport.is_closing() and target.transport.can_write_eof():
            target.transport.write_eof()
        if self._client_eof and self._upstream_eof:
            self.close()

    def kernel_ended(self, error: Exception | None) -> None:
        """The kernel relay is done: both ways half-closed (None), or a connection failed."""
        if error is not None:
            self.error = error
        self.close()

    def peer_lost(self, source: Peer, exc: Exception | None) -> None:
        if exc is not None:
            self.error = exc
        self.close()

    def pause_from(self, target: Peer) -> None:
        """``target`` cannot take more for now: stop reading from the other side."""
        source = self.upstream if target is self.client else self.client
        if source.transport is not None and not source.closed:
            source.transport.pause_reading()

    def resume_from(self, target: Peer) -> None:
        source = self.upstream if target is self.client else self.client
        if source is self.client and self.held_for_budget:
            return  # held for a person's answer, not for flow control
        ended = self._client_eof if source is self.client else self._upstream_eof
        if source.transport is not None and not source.closed and not ended:
            source.transport.resume_reading()

    # -- the hand-over to the kernel ------------------------------------------------

    def _to_kernel(self) -> None:
        """Move the bytes in the kernel from now on, if both connections can be handed over now.

        Only two sockets, plain TCP both ways (a TLS client transport cannot be), nothing
        left to count against a budget or to check, both ways still open,
        and nothing waiting in either transport's write buffer; a buffer not
        yet drained is tried again at the next bytes, anything else keeps
        the copying relay for good.
        """
        client, upstream = self.client, self.upstream
        ct, ut = client.transport, upstream.transport
        if (self.ended or self.budget is not None or not client.half_open or ct is None or ut is None
                or client.closed or upstream.closed or client.eof or upstream.eof or self.held_for_budget
                or ct.is_closing() or ut.is_closing()
                or ct.get_extra_info("socket") is None or ut.get_extra_info("socket") is None):  # fmt: skip
            self._kernel_wanted = False  # for good: not two sockets, or no longer both ways open
            return
        if ct.get_write_buffer_size() or ut.get_write_buffer_size():
            return
        self._kernel_wanted = False
        client.relay = None  # the transports' last callbacks (connection_lost) are not the tunnel's
        upstream.relay = None
        client_sock = take(ct)
        try:
            upstream_sock = take(ut)
        except BaseException:
            client_sock.close()
            raise
        self._kernel = KernelRelay(self._loop, self, client_sock, upstream_sock)
        self.spliced = True
        self._kernel.start()

    # -- the client check ------------------------------------------------------

    def look(self) -> None:
        """Show the held client bytes to the check again: what the upstream said may let them go."""
        if self._check is not None and self.client.buf and not self.ended:
            self._look()

    def _look(self) -> None:
        """Show the held bytes to the check; relay what it lets go, and time what it holds."""
        check = self._check
        assert check is not None
        ready = check.client(self)
        if self.ended:
            return
        if ready is None:
            self._release()
            return
        if ready:
            self._send(self.client, self.client.take(ready))
        if not self.client.buf:
            if self._check_timer is not None:
                self._check_timer.cancel()
                self._check_timer = None
        elif self._check_timer is None:
            self._check_timer = self._loop.call_later(self._check_timeout_s, self._check_expired)

    def _release(self) -> None:
        """End the check: what the client sent so far goes upstream, and relaying starts."""
        self._check = None
        if self._check_timer is not None:
            self._check_timer.cancel()
            self._check_timer = None
        if self.client.buf and not self.ended:
            self._send(self.client, self.client.take())

    def _check_expired(self) -> None:
        self._check_timer = None
        check = self._check
        if check is not None and not self.ended:
            check.expired(self)

    def _check_idle(self) -> None:
        idle = time.monotonic() - self.last
        if self.held_for_budget:  # waiting on a person is not idleness: look again a whole timeout later
            self._timer = self._loop.call_later(self._idle_timeout_s, self._check_idle)
        elif idle >= self._idle_timeout_s:
            self.idle_expired = True
            self.close()
        else:
            self._timer = self._loop.call_later(self._idle_timeout_s - idle, self._check_idle)
