"""The owner's side of ``egressd serve --workers N``: the worker processes, started, fed and watched.

The owner is the ``EgressService`` as without workers: it holds the runs,
the approvals and their channels and the control API, and serves its
share of the proxy's listeners and DNS. Each of the N-1 workers
(``egressd.cli.wiring.worker``) gets, as inherited descriptors, listening
sockets in each listener's (and the DNS server's) SO_REUSEPORT group (made here, so a worker
binds nothing), its end of a channel (``proxy.net.channel``) and the audit
chain's shared memory (``audit.shared``). Over the channel it is sent the
settings and the runs (``proxy.core.replica``: again on every change, in
the loop turn of the change), and the answers to the questions it forwards;
it sends back its questions, the answers its conversations applied and
each egress event.

A worker that dies is logged, and another is started in its place; the
connections it held are cut by the kernel. Each worker also watches the
owner: when its channel closes (the owner died), it closes its listeners
and stops (``worker.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest, Approver, PendingApproval, Settlement
from egressd.audit.log import AuditError, AuditSink
from egressd.audit.records import EgressEnded
from egressd.audit.shared import SharedChain
from egressd.config.cores import usable_cores
from egressd.config.settings import Settings
from egressd.proxy.core.decision import Screen, late_answer, settled_meanwhile
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.replica import Change, RegistryImage, apply_change, image_of
from egressd.proxy.core.runs import RunRegistry
from egressd.proxy.core.secrets import Secrets
from egressd.proxy.net.channel import Channel
from egressd.proxy.net.dnsserver import DnsServer
from egressd.proxy.net.inspector import Inspector
from egressd.proxy.net.listener import Listener
from egressd.proxy.net.owner import lend_budget
from egressd.vocabulary.egress import End
from egressd.vocabulary.reasons import Answer

from .errors import StartupError
from .listening import listener_limits

log = logging.getLogger("egressd")

# What a worker is sent on every change: the runs, the inspecting runs' CAs (``Inspector.handed``), the private
# ranges allowed (``Screen.allow_private``).
Image = tuple[RegistryImage, dict[str, Any], tuple[Any, ...]]

# How long a worker has to stop after it was told to, beyond the shutdown grace.
STOP_MARGIN_S = 5.0
# How long a worker has to start serving (Python's start-up and egressd's imports take about a second).
START_WAIT_S = 30.0
# How long a /metrics scrape waits for a worker's counters.
METRICS_WAIT_S = 1.0
# The least of a run's upload budget a worker is lent at once: a loan is a round trip to the owner.
LEAST_SHARE = 64 * 1024
# A worker that dies this soon after it started is started again only after as long (no crash loop).
MIN_LIFE_S = 2.0


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    channel: Channel
    started: float
    asks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    # The connections it wrote an ``egress`` record ahead for and has not ended: id → (run, when).
    open: dict[str, tuple[str | None, float]] = field(default_factory=dict)
    # Its metrics asked for and not yet sent: request number → (metrics, its task count).
    metrics: dict[int, asyncio.Future[tuple[Metrics, int]]] = field(default_factory=dict)


def process_count(settings: Settings) -> int:
    """How many processes serve: ``workers``, 0 meaning one per core (``cores.usable_cores``).

    A worker is Python started again (``sys.executable``). Where this user
    cannot run it (an interpreter under a directory it may not enter), the
    default gives one process and says why; a number asked for is a
    StartupError.
    """
    wanted = settings.workers or min(64, usable_cores())
    if wanted == 1 or os.access(sys.executable, os.X_OK):
        return wanted
    why = f"this user cannot run {sys.executable or 'Python'} to start them"
    if settings.workers:
        raise StartupError(f"bad setting workers: {settings.workers} processes asked for, and {why}")
    log.warning("egressd: serving from one process, not %d: %s", wanted, why)
    return 1


class WorkerPool:
    """The N-1 workers of an owner: ``start`` them, ``close`` them; ``deaths`` counts the ones lost."""

    def __init__(
        self,
        *,
        settings: Settings,
        processes: int,
        runs: RunRegistry,
        approver: Approver,
        inspector: Inspector | None,
        screen: Screen,
        secrets: Secrets | None,
        listeners: dict[str, Listener],
        dns: DnsServer | None,
        bound: dict[str, int],
        chain: SharedChain,
        audit: AuditSink,
        audit_stream: int | None,
        say: Callable[[str], None],
        observers: list[Callable[[dict[str, object]], None]],
    ) -> None:
        self._settings = settings
        self._processes = processes  # the owner and its workers
        self._runs = runs
        self._approver = approver
        if isinstance(approver, ApprovalBroker):
            approver.settled.append(self._settled)
        self._inspector = inspector
        self._screen = screen
        self._secrets = secrets  # the owner's, placeholders and values: a run's placeholder works in every process
        self._listeners = listeners
        self._dns = dns
        self._bound = bound
        self._chain = chain
        self._audit = audit
        self._say = say  # the owner's decision lines: a worker's are printed the same way
        self._observers = observers  # the owner's recorder's: who watches egress records as they end
        self._audit_stream = audit_stream  # the founder's standard-output stream (``--audit-log -``)
        self._workers: dict[int, _Worker] = {}
        self._push: asyncio.Handle | None = None
        self._watchers: set[asyncio.Task[None]] = set()
        self._closing = False
        self._numbers = itertools.count(1)
        self.deaths = 0
        # The runs' upload budgets are the owner's; a worker is lent a share at a time (a quarter of the
        # budget over the processes: at most that much each, unused, makes the person's question early).
        self._budget = listener_limits(settings).upload_budget_bytes
        self._share = max(LEAST_SHARE, self._budget // (4 * processes))

    async def start(self) -> None:
        """Start every worker; each says it is serving before this returns. OSError or RuntimeError if one cannot."""
        self._runs.watch = self._changed
        for index in range(1, self._processes):
            await self._start_one(index)

    async def _start_one(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sockets: list[tuple[str, socket.socket]] = []
        try:
            for setting, listener in self._listeners.items():
                sockets += [(setting, sock) for sock in listener.group_sockets()]
            args = ["--index", str(index), "--channel", str(theirs.fileno()), "--chain", str(self._chain.fd)]
            for setting, sock in sockets:
                args += ["--listener", f"{setting}={sock.fileno()}"]
            if self._dns is not None:
                udp, tcp = self._dns.group_sockets()
                sockets += [("dns_listen", udp), ("dns_listen", tcp)]
                args += ["--dns", f"{udp.fileno()},{tcp.fileno()}"]
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "egressd.cli.wiring.worker", *args,
                pass_fds=[theirs.fileno(), self._chain.fd, *(sock.fileno() for _, sock in sockets)],
                stdin=asyncio.subprocess.DEVNULL,
                stdout=self._audit_stream,  # None: the owner's own
            )  # fmt: skip
        finally:
            # The owner keeps no worker's sockets: one left open here would take connections nobody accepts.
            theirs.close()
            for _, sock in sockets:
                sock.close()
        ready: asyncio.Future[None] = loop.create_future()
        worker_ref: list[_Worker] = []

        def on_message(message: Any) -> None:
            if message == ("ready",):
                if not ready.done():
                    ready.set_result(None)
            elif worker_ref:
                self._received(worker_ref[0], message)

        channel = await Channel.over(ours, on_message)
        worker = _Worker(index, process, channel, loop.time())
        worker_ref.append(worker)
        # The settings' values, not the object: its class is made per read (``load_settings``) and does not pickle.
        values = {name: getattr(self._settings, name) for name in type(self._settings).model_fields}
        values["workers"] = self._processes  # resolved: a worker takes its share of the caps from it
        channel.send(("start", values, self._bound, self._image(), self._secrets))
        waiting: asyncio.Future[Any] = asyncio.ensure_future(process.wait())
        done, _ = await asyncio.wait({ready, waiting}, timeout=START_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if ready not in done:
            channel.close()
            if process.returncode is None:
                process.kill()
                await process.wait()
                raise RuntimeError(f"worker {index} did not say it served within {START_WAIT_S:g}s")
            raise RuntimeError(f"worker {index} exited with status {process.returncode} before it served")
        self._workers[index] = worker
        # The runs again: a change made while it started was pushed only to the workers already serving.
        channel.send(("image", *self._image()))
        watcher = loop.create_task(self._watch(worker))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _watch(self, worker: _Worker) -> None:
        status = await worker.process.wait()
        # What it sent before it died is still in the socket (its "opened" messages among it): read to the end.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(worker.channel.closed), STOP_MARGIN_S)
        worker.channel.close()
        for task in worker.asks.values():
            task.cancel()  # nobody is waiting for these answers any more
        if self._closing:
            return
        self._workers.pop(worker.index, None)
        self.deaths += 1
        log.error("worker %d (pid %d) died (status %s); its %d open connections were cut",
                  worker.index, worker.process.pid, status, len(worker.open))  # fmt: skip
        self._end_lost(worker)
        if asyncio.get_running_loop().time() - worker.started < MIN_LIFE_S:
            await asyncio.sleep(MIN_LIFE_S)  # one that keeps dying is started again no more often than this
            if self._closing:
                return
        try:
            await self._start_one(worker.index)
        except (OSError, RuntimeError) as exc:
            log.error("worker %d could not be started again: %s", worker.index, exc)

    def _end_lost(self, worker: _Worker) -> None:
        """An ``egress.end`` (``worker_lost``) for each connection the dead worker had open: no record left unended."""
        now = time.time()
        try:
            for request_id, (run, opened) in worker.open.items():
                self._audit.write(EgressEnded(id=request_id, ts=now, run=run, address=None, bytes_up=None,
                                              bytes_down=None, duration_s=max(0.0, now - opened),
                                              end=End.WORKER_LOST).record())  # fmt: skip
        except AuditError:
            pass  # the sink said why, once; egress is refused from now on
        worker.open.clear()

    def _received(self, worker: _Worker, message: Any) -> None:
        if isinstance(message, Change):
            if apply_change(self._runs, message) and message.what == "keep_event":
                for observer in self._observers:  # the approvals page's tail of egress, as for the owner's own
                    observer(message.args[0])
        elif message[0] == "metrics":
            waiting = worker.metrics.pop(message[1], None)
            if waiting is not None and not waiting.done():
                waiting.set_result((message[2], message[3]))
        elif message[0] == "say":
            self._say(message[1])
        elif message[0] == "log":
            _, level, name, text = message
            logging.getLogger(name).log(level, "worker %d: %s", worker.index, text)
        elif message[0] == "opened":
            worker.open[message[1]] = (message[2], message[3])
        elif message[0] == "ended":
            worker.open.pop(message[1], None)
        elif message[0] == "ask":
            _, ask_id, request = message
            task = asyncio.get_running_loop().create_task(self._ask(worker, ask_id, request))
            worker.asks[ask_id] = task
        elif message[0] == "lend":
            task = asyncio.get_running_loop().create_task(self._lend(worker, *message[1:]))
            worker.asks[message[1]] = task
        elif message[0] == "withdraw":
            asked = worker.asks.get(message[1])
            if asked is not None:
                asked.cancel()

    async def _ask(self, worker: _Worker, ask_id: int, request: ApprovalRequest) -> None:
        channel = worker.channel

        def late(outcome: ApprovalOutcome) -> None:
            channel.send(("late", ask_id, outcome))

        run = self._runs.get(request.run_id)
        if run is not None:  # the command running now, as the owner knows it (a worker's copy may lag)
            request = replace(request, command=run.command, task=run.task)
            if request.request is None and request.uploaded is None:  # a new domain's question
                settled = settled_meanwhile(run, request.host, request.port)
                if settled is not None:  # answered for the run while this question was on its way
                    worker.asks.pop(ask_id, None)
                    channel.send(("answer", ask_id, settled))
                    return
        try:
            outcome = await self._approver.ask(replace(request, on_late_answer=late))
        except asyncio.CancelledError:
            return  # withdrawn: the client gave up (a late answer still comes through ``late``)
        finally:
            worker.asks.pop(ask_id, None)
        channel.send(("answer", ask_id, outcome))

    def _settled(self, approval: PendingApproval, settlement: Settlement) -> None:
        """A new domain's approval settled: applied to the owner's run now, not when a worker reports it.

        A worker applies an answer to its copy of the run and tells the owner; a question from another
        worker already on its way would find the owner's run unchanged and open a second approval, which
        nobody answers. Applied here first, ``settled_meanwhile`` answers it (the worker's report changes
        nothing then).
        """
        request = approval.request
        run = self._runs.get(request.run_id)
        if run is None or request.request is not None or request.uploaded is not None:
            return  # a request's or an upload budget's question: not a domain's
        late_answer(run, request.host, request.port, ApprovalOutcome(settlement.answer, scope=settlement.scope))

    async def _lend(self, worker: _Worker, ask_id: int, run_id: str, site: str, port: int, need: int) -> None:
        """A worker's loan of a run's upload budget (``owner.lend_budget``); nothing for a run that has ended."""
        run = self._runs.get(run_id)
        try:
            if run is None:
                outcome, lent = ApprovalOutcome(Answer.NO_APPROVER), 0
            else:
                outcome, lent = await lend_budget(run, site, port, need, grant=self._budget, share=self._share,
                                                  ask=self._approver.ask)  # fmt: skip
        except asyncio.CancelledError:
            return  # withdrawn: the client gave up, and nothing was lent
        finally:
            worker.asks.pop(ask_id, None)
        worker.channel.send(("lent", ask_id, outcome, lent))

    async def metrics(self) -> list[tuple[Metrics, int]]:
        """Every worker's metrics and task count now (``/metrics``); one that does not answer in time is left out."""
        loop = asyncio.get_running_loop()
        asked = []
        for worker in self._workers.values():
            number = next(self._numbers)
            answer = worker.metrics[number] = loop.create_future()
            worker.channel.send(("metrics?", number))
            asked.append(answer)
        if not asked:
            return []
        done, pending = await asyncio.wait(asked, timeout=METRICS_WAIT_S)
        for late in pending:
            late.cancel()
        return [answer.result() for answer in done]

    def _changed(self) -> None:
        """A run changed in the owner: every worker is sent the runs at the end of this loop turn."""
        if self._push is None and self._workers:
            self._push = asyncio.get_running_loop().call_soon(self._send_image)

    def _image(self) -> Image:
        """The runs; the CAs of those that inspect (a client trusts its run's one CA, whichever process serves it);
        the private ranges allowed now (a reload changes them)."""
        cas = self._inspector.handed(self._runs) if self._inspector is not None else {}
        return image_of(self._runs), cas, self._screen.allow_private

    def _send_image(self) -> None:
        self._push = None
        image = ("image", *self._image())
        for worker in self._workers.values():
            worker.channel.send(image)

    async def close(self, grace_s: float) -> None:
        """Tell every worker to stop (``grace_s`` for its open connections), and wait for it; kill one that does not."""
        self._closing = True
        self._runs.watch = None
        if self._push is not None:
            self._push.cancel()
            self._push = None
        for worker in self._workers.values():
            worker.channel.send(("stop", grace_s))
        for worker in self._workers.values():
            try:
                await asyncio.wait_for(worker.process.wait(), grace_s + STOP_MARGIN_S)
            except TimeoutError:
                log.error("worker %d did not stop; killing it", worker.index)
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
        for watcher in list(self._watchers):
            watcher.cancel()
        self._workers.clear()
