"""The allowlist policy: entries, and the one function that decides a request.

``decide`` implements steps 1-7 of DESIGN.md "Decision order" and nothing
else: it never resolves, never waits and never asks anyone. What it returns
is a value: ALLOW (resolve, then check the addresses), DENY with a reason, or
ASK (the caller holds the request and asks an approver; the outcomes of asking
— no_approver, too_many_pending, denied, approval_timeout — and the address
check — private_address — are decided by the caller).

Learn mode (``RunPolicy.learn``, DESIGN.md ``--learn``) is decided here too,
once for every listener: what the allowlist alone would refuse or hold
(``port_not_allowed``, ``not_allowlisted``, ASK) is ALLOWed with no rule and
``learned`` set to the reason it would have had; everything else (deny
entries, IP literals, a bad request, a host denied earlier, and the callers'
address check) is decided exactly as without it.

Pure: no I/O.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from egressd.names.addresses import IPAddress, unmapped
from egressd.names.authority import parse_port, split_authority
from egressd.names.hosts import (
    HostError,
    is_public_suffix,
    parse_host,
    parse_ip_literal,
)
from egressd.names.suffixes import suffix_beneath
from egressd.proxy.core.requestrules import RequestRule, RuleError, parse_rule, under
from egressd.vocabulary.reasons import Reason

__all__ = [
    "APPROVED_RULE",
    "DEFAULT_PORTS",
    "PolicyDecision",
    "Entry",
    "EntryError",
    "RunPolicy",
    "Verdict",
    "approval_ports",
    "decide",
    "lasting_entry",
    "parse_entry",
]

# DESIGN.md "Policy": an entry without a port allows the web's two ports.
DEFAULT_PORTS: frozenset[int] = frozenset({80, 443})

APPROVED_RULE = "approved"


class Verdict(enum.Enum):
    """What the policy says: go ahead, refuse, or ask a person."""

    ALLOW = "allow"
    DENY = "deny"
    ASK = "ask"


@dataclass(frozen=True, slots=True)
class PolicyDecision:
    """The policy's answer for one HOST:PORT.

    ``host`` is the normalised host (the raw text when it could not be
    normalised); ``reason`` is set exactly when the verdict is DENY; ``rule``
    is the text of the entry that matched, ``"approved"`` for a destination
    approved during the run, or None. ``learned`` is set only on an ALLOW in
    learn mode: the reason the request would have been refused with
    (``not_allowlisted`` also for one that would have been held and asked
    about); its ``rule`` is None. ``address`` is the host's IP address
    when it is an IP literal and the verdict is not DENY (what to dial, from
    the parse that decided: the host is parsed once); it is a function of
    ``host``, so it takes no part in comparisons.
    """

    verdict: Verdict
    host: str
    port: int
    reason: Reason | None = None
    rule: str | None = None
    address: IPAddress | None = field(default=None, compare=False)
    learned: Reason | None = None
    # Allowed for inspection: a request rule names this host and port, so each request inside
    # its TLS is decided on its own (``decide_request``).
    inspect: bool = False

    def __post_init__(self) -> None:
        if (self.reason is not None) != (self.verdict is Verdict.DENY):
            raise ValueError("a PolicyDecision has a reason exactly when it denies")
        if self.learned is not None and (self.verdict is not Verdict.ALLOW or self.rule is not None):
            raise ValueError("only a learn-mode ALLOW, with no rule, says what it would have been")

    @classmethod
    def allow(cls, host: str, port: int, rule: str, address: IPAddress | None = None) -> PolicyDecision:
        return cls(Verdict.ALLOW, host, port, None, rule, address)

    @classmethod
    def deny(cls, host: str, port: int, reason: Reason, rule: str | None = None) -> PolicyDecision:
        return cls(Verdict.DENY, host, port, reason, rule)

    @classmethod
    def learn(cls, host: str, port: int, would: Reason, address: IPAddress | None = None) -> PolicyDecision:
        """Learn mode: allowed with no rule, recording the refusal ``would`` it would have been."""
        return cls(Verdict.ALLOW, host, port, None, None, address, would)

    @classmethod
    def ask(cls, host: str, port: int, address: IPAddress | None = None) -> PolicyDecision:
        return cls(Verdict.ASK, host, port, address=address)


class EntryError(ValueError):
    """An allowlist or denylist entry is malformed or too broad."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One parsed allowlist or denylist entry.

    ``host`` is the normalised host, the suffix after ``*.`` for a wildcard,
    or the canonical IP text; ``ports`` None means any port; ``address`` is
    set when the entry names an IP address.
    """

    text: str
    host: str
    wildcard: bool = False
    ports: frozenset[int] | None = DEFAULT_PORTS
    address: IPAddress | None = None
    # A request rule (``requestrules``): the entry allows the host's requests by method and path.
    request: RequestRule | None = None

    def matches_host(self, host: str) -> bool:
        """Whether the entry's text covers a host, which must already be normalised.

        A wildcard covers names below its suffix at any depth, never the
        suffix itself; an IP entry covers the same address in any spelling.
        This is the textual match a deny entry uses; an allow entry also
        needs ``reaches``.
        """
        if self.address is not None:
            try:
                other = parse_ip_literal(host)
            except HostError:
                return False
            return other is not None and unmapped(other) == unmapped(self.address)
        if self.wildcard:
            return host.endswith("." + self.host)
        return host == self.host

    def reaches(self, host: str) -> bool:
        """Whether an allow entry covers a host: ``matches_host``, and no public suffix in between.

        DESIGN.md "Policy": a wildcard never reaches across a public suffix
        beneath its base. ``*.amazonaws.com`` covers ``ec2.amazonaws.com``
        but not ``bucket.s3.amazonaws.com``, whose owner is whoever
        registered ``bucket`` under the suffix ``s3.amazonaws.com`` (Public
        Suffix List, private section included). The list is asked only
        after the cheap textual match, and ``decide``'s answers are
        remembered per run, so a repeated host never asks it again.
        """
        if not self.matches_host(host):
            return False
        return not self.wildcard or suffix_beneath(host, self.host) is None

    def allows_port(self, port: int) -> bool:
        """Whether the entry allows a port."""
        return self.ports is None or port in self.ports


def parse_entry(text: str) -> Entry:
    """Parse an entry: ``example.com``, ``*.example.com``, ``host:8443``, ``host:*``.

    IP entries are ``127.0.0.1``, ``127.0.0.1:8080``, ``[::1]:443`` or ``::1``
    (an unbracketed IPv6 address cannot carry a port). Without a port an entry
    allows 80 and 443. Raises EntryError for an empty or malformed entry, a
    wildcard other than one leading ``*.``, a wildcard on an IP address, and a
    wildcard covering a public suffix (``*.com``, ``*.co.uk``, ``*.github.io``,
    or an unknown top-level name such as ``*.internal``).
    """
    if not text:
        raise EntryError("empty entry")
    try:
        rule = parse_rule(text)
    except RuleError as error:
        raise EntryError(f"entry {text!r}: {error}") from error
    if rule is not None:
        host_entry = parse_entry(rule.authority)
        if host_entry.address is not None:
            raise EntryError(f"entry {text!r}: request rules name hosts, not IP addresses")
        return Entry(rule.text, host_entry.host, host_entry.wildcard, host_entry.ports, request=rule)
    try:
        host_text, port_text = split_authority(text)
        if port_text is None:
            ports: frozenset[int] | None = DEFAULT_PORTS
        elif port_text == "*":
            ports = None
        else:
            ports = frozenset({parse_port(port_text)})
    except HostError as error:
        raise EntryError(f"entry {text!r}: {error}") from error
    if host_text == "*":
        raise EntryError(f"entry {text!r}: a bare '*' would allow every host; use '*.domain'")
    wildcard = host_text.startswith("*.")
    name = host_text[2:] if wildcard else host_text
    if "*" in name and ":" in name:
        raise EntryError(f"entry {text!r}: an IPv6 address needs brackets to carry a port")
    if "*" in name:
        raise EntryError(f"entry {text!r}: the only wildcard allowed is one leading '*.'")
    try:
        parsed = parse_host(name)
        host, address = parsed.name, parsed.address
        covers_suffix = wildcard and address is None and is_public_suffix(host)
    except HostError as error:
        raise EntryError(f"entry {text!r}: {error}") from error
    if wildcard and address is not None:
        raise EntryError(f"entry {text!r}: a wildcard cannot cover an IP address")
    if covers_suffix:
        raise EntryError(
            f"entry {text!r}: {host!r} is a public suffix, so the wildcard would cover "
            "domains owned by anyone"
        )
    return Entry(text=text, host=host, wildcard=wildcard, ports=ports, address=address)


def lasting_entry(host: str, port: int) -> str:
    """The allowlist entry an *always* answer keeps for ``host`` (normalised, IDNA) on ``port``.

    Never broader than what was asked: the exact host with its port
    (``host:port``; an IP address in brackets), no wildcard invented, so it
    never crosses a public suffix. Raises EntryError when ``parse_entry``
    refuses it or reads it as anything but that one host on that one port.
    """
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    entry = parse_entry(text)
    if entry.wildcard or entry.host != host or entry.ports != frozenset({port}):
        raise EntryError(f"entry {text!r} would not name exactly {host!r} on port {port}")
    return text


@dataclass(frozen=True, slots=True)
class RunPolicy:
    """The per-run state ``decide`` needs.

    ``approved`` maps a normalised host to the ports approved for it during
    the run (see ``approval_ports``); ``denied`` holds normalised hosts denied
    during the run; ``ask`` is False when asking is switched off (--no-ask);
    ``learn`` is learn mode (--learn: see the module docstring).
    """

    allow: tuple[Entry, ...] = ()
    deny: tuple[Entry, ...] = ()
    approved: Mapping[str, frozenset[int]] = field(default_factory=dict)
    denied: frozenset[str] = frozenset()
    ask: bool = True
    learn: bool = False
    # Requests approved (method, host, port, path prefix) and denied (method, host, path prefix)
    # during the run, inside inspected connections.
    approved_requests: frozenset[tuple[str, str, int, str]] = frozenset()
    denied_requests: frozenset[tuple[str, str, str]] = frozenset()

    @property
    def inspects(self) -> bool:
        """Whether any allow entry is a request rule (else nothing is inspected: no scan per request)."""
        return any(entry.request is not None for entry in self.allow)


def decide(policy: RunPolicy, host: str, port: int) -> PolicyDecision:
    """Decide a request for HOST:PORT, with HOST as the client sent it.

    1. malformed host, or port outside 1..65535 → DENY bad_request;
    2. a deny entry matches the host (on any port) → DENY denylisted; a deny
       wildcard matches textually, across public suffixes too (refusing more
       is safe);
    3. the host is an IP literal (any spelling) that no allow entry names
       → DENY ip_literal;
    4. an allow entry matches the host and allows the port → ALLOW (rule: the
       entry), or the host was approved in this run for the port → ALLOW
       (rule: "approved"); a wildcard whose base has a public suffix between
       it and the host does not match (``Entry.reaches``);
    5. an allow entry matches the host but none allows the port: a destination
       of its own → DENY denied_earlier when a person denied the host, else
       ASK; with asking off DENY port_not_allowed (rule: the first matching
       entry);
    6. the host was denied earlier in this run → DENY denied_earlier;
    7. asking is off → DENY not_allowlisted; otherwise → ASK.

    In learn mode steps 5 and 7 ALLOW instead, with no rule and ``learned``
    set to ``port_not_allowed`` or ``not_allowlisted`` (for ASK too).
    """
    try:
        parsed = parse_host(host)
    except HostError:
        return PolicyDecision.deny(host, port, Reason.BAD_REQUEST)
    name, address = parsed.name, parsed.address
    if not 1 <= port <= 65535:
        return PolicyDecision.deny(name, port, Reason.BAD_REQUEST)
    for entry in policy.deny:
        if entry.matches_host(name):
            return PolicyDecision.deny(name, port, Reason.DENYLISTED, entry.text)
    matching = [entry for entry in policy.allow if entry.reaches(name)]
    if address is not None and not matching:
        return PolicyDecision.deny(name, port, Reason.IP_LITERAL)
    for entry in matching:
        if entry.allows_port(port):
            if entry.request is None and policy.inspects:
                # A name with request rules is inspected even where a plain entry names it too.
                rules = [e for e in matching if e.request is not None and e.allows_port(port)]
                if rules:
                    return PolicyDecision(Verdict.ALLOW, name, port, rule=rules[0].text, inspect=True)
            inspect = entry.request is not None
            return PolicyDecision(Verdict.ALLOW, name, port, rule=entry.text, address=address, inspect=inspect)
    if port in policy.approved.get(name, frozenset()):
        return PolicyDecision.allow(name, port, APPROVED_RULE, address)
    if matching:
        # A port the entries do not name is a destination of its own: asked about like an unknown one.
        if policy.learn:
            return PolicyDecision.learn(name, port, Reason.PORT_NOT_ALLOWED, address)
        if not policy.ask:
            return PolicyDecision.deny(name, port, Reason.PORT_NOT_ALLOWED, matching[0].text)
        if name in policy.denied:
            return PolicyDecision.deny(name, port, Reason.DENIED_EARLIER)
        return PolicyDecision.ask(name, port, address)
    if name in policy.denied:
        return PolicyDecision.deny(name, port, Reason.DENIED_EARLIER)
    if policy.learn:
        return PolicyDecision.learn(name, port, Reason.NOT_ALLOWLISTED, address)
    if not policy.ask:
        return PolicyDecision.deny(name, port, Reason.NOT_ALLOWLISTED)
    return PolicyDecision.ask(name, port, address)


def decide_request(policy: RunPolicy, method: str, host: str, port: int, path: str) -> PolicyDecision:
    """Decide one request inside an inspected connection to ``host``:``port`` (allowed for inspection).

    ``host`` is normalised, ``path`` normalised without its query
    (``requestrules.normalise_path``), ``method`` the one the request is
    judged as. A name's requests are decided by its request rules alone (a
    plain entry for the same name allows none of them):

    1. a request rule for the host and port covers the method and path → ALLOW (rule: the entry);
    2. the method and a prefix of the path were approved during the run → ALLOW (rule: "approved");
    3. they were denied during the run → DENY denied_earlier;
    4. learn mode → ALLOW, ``learned`` not_allowlisted; asking is off → DENY not_allowlisted;
       otherwise → ASK (the request is shown to the approver).
    """
    for entry in policy.allow:
        rule = entry.request
        if rule is not None and entry.allows_port(port) and entry.reaches(host) and rule.covers(method, path):
            return PolicyDecision.allow(host, port, entry.text)
    for approved_method, approved_host, approved_port, prefix in policy.approved_requests:
        if (approved_method, approved_host, approved_port) == (method, host, port) and under(path, prefix):
            return PolicyDecision.allow(host, port, APPROVED_RULE)
    for denied_method, denied_host, prefix in policy.denied_requests:
        if (denied_method, denied_host) == (method, host) and under(path, prefix):
            return PolicyDecision.deny(host, port, Reason.DENIED_EARLIER)
    if policy.learn:
        return PolicyDecision.learn(host, port, Reason.NOT_ALLOWLISTED)
    if not policy.ask:
        return PolicyDecision.deny(host, port, Reason.NOT_ALLOWLISTED)
    return PolicyDecision.ask(host, port)


def approval_ports(port: int) -> frozenset[int]:
    """The ports an approval for ``port`` grants: that port, and 80 and 443.

    DESIGN.md "Decision order": an approval allows the host on its port and on
    ports 80 and 443 for the rest of the run.
    """
    return frozenset({port}) | DEFAULT_PORTS
