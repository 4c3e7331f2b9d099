"""A worker process of ``egressd serve --workers N``: serves its share of the proxy's listeners and DNS.

Started by the owner (``workers.WorkerPool``) as ``python -m
egressd.cli.wiring.worker``, with its listening sockets, its channel and the
audit chain's shared memory as inherited descriptors. It is sent the
settings and the runs, and then serves every connection the kernel gives
its sockets as the owner would: the same conversation, policy, records
(written ahead to the same log, in the same chain) and dials. A question
for a person goes to the owner (``proxy.net.owner``).

When the channel closes without a stop (the owner died), the worker stops
at once: its listeners close (a new connection is refused), its open
connections are cut, and nothing more goes out.

Its log lines (the decision lines among them) go to the owner, which prints
them as its own: one stream, kept clear of a terminal's prompt. Once the
owner is gone they go to standard error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import ssl
import sys
from typing import Any

from egressd.audit.log import AuditError, JsonlAuditSink
from egressd.audit.shared import SharedChain
from egressd.config.settings import Settings
from egressd.proxy.core.decision import Screen
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.modes import EXPLICIT, SOCKS, Mode, transparent_http, transparent_tls
from egressd.proxy.core.replica import follow
from egressd.proxy.core.runs import RunRegistry
from egressd.proxy.core.secrets import Secrets
from egressd.proxy.net.channel import Channel
from egressd.proxy.net.dialer import Dialer, bound_locally
from egressd.proxy.net.dnsserver import DnsServer
from egressd.proxy.net.inspector import Inspector
from egressd.proxy.net.listener import Listener
from egressd.proxy.net.owner import OwnerApprover, ReportingRecorder
from egressd.proxy.net.resolver import DnsResolver, Resolver, SystemResolver, parse_server
from egressd.proxy.net.runner import EgressPath

from ..logformat import setup_logging
from .errors import StartupError
from .listening import dns_answers, dns_limits, listener_limits, own_endpoints, refusal_budget
from .loop import run_async
from .workers import Image

log = logging.getLogger("egressd")

_MODES: dict[str, Mode] = {
    "listen": EXPLICIT,
    "transparent_tls": transparent_tls(),
    "transparent_http": transparent_http(),
    "socks": SOCKS,
}


class Worker:
    """One worker's proxy: built from the owner's ``start`` message, stopped by its ``stop`` or its death."""

    def __init__(
        self,
        index: int,
        chain_fd: int,
        sockets: list[tuple[str, socket.socket]],
        dns: tuple[socket.socket, socket.socket] | None,
    ) -> None:
        self.index = index
        self._chain_fd = chain_fd
        self._sockets = sockets
        self._dns_sockets = dns
        self.dns: DnsServer | None = None
        self.channel: Channel | None = None
        self.started: asyncio.Future[tuple[Settings, dict[str, int], Image, Secrets | None]] = (
            asyncio.get_running_loop().create_future()
        )
        self.stop: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.runs = RunRegistry()
        self.approver: OwnerApprover | None = None
        self.listeners: list[Listener] = []
        self.audit: JsonlAuditSink | None = None
        self.inspector: Inspector | None = None
        self.screen: Screen | None = None
        self.metrics: Metrics | None = None
        self._resolver: Resolver | None = None
        self._latest: Image | None = None  # the owner's last image: followed once the proxy is built

    def on_message(self, message: Any) -> None:
        kind = message[0]
        if kind == "image":
            self._latest = message[1:]
            if self.screen is not None:  # built: follow now; else ``build`` follows the latest
                self.follow(self._latest)
        elif kind == "metrics?" and self.channel is not None and self.metrics is not None:
            self.channel.send(("metrics", message[1], self.metrics, len(asyncio.all_tasks())))
        elif kind == "answer" and self.approver is not None:
            self.approver.answered(message[1], message[2])
        elif kind == "lent" and self.approver is not None:
            self.approver.lent(message[1], message[2], message[3])
        elif kind == "late" and self.approver is not None:
            self.approver.late(message[1], message[2])
        elif kind == "start" and not self.started.done():
            # The owner's values as they are: read and checked there (nothing here reads the environment again).
            # The declared secrets too: their placeholders are the ones the owner handed to the runs.
            settings = Settings.model_construct(**message[1])
            self._latest = message[3]
            self.started.set_result((settings, message[2], message[3], message[4]))
        elif kind == "stop" and not self.stop.done():
            self.stop.set_result(float(message[1]))

    def follow(self, image: Image) -> None:
        """What the owner holds now: the runs, their CAs, the private ranges allowed."""
        assert self.channel is not None and self.inspector is not None and self.screen is not None
        runs, cas, allow_private = image
        follow(self.runs, runs, self.channel.send)
        self.inspector.take(cas)
        self.screen.set_allow_private(allow_private)

    async def build(self, settings: Settings, bound: dict[str, int], image: Image, secrets: Secrets | None) -> None:
        """The proxy as the owner's, on this worker's sockets; StartupError naming what failed."""
        s = settings
        assert self.channel is not None
        try:
            self.audit = JsonlAuditSink(s.audit_path, fsync=s.audit_fsync, max_bytes=s.audit_max_bytes,
                                        keep=s.audit_keep, shared=SharedChain.attach(self._chain_fd))  # fmt: skip
        except AuditError as exc:
            raise StartupError(f"worker {self.index}: bad setting audit_log: {exc}") from None
        self._resolver = DnsResolver(parse_server(s.upstream_dns)) if s.upstream_dns else SystemResolver()
        try:
            inspector = Inspector(origin_cafile=str(s.inspect_origin_ca_file) if s.inspect_origin_ca_file else None)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"bad setting inspect_origin_ca_file: {exc}") from None
        self.approver = OwnerApprover(self.channel.send)
        self.runs = RunRegistry(learn=s.learn, global_deny=image[0].global_deny)
        self.inspector = inspector
        own = own_endpoints(s, bound)
        self.screen = Screen(allow_private=s.allow_private_networks, own=own, is_local=bound_locally)
        self.follow(self._latest or image)  # an image sent while this process started is newer than the first
        self.metrics = Metrics()
        recorder = ReportingRecorder(
            audit=self.audit, metrics=self.metrics, refusals=refusal_budget(s, share=s.workers)
        )
        recorder.tell_now, recorder.tell = self.channel.send_now, self.channel.send
        path = EgressPath(
            recorder=recorder,
            dialer=Dialer(origin_tls=inspector.origin_context),
            approver=self.approver,
            resolver=self._resolver,
            screen=self.screen,
            inspector=inspector,
            secrets=secrets,
            lender=self.approver,
        )
        path.recorder.say = self._say
        limits = listener_limits(s, share=s.workers)
        for setting, sock in self._sockets:
            listener = Listener(path=path, runs=self.runs, limits=limits, mode=_MODES[setting])
            await listener.start_on(sock)
            self.listeners.append(listener)
        if self._dns_sockets is not None:
            answer4, answer6 = dns_answers(s)
            self.dns = DnsServer(recorder=recorder, runs=self.runs, answer4=answer4, answer6=answer6,
                                 strict=s.dns_strict, **dns_limits(s.workers)._asdict())  # fmt: skip
            await self.dns.start_on(*self._dns_sockets)

    def _say(self, line: str) -> None:
        """A decision line: printed by the owner (to stderr here once it is gone)."""
        if self.channel is not None and self.channel.open:
            self.channel.send(("say", line))
        else:
            print(line, file=sys.stderr, flush=True)

    async def close(self, grace_s: float) -> None:
        if self.dns is not None:
            await self.dns.close()
        await asyncio.gather(*(listener.close(grace_s) for listener in self.listeners))
        if self.approver is not None:
            self.approver.owner_gone()
        close = getattr(self._resolver, "close", None)
        if close is not None:
            await close()
        if self.audit is not None:
            self.audit.close()


async def _serve(args: argparse.Namespace) -> int:
    sockets = []
    for text in args.listener:
        setting, _, fd = text.partition("=")
        sockets.append((setting, socket.socket(fileno=int(fd))))
    dns = None
    if args.dns is not None:
        udp, _, tcp = args.dns.partition(",")
        dns = (socket.socket(fileno=int(udp)), socket.socket(fileno=int(tcp)))
    worker = Worker(args.index, args.chain, sockets, dns)
    worker.channel = await Channel.over(socket.socket(fileno=args.channel), worker.on_message)
    first: set[asyncio.Future[Any]] = {worker.started, worker.channel.closed}
    done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    if worker.started not in done:
        return 1  # the owner went away before it said how to start
    settings, bound, image, secrets = worker.started.result()
    setup_logging(settings.log_level, settings.log_format)
    logging.root.handlers = [_OwnerLog(worker.channel, logging.root.handlers[0])]
    try:
        await worker.build(settings, bound, image, secrets)
    except StartupError as exc:
        log.error("worker %d: %s", args.index, exc)
        await worker.close(0)
        return 1
    worker.channel.send(("ready",))
    last: set[asyncio.Future[Any]] = {worker.stop, worker.channel.closed}
    done, _ = await asyncio.wait(last, return_when=asyncio.FIRST_COMPLETED)
    if worker.stop in done:
        await worker.close(worker.stop.result())
        return 0
    # The owner died: nobody holds the runs, answers questions or serves the control API. Stop now.
    log.error("worker %d: the owner process is gone; stopping, open connections cut", args.index)
    await worker.close(0)
    return 1


class _OwnerLog(logging.Handler):
    """A worker's log records, sent to the owner to print; ``fallback`` (standard error) once it is gone."""

    def __init__(self, channel: Channel, fallback: logging.Handler) -> None:
        super().__init__()
        self._channel = channel
        self._fallback = fallback

    def emit(self, record: logging.LogRecord) -> None:
        if not self._channel.open:
            self._fallback.handle(record)
            return
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self._channel.send(("log", record.levelno, record.name, text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="egressd worker", description="a worker of egressd serve --workers N")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--channel", type=int, required=True)
    parser.add_argument("--chain", type=int, required=True)
    parser.add_argument("--listener", action="append", default=[], help="SETTING=FD, one per listening socket")
    parser.add_argument("--dns", help="UDPFD,TCPFD: the DNS server's two sockets")
    args = parser.parse_args(argv)
    return run_async(lambda: _serve(args))


if __name__ == "__main__":
    sys.exit(main())
