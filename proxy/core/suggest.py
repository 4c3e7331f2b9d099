"""``egressd audit suggest``: allowlist entries, as TOML for ``--allow-file``, from what a run did.

Learn, then lock (DESIGN.md ``--learn``): a run in learn mode lets out what
its allowlist would have refused, recording each such attempt as
``learned``; this turns the run's records into the allowlist that would
have let it do the same. Pure: records in, text out (the command,
``egressd.cli.commands.audit``, reads the files). It lives beside the
policy because every entry it prints is one the policy's own parser
(``policy.parse_entry``) accepts, and every wildcard one whose
``Entry.reaches`` covers each name it stands for.

What counts, for the run chosen (``pick_run``):

1. ``egress`` records of kind connect, http, tls and socks (dns too with
   ``include_dns``) that were allowed — by a rule, an approval or learn
   mode — or that the policy let through and the network then failed (a
   reason whose status is 502 or 504: the upstream failures); an
   allowed connection whose ``egress.end`` names a refusal (``end``: a
   reason code such as ``sni_mismatch``) was refused after all; a name that
   never resolved (``resolve_failed``: a typo, a name that does not exist)
   is listed in the closing comment, not suggested;
2. ``approval.requested`` records whose ``approval.decided`` allowed them;
3. never an IP literal, and never a host that was refused by the policy
   (a reason whose status is 403: a deny entry, a private address, a
   person's denial, ...): those are listed in a closing comment.

Requests on inspected names (``https`` records, and ``http`` ones that name a
method and path) become request rules instead of their host's entry: per host,
port and path prefix (``requestrules.approval_prefix``, the first two
segments) one rule naming every method used under it, ``GET|POST
api.github.com/org/repo/**`` (``requestrules.suggested_rule``'s form); to
learn them, run with ``--learn`` and ``inspect HOST`` for the names to watch.

Entries: a host used on 80 or 443 is ``host``; another port is
``host:PORT``. Three or more names under one registered domain (names
below it, used on 80 or 443) become ``*.domain`` — a registered domain is
never a public suffix, and the wildcard is made only for the names the
policy's ``Entry.reaches`` lets it reach (no public suffix between); the
apex, if used itself, stays an entry of its own (a wildcard does not cover
it). Only entries ``policy.parse_entry`` accepts are printed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from egressd.names.hosts import HostError, parse_host
from egressd.names.shown import toml_string
from egressd.names.suffixes import registrable_domain
from egressd.proxy.core.policy import Entry, EntryError, parse_entry
from egressd.proxy.core.requestrules import approval_prefix, suggested_rule
from egressd.vocabulary.reasons import Reason, reason_for

__all__ = ["CONNECTION_KINDS", "MIN_GROUP", "Suggestion", "SuggestError", "pick_run", "render", "suggest"]

CONNECTION_KINDS = frozenset({"connect", "http", "tls", "socks"})
# Fewer names than this stay listed one by one: two names are no pattern, and a
# wildcard allows every name under the domain, not only those seen.
MIN_GROUP = 3
# An entry without a port allows these (DESIGN.md "Policy").
_WEB_PORTS = frozenset({80, 443})
# The statuses of refusals after the policy let the host through (the upstream failures):
# the run needed the host all the same.
_UPSTREAM_STATUSES = frozenset({502, 504})
# The status of the policy's refusals (and sni_mismatch): about the destination itself.
_POLICY_STATUS = 403
# Names shown in a wildcard's comment before "…".
_SHOWN = 3


class SuggestError(Exception):
    """Nothing to suggest from: an unknown run, or no run at all in the records."""


@dataclass(frozen=True, slots=True)
class Suggestion:
    """The entries for one run, with what the closing comments list.

    ``entries`` are (entry text, comment or None), in output order;
    ``hosts`` counts the distinct host names behind them; ``refused`` is
    (host, reason) of what was refused and is not suggested; ``literals``
    the IP addresses used, never suggested.
    """

    run: str | None
    started: str | None
    entries: tuple[tuple[str, str | None], ...]
    hosts: int
    learned: int
    refused: tuple[tuple[str, str], ...] = ()
    literals: tuple[str, ...] = ()


@dataclass
class _Seen:
    ports: dict[str, set[int]] = field(default_factory=dict)  # host → ports used (443 for a DNS name)
    # (host, port, path prefix) → the methods used under it, on an inspected name
    requests: dict[tuple[str, int, str], set[str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # host → the first reason it was refused
    literals: set[str] = field(default_factory=set)
    learned: int = 0


def pick_run(records: Iterable[Mapping[str, object]], run: str | None) -> tuple[str | None, str | None, int]:
    """Which run to suggest for: (run id, its start time, the index of its last ``run.start``).

    ``run`` None: the run of the last ``run.start`` record, else of the last
    ``egress`` record (a log without run records: from its start). A run
    started more than once (``egressd serve``'s ``default``, each time it
    starts) counts from its last start. Raises SuggestError when ``run`` is
    named in no record, or when the records hold no run at all.
    """
    items = list(records)
    last_start: dict[str, tuple[int, str | None]] = {}
    seen: set[str] = set()
    last_any: str | None = None
    for index, record in enumerate(items):
        rid = record.get("run")
        if not isinstance(rid, str):
            continue
        seen.add(rid)
        if record.get("event") == "run.start":
            ts = record.get("ts")
            last_start[rid] = (index, ts if isinstance(ts, str) else None)
        if record.get("event") in ("run.start", "egress"):
            last_any = rid
    if run is None:
        starts = sorted(last_start.items(), key=lambda item: item[1][0])
        run = starts[-1][0] if starts else last_any
        if run is None:
            raise SuggestError("no run in the audit records: nothing to suggest from")
    elif run not in seen:
        raise SuggestError(f"no run {run!r} in the audit records")
    index, started = last_start.get(run, (0, None))
    return run, started, index


def suggest(
    records: Iterable[Mapping[str, object]], run: str | None = None, *, include_dns: bool = False
) -> Suggestion:
    """The suggestion for ``run`` (see ``pick_run``) from ``records``, oldest first; steps in the module docstring."""
    items = list(records)
    run_id, started, first = pick_run(items, run)
    mine = [r for r in items[first:] if r.get("run") == run_id]
    kinds = CONNECTION_KINDS | {"dns"} if include_dns else CONNECTION_KINDS
    # An allowed connection cut after its record was written: its end names the refusal.
    cut = {r.get("id"): r.get("end") for r in mine if r.get("event") == "egress.end" and _reason(r.get("end"))}
    seen = _Seen()
    requested: dict[object, tuple[object, object]] = {}
    for record in mine:
        event = record.get("event")
        if event == "approval.requested":
            requested[record.get("id")] = (record.get("host"), record.get("port"))
        elif event == "approval.decided" and record.get("decision") == "allow":
            host, port = requested.get(record.get("id"), (None, None))
            _use(seen, host, port)
        elif event == "egress" and (record.get("kind") in kinds or record.get("kind") == "https"):
            decision, reason = record.get("decision"), _reason(record.get("reason"))
            if decision == "allow" and record.get("id") in cut:
                decision, reason = "deny", _reason(cut[record.get("id")])
            port = record.get("port") if record.get("kind") != "dns" else 443
            if reason is Reason.RESOLVE_FAILED:  # a name that never resolved reached nothing: listed, not suggested
                host = _name(record.get("host"))
                if host is not None:
                    seen.refused.setdefault(host, reason.value)
            elif decision == "allow" or (reason is not None and reason.status in _UPSTREAM_STATUSES):
                if not _request(seen, record):
                    _use(seen, record.get("host"), port)
                if record.get("learned") is not None:
                    seen.learned += 1
            elif reason is not None and reason.status == _POLICY_STATUS:
                host = _name(record.get("host"))
                if host is not None:
                    seen.refused.setdefault(host, reason.value)
    inspected = {host for host, _, _ in seen.requests}
    entries, hosts = _entries({h: p for h, p in seen.ports.items() if h not in inspected})
    entries += _rules(seen.requests)
    hosts += len(inspected)
    refused = tuple(sorted((h, why) for h, why in seen.refused.items() if h not in seen.ports))
    return Suggestion(
        run=run_id,
        started=started,
        entries=entries,
        hosts=hosts,
        learned=seen.learned,
        refused=refused,
        literals=tuple(sorted(seen.literals)),
    )


def _reason(value: object) -> Reason | None:
    """The reason a record's code names; None for no code or one that is none (``closed``, ...)."""
    if not isinstance(value, str):
        return None
    try:
        return reason_for(value)
    except ValueError:
        return None


def _name(value: object) -> str | None:
    """The normalised host a record names (a name or an IP address's text), None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return parse_host(value).name
    except HostError:
        return None


def _use(seen: _Seen, host_value: object, port: object) -> None:
    host = _name(host_value)
    if host is None or not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        return
    if parse_host(host).address is not None:
        seen.literals.add(host)
        return
    seen.ports.setdefault(host, set()).add(port)


def _request(seen: _Seen, record: Mapping[str, object]) -> bool:
    """Count an allowed request on an inspected name (it names a method and a path); False for anything else."""
    method, path, port = record.get("method"), record.get("path"), record.get("port")
    host = _name(record.get("host"))
    if not (isinstance(method, str) and isinstance(path, str) and isinstance(port, int) and host is not None):
        return False
    seen.requests.setdefault((host, port, approval_prefix(path)), set()).add(method)
    return True


def _rules(requests: Mapping[tuple[str, int, str], set[str]]) -> tuple[tuple[str, str | None], ...]:
    """One rule per host, port and prefix, naming the methods used; only what ``parse_entry`` accepts."""
    rows = []
    for (host, port, prefix), methods in sorted(requests.items(), key=lambda item: (_order(item[0][0]), item[0])):
        text = suggested_rule("|".join(sorted(methods)), host, port, prefix)
        if _entry(text) is not None:
            rows.append((text, None))
    return tuple(rows)


def _entries(ports: Mapping[str, set[int]]) -> tuple[tuple[tuple[str, str | None], ...], int]:
    """The entries for the hosts used, grouped per the module docstring, and how many hosts they stand for."""
    web = sorted(h for h, used in ports.items() if used & _WEB_PORTS)
    by_domain: dict[str, list[str]] = {}
    for host in web:
        domain = registrable_domain(host)
        if domain is not None and host != domain:
            by_domain.setdefault(domain, []).append(host)
    grouped: dict[str, str] = {}  # host → the domain of its wildcard
    for domain, names in by_domain.items():
        wildcard = _entry(f"*.{domain}")
        # The policy's own rules: the entry parses (no public suffix covered) and reaches each name.
        reached = [name for name in names if wildcard is not None and wildcard.reaches(name)]
        if len(reached) >= MIN_GROUP:
            grouped.update(dict.fromkeys(reached, domain))
    rows: list[tuple[tuple[str, int, str, int], str, str | None]] = []
    for domain in sorted(set(grouped.values())):
        names = sorted(h for h, d in grouped.items() if d == domain)
        shown = ", ".join(names[:_SHOWN]) + (", …" if len(names) > _SHOWN else "")
        rows.append(((_order(domain), 0, domain, 0), f"*.{domain}", f"{len(names)} names: {shown}"))
    for host, used in ports.items():
        if used & _WEB_PORTS and host not in grouped:
            rows.append(((_order(host), 1, host, 0), host, None))
        for port in sorted(used - _WEB_PORTS):
            rows.append(((_order(host), 1, host, port), f"{host}:{port}", None))
    rows.sort(key=lambda row: row[0])
    # Only what the policy would accept is printed (a name the log holds but no entry can say is left out).
    kept = tuple((text, note) for _, text, note in rows if _entry(text) is not None)
    return kept, len(ports)


def _entry(text: str) -> Entry | None:
    try:
        return parse_entry(text)
    except EntryError:
        return None


def _order(host: str) -> str:
    """Sort key: by registered domain, so a domain's entries stay together."""
    return registrable_domain(host) or host


def _shown(text: str) -> str:
    """Text safe inside a TOML comment: one line, printable ASCII (a hostile name cannot end the comment)."""
    escaped = text.encode("unicode_escape").decode("ascii")
    return "".join(ch if " " <= ch <= "~" else "?" for ch in escaped)[:255]


def render(suggestion: Suggestion) -> str:
    """The suggestion as TOML for ``--allow-file``: a header comment, ``allow = [...]``, closing comments."""
    s = suggestion
    where = f" (started {s.started})" if s.started else ""
    learned = f", {_count(s.learned, 'attempt')} let through by learn mode" if s.learned else ""
    lines = [f"# egressd audit suggest: {_count(s.hosts, 'host')} from run {_shown(s.run or '-')}{where}{learned}"]
    if not s.entries:
        lines.append("allow = []")
    else:
        lines.append("allow = [")
        for text, note in s.entries:
            item = f"  {toml_string(text)},"
            lines.append(f"{item}  # {_shown(note)}" if note else item)
        lines.append("]")
    if s.literals:
        lines.append("# IP addresses used, not suggested: " + ", ".join(_shown(a) for a in s.literals))
    if s.refused:
        lines.append("# refused, not suggested: " + ", ".join(f"{_shown(h)} ({_shown(r)})" for h, r in s.refused))
    return "\n".join(lines) + "\n"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
