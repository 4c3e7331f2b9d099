"""An egressd instance wired from settings: proxy, control API, audit, approver.

``egressd serve`` runs one in the foreground; ``egressd run`` and the tests
embed one in their own event loop. Start-up either completes or raises
``StartupError`` with one message and leaves nothing running behind it.

``EgressService.reload`` applies new settings to a running instance
(``egressd serve`` on SIGHUP): the policy settings (``LIVE_SETTINGS``, and
what the allow file holds) take effect for new requests, every other
setting keeps its start-up value until a restart, and settings that do not
make a valid policy change nothing at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import ssl
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web

from egressd.approvals.assembly import approver_from_settings as _approvals_from_settings
from egressd.approvals.assembly import web_inbox
from egressd.approvals.commandoutput import TerminalOutput
from egressd.approvals.interface import Approver, ManagedApprover, SetupError
from egressd.audit.log import STDOUT, AuditError, AuditSink, JsonlAuditSink
from egressd.audit.records import fleet_state_record, policy_reloaded_record, run_record
from egressd.audit.shared import SharedChain
from egressd.config.allowfile import AllowFileError, read_allow_file
from egressd.config.presets import UnknownPreset, preset_entries
from egressd.config.settings import Settings, parse_hostport, token_path
from egressd.control.api import PUBLIC_PATHS, Lasting, build_app
from egressd.proxy.core.addresses import forbidden_reason
from egressd.proxy.core.decision import Screen, private_hint
from egressd.proxy.core.entries import EntryChange, LiveMerge, entry_diff
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.modes import EXPLICIT, SOCKS, ListenerLimits, transparent_http, transparent_tls
from egressd.proxy.core.policy import Entry, EntryError, parse_entry
from egressd.proxy.core.runs import DEFAULT_RUN_ID, Run, RunError, RunRegistry, new_control_token
from egressd.proxy.core.secrets import Secrets
from egressd.proxy.net.dialer import Dialer, bound_locally
from egressd.proxy.net.dnsserver import DnsServer
from egressd.proxy.net.inspector import Inspector
from egressd.proxy.net.kernelrelay import PIPES
from egressd.proxy.net.listener import Listener
from egressd.proxy.net.recorder import Recorder
from egressd.proxy.net.resolver import DnsResolver, Resolver, SystemResolver, parse_server
from egressd.proxy.net.runner import EgressPath

from ..logformat import direct_writer
from .anchor import say_head, say_heads
from .controltoken import TokenFileError, UntrustedEndpoint, check_socket_directory, write_token_file
from .declared import SecretSettingError, secrets_from_settings
from .errors import StartupError
from .fleetlasting import FleetLasting
from .lasting import lasting_answers
from .listening import dns_answers, dns_limits, listener_limits, own_endpoints, refusal_budget
from .workers import WorkerPool, process_count

log = logging.getLogger("egressd")


# Learn mode lets out what the allowlist would refuse: the terminal is reminded this often (DESIGN.md: "loudly").
LEARN_NOTICE_INTERVAL_S = 60.0


def learn_notice(learned: int | None) -> str:
    """The learn-mode warning: at start (``learned`` None), then with the count of attempts learned so far."""
    if learned is None:
        return (
            "egressd: LEARN MODE: egress is NOT restricted by the allowlist: what it would refuse or hold goes out "
            "and is recorded as learned (deny entries, IP literals and private addresses are still refused); "
            "turn what a run did into an allowlist with `egressd audit suggest`"
        )
    return f"egressd: LEARN MODE: egress is NOT restricted by the allowlist; {learned} attempts learned so far"


class ReloadError(Exception):
    """New settings were refused as a whole; the old policy is in force. The message names the setting or file."""


# The settings a reload applies: the policy. ``allow_file`` is not among them: its
# contents are re-read on every reload, but its path is where *always* answers are
# appended, fixed at start-up like every other setting.
LIVE_SETTINGS = frozenset({"allow", "deny", "preset", "allow_private", "ask"})


@dataclass(frozen=True, slots=True)
class PolicyReload:
    """What a reload changed: configured entries added and removed, other live settings changed, the
    settings that changed but need a restart (kept as they were), and what became of the default run's
    live edits (kept on top of the files, or now said by them)."""

    entries: EntryChange
    changed: tuple[str, ...]
    needs_restart: tuple[str, ...]
    live: LiveMerge = LiveMerge()


def entries_from_settings(settings: Settings) -> tuple[tuple[Entry, ...], tuple[Entry, ...]]:
    """Allow (with presets and the allow file's entries) and deny entries; StartupError naming a bad one."""
    try:
        preset_texts = [text for name in settings.preset for text in preset_entries(name)]
    except UnknownPreset as exc:
        raise StartupError(f"bad setting preset: {exc}") from None
    file_allow: tuple[str, ...] = ()
    file_deny: tuple[str, ...] = ()
    if settings.allow_file is not None:
        try:
            held = read_allow_file(settings.allow_file)
        except AllowFileError as exc:
            raise StartupError(f"bad setting allow_file: {exc}") from None
        file_allow, file_deny = held.allowed, held.deny
    parsed: list[tuple[Entry, ...]] = []
    for setting, texts in (
        ("allow", [*settings.allow, *preset_texts]),
        ("deny", settings.deny),
        ("allow_file", [*file_allow, *file_deny]),
    ):
        try:
            parsed.append(tuple(parse_entry(t) for t in texts))
        except EntryError as exc:
            where = f" ({settings.allow_file})" if setting == "allow_file" else ""
            raise StartupError(f"bad setting {setting}: {exc}{where}") from None
    from_file = parsed[2]
    return parsed[0] + from_file[: len(file_allow)], parsed[1] + from_file[len(file_allow) :]


def declared_secrets(settings: Settings, allow: Sequence[Entry] | None) -> Secrets | None:
    """``secrets_from_settings`` with egressd's own environment; StartupError."""
    try:
        return secrets_from_settings(settings, allow, os.environ)
    except SecretSettingError as exc:
        raise StartupError(str(exc)) from None


def _describe_change(entries: EntryChange, changed: tuple[str, ...]) -> str:
    """One line for the log: ``allow +a.com -b.com; deny +c.com; allow_private changed``, or ``no change``."""
    parts = []
    for kind, added, removed in (
        ("allow", entries.allow_added, entries.allow_removed),
        ("deny", entries.deny_added, entries.deny_removed),
    ):
        if added or removed:
            parts.append(" ".join([kind, *(f"+{t}" for t in added), *(f"-{t}" for t in removed)]))
    parts += [f"{name} changed" for name in changed]
    return "; ".join(parts) or "no change"


def approver_from_settings(
    settings: Settings, *, audit: AuditSink, terminal_output: TerminalOutput | None = None,
    fleet_instance: str | None = None, keep: FleetLasting | None = None,
) -> Approver:
    """The approver the settings name (a broker is not started yet); StartupError naming a bad setting."""
    try:
        return _approvals_from_settings(settings, audit=audit, terminal_output=terminal_output,
                                        fleet_instance=fleet_instance, keep=keep.keep if keep is not None else None,
                                        share_denial=keep.share if keep is not None else None)  # fmt: skip
    except SetupError as exc:
        raise StartupError(str(exc)) from None


class EgressService:
    """The proxy, its control API and its audit log, in the running event loop."""

    def __init__(
        self,
        settings: Settings,
        *,
        approver: Approver | None = None,
        resolver: Resolver | None = None,
        audit: AuditSink | None = None,
        terminal_output: TerminalOutput | None = None,
        workers: bool = False,
        fleet_instance: str | None = None,
    ) -> None:
        self.settings = settings
        self._fleet_instance = fleet_instance  # this egressd's id in its fleet (serve --state): approvals shared
        self._fleet_rules: FleetLasting | None = None  # and the fleet's always answers, applied here
        # ``egressd serve``'s: worker processes besides this one (an embedded egressd has none); how many is
        # decided at the start (``process_count``).
        self._serve_workers = workers
        self._processes = 1
        self._with_workers = False
        self.workers: WorkerPool | None = None
        self._approver = approver
        self._terminal_output = terminal_output  # a sandboxed command's output, held back during a prompt
        self._approvals: ManagedApprover | None = None  # the broker this service started (and stops)
        self._resolver = resolver
        self._audit = audit
        self._own_audit: JsonlAuditSink | None = None  # the file sink this service opened (SIGUSR1 reopens it)
        self.runs: RunRegistry | None = None
        self.path: EgressPath | None = None  # what every connection goes through (recorder, dialer, ...)
        self.proxy: Listener | None = None
        self.dns: DnsServer | None = None
        self.transparent_tls: Listener | None = None
        self.transparent_http: Listener | None = None
        self.socks: Listener | None = None  # the SOCKS5 listener (``socks``), when set
        self._control_runner: web.AppRunner | None = None
        self.control_token = ""
        self.control_address: str = ""
        self._bound: dict[str, int] = {}  # listener setting → the port it got
        self._learn_notices: asyncio.Task[None] | None = None  # learn mode's reminder, owned and cancelled here
        self._heads: asyncio.Task[None] | None = None  # the audit head said outside the log (``anchor``)
        self.learn_notice_interval_s = LEARN_NOTICE_INTERVAL_S
        # The configured entries (settings, presets, allow file), as the last start or reload read them.
        self._allow: tuple[Entry, ...] = ()
        self._deny: tuple[Entry, ...] = ()
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> EgressService:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def proxy_address(self) -> tuple[str, int]:
        assert self.proxy is not None
        return self.proxy.address

    @property
    def dns_address(self) -> tuple[str, int] | None:
        """Where the DNS server listens (the port it got, for ``dns_listen`` port 0); None without one."""
        return self.dns.address if self.dns is not None else None

    @property
    def transparent_tls_address(self) -> tuple[str, int] | None:
        return self.transparent_tls.address if self.transparent_tls is not None else None

    @property
    def transparent_http_address(self) -> tuple[str, int] | None:
        return self.transparent_http.address if self.transparent_http is not None else None

    @property
    def socks_address(self) -> tuple[str, int] | None:
        return self.socks.address if self.socks is not None else None

    @property
    def default_run(self) -> Run | None:
        return self.runs.default if self.runs else None

    def reopen_audit(self) -> None:
        """Reopen the audit log at its path (``SIGUSR1``, after logrotate moved it); a sink given to us is left alone.

        Runs on the event loop, between two records, so none is split or lost.
        """
        if self._own_audit is not None:
            self._own_audit.reopen()

    def reload(self, settings: Settings) -> PolicyReload:
        """Apply ``settings``' policy to the running instance, for new requests; ReloadError changes nothing.

        1. The configured entries are read as at start-up (settings, presets,
           the allow file, each entry parsed); anything wrong → ReloadError
           naming the setting or file, the ``policy.reloaded`` record says
           why, and the old policy stays whole.
        2. The default run's entries become the configured ones with its
           live edits on top (``egressd policy default``, ``PATCH
           /runs/default``: ``Run.reconfigure``; an edit the files now say
           is theirs from then on) and its ``ask`` follows
           the setting when the setting changed; runs created through the
           control API keep their own entries, and the configured deny
           entries replace their ``global_deny``; ``allow_private`` applies
           to every run's next dial.
        3. Any other setting that changed is logged as needing a restart and
           kept as it was: the running listeners, channels, audit log and
           limits are those of the start.

        Approvals and denials made during a run stay, open connections are
        not decided again. Logs one line and writes one ``policy.reloaded``
        record either way.
        """
        assert self.path is not None and self.runs is not None
        old = self.settings
        try:
            # The allow file read is the one named at start (a new path needs a restart).
            allow, deny = self._entries(settings.model_copy(update={"allow_file": old.allow_file}))
        except StartupError as exc:
            self.refuse_reload(str(exc))
            raise ReloadError(str(exc)) from None
        needs_restart = tuple(
            name
            for name in type(old).model_fields
            if name not in LIVE_SETTINGS and getattr(settings, name) != getattr(old, name)
        )
        changed = tuple(name for name in ("allow_private", "ask") if getattr(settings, name) != getattr(old, name))
        allow_added, allow_removed = entry_diff(self._allow, allow)
        deny_added, deny_removed = entry_diff(self._deny, deny)
        entries = EntryChange(allow_added, allow_removed, deny_added, deny_removed)

        # Everything is checked: from here on nothing can fail half-way.
        self._allow, self._deny = allow, deny
        default = self.runs.default
        live = LiveMerge()
        if default is not None:
            if "ask" in changed:
                default.ask = settings.ask
            # The operator's live edits stay on top; also forgets the decisions made under the old ``ask``.
            live = default.reconfigure(allow, deny)
        self.runs.set_global_deny(deny)
        if "allow_private" in changed:
            self.path.screen.set_allow_private(settings.allow_private_networks)
        self.settings = old.model_copy(update={name: getattr(settings, name) for name in LIVE_SETTINGS})

        if needs_restart:
            log.warning(
                "reload: %s changed but only apply at start-up (needs a restart); kept as they were",
                ", ".join(needs_restart),
            )
        log.info("policy reloaded: %s", _describe_change(entries, changed))
        if live.kept:
            log.warning("reload: live edits kept on top of the files: %s", _describe_change(live.kept, ()))
        if live.in_files:
            log.info("reload: live edits the files now say (the files rule them): %s",
                     _describe_change(live.in_files, ()))
        self._write_run_record(
            policy_reloaded_record(
                ts=time.time(),
                ok=True,
                added=entries.added,
                removed=entries.removed,
                changed=changed,
                needs_restart=needs_restart,
                live_kept=live.kept.by_kind,
                live_in_files=live.in_files.by_kind,
            )
        )
        return PolicyReload(entries, changed, needs_restart, live)

    def refuse_reload(self, error: str) -> None:
        """A reload was refused (``error`` names the setting or file): one log line, one record; nothing changes."""
        log.error("reload refused, the old policy stays in force: %s", error)
        self._write_run_record(policy_reloaded_record(ts=time.time(), ok=False, error=error))

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.close(grace_s=0)
            raise

    def _entries(self, settings: Settings) -> tuple[tuple[Entry, ...], tuple[Entry, ...]]:
        """``entries_from_settings``, with the fleet's standing *always* entries allowed too."""
        allow, deny = entries_from_settings(settings)
        if self._fleet_rules is None:
            return allow, deny
        kept: list[Entry] = []
        for text in self._fleet_rules.entries():
            try:
                kept.append(parse_entry(text))
            except EntryError as exc:  # a row another egressd wrote: this one does not apply what it cannot read
                log.warning("fleet: the always entry %r is not applied here: %s", text, exc)
        return allow + tuple(kept), deny

    def _take_back(self, entries: Sequence[str]) -> None:
        """Always entries revoked on another instance: every live run's own approval for each goes too."""
        assert self.runs is not None
        for run in self.runs:
            for entry in entries:
                with contextlib.suppress(RunError):
                    run.revoke([entry])

    async def _start(self) -> None:
        s = self.settings
        if self._fleet_instance is not None and s.state is not None:
            self._fleet_rules = FleetLasting(s.state.get_secret_value(), self._fleet_instance,
                                             share_denials=s.share_denials, group=s.group)  # fmt: skip
            await self._fleet_rules.open()  # the standing rules are part of the first policy
            self._stack.push_async_callback(self._fleet_rules.close)
        allow, deny = self._entries(s)
        self._allow, self._deny = allow, deny
        for entry in allow:  # allowed, and refused all the same at the address check: said now, not at the first try
            if entry.address is not None and forbidden_reason(entry.address, s.allow_private_networks) is not None:
                log.warning("egressd: the allow entry %s names a private or special address, which is refused "
                            "unless --allow-private covers it (%s)", entry.text, private_hint(str(entry.address)))

        audit = self._audit
        chain: SharedChain | None = None
        self._processes = process_count(s) if self._serve_workers else 1
        self._with_workers = self._processes > 1
        if self._with_workers:
            if audit is not None:
                raise StartupError("bad setting workers: workers write egressd's own audit log, and a sink was given")
            chain = SharedChain.create()
            self._stack.callback(chain.close)
        if audit is None:
            path = s.audit_path
            if s.audit_log is None:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                audit = JsonlAuditSink(path, fsync=s.audit_fsync, max_bytes=s.audit_max_bytes, keep=s.audit_keep,
                                       shared=chain)  # fmt: skip
            except AuditError as exc:
                raise StartupError(f"bad setting audit_log: {exc}") from None
            self._stack.callback(audit.close)
            self._own_audit = audit
        resolver = self._resolver
        if resolver is None:
            if s.upstream_dns:
                resolver = DnsResolver(parse_server(s.upstream_dns))
                self._stack.push_async_callback(resolver.close)
            else:
                resolver = SystemResolver()
        approver = self._approver
        if approver is None:
            approver = approver_from_settings(s, audit=audit, terminal_output=self._terminal_output,
                                              fleet_instance=self._fleet_instance, keep=self._fleet_rules)  # fmt: skip
            if isinstance(approver, ManagedApprover):
                self._approvals = approver
                try:
                    await approver.start()  # Slack's auth.test and Socket Mode, the terminal, ...
                except SetupError as exc:
                    raise StartupError(str(exc)) from None

        listen_host, listen_port = s.listen_address
        try:
            inspector = Inspector(origin_cafile=str(s.inspect_origin_ca_file) if s.inspect_origin_ca_file else None)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"bad setting inspect_origin_ca_file: {exc}") from None
        self.path = EgressPath(
            recorder=Recorder(
                audit=audit, metrics=Metrics(), refusals=refusal_budget(s, share=self._processes)
            ),
            dialer=Dialer(origin_tls=inspector.origin_context),
            approver=approver,
            resolver=resolver,
            screen=Screen(allow_private=s.allow_private_networks, own=own_endpoints(s), is_local=bound_locally),
            inspector=inspector,
            # With --require-auth runs bring their own lists (a run session checks its list first).
            secrets=declared_secrets(s, None if s.require_auth else entries_from_settings(s)[0]),
        )
        self.path.recorder.say = direct_writer(logging.getLogger("egressd.decisions")) or self.path.recorder.say
        default = None
        if not s.require_auth:
            default = Run(
                id=DEFAULT_RUN_ID,
                token=secrets.token_urlsafe(24),
                task=None,
                allow=allow,
                deny=deny,
                ask=s.ask,
                learn=s.learn,
                started=time.time(),
            )
        # The operator's deny entries apply to the runs created through the control API too.
        self.runs = RunRegistry(default=default, learn=s.learn, global_deny=deny)
        if self._fleet_rules is not None:
            self._fleet_rules.attach(self.runs)

        limits = listener_limits(s, share=self._processes)
        self.proxy = Listener(path=self.path, runs=self.runs, limits=limits, mode=EXPLICIT)
        try:
            await self.proxy.start(listen_host, listen_port, shared=self._with_workers)
        except OSError as exc:
            raise StartupError(f"bad setting listen: cannot listen on {s.listen}: {exc.strerror}") from None
        self._listening("listen", self.proxy.address[1])
        await self._start_transparent(limits)
        await self._start_control()
        if chain is not None:
            await self._start_workers(chain, audit)
        if default is not None:
            self._write_run_record(
                run_record(
                    "run.start",
                    ts=time.time(),
                    run=default.id,
                    allow=[e.text for e in allow],
                    deny=[e.text for e in deny],
                    **({"learn": True} if s.learn else {}),
                )
            )
        if s.learn:  # said once everything started: a failed start prints only its one error line
            print(learn_notice(None), file=sys.stderr, flush=True)
            self._learn_notices = asyncio.get_running_loop().create_task(self._remind_learning())
        self._heads = asyncio.get_running_loop().create_task(say_heads(self.path.recorder.audit))

    async def _remind_learning(self) -> None:
        """Learn mode: say on stderr, every ``learn_notice_interval_s``, that egress is open (until close)."""
        while True:
            await asyncio.sleep(self.learn_notice_interval_s)
            learned = self.path.recorder.metrics.learned if self.path is not None else 0
            print(learn_notice(learned), file=sys.stderr, flush=True)

    async def _start_transparent(self, limits: ListenerLimits) -> None:
        """The transparent SNI and Host listeners, the SOCKS5 listener and the DNS server, each when set."""
        s = self.settings
        assert self.path is not None and self.runs is not None
        if s.transparent_tls is not None:
            self.transparent_tls = Listener(path=self.path, runs=self.runs, limits=limits, mode=transparent_tls())
            await self._listen(self.transparent_tls, "transparent_tls", s.transparent_tls)
        if s.transparent_http is not None:
            self.transparent_http = Listener(path=self.path, runs=self.runs, limits=limits, mode=transparent_http())
            await self._listen(self.transparent_http, "transparent_http", s.transparent_http)
        if s.socks is not None:
            self.socks = Listener(path=self.path, runs=self.runs, limits=limits, mode=SOCKS)
            await self._listen(self.socks, "socks", s.socks)
        if s.dns_listen is not None:
            answer4, answer6 = dns_answers(s)
            self.dns = DnsServer(
                recorder=self.path.recorder, runs=self.runs, answer4=answer4, answer6=answer6, strict=s.dns_strict,
                **dns_limits(self._processes)._asdict(),
            )
            await self._listen(self.dns, "dns_listen", s.dns_listen)

    @property
    def processes(self) -> int:
        """How many processes serve the proxy's listeners: this one and its workers (known once started)."""
        return self._processes

    async def _workers_metrics(self) -> list[tuple[Metrics, int]]:
        return await self.workers.metrics() if self.workers is not None else []

    async def _start_workers(self, chain: SharedChain, audit: AuditSink) -> None:
        """The worker processes, each in every TCP listener's group; StartupError if one cannot start."""
        assert self.runs is not None and self.path is not None and self.proxy is not None
        assert isinstance(audit, JsonlAuditSink)  # the service's own: a sink given is refused with workers
        listeners = {"listen": self.proxy, "transparent_tls": self.transparent_tls,
                     "transparent_http": self.transparent_http, "socks": self.socks}  # fmt: skip
        self.workers = WorkerPool(
            settings=self.settings, processes=self._processes, runs=self.runs, approver=self.path.approver,
            inspector=self.path.inspector, screen=self.path.screen, secrets=self.path.secrets,
            say=self.path.recorder.say, observers=self.path.recorder.observers,
            listeners={name: listener for name, listener in listeners.items() if listener is not None}, dns=self.dns,
            bound=dict(self._bound), chain=chain, audit=audit,
            audit_stream=audit.descriptor if audit.path == STDOUT else None,
        )  # fmt: skip
        try:
            await self.workers.start()
        except (OSError, RuntimeError) as exc:
            raise StartupError(f"bad setting workers: {exc}") from None

    async def _listen(self, server: Listener | DnsServer, setting: str, value: str) -> None:
        host, port = parse_hostport(value, setting)
        try:
            await server.start(host, port, shared=self._with_workers)
        except OSError as exc:
            raise StartupError(f"bad setting {setting}: cannot listen on {value}: {exc.strerror}") from None
        self._listening(setting, server.address[1])

    def _listening(self, setting: str, port: int) -> None:
        """A listener is bound: its endpoint joins egressd's own before anything is dialled to it."""
        assert self.path is not None
        self._bound[setting] = port
        self.path.screen.own = own_endpoints(self.settings, self._bound)

    async def _start_control(self) -> None:
        s = self.settings
        assert self.path is not None and self.runs is not None
        if s.control_token is not None:
            self.control_token = s.control_token.get_secret_value()
        else:
            self.control_token = new_control_token()
            path = token_path(s)
            try:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                # A new file of ours, mode 0600, renamed over the name: never one another user put there first.
                write_token_file(path, self.control_token)
            except OSError as exc:
                raise StartupError(f"bad setting control: cannot write the token file {path}: {exc.strerror}") from None
            except TokenFileError as exc:
                raise StartupError(f"bad setting control: cannot write the token file {path}: {exc}") from None
        egress = self.path
        app = build_app(
            recorder=egress.recorder,
            screen=egress.screen,
            runs=self.runs,
            proxy_address=self.proxy_address,
            token=self.control_token,
            inspector=self.path.inspector,
            placeholders={s.name: s.placeholder for s in self.path.secrets.declared} if self.path.secrets else None,
            lasting=self._lasting(),
            more_metrics=self._workers_metrics if self._with_workers else None,
        )
        pages: list[str] = []  # the approvals page's own random path, printed with its URL
        if isinstance(self.path.approver, ManagedApprover):
            # /approvals for `egressd pending|allow|deny`; the webhook callback and
            # Slack's interactivity endpoint are public: their signature is the credential.
            for route in self.path.approver.routes():
                app.router.add_route(route.method, route.path, route.handler)
                if route.public:
                    app[PUBLIC_PATHS].add(route.path)
                if route.page:
                    pages.append(route.path)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._control_runner = runner
        try:
            if s.control.startswith("unix:"):
                socket_path = s.control.removeprefix("unix:")
                try:
                    check_socket_directory(socket_path)  # `egressd pending` would not trust it there
                except UntrustedEndpoint as exc:
                    raise StartupError(f"bad setting control: {exc}") from None
                site: web.BaseSite = web.UnixSite(runner, socket_path)
                await site.start()
                os.chmod(socket_path, 0o600)
                self.control_address = s.control
            else:
                host, port = parse_hostport(s.control, "control")
                site = web.TCPSite(runner, host, port, reuse_address=True)
                await site.start()
                sockets = runner.addresses
                bound_port = sockets[0][1] if sockets else port
                self._listening("control", bound_port)
                shown = f"[{host}]" if ":" in host else host
                self.control_address = f"http://{shown}:{bound_port}"
                for page in pages:
                    log.info(
                        "approvals page: %s%s (sign in with the control token); %s",
                        (s.public_url or self.control_address).rstrip("/"),
                        page,
                        f"an inbox: a new domain is held up to {s.approval_timeout:g}s for whoever opens it"
                        if web_inbox(s) else "a new domain is refused (no_approver) unless someone has it open",
                    )
        except OSError as exc:
            raise StartupError(f"bad setting control: cannot listen on {s.control}: {exc.strerror}") from None

    def _write_run_record(self, record: dict[str, object]) -> None:
        assert self.path is not None
        with contextlib.suppress(AuditError):
            self.path.recorder.audit.write(record)

    def _lasting(self) -> Lasting:
        """The *always* answers the control API lists and revokes: the allow file's, and the fleet's."""
        in_file = lasting_answers(self.settings.allow_file, lambda: self.reload(self.settings))
        if self._fleet_rules is None:
            return in_file
        self._fleet_rules.apply = lambda: self.reload(self.settings)
        self._fleet_rules.take_back = self._take_back
        instance = self._fleet_rules.instance
        self._fleet_rules.state_changed = lambda error: self._write_run_record(fleet_state_record(
            ts=time.time(), instance=instance, reachable=error is None, error=error))  # fmt: skip
        return self._fleet_rules.lasting(in_file)

    async def close(self, grace_s: float | None = None) -> None:
        """Stop accepting, let tunnels finish within the grace period, flush the log."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        for task in (self._learn_notices, self._heads):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._learn_notices = self._heads = None
        if self._approvals is not None:
            # Nobody can answer once egressd stops: held requests are denied now, not after the grace.
            await self._approvals.close()
            self._approvals = None
        if self.dns is not None:
            await self.dns.close()
            self.dns = None
        if self.workers is not None:
            await self.workers.close(grace)
            self.workers = None
        # Every TCP listener gets the same grace at the same time, not one after another.
        listeners = [x for x in (self.transparent_tls, self.transparent_http, self.socks, self.proxy) if x is not None]
        await asyncio.gather(*(listener.close(grace) for listener in listeners))
        self.transparent_tls = self.transparent_http = self.socks = None
        self.proxy = None
        PIPES.close()  # the empty pipes kept for spliced tunnels (one in use goes back when its tunnel ends)
        if self._control_runner is not None:
            await self._control_runner.cleanup()
            self._control_runner = None
        if self.path is not None:
            self.path.recorder.flush_suppressed(every=True)  # refusals counted but not yet summarised
        if self.runs is not None and self.runs.default is not None and self.path is not None:
            now = time.time()
            self._write_run_record(run_record("run.end", ts=now, run=self.runs.default.id,
                                              **self.runs.default.summary(now)))  # fmt: skip
            self.runs = None
        if self.path is not None:
            # What the last loop iteration queued (a sink the caller gave is not closed here).
            with contextlib.suppress(AuditError):
                self.path.recorder.audit.flush()
            say_head(self.path.recorder.audit)  # the last head, outside the log
        await self._stack.aclose()
