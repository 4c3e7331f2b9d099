"""Audit records as lines to print (``egressd audit``): a fixed-width table for a terminal, or JSON Lines.

The log's fields carry what a sandboxed process asked for (host names,
commands), so every value is escaped: a record cannot move the cursor or
repaint the screen.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping

from egressd.audit.query import record_datetime
from egressd.names.shown import ascii_escaped
from egressd.vocabulary.egress import End

# A command longer than this is cut in the table (``--json`` shows it all);
# host names are never cut, since a cut could hide the domain that matters.
_MAX_TEXT = 80


def format_json(record: Mapping[str, object]) -> str:
    """Return ``record`` as one compact JSON line (no newline).

    ASCII-only, so control characters, C1 controls and look-alike letters
    arrive on the terminal as ``\\uXXXX`` escapes, never raw.
    """
    return json.dumps(record, separators=(",", ":"), ensure_ascii=True)


_COLUMNS: tuple[tuple[str, int, bool], ...] = (
    # (title, width, right-aligned)
    ("TIME (UTC)", 19, False),
    ("RUN", 12, False),
    ("KIND", 7, False),
    ("DECISION", 8, False),
    ("REASON", 18, False),
    ("DESTINATION", 30, False),
    ("ADDRESS", 15, False),
    ("UP", 9, True),
    ("DOWN", 9, True),
    ("DURATION", 8, True),
    ("BY", 0, False),
)


def format_table(records: Iterable[Mapping[str, object]]) -> Iterator[str]:
    """Yield a header line, then one fixed-width line per record (no newlines).

    Egress records show time (UTC), run, kind, ALLOW/DENY, reason,
    host:port, address, bytes up/down, duration and the approver; run and
    approval events get a one-line summary in the same time and run
    columns. A value wider than its column pushes the rest of the line right
    rather than being cut. Every value from the record is escaped: control
    characters, backslashes and non-ASCII characters appear as ``\\x1b``,
    ``\\\\``, ``\\u0430`` and so on.
    """
    yield _row([title for title, _, _ in _COLUMNS])
    for record in records:
        if record.get("event") == "egress":
            yield _egress_row(record)
        else:
            yield _event_row(record)



def _safe(value: object) -> str:
    """Render a value from a record so it prints as itself and nothing else.

    Printable ASCII stays; a backslash is doubled so an escape cannot be
    forged; everything else (C0/C1 controls, DEL, any non-ASCII letter that
    could pose as another) becomes a Python-style escape (``egressd.names.shown.ascii_escaped``).
    """
    return ascii_escaped(value if isinstance(value, str) else str(value))


def _text(value: object, limit: int | None = None) -> str:
    if value is None:
        return "-"
    text = _safe(value)
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def _time(record: Mapping[str, object]) -> str:
    moment = record_datetime(record)
    if moment is None:
        return _text(record.get("ts"), 19)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _destination(host: object, port: object) -> str:
    if host is None:
        return "-"
    name = _safe(host)
    if ":" in name:
        name = f"[{name}]"  # an IPv6 literal, as in a URL (RFC 3986 §3.2.2)
    return name if port is None else f"{name}:{_safe(port)}"


def _bytes(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _text(value, 9)
    amount = float(value)
    if amount < 1024:
        return f"{amount:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        amount /= 1024
        if amount < 1024 or unit == "TiB":
            break
    return f"{amount:.1f} {unit}"


def _duration(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return _text(value, 8)
    seconds = float(value)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _row(cells: list[str]) -> str:
    parts: list[str] = []
    for (_, width, right), cell in zip(_COLUMNS, cells, strict=True):
        parts.append(cell.rjust(width) if right else cell.ljust(width))
    return "  ".join(parts).rstrip()


def _egress_row(record: Mapping[str, object]) -> str:
    approval = record.get("approval")
    by = "-"
    if isinstance(approval, Mapping):
        by = _text(approval.get("by")) if approval.get("by") is not None else "(no answer)"
    decision = record.get("decision")
    reason = record.get("reason")
    if reason is None and record.get("end") not in (None, End.CLOSED):
        reason = record.get("end")  # open, idle_timeout, shutdown
    return _row(
        [
            _time(record),
            _text(record.get("run")),
            _text(record.get("kind")),
            _text(decision.upper() if isinstance(decision, str) else decision),
            _text(reason),
            _destination(record.get("host"), record.get("port")),
            _text(record.get("address")),
            _bytes(record.get("bytes_up")),
            _bytes(record.get("bytes_down")),
            _duration(record.get("duration_s")),
            by,
        ]
    )


def _event_row(record: Mapping[str, object]) -> str:
    event = record.get("event")
    if event == "approval.requested":
        channels = record.get("channels")
        via = ",".join(_safe(c) for c in channels) if isinstance(channels, list) else "-"
        summary = (
            f"APPROVAL ASKED    {_text(record.get('id'))}  "
            f"{_destination(record.get('host'), record.get('port'))}  via {via}  "
            f"command: {_text(record.get('command'), _MAX_TEXT)}"
        )
    elif event == "approval.decided":
        decision = record.get("decision")
        verdict = _text(decision.upper() if isinstance(decision, str) else decision)
        who = (
            f"by {_text(record.get('by'))} via {_text(record.get('channel'))}"
            if record.get("by") is not None
            else "nobody answered"
        )
        reason = record.get("reason")
        because = f" ({_text(reason)})" if reason is not None else ""
        summary = (
            f"APPROVAL {verdict:<8} {_text(record.get('id'))}  {who}{because}"
            f"  after {_duration(record.get('waited_s'))}"
        )
    else:
        label = _text(event).upper().replace(".", " ")
        # The chain's hash is for `egressd audit verify`, not for reading (--json shows it).
        fields = "  ".join(
            f"{_safe(key)}: {_field(value)}" for key, value in record.items()
            if key not in ("event", "ts", "run", "prev")
        )  # fmt: skip
        summary = f"{label:<17} {fields}".rstrip()
    return f"{_time(record):<19}  {_text(record.get('run')):<12}  {summary}"


def _field(value: object) -> str:
    if isinstance(value, list):
        return ",".join(_text(item, _MAX_TEXT) for item in value) or "-"
    if isinstance(value, Mapping):  # read as words, not as a JSON blob: {"allow": ["a"]} is "allow=a"
        return _text(" ".join(f"{_safe(k)}={_field(v)}" for k, v in value.items()) or "-", _MAX_TEXT)
    return _text(value, _MAX_TEXT)
