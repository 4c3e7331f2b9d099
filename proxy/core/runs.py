"""Runs: one sandbox's lifetime, and how a request is attributed to one.

A run holds the state the decision needs (its allowlist, what was approved or
denied during it, whether to ask), the command it is executing now (for the
approval message), its credentials (the proxy token its sandbox sends, and
the control token its runner uses on the control API: ``control_token``,
which acts on this run alone and dies with it) and the source addresses
bound to it, and
a bounded window of its recent egress events for the control API. A run on a
network of its own (``egressd run --connect``: a Docker network per run)
also holds egressd's address there, which its proxy URL names and its DNS
answers with.

Attribution order (``RunRegistry.attribute``):
1. ``Proxy-Authorization: Basic base64(RUN_ID:TOKEN)`` present (SOCKS5:
   username RUN_ID, password TOKEN, ``credentials``) → that run if the
   credentials are right, else nothing (the caller answers 407);
2. the client's source address is bound to a run → that run;
3. the default run, when there is one (``egressd serve`` without
   ``--require-auth``);
4. nothing: the caller refuses with ``auth_required``.

Entries change while a run lives (``egressd serve`` on SIGHUP, ``PATCH
/runs/ID``): ``Run.reconfigure``, ``Run.change_entries`` and the registry's
``global_deny`` replace the values ``decide`` reads and forget the decisions
remembered under the old ones, so the change applies to the next request.
A run remembers the edits made through the control API (its live edits), so
a reload of the configured entries (``Run.reconfigure``) lays them on top of
what the files say now instead of dropping them (``LiveMerge``).
A connection already decided is not decided again; approvals and denials
made during the run stay. An entry's identity is what it matches
(``entry_key``), so ``Example.com`` removes ``example.com``.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hmac
import ipaddress
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from egressd.names.addresses import IPAddress, unmapped
from egressd.names.hosts import HostError, normalised, registered_domain, split_port
from egressd.proxy.core.budget import Budget
from egressd.proxy.core.entries import EntryChange, LiveMerge, entry_key
from egressd.proxy.core.memo import remember
from egressd.proxy.core.policy import (
    DEFAULT_PORTS,
    Entry,
    PolicyDecision,
    RunPolicy,
    Verdict,
    approval_ports,
    decide,
    decide_request,
)
from egressd.vocabulary.reasons import Reason

DEFAULT_RUN_ID = "default"
# Enough for an agent's step to be read back by the runner; older events stay
# in the audit log, which is the record of truth.
EVENT_WINDOW = 10_000
# Distinct (host, port) decisions remembered per run; a flood of new names only empties it.
DECISION_CACHE = 4096
# A run's control token: 32 random bytes (256 bits), not guessable within any number of tries.
CONTROL_TOKEN_BYTES = 32


def new_control_token() -> str:
    """A fresh control token, in hex: never starting with '-' (``--control-token "$TOKEN"`` must parse)."""
    return secrets.token_hex(CONTROL_TOKEN_BYTES)


class RunError(Exception):
    """A run could not be created or found (unknown id, address already bound), or changed as asked."""


def _edited(
    entries: tuple[Entry, ...], add: Sequence[Entry], remove: Sequence[Entry], what: str
) -> tuple[tuple[Entry, ...], tuple[str, ...], tuple[str, ...]]:
    """``entries`` without ``remove`` and with ``add`` (removals first); RunError for a removal not there."""
    present = {entry_key(e) for e in entries}
    for entry in remove:
        if entry_key(entry) not in present:
            raise RunError(f"{what}: {entry.text!r} is not an entry of this run")
    gone = {entry_key(e) for e in remove}
    removed = tuple(e.text for e in entries if entry_key(e) in gone)
    kept = [e for e in entries if entry_key(e) not in gone]
    added: list[str] = []
    keys = {entry_key(e) for e in kept}
    for entry in add:
        if entry_key(entry) not in keys:  # already there: nothing to add
            kept.append(entry)
            keys.add(entry_key(entry))
            added.append(entry.text)
    return tuple(kept), tuple(added), removed


@dataclass(eq=False)
class Run:
    """One run's mutable state. Only the event loop thread touches it."""

    id: str
    token: str = field(repr=False)
    task: str | None
    allow: tuple[Entry, ...]
    deny: tuple[Entry, ...]
    ask: bool = True
    # Learn mode (--learn): what the allowlist alone would refuse is let through and recorded as ``learned``.
    learn: bool = False
    sources: frozenset[IPAddress] = frozenset()
    # egressd's address on the run's own network (None: the configured listeners' and DNS answer).
    address: IPAddress | None = None
    command: str | None = None
    approved: dict[str, frozenset[int]] = field(default_factory=dict)
    denied: set[str] = field(default_factory=set)
    # Inside inspected connections: (method, host, port, path prefix) approved, (method, host, prefix) denied.
    approved_requests: set[tuple[str, str, int, str]] = field(default_factory=set)
    denied_requests: set[tuple[str, str, str]] = field(default_factory=set)
    # Upload budgets, per registered domain (``budget``): made when the first byte goes there.
    budgets: dict[str, Budget] = field(default_factory=dict)
    open_connections: int = 0
    # Connections from the run's own source addresses still sending a request head (slowloris).
    waiting_heads: int = 0
    pending_approvals: int = 0
    events: deque[tuple[int, dict[str, Any]]] = field(default_factory=lambda: deque(maxlen=EVENT_WINDOW))
    next_event: int = 1
    # What the run did, for its ``run.end`` record (``summary``): connections and requests, DNS aside.
    allowed: int = 0
    refused: int = 0
    answered: int = 0  # decided by a person's answer (an approval)
    started: float = 0.0  # wall-clock seconds, the creator's clock (the core reads none)
    ended: bool = False
    # The run's own bearer token on the control API (``RunRegistry.by_control_token``); never shown.
    control_token: str = field(default="", repr=False)
    # The operator's deny entries (``serve``'s --deny and its allow file's), applied to a run
    # created through the control API on top of its own; the registry keeps them current.
    global_deny: tuple[Entry, ...] = ()
    _policy: RunPolicy | None = None
    # decide() is pure, so its answers for this policy are kept until the policy changes.
    _decisions: dict[tuple[str, int], PolicyDecision] = field(default_factory=dict)
    # The live edits (``change_entries``), the last one per entry: (kind, entry_key) → (entry, added).
    _live: dict[tuple[str, tuple[object, ...]], tuple[Entry, bool]] = field(default_factory=dict)
    # Told of every change of what ``decide`` reads (``RunRegistry.watch``: the workers' copies follow).
    watch: Callable[[], None] | None = field(default=None, repr=False)

    def policy(self) -> RunPolicy:
        """The pure decision input; rebuilt only after an approval, a denial or an entry change."""
        if self._policy is None:
            self._policy = RunPolicy(
                allow=self.allow,
                deny=self.deny + self.global_deny,
                approved=dict(self.approved),
                denied=frozenset(self.denied),
                ask=self.ask,
                learn=self.learn,
                approved_requests=frozenset(self.approved_requests),
                denied_requests=frozenset(self.denied_requests),
            )
        return self._policy

    def inspected_names(self) -> frozenset[str]:
        """The names whose TLS the run inspects: the hosts of its request rules (``*.`` kept for a wildcard)."""
        return frozenset(
            f"*.{entry.host}" if entry.wildcard else entry.host for entry in self.allow if entry.request is not None
        )

    def decide_request(self, method: str, host: str, port: int, path: str) -> PolicyDecision:
        """``policy.decide_request`` for this run (not remembered: paths are many)."""
        return decide_request(self.policy(), method, host, port, path)

    def budget(self, site: str, grant: int) -> Budget:
        """The run's upload budget for ``site`` (a registered domain), ``grant`` bytes at a time."""
        budget = self.budgets.get(site)
        if budget is None:
            budget = self.budgets[site] = Budget(site, grant)
        return budget

    def approve_request(self, method: str, host: str, port: int, prefix: str) -> None:
        """Allow ``method`` on the paths under ``prefix`` of host:port for the rest of the run."""
        self.approved_requests.add((method, host, port, prefix))
        self._changed()

    def deny_request(self, method: str, host: str, prefix: str) -> None:
        """A denied request sticks: ``method`` under ``prefix`` of the host is ``denied_earlier`` from now on."""
        self.denied_requests.add((method, host, prefix))
        self._changed()

    def decide(self, host: str, port: int) -> PolicyDecision:
        """``policy.decide`` for this run, remembered per (host, port) until the policy changes.

        Step 6 reaches further here than in the pure policy: a host whose
        registered domain was denied earlier in the run is ``denied_earlier``
        too, rather than asked about (approval fatigue: ``a1.evil.com``,
        ``a2.evil.com``, ... each a new prompt).
        """
        key = (host, port)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decide(host, port)
            remember(self._decisions, key, decision, DECISION_CACHE)
        return decision

    def _decide(self, host: str, port: int) -> PolicyDecision:
        decision = decide(self.policy(), host, port)
        asks = decision.verdict is Verdict.ASK or decision.learned is Reason.NOT_ALLOWLISTED
        if asks and self.denied and _site(decision.host) in self.denied:
            return PolicyDecision.deny(decision.host, port, Reason.DENIED_EARLIER)
        return decision

    def approve(self, host: str, port: int) -> None:
        """Allow host on port (and 80/443) for the rest of the run."""
        self.approved[host] = self.approved.get(host, frozenset()) | approval_ports(port)
        self._changed()

    def deny_host(self, host: str) -> None:
        """A denial sticks for the rest of the run and covers the host's registered domain.

        DESIGN.md "Decision order": every name under it that is not on the
        allowlist (nor approved earlier) is then ``denied_earlier``. A host
        with no registered domain (an IP literal, a public suffix) covers only
        itself.
        """
        self.denied.add(host)
        site = _site(host)
        if site is not None:
            self.denied.add(site)
        self._changed()

    def set_command(self, command: str | None) -> None:
        """The command the run executes now (its records and approval messages name it)."""
        self.command = command
        if self.watch is not None:
            self.watch()

    def stop_asking(self) -> None:
        """The run made as many approval requests as it may: new domains are ``not_allowlisted``."""
        self.ask = False
        self._changed()

    def set_entries(self, allow: Sequence[Entry], deny: Sequence[Entry]) -> None:
        """Replace the run's own entries; approvals, denials and the record of live edits stay."""
        self.allow, self.deny = tuple(allow), tuple(deny)
        self._changed()

    def reconfigure(self, allow: Sequence[Entry], deny: Sequence[Entry]) -> LiveMerge:
        """The configured entries changed (a reload): they become the run's, with its live edits on top.

        An edit the configured entries now say themselves is dropped from
        the live edits (``LiveMerge.in_files``); every other one is applied
        again (an added entry added, a removed one removed) and kept. So an
        operator's deny made through the control API outlives every reload,
        until the files say it too.
        """
        configured = {"allow": tuple(allow), "deny": tuple(deny)}
        kept: dict[str, tuple[list[str], list[str]]] = {"allow": ([], []), "deny": ([], [])}
        in_files: dict[str, tuple[list[str], list[str]]] = {"allow": ([], []), "deny": ([], [])}
        for (kind, key), (entry, added) in list(self._live.items()):
            said = any(entry_key(e) == key for e in configured[kind])
            where = in_files if said == added else kept
            where[kind][0 if added else 1].append(entry.text)
            if said == added:
                del self._live[(kind, key)]
        merged: dict[str, tuple[Entry, ...]] = {}
        for kind, entries in configured.items():
            removed = {key for (k, key), (_, added) in self._live.items() if k == kind and not added}
            adds = [entry for (k, _), (entry, added) in self._live.items() if k == kind and added]
            merged[kind] = tuple(e for e in entries if entry_key(e) not in removed) + tuple(adds)
        self.set_entries(merged["allow"], merged["deny"])

        def change(lists: dict[str, tuple[list[str], list[str]]]) -> EntryChange:
            return EntryChange(*(tuple(texts) for kind in ("allow", "deny") for texts in lists[kind]))

        return LiveMerge(kept=change(kept), in_files=change(in_files))

    def set_global_deny(self, deny: Sequence[Entry]) -> None:
        self.global_deny = tuple(deny)
        self._changed()

    def change_entries(
        self,
        *,
        allow_add: Sequence[Entry] = (),
        allow_remove: Sequence[Entry] = (),
        deny_add: Sequence[Entry] = (),
        deny_remove: Sequence[Entry] = (),
    ) -> EntryChange:
        """Add and remove the run's own entries, removals first; all of it or, on RunError, nothing.

        Removing an entry the run does not have is an error (a mistyped
        removal must not pass for a narrowed policy), and so is removing one
        of ``global_deny`` (the operator's, not the run's); adding one it
        already has changes nothing and is not reported as added.
        """
        allow, allow_added, allow_removed = _edited(self.allow, allow_add, allow_remove, "allow.remove")
        deny, deny_added, deny_removed = _edited(self.deny, deny_add, deny_remove, "deny.remove")
        change = EntryChange(allow_added, allow_removed, deny_added, deny_removed)
        if change:
            by_text = {e.text: e for e in (*self.allow, *self.deny, *allow, *deny)}  # the old and the new entries
            self.set_entries(allow, deny)
            # Removals first, as applied: an entry removed and added again in one edit ends up added.
            for kind, texts, added in (
                ("allow", allow_removed, False), ("deny", deny_removed, False),
                ("allow", allow_added, True), ("deny", deny_added, True),
            ):  # fmt: skip
                for text in texts:
                    entry = by_text[text]
                    self._live[(kind, entry_key(entry))] = (entry, added)
        return change

    def revoke(self, texts: Sequence[str], *, check_only: bool = False) -> list[str]:
        """Take back approvals given for the run: ``host`` (every port, and every request approved
        inside its inspected connections) or ``host:port``; all of it or, on RunError, nothing.

        What was taken back applies from the run's next request (a connection open now goes on).
        """
        taken: list[tuple[str, int | None]] = []
        for text in texts:
            name, port_text = split_port(text)
            host = normalised(name)
            if port_text and not (port_text.isdigit() and 1 <= int(port_text) <= 65535):
                raise RunError(f"revoke {text!r}: {port_text!r} is no port")
            port = int(port_text) if port_text else None
            requests = {key for key in self.approved_requests if key[1] == host}
            if host is None or not (host in self.approved or (port is None and requests)):
                raise RunError(f"revoke {text!r}: the run has no approval for it")
            if port is not None and port not in self.approved[host]:
                raise RunError(f"revoke {text!r}: the run's approval for {host} is not for port {port}")
            taken.append((host, port))
        if check_only:
            return []
        for host, port in taken:
            left = frozenset() if port is None else self.approved.get(host, frozenset()) - {port}
            if left:
                self.approved[host] = left
            else:
                self.approved.pop(host, None)
            if port is None:
                self.approved_requests = {key for key in self.approved_requests if key[1] != host}
        self._changed()
        return [host if port is None else f"{host}:{port}" for host, port in taken]

    def _changed(self) -> None:
        self._policy = None
        self._decisions.clear()
        if self.watch is not None:
            self.watch()

    def at_connection_cap(self, cap: int) -> bool:
        """Whether the run holds ``cap`` client connections, decided or still sending their head."""
        return self.open_connections + self.waiting_heads >= cap

    def waiting_head(self) -> WaitingHead:
        """Count a connection whose request head is still arriving against this run's cap (``with``).

        A head says which run it belongs to only once it is read; a run whose
        source addresses are its own (a sandbox on a network of its own) is
        known at accept, so its slow heads fill its own cap, not egressd's.
        """
        return WaitingHead(self)

    def allowed_texts(self) -> tuple[str, ...]:
        """The allowlist as a person reads it: entries, then approvals.

        An approval on another port than 80 and 443 shows as ``host:PORT``
        (one per port: the approval allows 80 and 443 too); else the host.
        """
        approved = [
            f"{host}:{port}" if port else host
            for host in sorted(self.approved)
            for port in sorted(self.approved[host] - DEFAULT_PORTS) or [0]
        ]
        return tuple(e.text for e in self.allow) + tuple(approved)

    def record_event(self, record: Mapping[str, Any]) -> None:
        """Keep a copy of ``record`` in the event window."""
        self.events.append((self.next_event, dict(record)))
        self.next_event += 1

    def keep_event(self, record: dict[str, Any]) -> None:
        """Keep ``record`` itself in the event window, not a copy: the caller built it for this and edits it no more.

        The recorder's way (one record per egress attempt and DNS query): every
        reader of the window and of the recorder's observers only reads.
        """
        self.events.append((self.next_event, record))
        self.next_event += 1
        if record.get("kind") != "dns":
            if record.get("decision") == "allow":
                self.allowed += 1
            else:
                self.refused += 1
            approval = record.get("approval")
            if isinstance(approval, dict) and approval.get("by") is not None:  # a person answered, not a timeout
                self.answered += 1

    def summary(self, now: float) -> dict[str, Any]:
        """What its ``run.end`` record says of the run: how long, what went out, what was refused, what a
        person decided (connections and requests; DNS queries are not counted)."""
        return {"duration_s": round(now - self.started, 3), "allowed": self.allowed, "refused": self.refused,
                "answered": self.answered}  # fmt: skip

    def events_after(self, cursor: int, limit: int = 1000) -> tuple[list[dict[str, Any]], int]:
        """Events with sequence numbers above ``cursor``, and the new cursor."""
        picked = [(seq, rec) for seq, rec in self.events if seq > cursor][:limit]
        if not picked:
            return [], cursor
        return [rec for _, rec in picked], picked[-1][0]

    def describe(self) -> dict[str, Any]:
        """The run as the control API shows it (never the token)."""
        return {
            "id": self.id,
            "task": self.task,
            "allow": [e.text for e in self.allow],
            "deny": [e.text for e in self.deny],
            "global_deny": [e.text for e in self.global_deny],
            "approved": sorted(self.approved),
            "denied": sorted(self.denied),
            "ask": self.ask,
            "learn": self.learn,
            "sources": sorted(str(a) for a in self.sources),
            "address": str(self.address) if self.address is not None else None,
            "command": self.command,
            "open_connections": self.open_connections,
        }


def _site(host: str) -> str | None:
    """The registered domain a denial of ``host`` covers; None when it covers only the host itself."""
    try:
        return registered_domain(host)
    except HostError:
        return None


@functools.lru_cache(maxsize=4096)  # a client connects from the same few addresses again and again
def source_address(text: str) -> IPAddress | None:
    """The address a client's source is bound by: ``peer[0]`` of a socket, as a value.

    A zone id is dropped and an IPv4-mapped IPv6 address (a dual-stack
    listener's view of an IPv4 client) becomes the IPv4 address it maps, so
    one client has one key whichever listener it reached. None when the text
    is no address (a Unix socket).
    """
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    return unmapped(address)


def parse_proxy_authorization(value: str) -> tuple[str, str] | None:
    """``Basic base64(id:token)`` → (id, token), or None when malformed."""
    # Only SP and HTAB are whitespace here (RFC 9110 §5.6.3), not str.strip()'s NBSP or NEL.
    scheme, _, payload = value.strip(" \t").partition(" ")
    if scheme.lower() != "basic" or not payload:
        return None
    try:
        # ValueError: a payload that is not ASCII (b64decode's binascii.Error
        # and UnicodeDecodeError are ValueErrors too).
        decoded = base64.b64decode(payload.strip(" \t"), validate=True).decode("utf-8")
    except ValueError:
        return None
    run_id, sep, token = decoded.partition(":")
    if not sep or not run_id:
        return None
    return run_id, token


class WaitingHead:
    """``Run.waiting_head``'s context: a plain class, as it is entered once per request."""

    __slots__ = ("run",)

    def __init__(self, run: Run) -> None:
        self.run = run

    def __enter__(self) -> None:
        self.run.waiting_heads += 1

    def __exit__(self, *exc: object) -> None:
        self.run.waiting_heads -= 1


# For a connection bound to no run: nothing to count (one object, entered as often as needed).
NOT_WAITING = contextlib.nullcontext()


class RunRegistry:
    """All live runs, by id and by bound source address.

    ``learn``: learn mode is egressd-wide (--learn), so every run created here has it.
    """

    def __init__(self, *, default: Run | None = None, learn: bool = False, global_deny: Sequence[Entry] = ()) -> None:
        self._runs: dict[str, Run] = {}
        self._by_source: dict[IPAddress, Run] = {}
        # The same runs by each bound address's text (``str``): one string per address, so a lookup by
        # text finds what one by address finds, hashing a str (its hash kept) rather than an ip_address
        # (hashed in Python, per lookup). The DNS server's index (``attribute_text``), kept with ``_by_source``.
        self._by_text: dict[str, Run] = {}
        self.default = default
        self.learn = learn
        # Applied to every run but the default one, whose own deny entries are these already.
        self.global_deny = tuple(global_deny)
        if default is not None:
            self._runs[default.id] = default
        self._watch: Callable[[], None] | None = None
        # Called with each run ``create`` made (a fleet's shared denials reach it as it starts).
        self.joined: list[Callable[[Run], None]] = []

    @property
    def watch(self) -> Callable[[], None] | None:
        """Called on every change of a run's policy, and when a run begins or ends (None: nobody watches)."""
        return self._watch

    @watch.setter
    def watch(self, watch: Callable[[], None] | None) -> None:
        self._watch = watch
        for run in self._runs.values():
            run.watch = watch

    def __iter__(self) -> Any:
        return iter(list(self._runs.values()))

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)

    def create(
        self,
        *,
        task: str | None,
        allow: Iterable[Entry],
        deny: Iterable[Entry] = (),
        ask: bool = True,
        sources: Iterable[IPAddress] = (),
        address: IPAddress | None = None,
        run_id: str | None = None,
        started: float = 0.0,
    ) -> Run:
        """Register a new run with fresh credentials; its source addresses must be free.

        ``address`` is egressd's own address on the run's network, when the
        run has one of its own.
        """
        sources = frozenset(sources)
        for source in sources:
            if source in self._by_source:
                raise RunError(f"source address {source} is already bound to run {self._by_source[source].id}")
        run_id = run_id or f"r-{secrets.token_hex(4)}"
        if run_id in self._runs:
            raise RunError(f"run {run_id} exists")
        run = Run(
            id=run_id,
            token=secrets.token_urlsafe(24),
            control_token=new_control_token(),
            task=task,
            allow=tuple(allow),
            deny=tuple(deny),
            ask=ask,
            learn=self.learn,
            sources=sources,
            address=address,
            global_deny=self.global_deny,
            started=started,
        )
        self.add(run)
        for callback in self.joined:
            callback(run)
        return run

    def add(self, run: Run) -> None:
        """Register ``run``, made with its credentials already (``create``'s, or a worker's copy of one)."""
        self._runs[run.id] = run
        for source in run.sources:
            self._by_source[source] = run
            self._by_text[str(source)] = run
        run.watch = self._watch
        if self._watch is not None:
            self._watch()

    def set_global_deny(self, deny: Sequence[Entry]) -> None:
        """The operator's deny entries changed: every run but the default one applies them from its next request."""
        self.global_deny = tuple(deny)
        for run in self._runs.values():
            if run is not self.default:
                run.set_global_deny(self.global_deny)
        if self._watch is not None:
            self._watch()

    def end(self, run_id: str) -> Run:
        run = self._runs.pop(run_id, None)
        if run is None:
            raise RunError(f"no run {run_id}")
        run.ended = True  # a request held across the end must not go out afterwards
        for address in run.sources:
            self._by_source.pop(address, None)
            self._by_text.pop(str(address), None)
        if run is self.default:
            self.default = None
        if self._watch is not None:
            self._watch()
        return run

    def authenticate(self, header: str) -> Run | None:
        """The run whose credentials the header carries, or None."""
        parsed = parse_proxy_authorization(header)
        if parsed is None:
            return None
        return self.credentials(*parsed)

    def credentials(self, run_id: str, token: str) -> Run | None:
        """The run whose id and token these are, or None (``Proxy-Authorization``'s, or SOCKS5's RFC 1929 pair)."""
        run = self._runs.get(run_id)
        if run is None:
            # Compare anyway, so a wrong id costs the same time as a wrong token.
            hmac.compare_digest(token.encode(), b"x" * 32)  # bytes: a str token may not be ASCII
            return None
        return run if hmac.compare_digest(token.encode(), run.token.encode()) else None

    def by_control_token(self, token: str) -> Run | None:
        """The live run whose control token this is, or None (an ended run's token matches nothing).

        Every live run's token is compared, in constant time, whichever
        matches: the time taken says nothing about which run's token, or how
        much of one, was guessed. A run without a control token (the default
        run) never matches.
        """
        given = token.encode()
        found: Run | None = None
        for run in self._runs.values():
            if hmac.compare_digest(given, run.control_token.encode()) and run.control_token:
                found = run
        return found

    def bound(self, source: IPAddress | None) -> Run | None:
        """The run this source address is bound to, if any (never the default run by default)."""
        return self._by_source.get(source) if source is not None else None

    def attribute(self, source: IPAddress | None, proxy_authorization: str | None) -> Run | None:
        """Steps 1-4 of the module docstring."""
        if proxy_authorization is not None:
            return self.authenticate(proxy_authorization)
        if source is not None:
            run = self._by_source.get(source)
            if run is not None:
                return run
        return self.default

    def attribute_text(self, source: str | None) -> Run | None:
        """``attribute(address, None)`` for the source address given as its text, ``str(address)``: steps 2-4.

        For a caller that keeps each client's address as text (the DNS
        server: one lookup per query). ``str`` of an address is one string
        per address (IPv6 compressed and lower-case, a scope id kept; an
        IPv4 text has no colon), so this finds exactly the run ``attribute``
        finds for the address, and the default run (or nothing) otherwise.
        """
        if source is not None:
            run = self._by_text.get(source)
            if run is not None:
                return run
        return self.default
