"""A sandbox session: network, embedded egressd, registered run and sandbox, as one unit.

``egressd run`` and ``egressd agent`` both use it:

    async with SandboxSession(settings, workdir=..., task=..., extra_env=...) as session:
        cursor = session.cursor()
        session.set_command("pip install x")
        obs = await session.box.run(argv, limits=...)
        obs.egress_refusals = session.refusals_since(cursor)

Entering it: (1) makes or checks the working directory (a root-owned one is
refused here, before anything exists; its owner must be able to reach it, as
bwrap runs as them), (2) removes leftovers of dead runs, (3) creates the
run's network, (4) starts egressd on the host side of the veth (proxy, DNS,
transparent TLS/HTTP; control API on a private unix socket; runs need
credentials or the bound source address), (5) registers the run, (6)
prepares the sandbox. Leaving it undoes all of that in reverse order,
whatever happened. A failure to set up raises ``SessionError`` (exit 125).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Generic, Protocol, TypeVar, runtime_checkable

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.commandoutput import TerminalOutput
from egressd.audit.records import run_record
from egressd.audit.views import EgressSeen, Refusal, refusals
from egressd.config.settings import Settings, token_path
from egressd.proxy.core.runs import Run
from egressd.sandbox.backend import Sandbox, SandboxError
from egressd.sandbox.bwrap import SANDBOX_GID, SANDBOX_UID
from egressd.sandbox.doctor import clean_tmp
from egressd.sandbox.identity import refusal, run_as, unreachable
from egressd.sandbox.launcher import BwrapSandbox, owner_reaches
from egressd.sandbox.limits import Cgroup, cgroup_mode, leftover_cgroups
from egressd.sandbox.network import (
    DEFAULT_RANGE,
    OWNERS_DIR,
    EgressPorts,
    NetworkError,
    RunNetwork,
    clean_leftovers,
    owner_alive,
)
from egressd.sandbox.seccomp import SeccompUnsupported, check_machine

from .fleet import FleetPresence
from .instances import register_quietly
from .service import EgressService, StartupError, declared_secrets, entries_from_settings


def refusal_summaries(records: Iterable[Mapping[str, object]]) -> list[Refusal]:
    """The refusals among egress records (``EgressSeen.is_refusal``), as runners report them."""
    return refusals(EgressSeen.of(record) for record in records)


class RunHandle(Protocol):
    """The run a session made, as runners name it."""

    @property
    def id(self) -> str: ...


@runtime_checkable
class Session(Protocol):
    """What ``egressd run`` and ``egressd agent`` use of a sandboxed run, whichever
    backend made it: ``SandboxSession`` (bubblewrap) or ``egressd.cli.wiring.docker_session.DockerSession``.

    Entered, it has a working directory, a run in egressd and a sandbox
    (``box``: ``run(command, **options)`` → Observation, ``copy_out``) whose
    every connection that run's policy decides.
    """

    workdir: Path
    made_workdir: bool
    terminal_output: TerminalOutput
    kind: str  # run or agent: how the registry of running instances names it
    exit_status: int | None  # set by the runner once the command ended: the run.end record carries it

    @property
    def run(self) -> RunHandle | None:
        """The run in egressd once entered (read-only here: each backend's own type)."""

    @property
    def box(self) -> Sandbox: ...

    def set_command(self, command: str | None) -> None:
        """What the run executes now: shown in approval messages and audit records."""

    def cursor(self) -> int:
        """A position in the run's egress events; pass it to ``refusals_since``."""

    def refusals_since(self, cursor: int) -> list[Refusal]:
        """Egress refusals recorded after ``cursor`` (``refusal_summaries``)."""

    def observe(self, callback: Callable[[EgressSeen], None]) -> None:
        """Call ``callback`` with every egress record of this run, read once (``EgressSeen``)."""

    async def __aenter__(self) -> Session: ...

    async def __aexit__(self, *exc: object) -> None: ...


class SessionError(Exception):
    """The sandbox could not be set up (the message says why)."""


async def clean_stale() -> list[str]:
    """Remove leftovers of runs whose egressd is gone: namespaces, veths, cgroups, /tmp directories."""
    removed = await clean_leftovers()
    live = {p.name for p in OWNERS_DIR.glob("*") if owner_alive(p.name)} if OWNERS_DIR.is_dir() else set()
    mode = cgroup_mode()[0] or "v1"
    for group in leftover_cgroups(live):
        # A dead run's sandbox may still be running (killed egressd before bwrap armed its
        # parent-death signal): kill what is in its cgroup, then remove it.
        await Cgroup(mode, [group]).remove(timeout_s=2.0)
        if not group.exists():
            removed.append(str(group))
    removed += clean_tmp()
    return removed


def check_host() -> None:
    try:
        check_machine()  # first: nothing else helps on a machine the filter is not written for
    except SeccompUnsupported as exc:
        raise SessionError(str(exc)) from None
    if os.geteuid() != 0:
        raise SessionError("egressd needs root to create the sandbox's network namespace (see: egressd doctor)")
    for tool in ("bwrap", "nsenter", "ip", "nft"):
        if shutil.which(tool) is None:
            raise SessionError(f"{tool} is not installed (see: egressd doctor)")


BoxT = TypeVar("BoxT")


class SessionBase(Generic[BoxT]):
    """What a session of either backend keeps: its settings, the working directory asked
    for (None: make one), the task, the sandbox's extra environment and terminal type;
    once entered, the working directory in use and the sandbox (``box``). Leaving it
    undoes, in reverse, everything entering did (``_stack``).

    ``terminal_output`` carries a command's output to our terminal (``run(relay=...)``):
    the session's terminal approver holds it back while it prompts."""

    def __init__(
        self,
        settings: Settings,
        *,
        workdir: Path | None,
        task: str | None,
        extra_env: Mapping[str, str] = {},
        keep_workdir: bool = False,
        term: str | None = None,
    ) -> None:
        self.settings = settings
        self._workdir_arg = workdir
        self.task = task
        self.extra_env = dict(extra_env)
        self.keep_workdir = keep_workdir
        self.term = term
        self.workdir: Path = Path()
        self.made_workdir = workdir is None
        self.kind = "run"  # the command that runs it, as the registry of running instances names it (open_session)
        self.exit_status: int | None = None  # the command's, when the runner knows it: its run.end says it
        self._box: BoxT | None = None
        self._stack = contextlib.AsyncExitStack()
        self.terminal_output = TerminalOutput()

    @property
    def box(self) -> BoxT:
        assert self._box is not None, "the session is not entered"
        return self._box

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    _start_failed = False  # set by a session whose start failed: nothing ran in its fresh directory

    def _drop_unstarted_workdir(self, path: Path) -> None:
        """A kept fresh directory of a run that never started holds nothing to keep: remove it (empty only)."""
        if self._start_failed:
            with contextlib.suppress(OSError):
                path.rmdir()

    def _take_workdir(self) -> tuple[int, int]:
        """Make or check the working directory; returns who the command will run as (uid, gid).

        Called first, so a run that cannot start creates nothing. A fresh
        directory belongs to the unprivileged SANDBOX_UID:SANDBOX_GID (and is
        removed afterwards unless kept); a given one must exist and belong to
        an ordinary user (``identity.run_as``): a root-owned one is refused.
        """
        if self._workdir_arg is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="egressd-work-"))
            if not self.keep_workdir:
                self._stack.callback(shutil.rmtree, self.workdir, True)
            else:
                self._stack.callback(self._drop_unstarted_workdir, self.workdir)
            try:
                os.chown(self.workdir, SANDBOX_UID, SANDBOX_GID)
            except OSError as exc:
                raise SessionError(f"cannot give the fresh working directory to uid {SANDBOX_UID}: {exc}") from None
            return SANDBOX_UID, SANDBOX_GID
        self.workdir = Path(self._workdir_arg)
        if not self.workdir.is_dir():
            raise SessionError(f"working directory {self.workdir} does not exist")
        info = self.workdir.stat()
        ids = run_as(info.st_uid, info.st_gid)
        if ids is None:
            raise SessionError(refusal(str(self.workdir)))
        return ids


class SandboxSession(SessionBase[BwrapSandbox]):
    """Everything one sandboxed run needs, created and destroyed together."""

    def __init__(
        self,
        settings: Settings,
        *,
        workdir: Path | None,
        task: str | None,
        extra_env: Mapping[str, str] = {},
        keep_workdir: bool = False,
        net_range: str = DEFAULT_RANGE,
        term: str | None = None,
    ) -> None:
        super().__init__(
            settings, workdir=workdir, task=task, extra_env=extra_env, keep_workdir=keep_workdir, term=term
        )
        self.net_range = net_range
        self.network: RunNetwork | None = None
        self.service: EgressService | None = None
        self.run: Run | None = None

    async def __aenter__(self) -> SandboxSession:
        try:
            await self._enter()
        except BaseException:
            self._start_failed = True
            await self._stack.aclose()
            raise
        return self

    async def _enter(self) -> None:
        check_host()
        allow, deny = entries_from_settings(self.settings)
        try:  # a secret no rule of the run's list lets egressd put in: said before anything is made
            declared_secrets(self.settings, allow)
        except StartupError as exc:
            raise SessionError(str(exc)) from None
        # In a fleet (--state): the database checked before anything is made, the run listed with it after.
        try:
            fleet = await FleetPresence.open(self.settings)
        except StartupError as exc:
            raise SessionError(str(exc)) from None
        if fleet is not None:
            self._stack.push_async_callback(fleet.leave)
        uid, gid = self._take_workdir()
        # bwrap runs as the owner and opens the directory itself (Docker's engine binds it as root).
        if not await owner_reaches(self.workdir, uid, gid):
            raise SessionError(unreachable(str(self.workdir), uid, gid))
        await clean_stale()
        stack = self._stack
        try:
            self.network = await RunNetwork.create(pool=self.net_range, ports=EgressPorts())
        except NetworkError as exc:
            raise SessionError(f"cannot create the sandbox network: {exc}") from None
        stack.push_async_callback(self.network.destroy)
        # Made after the network, whose owner file names this process: the run key in the
        # name lets `egressd doctor --clean` remove it once a killed run's egressd is gone.
        private = Path(tempfile.mkdtemp(prefix=f"egressd-run-{self.network.plan.run_key}-"))
        stack.callback(shutil.rmtree, private, True)
        host, ports = str(self.network.plan.host_ip), self.network.ports
        service_settings = self.settings.model_copy(
            update={
                "listen": f"{host}:{ports.proxy}",
                "dns_listen": f"{host}:{ports.dns}",
                "transparent_tls": f"{host}:{ports.tls}",
                "transparent_http": f"{host}:{ports.http}",
                "socks": f"{host}:{ports.socks}",
                "dns_answer": host,
                "control": f"unix:{private / 'control.sock'}",
                "require_auth": True,
            }
        )
        self.service = EgressService(service_settings, terminal_output=self.terminal_output,
                                     fleet_instance=fleet.id if fleet is not None else None)  # fmt: skip
        try:
            await self.service.start()
        except StartupError as exc:
            raise SessionError(str(exc)) from None
        stack.push_async_callback(self.service.close, 1.0)
        # SIGUSR1 reopens the audit log, as for `egressd serve` (logrotate's postrotate), instead of killing the run.
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.service.reopen_audit)
        stack.callback(loop.remove_signal_handler, signal.SIGUSR1)
        assert self.service.runs is not None and self.service.path is not None
        run = self.service.runs.create(task=self.task, allow=allow, deny=deny, ask=self.settings.ask,
                                       sources=[self.network.plan.sandbox_ip], started=time.time())
        self.run = run
        self._audit(run_record("run.start", ts=time.time(), run=run.id, task=self.task, allow=[e.text for e in allow],
                               deny=[e.text for e in deny], sources=[str(self.network.plan.sandbox_ip)],
                               **({"learn": True} if run.learn else {})))
        stack.callback(self._end_run)
        if fleet is not None:
            registry = self.service.runs
            fleet.runs = lambda: [r.describe() for r in registry]
            try:
                joined = await fleet.join(f"egressd run {run.id}, control {self.service.control_address}")
            except StartupError as exc:
                raise SessionError(str(exc)) from None
            logging.getLogger("egressd").info("fleet: state database %s, this run's egressd listed as %s",
                                              fleet.shown, joined.id)  # fmt: skip
        # In the registry of running instances: `egressd pending|allow|deny` find this run's private socket.
        registration = register_quietly(
            kind=self.kind, control=self.service.control_address, task=self.task,
            token_file=None if service_settings.control_token is not None else token_path(service_settings),
        )  # fmt: skip
        if registration is not None:
            stack.callback(registration.remove)
        secrets = self.service.path.secrets
        if secrets is not None:
            # The command holds each secret's placeholder under its name, never its value.
            self.extra_env.update({secret.name: secret.placeholder for secret in secrets.declared})
        try:
            self._box = BwrapSandbox(
                network=self.network,
                workdir=self.workdir,
                proxy_url=f"http://{run.id}:{run.token}@{host}:{ports.proxy}",
                socks_url=f"socks5h://{run.id}:{run.token}@{host}:{ports.socks}",
                extra_env=self.extra_env,
                term=self.term,
                run_ca_pem=self._run_ca(run),
            )
        except SandboxError as exc:
            raise SessionError(str(exc)) from None
        stack.push_async_callback(self._box.destroy)

    def _run_ca(self, run: Run) -> bytes | None:
        """The run's inspection CA when it inspects names (its sandbox trusts it), else None."""
        assert self.service is not None and self.service.path is not None
        inspector = self.service.path.inspector
        if inspector is None or not run.inspected_names():
            return None
        return inspector.certificate_pem(run)

    def _audit(self, record: dict[str, object]) -> None:
        assert self.service is not None and self.service.path is not None
        with contextlib.suppress(Exception):
            self.service.path.recorder.audit.write(record)

    def _end_run(self) -> None:
        if self.service is None or self.run is None or self.service.runs is None:
            return
        if self.service.runs.get(self.run.id) is not None:
            self.service.runs.end(self.run.id)
        now = time.time()
        exit_status = {} if self.exit_status is None else {"exit_status": self.exit_status}
        self._audit(run_record("run.end", ts=now, run=self.run.id, **exit_status, **self.run.summary(now)))

    # -- what runners need -------------------------------------------------------

    @property
    def control_address(self) -> str:
        """Where this run's egressd answers ``egressd pending|allow|deny --control ...``."""
        assert self.service is not None
        return self.service.control_address

    def set_command(self, command: str | None) -> None:
        """What the run executes now: shown in approval messages and audit records."""
        assert self.run is not None
        self.run.command = command

    def cursor(self) -> int:
        """A position in the run's egress events; pass it to ``refusals_since``."""
        assert self.run is not None
        return self.run.next_event - 1

    def refusals_since(self, cursor: int) -> list[Refusal]:
        """Egress refusals recorded after ``cursor``: host, port, reason, kind."""
        assert self.run is not None
        events, _ = self.run.events_after(cursor, limit=10_000)
        return refusal_summaries(events)

    def on_held(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` each time a request of this run is held for a person (an approval opens)."""
        assert self.service is not None and self.service.path is not None and self.run is not None
        run_id, approver = self.run.id, self.service.path.approver
        if isinstance(approver, ApprovalBroker):
            approver.opened.append(lambda approval: callback() if approval.request.run_id == run_id else None)

    def observe(self, callback: Callable[[EgressSeen], None]) -> None:
        """Call ``callback`` with every egress record of this run as it is written."""
        assert self.service is not None and self.service.path is not None and self.run is not None
        run_id = self.run.id
        self.service.path.recorder.observers.append(
            lambda record: callback(EgressSeen.of(record)) if record.get("run") == run_id else None
        )
