"""A Docker sandbox session: ``egressd.cli.wiring.session.SandboxSession``'s counterpart for ``--backend docker``.

``egressd run --backend docker`` and ``egressd agent --backend docker`` use it
exactly like the bubblewrap session:

    async with DockerSession(settings, workdir=..., task=..., image=...) as session:
        cursor = session.cursor()
        session.set_command("pip install x")
        obs = await session.box.run(argv, limits=...)
        obs.egress_refusals = session.refusals_since(cursor)
        report = await session.box.copy_out(["dist/*"], Path("out"))

Entering it: (1) connects to the Docker Engine and removes leftovers of dead
runs (by label), (2) creates the run's internal and outgoing networks, (3)
starts egressd's container from the egressd image, configured by EGRESSD_*
variables and given its secrets as files (``sidecar_secrets``: never as
variables, which ``docker inspect`` shows) (``--require-auth``: the sandbox's
traffic is bound to its source address; the control API on the host's
loopback with a fresh bearer token) —
or, with ``--connect URL``, uses a running egressd: the run still gets an
internal network of its own (sandboxes of different runs never share one),
and that egressd's container is attached to it for the run's lifetime — (4)
registers the run through the control API, with the global control token,
which is then dropped: every later call goes with the run's own control
token, which acts on this run alone (``egressd.control.api``), (5) prepares the sandbox.
Leaving it ends the run, appends egressd's audit records to the host's audit
log, and removes every container and volume of the run and its networks
(detaching a running egressd first), whatever happened. A failure to set up
raises ``SessionError`` (exit 125).

Approvals from the terminal where the session was started (``--approver
terminal``): egressd in its container has no terminal, so
``egressd.approvals.relay.TerminalRelay`` stands in for one — egressd delivers
each approval by a signed webhook to a listener of ours on the outgoing
network's host address, the prompt appears on our terminal
(``egressd.approvals.terminal``), and the answer goes back through the control API (``POST /approvals/ID/allow|deny``).

The run's events come through the control API (``GET /runs/ID/events``):
polled while a command runs (for refusals printed as they happen) and once
more when it ends, so ``refusals_since`` is complete when ``box.run`` returns.
``set_command`` is recorded at once and sent (``PUT /runs/ID/command``)
before the next command starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from yarl import URL

from egressd.approvals.relay import TerminalRelay
from egressd.audit.log import AuditError, JsonlAuditSink
from egressd.audit.views import EgressSeen, Refusal, refusals
from egressd.config.settings import SECRET_SETTINGS, Settings, token_path
from egressd.proxy.core.runs import new_control_token
from egressd.sandbox.backend import Observation, Sandbox, SandboxError
from egressd.sandbox.copyout import CopyOutError, CopyReport
from egressd.sandbox.docker.commands import DockerSandbox, StagedWorkdir
from egressd.sandbox.docker.config import (
    CONTROL_PORT,
    DEFAULT_DOCKER_RANGE,
    DEFAULT_EGRESSD_IMAGE,
    DEFAULT_IMAGE,
    EGRESSD_STATE,
    PROXY_PORT,
    SECRETS_DIR,
    SOCKS_PORT,
    resource_labels,
    seccomp_option,
)
from egressd.sandbox.docker.engine import DockerEngine, clean_leftovers, owner_token
from egressd.sandbox.docker.networks import DockerRun, DockerRunNetwork, SharedEgressdNetwork
from egressd.sandbox.docker.sidecar import read_file, start_egressd

from .control_client import ControlClient, ControlError
from .controltoken import TokenFileError, read_token_file
from .declared import SecretSettingError, secrets_from_settings
from .instances import register_quietly
from .service import StartupError, entries_from_settings
from .session import SessionBase, SessionError

# The control API answers at once; anything slower means it is not there.
CONTROL_TIMEOUT_S = 10.0
# While a command runs, refusals are printed this soon after they happen.
POLL_INTERVAL_S = 0.25
MAX_AUDIT_BYTES = 256 * 1024 * 1024
# Settings the sidecar takes from ours as they are. The rest is per run (the
# allowlist goes in POST /runs) or fixed by the session (listeners, control).
# The settings the sidecar does not take from ours; every other one is passed on, so a
# new setting reaches the sidecar without anyone remembering to list it here.
SIDECAR_OWN = frozenset({
    # its listeners and control API: fixed to the run's networks (``sidecar_environment``)
    "listen", "control", "dns_listen", "dns_answer", "dns_answer6", "transparent_tls", "transparent_http",
    "socks", "require_auth", "control_token", "control_token_file",
    # the run's policy: registered with the run through the control API, not egressd-wide
    "allow", "deny", "preset", "ask",
    # its audit log: in its volume, appended to ours when the run ends
    "audit_log", "audit_max_bytes", "audit_keep",
    # a host path: the file's contents go to the container as one of its files (``sidecar_files``)
    "inspect_origin_ca_file",
    # one process: it serves one sandbox, and one per core of a large host would not fit its memory limit
    "workers",
})
# The container's files besides the secret settings' (``sidecar_files``): a declared secret's value is
# ``declared.NAME``, named to egressd there by NAME_FILE; the CA for inspected origins is ORIGIN_CA.
DECLARED = "declared."
ORIGIN_CA = "inspect_origin_ca"
PASSTHROUGH = tuple(
    name for name in Settings.model_fields
    if name not in SIDECAR_OWN and not name.endswith("_file")  # a *_file secret arrives as its value
)


def env_value(value: Any) -> str:
    """A setting's value as an EGRESSD_* variable holds it (pure)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def sidecar_environment(
    settings: Settings,
    *,
    egressd_ip: str,
    control_ip: str,
    token: str,
    files: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """egressd's configuration in its container, as EGRESSD_* variables (pure).

    Our settings that differ from the defaults are passed on (policy
    exemptions, approval channels, limits); the listeners are fixed: proxy,
    DNS and transparent TLS/HTTP on the internal network's address only,
    the control API on the outgoing network's address only (published on
    the host's loopback), every client bound to a run. Secrets are not
    values here: EGRESSD_<NAME>_FILE names the file ``sidecar_secrets``
    puts in the container; ``files`` are ``sidecar_files``'s.
    """
    env: dict[str, str] = {}
    for name in PASSTHROUGH:
        if name in SECRET_SETTINGS:
            continue
        value = getattr(settings, name)
        default = Settings.model_fields[name].get_default(call_default_factory=True)
        if value is None or value == default:
            continue
        if name == "approver":
            # A terminal is ours, not the container's: the sidecar would find none.
            value = [a for a in value if a != "terminal"]
            if not value:
                continue
        env[f"EGRESSD_{name.upper()}"] = env_value(value)
    env.update(
        {
            "EGRESSD_LISTEN": f"{egressd_ip}:{PROXY_PORT}",
            "EGRESSD_DNS_LISTEN": f"{egressd_ip}:53",
            "EGRESSD_TRANSPARENT_TLS": f"{egressd_ip}:443",
            "EGRESSD_TRANSPARENT_HTTP": f"{egressd_ip}:80",
            "EGRESSD_SOCKS": f"{egressd_ip}:{SOCKS_PORT}",
            "EGRESSD_DNS_ANSWER": egressd_ip,
            "EGRESSD_CONTROL": f"{control_ip}:{CONTROL_PORT}",
            "EGRESSD_WORKERS": "1",
            "EGRESSD_REQUIRE_AUTH": "true",
            "EGRESSD_AUDIT_LOG": f"{EGRESSD_STATE}/audit.jsonl",
        }
    )
    for name in sidecar_secrets(settings, token=token, files=files):
        path = f"{SECRETS_DIR}/{name}"
        if name.startswith(DECLARED):
            env[f"{name.removeprefix(DECLARED)}_FILE"] = path  # as ``secrets_from_settings`` looks for it
        elif name == ORIGIN_CA:
            env["EGRESSD_INSPECT_ORIGIN_CA_FILE"] = path
        else:
            env[f"EGRESSD_{name.upper()}_FILE"] = path
    return env


def sidecar_secrets(settings: Settings, *, token: str, files: Mapping[str, str] | None = None) -> dict[str, str]:
    """The secrets egressd's container reads from files (name -> value) (pure).

    The run's control ``token``, each of our secret settings that is
    passed on (``PASSTHROUGH``) and set, and ``files`` (``sidecar_files``).
    """
    secret_files = {"control_token": token}
    for name in PASSTHROUGH:
        value = getattr(settings, name)
        if name in SECRET_SETTINGS and value is not None:
            secret_files[name] = env_value(value)
    secret_files.update(files or {})
    return secret_files


def sidecar_files(settings: Settings, environ: Mapping[str, str]) -> dict[str, str]:
    """What else egressd's container reads from files: each declared secret's value (from ``environ``,
    as ``secrets_from_settings`` takes it) and the CA for inspected origins; StartupError when one cannot
    be had (nothing is created before this)."""
    try:
        declared = secrets_from_settings(settings, entries_from_settings(settings)[0], environ)
    except SecretSettingError as exc:
        raise StartupError(str(exc)) from None
    files = {f"{DECLARED}{secret.name}": secret.value for secret in declared.declared} if declared else {}
    if settings.inspect_origin_ca_file is not None:
        try:
            files[ORIGIN_CA] = settings.inspect_origin_ca_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise StartupError(f"bad setting inspect_origin_ca_file: {exc}") from None
    return files


def _connect_token(settings: Settings) -> str:
    if settings.control_token is not None:
        return settings.control_token.get_secret_value()
    path = token_path(settings)
    try:
        return read_token_file(path)
    except TokenFileError as exc:
        raise SessionError(f"--connect: {exc}") from None
    except OSError as exc:
        raise SessionError(f"--connect needs the control token: give --control-token or write it to {path} "
                           f"({exc.strerror})") from None


@dataclass(frozen=True)
class RemoteRun:
    """The run as egressd's control API created it (``SandboxSession.run``'s counterpart)."""

    id: str
    proxy_url: str


class _SessionBox:
    """The sandbox as runners see it (a ``backend.Sandbox``): ``run`` also sends the command and collects its events."""

    def __init__(self, session: DockerSession, sandbox: DockerSandbox) -> None:
        self._session = session
        self.sandbox = sandbox

    @property
    def workdir(self) -> Path:
        return self.sandbox.workdir

    async def run(self, command: Sequence[str], **kwargs: Any) -> Observation:
        await self._session.flush_command()
        self._session.polling = True
        try:
            return await self.sandbox.run(command, **kwargs)
        finally:
            self._session.polling = False
            await self._session.poll()

    async def copy_out(self, patterns: list[str], dest: Path) -> CopyReport:
        return await self.sandbox.copy_out(patterns, dest)

    async def destroy(self) -> None:
        await self.sandbox.destroy()


class DockerSession(SessionBase[_SessionBox]):
    """Everything one sandboxed run on Docker needs, created and destroyed together."""

    def __init__(
        self,
        settings: Settings,
        *,
        workdir: Path | None,
        task: str | None,
        extra_env: Mapping[str, str] = {},
        keep_workdir: bool = False,
        term: str | None = None,
        image: str = DEFAULT_IMAGE,
        egressd_image: str = DEFAULT_EGRESSD_IMAGE,
        connect: str | None = None,
        net_range: str = DEFAULT_DOCKER_RANGE,
        labels: Mapping[str, str] = {},
        docker_url: str | None = None,
        tty_path: str = "/dev/tty",
    ) -> None:
        super().__init__(
            settings, workdir=workdir, task=task, extra_env=extra_env, keep_workdir=keep_workdir, term=term
        )
        self.image = image
        self.egressd_image = egressd_image
        self.connect = connect
        self.net_range = net_range
        self.labels = dict(labels)
        self.docker_url = docker_url
        self.tty_path = tty_path
        self.relay: TerminalRelay | None = None
        self.engine: DockerEngine | None = None
        self.resources: DockerRun | None = None
        self.control: ControlClient | None = None
        self.egressd_container: str | None = None
        self.run_id: str | None = None
        self.run: RemoteRun | None = None
        self.polling = False
        self._events: list[EgressSeen] = []  # the run's egress records, each read once as it arrived
        self._server_cursor = 0
        self._observers: list[Callable[[EgressSeen], None]] = []
        self._command: str | None = None
        self._command_sent = True
        self._poll_lock = asyncio.Lock()
        self._files: dict[str, str] = {}  # ``sidecar_files``'s

    async def __aenter__(self) -> DockerSession:
        try:
            await self._enter()
        except (SandboxError, StartupError, ControlError) as exc:  # one error for runners: SessionError
            await self._stack.aclose()
            raise SessionError(str(exc)) from None
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _enter(self) -> None:
        if self.settings.state is not None:
            raise StartupError("bad setting state: the Docker backend's egressd runs in a container of its own and "
                               "does not join a fleet yet: use --backend bwrap, or egressd serve --state")  # fmt: skip
        entries_from_settings(self.settings)  # a bad entry stops us before anything is created
        # Declared secrets' values and the origins' CA, for the sidecar: a missing one stops us here.
        self._files = {} if self.connect else sidecar_files(self.settings, os.environ)
        if self.connect and self.settings.secret:
            raise StartupError("--secret cannot be given with --connect: declare it to the egressd you connect to")
        self._prepare_workdir()  # so does a root-owned working directory: before the engine is asked anything
        stack = self._stack
        # SIGUSR1 (logrotate) must not kill the run: this backend opens the host's audit log only when the
        # run ends (``_save_audit``), so whatever the log was moved to, the records go to its path then.
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: None)
        stack.callback(loop.remove_signal_handler, signal.SIGUSR1)
        self.engine = await stack.enter_async_context(DockerEngine.connect(self.docker_url))
        machine = str((await self.engine.version()).get("Arch") or "")
        seccomp_option(machine)  # an engine of another architecture: refused before anything is created
        await clean_leftovers(self.engine)
        for image in (self.image,) + (() if self.connect else (self.egressd_image,)):
            if not await self.engine.image_exists(image):
                raise SessionError(f"the image {image} is not on this Docker Engine: build it "
                                   "(bash docker/build.sh, or docker build -f docker/Dockerfile ...) or name another")
        runtime = "runsc" if "runsc" in await self.engine.runtimes() else None
        # The working directory staged and seen at /work by the engine before any network or egressd is made:
        # an engine in another mount namespace would mount the bare stage directory (``StagedWorkdir.check_seen``).
        staged = StagedWorkdir.make(self.workdir)
        stack.callback(staged.remove)
        await staged.check_seen(self.engine, self.image,
                                resource_labels(f"probe-{secrets.token_hex(4)}", "probe", owner_token(), self.labels))
        if self.connect:
            network, address, dns = await self._join_running_egressd()
        else:
            network, address, dns = await self._start_sidecar()
        assert self.control is not None and self.run_id is not None
        self._box = _SessionBox(self, DockerSandbox(
            engine=self.engine, network=network, address=address, dns=dns, image=self.image,
            workdir=self.workdir, proxy_url=self._proxy_url, labels=self.resources_labels("command"),
            # The sidecar has a SOCKS5 listener; a running egressd joined with --connect may not.
            socks_url=None if self.connect else str(URL(self._proxy_url).with_scheme("socks5h").with_port(SOCKS_PORT)),
            extra_env=self.extra_env, term=self.term, runtime=runtime, machine=machine, staged=staged,
            run_ca_pem=await self._run_ca(),
        ))
        stack.push_async_callback(self._box.sandbox.destroy)
        poller = asyncio.ensure_future(self._poll_forever())

        async def stop_poller() -> None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller

        stack.push_async_callback(stop_poller)

    def resources_labels(self, role: str) -> dict[str, str]:
        assert self.resources is not None
        return self.resources.labels_for(role)

    def _prepare_workdir(self) -> None:
        """A fresh working directory for the unprivileged sandbox user, or the given one if an
        ordinary user owns it (``SessionBase._take_workdir``); the engine mounts it nosuid,nodev
        through a stage of ours (``DockerSandbox``)."""
        self._take_workdir()

    async def _start_sidecar(self) -> tuple[str, str, str]:
        assert self.engine is not None
        net = await DockerRunNetwork.create(self.engine, pool=self.net_range, labels=self.labels)
        self.resources = net
        self._stack.push_async_callback(net.destroy)
        if net.note:
            print(f"egressd: {net.note}", file=sys.stderr)
        p = net.plan
        token = new_control_token()
        settings = await self._with_terminal_relay(str(p.outgoing.network_address + 1))
        env = sidecar_environment(settings, egressd_ip=str(p.egressd_ip), control_ip=str(p.egressd_outgoing_ip),
                                  token=token, files=self._files)
        sidecar = await start_egressd(net, image=self.egressd_image, env=env,
                                      secrets=sidecar_secrets(settings, token=token, files=self._files))
        self.egressd_container = sidecar.id
        self._stack.push_async_callback(self._save_audit)
        await self._register(sidecar.control_url, token, p.sandbox_ip)
        return p.internal_name, str(p.sandbox_ip), str(p.egressd_ip)

    async def _with_terminal_relay(self, gateway: str) -> Settings:
        """Our settings for the sidecar, its terminal approver relayed to ours (see ``TerminalRelay``)."""
        if "terminal" not in self.settings.approver:
            return self.settings
        if "webhook" in self.settings.approver:
            raise SessionError("with --backend docker the terminal approver is relayed over egressd's webhook "
                               "channel, so --approver terminal and --approver webhook cannot both be given")
        relay = TerminalRelay(address=gateway, tty_path=self.tty_path, output=self.terminal_output)
        if not await relay.start():
            return self.settings  # no terminal: the channel is not attached, as with bubblewrap
        self.relay = relay
        self._stack.push_async_callback(relay.close)
        approvers = [a for a in self.settings.approver if a != "terminal"] + ["webhook"]
        return self.settings.model_copy(update={"approver": approvers, "webhook_url": relay.url,
                                                "webhook_secret": SecretStr(relay.secret),
                                                "unsafe_webhook_http": True})

    async def _join_running_egressd(self) -> tuple[str, str, str]:
        """``--connect``: a network of the run's own, with that egressd's container attached to it.

        The container is the one whose published port (or own address) the
        control URL names. The subnet keeps clear of addresses that egressd
        still binds to other runs (a run whose process was killed stays
        registered). egressd must listen on every address of its container:
        the run's proxy URL and DNS answers name its address on the new
        network, and the control API refuses the run otherwise.
        """
        assert self.engine is not None and self.connect is not None
        control = ControlClient.for_url(self.connect, _connect_token(self.settings), timeout_s=CONTROL_TIMEOUT_S)
        self._stack.push_async_callback(control.close)
        health = await control.call("GET", "/health")
        if not isinstance(health, dict) or health.get("status") != "ok":
            raise SessionError(f"egressd at {self.connect} is not healthy: {health}")
        url = URL(self.connect)
        found = await self.engine.containers_serving(url.host or "", url.port or 0)
        if len(found) != 1:
            why = "no container" if not found else f"{len(found)} containers"
            raise SessionError(f"{why} of this Docker Engine serve{'s' if not found else ''} {self.connect}: "
                               "--connect needs egressd's own container, its control port published")
        runs = await control.call("GET", "/runs")
        bound = [ipaddress.ip_network(a) for r in (runs or {}).get("runs") or [] for a in r.get("sources") or []]
        net = await SharedEgressdNetwork.create(self.engine, pool=self.net_range, labels=self.labels,
                                                avoid=[b for b in bound if isinstance(b, ipaddress.IPv4Network)])
        self.resources = net
        self._stack.push_async_callback(net.destroy)
        if net.note:
            print(f"egressd: {net.note}", file=sys.stderr)
        await net.attach(found[0])
        p = net.plan
        await self._register_with(control, p.sandbox_ip, egressd=p.egressd_ip)
        if URL(self._proxy_url).host != str(p.egressd_ip):
            # An egressd that predates runs with networks of their own ignores "address":
            # its proxy and DNS would name an address this network has no way to.
            raise SessionError(f"egressd at {self.connect} cannot serve a run on a network of its own "
                               "(it ignored the run's address): upgrade it")
        return p.internal_name, str(p.sandbox_ip), str(p.egressd_ip)

    async def _register(self, control_url: str, token: str, address: ipaddress.IPv4Address) -> None:
        control = ControlClient.for_url(control_url, token, timeout_s=CONTROL_TIMEOUT_S)
        self._stack.push_async_callback(control.close)
        await self._register_with(control, address)

    async def _register_with(
        self, control: ControlClient, address: ipaddress.IPv4Address, *, egressd: ipaddress.IPv4Address | None = None
    ) -> None:
        """Register the run for the sandbox at ``address`` (and, on a shared egressd, egressd's address there).

        ``control`` carries the global token; every later call (command,
        events, approvals answered from our terminal, ending the run) goes
        with the run's own control token, and ``control`` is closed. An
        egressd too old to return one keeps being called with the global token.
        """
        s = self.settings
        body: dict[str, Any] = {
            "task": self.task, "allow": list(s.allow), "deny": list(s.deny), "preset": list(s.preset),
            "ask": s.ask, "sources": [str(address)],
        }
        if egressd is not None:
            body["address"] = str(egressd)
        created = await control.call("POST", "/runs", body)
        run_token = created.get("control_token") if isinstance(created, dict) else None
        if isinstance(run_token, str) and run_token:
            # From here on the run's own token, which acts on this run alone (egressd.control.api): the
            # global one is dropped with its client, no longer held by this session.
            run_control = ControlClient.for_url(control.url, run_token, timeout_s=CONTROL_TIMEOUT_S)
            self._stack.push_async_callback(run_control.close)
            await control.close()
            control = run_control
        self.control = control
        placeholders = created.get("secrets") if isinstance(created, dict) else None
        if isinstance(placeholders, dict):
            # The command holds each declared secret's placeholder under its name, never its value.
            self.extra_env.update({str(k): str(v) for k, v in placeholders.items()})
        if isinstance(run_token, str) and run_token:
            # In the registry of running instances, with the run's own token (in a file of its own there).
            registration = register_quietly(kind=self.kind, control=control.url, task=self.task, token=run_token)
            if registration is not None:
                self._stack.callback(registration.remove)
        if self.relay is not None:
            self.relay.control = control
            self.relay.run_scoped = isinstance(run_token, str) and bool(run_token)
        self.run_id = str(created["id"])
        self._proxy_url = str(created["proxy_url"])
        self.run = RemoteRun(self.run_id, self._proxy_url)
        self._stack.push_async_callback(self._end_run)

    async def _end_run(self) -> None:
        assert self.control is not None
        with contextlib.suppress(SessionError, ControlError):
            await self.poll()
            await self.control.call("DELETE", f"/runs/{self.run_id}")

    async def _save_audit(self) -> None:
        """Append the sidecar's audit records to ours, before its volume goes."""
        assert self.engine is not None and self.egressd_container is not None
        try:
            data = await read_file(self.engine, self.egressd_container, f"{EGRESSD_STATE}/audit.jsonl", MAX_AUDIT_BYTES)
        except (SandboxError, OSError) as exc:
            print(f"egressd: could not read the run's audit records: {exc}", file=sys.stderr)
            return
        if not data:
            return
        path = self.settings.audit_path
        try:
            if self.settings.audit_log is None:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            sink = JsonlAuditSink(path, fsync=self.settings.audit_fsync)
        except (AuditError, OSError) as exc:
            print(f"egressd: could not append the run's audit records to {path}: {exc}", file=sys.stderr)
            return
        try:
            for line in data.decode("utf-8", errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict):
                        sink.write(record)
        except AuditError as exc:
            print(f"egressd: could not append the run's audit records to {path}: {exc}", file=sys.stderr)
        finally:
            sink.close()

    # -- events --------------------------------------------------------------------

    async def poll(self) -> None:
        """Fetch the run's new events from egressd (and tell the observers)."""
        if self.control is None or self.run_id is None:
            return
        async with self._poll_lock:
            for _ in range(100):  # 1000 events a call: bounded, and more than a command makes
                data = await self.control.call("GET", f"/runs/{self.run_id}/events?cursor={self._server_cursor}")
                events = data.get("events") or []
                self._server_cursor = int(data.get("cursor", self._server_cursor))
                for event in events:
                    seen = EgressSeen.of(event)
                    self._events.append(seen)
                    for observer in self._observers:
                        observer(seen)
                if not events:
                    return

    async def _run_ca(self) -> bytes | None:
        """The run's inspection CA (its command trusts it), or None when the run inspects no names."""
        assert self.control is not None and self.run_id is not None
        status, text = await self.control.request_text("GET", f"/runs/{self.run_id}/ca")
        if status == 404:
            return None
        if status in (401, 403):
            # A run-scoped token may not read it: the command then cannot take inspected TLS (it fails closed).
            sys.stderr.write("egressd: this run's inspection CA needs egressd's global control token; "
                             "inspected names will fail\n")
            return None
        if status != 200 or "BEGIN CERTIFICATE" not in text:
            raise ControlError(f"egressd's control API refused GET /runs/{self.run_id}/ca: {status}", status)
        return text.encode()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            if self.polling:
                with contextlib.suppress(SessionError, ControlError):
                    await self.poll()

    async def flush_command(self) -> None:
        if self._command_sent or self.control is None:
            return
        await self.control.call("PUT", f"/runs/{self.run_id}/command", {"command": self._command})
        self._command_sent = True

    # -- what runners need (the same surface as SandboxSession) ------------------------

    def set_command(self, command: str | None) -> None:
        """What the run executes now: sent to egressd before the next command starts."""
        self._command = command
        self._command_sent = False

    def cursor(self) -> int:
        """A position in the run's egress events; pass it to ``refusals_since``."""
        return len(self._events)

    def refusals_since(self, cursor: int) -> list[Refusal]:
        """Egress refusals recorded after ``cursor``: host, port, reason, kind."""
        return refusals(self._events[cursor:])

    def observe(self, callback: Callable[[EgressSeen], None]) -> None:
        """Call ``callback`` with every egress record of this run as it arrives."""
        self._observers.append(callback)


async def copy_out(box: Sandbox, patterns: list[str], dest: Path) -> CopyReport:
    """``box.copy_out``, whichever backend made ``box``.

    A refused destination or a backend failure is a ``SessionError`` ("copy-out
    failed: ...", exit 125), for ``egressd run`` and ``egressd agent`` alike.
    """
    try:
        return await box.copy_out(patterns, dest)
    except (CopyOutError, SandboxError) as exc:
        raise SessionError(f"copy-out failed: {exc}") from None
