"""The one TCP listener: accepts clients and runs each one's conversation in a task.

egressd listens in four modes (``egressd.proxy.core.modes``): the explicit
proxy, the transparent Host listener, the transparent SNI listener and the
SOCKS5 listener. They differ only in their way in (``egressd.proxy.core.ways``);
every connection is one conversation (``egressd.proxy.core.conversation``)
that a ``runner.Runner`` executes. The listener keeps the tasks and the
spliced tunnels, so that ``close`` can give them a grace period and then
end them.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket

from egressd.proxy.core.conversation import Listening
from egressd.proxy.core.inspected import InspectedWay
from egressd.proxy.core.modes import ListenerLimits, Mode
from egressd.proxy.core.runs import RunRegistry
from egressd.proxy.core.ways import WAYS
from egressd.proxy.net.runner import EgressPath, Runner
from egressd.proxy.net.stream import Peer
from egressd.proxy.net.tunnel import Tunnel


def twin(own: socket.socket) -> socket.socket:
    """A socket bound where ``own`` is, in its SO_REUSEPORT group (a TCP one not listening yet)."""
    sock = socket.socket(own.family, own.type)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if own.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(own.getsockname())
    except BaseException:
        sock.close()
        raise
    return sock


class Listener:
    """Accepts clients on one listening socket and serves each in a task until it is spliced or closed.

    ``mode`` may be replaced (a test's destination port): from the next accept on.
    """

    def __init__(self, *, path: EgressPath, runs: RunRegistry, limits: ListenerLimits, mode: Mode) -> None:
        self.path = path
        self.runs = runs
        self.limits = limits
        self._mode = mode
        # What every conversation of this listener is given: made once, again when ``mode`` changes.
        self.listening = self._listening()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # ``start``'s: asked once, not once per client
        self._address: tuple[str, int] | None = None
        self._sockets: tuple[socket.socket, ...] = ()  # what ``start`` bound (two for ``localhost``)
        # Each client's task while it serves it; the task takes itself out (``Runner.run``): a done
        # callback would cost every connection one more call_soon and loop turn.
        self.tasks: dict[Peer, asyncio.Task[None]] = {}
        self.tunnels: set[Tunnel] = set()
        self._all_ended: asyncio.Event | None = None  # while close() waits for the tunnels
        self.cutting = False  # close() is ending what the grace period left open

    @property
    def address(self) -> tuple[str, int]:
        assert self._address is not None, "not started"
        return self._address

    def _listening(self) -> Listening:
        """What every conversation of this listener is given: made once, not once per connection."""
        path, mode = self.path, self.mode
        recorder = path.recorder
        return Listening(
            way=WAYS[mode.reads],
            mode=mode,
            limits=self.limits,
            runs=self.runs,
            metrics=recorder.metrics,
            screen=path.screen,
            audit=recorder.audit,
            begin=recorder.begin,
            # Every way in whose tunnels may carry TLS: CONNECT, the transparent TLS listener, SOCKS.
            inspecting=InspectedWay if path.inspector is not None else None,
            secrets=path.secrets,
        )

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        """A new mode (a test's destination port): for the connections accepted from now on."""
        self._mode = mode
        self.listening = self._listening()

    async def start(self, host: str, port: int, *, shared: bool = False) -> None:
        """Listen on host:port; ``shared``: other processes of this egressd will listen there too (SO_REUSEPORT).

        A shared port is first bound alone, as an unshared one is, so a port
        another program (or another egressd) holds is refused all the same.
        """
        loop = self._loop = asyncio.get_running_loop()
        if shared and port != 0:
            probe = await loop.create_server(asyncio.Protocol, host, port, reuse_address=True)
            probe.close()
            await probe.wait_closed()
        # A partial, not a lambda: the factory runs at every accept, and a partial is called in C.
        self._server = await loop.create_server(
            functools.partial(Peer, self._accepted, loop), host, port, backlog=1024, reuse_address=True,
            reuse_port=shared or None,
        )  # fmt: skip
        self._sockets = self._server.sockets
        bound = self._sockets[0].getsockname()
        self._address = (bound[0], bound[1])

    async def start_on(self, sock: socket.socket) -> None:
        """Accept on a listening socket made elsewhere (a worker's, made by the owner: ``group_sockets``)."""
        loop = self._loop = asyncio.get_running_loop()
        self._server = await loop.create_server(functools.partial(Peer, self._accepted, loop), sock=sock, backlog=1024)
        bound = self._server.sockets[0].getsockname()
        self._address = (bound[0], bound[1])

    def group_sockets(self) -> list[socket.socket]:
        """New listening sockets on every address this listener has, in its SO_REUSEPORT group (for a worker)."""
        assert self._server is not None, "not started"
        made: list[socket.socket] = []
        try:
            for own in self._sockets:
                made.append(twin(own))
                made[-1].listen(1024)
        except BaseException:
            for sock in made:
                sock.close()
            raise
        return made

    def _accepted(self, client: Peer) -> None:
        # No TCP_NODELAY here: asyncio and uvloop set it on every TCP transport.
        loop = self._loop
        assert loop is not None  # set by start(), before any accept
        self.tasks[client] = loop.create_task(Runner(self, client).run())

    def tunnel_ended(self, tunnel: Tunnel) -> None:
        """A spliced tunnel ended (``runner.Shared``): the last one wakes ``close``."""
        self.tunnels.discard(tunnel)
        if not self.tunnels and self._all_ended is not None:
            self._all_ended.set()

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting, give open connections ``grace_s`` to finish, then end them."""
        if self._server is not None:
            self._server.close()  # stop accepting; open connections are ours to end
        if grace_s > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace_s
            if self.tasks:
                await asyncio.wait(set(self.tasks.values()), timeout=grace_s)
            # Spliced tunnels have no task to wait on: the last to end sets this.
            self._all_ended = asyncio.Event()
            if self.tunnels:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_ended.wait(), max(0.0, deadline - loop.time()))
        self.cutting = True
        for tunnel in list(self.tunnels):
            tunnel.close()
        tasks = set(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
