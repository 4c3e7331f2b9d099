"""The one TCP listener: accepts clients and serves each in the way its mode says.

egressd listens in four modes (``egressd.proxy.core.modes``): the explicit
proxy, the transparent Host listener, the transparent SNI listener and the
SOCKS5 listener. They
differ only in what the client sends first, how the destination is found,
how a run is attributed and how a refusal is sent, which the ``Mode`` value
says; the conversation that follows from it is ``server.serve_http`` (a
request head), ``transparent.serve_tls`` (a ClientHello) or
``socks.serve_socks`` (a SOCKS5 handshake).

What a client connection holds while it lasts is a ``Held``, released once
by whoever has it last: the listener's task, or the tunnel it was spliced
to (``Held.splice``).

1. the listener's count of open connections (``Metrics.connections_open``):
   from when its task starts to the release;
2. a slot under its run's cap (``Run.open_connections``) while a request
   is decided, dialled and relayed (``Held.slot``);
3. the attempt to record when the connection ends (``Held.attempt``);
4. the upstream connection the HTTP modes keep for the client's next
   request to the same host (``Held.kept``), closed with the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Final

from egressd.proxy.core.modes import IDLE_END, SHUTDOWN_END, ListenerLimits, Mode, Reads
from egressd.proxy.core.reasons import Reason
from egressd.proxy.core.runs import Run, RunRegistry
from egressd.proxy.net.gate import Attempt, Gate, Seen
from egressd.proxy.net.server import serve_http
from egressd.proxy.net.socks import serve_socks
from egressd.proxy.net.stream import Peer, PeerClosed
from egressd.proxy.net.transparent import serve_tls
from egressd.proxy.net.tunnel import ClientCheck, Tunnel

# Module constants: an Enum member's lookup on its class costs ten times a global's (every accept).
_HTTP: Final = Reads.HTTP
_TLS: Final = Reads.TLS


class Listener:
    """Accepts clients on one listening socket and serves each in a task until it is spliced or closed.

    ``mode`` may be replaced before ``start`` (a test's destination port).
    """

    def __init__(self, *, gate: Gate, runs: RunRegistry, limits: ListenerLimits, mode: Mode) -> None:
        self.gate = gate
        self.runs = runs
        self.limits = limits
        self.mode = mode
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # ``start``'s: asked once, not once per client
        self._address: tuple[str, int] | None = None
        # Each client's task while it serves it; the task takes itself out (``Held.release``): a done
        # callback would cost every connection one more call_soon and loop turn.
        self._tasks: dict[Peer, asyncio.Task[None]] = {}
        self._tunnels: set[Tunnel] = set()
        self._all_ended: asyncio.Event | None = None  # while close() waits for the tunnels
        self._cutting = False  # close() is ending what the grace period left open

    @property
    def address(self) -> tuple[str, int]:
        assert self._address is not None, "not started"
        return self._address

    async def start(self, host: str, port: int) -> None:
        loop = self._loop = asyncio.get_running_loop()
        # A partial, not a lambda: the factory runs at every accept, and a partial is called in C.
        self._server = await loop.create_server(
            functools.partial(Peer, self._accepted, loop), host, port, backlog=1024, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()
        self._address = (bound[0], bound[1])

    def _accepted(self, client: Peer) -> None:
        # No TCP_NODELAY here: asyncio and uvloop set it on every TCP transport.
        reads = self.mode.reads  # `is`, not a dict: an Enum's hash is a Python call
        serve = serve_http if reads is _HTTP else serve_tls if reads is _TLS else serve_socks
        loop = self._loop
        assert loop is not None  # set by start(), before any accept
        task = loop.create_task(serve(self, client))
        self._tasks[client] = task

    def hold(self, client: Peer) -> Held:
        """What ``client``'s connection holds, counted open from now: called first by its task.

        Counted when the task runs, not at the accept, so the cap compares the tasks under way.
        """
        return Held(self, client)

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting, give open connections ``grace_s`` to finish, then end them."""
        if self._server is not None:
            self._server.close()  # stop accepting; open connections are ours to end
        if grace_s > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace_s
            if self._tasks:
                await asyncio.wait(set(self._tasks.values()), timeout=grace_s)
            # Spliced tunnels have no task to wait on: the last to end sets this.
            self._all_ended = asyncio.Event()
            if self._tunnels:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_ended.wait(), max(0.0, deadline - loop.time()))
        self._cutting = True
        for tunnel in list(self._tunnels):
            tunnel.close()
        tasks = set(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def finish(self, attempt: Attempt) -> None:
        """``gate.finish``, saying ``shutdown`` for a connection cut when the grace period ran out."""
        if self._cutting and attempt.opened:
            attempt.ends(SHUTDOWN_END)
        self.gate.finish(attempt)


class Held:
    """What one client connection holds (the module docstring's list), each released once.

    The listener's task has it while it serves the client, and ends with
    ``release``; once ``splice`` has handed the connection to a tunnel, the
    tunnel has it, and what the task then calls here does nothing: the
    tunnel's end releases it all.
    """

    __slots__ = ("listener", "client", "attempt", "kept", "_run", "_tunnel", "_released")

    def __init__(self, listener: Listener, client: Peer) -> None:
        self.listener = listener
        self.client = client
        # What to record if the connection ends with it unrecorded: an attempt the gate has
        # (``Gate.finish`` is idempotent), or one seen and not yet refused (recorded with no reason).
        self.attempt: Attempt | Seen | None = None
        # The HTTP modes' kept upstream connection: (host and port, the address dialled, the upstream).
        self.kept: tuple[tuple[str, int], str | None, Peer] | None = None
        self._run: Run | None = None
        self._tunnel: Tunnel | None = None
        self._released = False
        listener.gate.metrics.connections_open += 1

    def slot(self, run: Run) -> Held:
        """``with held.slot(run):`` the request counts against ``run``'s connection cap until the block ends.

        Or until its tunnel does, when the block spliced it. (The ``with`` is this
        object: a generator-based context manager would cost every request twice as much.)
        """
        run.open_connections += 1
        self._run = run
        return self

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        if self._tunnel is None and (run := self._run) is not None:  # the slot, released (inlined: every request)
            self._run = None
            run.open_connections -= 1

    def done(self, attempt: Attempt) -> None:
        """The request is over: record ``attempt`` (unless its tunnel will)."""
        if self._tunnel is None:
            self.attempt = None
            self.listener.finish(attempt)

    def release(self) -> None:
        """The connection is over: record what is left, count it closed, close the client (unless spliced).

        Called last by the client's task, which the listener then stops tracking.
        """
        self.listener._tasks.pop(self.client, None)
        if self._tunnel is None:
            self._release()

    def splice(self, upstream: Peer, attempt: Attempt, check: ClientCheck | None = None) -> None:
        """Hand the decided connection to a tunnel, which relays both ways from now on.

        Returns at once: the caller's coroutine ends, and the tunnel owns the
        client, the upstream, the run's slot and the attempt, which its end
        records and releases. Bytes already buffered on either side go first.
        """
        limits = self.listener.limits
        self.attempt = attempt
        tunnel = self._tunnel = Tunnel(
            self.client,
            upstream,
            idle_timeout_s=limits.idle_timeout_s,
            on_end=self._tunnel_ended,
            check=check,
            check_timeout_s=limits.head_timeout_s,
            loop=self.client.loop,
        )
        self.listener._tunnels.add(tunnel)  # the listener's close() ends it (same module: no call per tunnel)
        tunnel.start()

    async def refuse(self, reason: Reason, detail: str | None, answer: bytes | None) -> None:
        """Refuse what the connection holds: its attempt denied, ``answer`` sent (if any), a ``Seen`` recorded.

        For the modes that read no request head (TLS, SOCKS): an attempt the
        gate has is recorded at ``release``, as ever; one only seen is
        recorded here, once the answer is out.
        """
        current = self.attempt
        if isinstance(current, Attempt):
            current.refuse(reason, detail)
        if answer:
            with contextlib.suppress(PeerClosed):
                await self.client.send(answer)
        if isinstance(current, Seen):
            self.attempt = None
            self.listener.gate.refuse(current, reason, detail)

    def failed(self) -> None:
        """The connection's coroutine failed (a bug, logged by it): what it held is a ``bad_request``."""
        current = self.attempt
        if isinstance(current, Seen):
            self.attempt = None
            self.listener.gate.refuse(current, Reason.BAD_REQUEST)
        elif isinstance(current, Attempt) and not current.decided:
            current.refuse(Reason.BAD_REQUEST)

    def _tunnel_ended(self, tunnel: Tunnel) -> None:
        """Everything the spliced connection's coroutine would have done when it finished."""
        listener = self.listener
        listener._tunnels.discard(tunnel)
        if not listener._tunnels and listener._all_ended is not None:
            listener._all_ended.set()  # the last tunnel close() waited for
        attempt = self.attempt
        assert isinstance(attempt, Attempt)
        attempt.bytes_up += tunnel.bytes_up
        attempt.bytes_down += tunnel.bytes_down
        if tunnel.idle_expired:
            attempt.ends(IDLE_END)
        tunnel.upstream.close()
        self._release()

    def _release_slot(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.open_connections -= 1

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self._release_slot()
        attempt, self.attempt = self.attempt, None
        if isinstance(attempt, Attempt):
            self.listener.finish(attempt)
        elif attempt is not None:
            self.listener.gate.refuse(attempt, None)
        self.listener.gate.metrics.connections_open -= 1
        kept, self.kept = self.kept, None
        if kept is not None:
            kept[2].close()
        self.client.close()
