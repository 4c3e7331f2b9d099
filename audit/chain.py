"""The audit log's hash chain checked (``egressd audit verify``, pure but for reading the files).

Each record's ``prev`` is the SHA-256 of the line before it, as stored;
``verify_chain`` checks lines given in order (across rotated files) and names
the first record edited, removed, inserted or cut short; ``verify_files``
feeds it the lines of files. Everything a report names from a record is
escaped (``egressd.names.shown.ascii_escaped``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from egressd.names.shown import ascii_escaped


@dataclass(frozen=True)
class ChainLine:
    """One line of a log for ``verify_chain``: where it is, and its bytes as stored (newline included)."""

    file: str
    number: int  # 1-based, within ``file``
    raw: bytes


@dataclass(frozen=True)
class ChainReport:
    """What ``verify_chain`` found.

    ``records``: the records checked and found chained before any problem;
    ``problem``: None if the chain is intact, else a sentence naming the
    first record edited, removed, inserted or cut short; ``notes``: what
    the check could not cover (a first record that continues a chain from
    a file not given).
    """

    records: int
    problem: str | None
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.problem is None


def verify_chain(lines: Iterable[ChainLine], head: str | None = None) -> ChainReport:
    """Check that each record's ``prev`` is the SHA-256 (hex) of the line before it, as stored.

    The lines are the log's, oldest first, across rotated files. The first
    record may carry ``prev: null`` (a fresh log) or a hash (its chain began
    in a file not given; noted, since what came before cannot be checked).
    At the first break it names what the bytes show: a line whose record
    carries the same ``prev`` as the line before it, or one the next record
    skips over, was inserted; otherwise the line before the break was
    edited or records were removed just before the break (an unkeyed chain
    cannot tell those two apart, so both are named). A last line without
    its newline is a truncated tail; a line that is not a JSON object with
    a ``prev`` is named as damaged. Stops at the first problem.

    ``head``: a hash egressd reported outside the file (its log's ``audit
    head`` line), the SHA-256 of a line it had written. A chain alone cannot
    see whole records cut from its tail; with the head, a log none of whose
    lines hashes to it has lost records (or is another log).
    """
    it = iter(lines)
    notes: list[str] = []
    count = 0
    previous: ChainLine | None = None
    previous_prev: object = None  # the prev the previous record carried
    current = next(it, None)
    anchored = head is None
    while current is not None:
        following = next(it, None)
        if not anchored:
            anchored = hashlib.sha256(current.raw).hexdigest() == head
        where = _where(current)
        if not current.raw.endswith(b"\n"):
            if following is None:
                tail = f"truncated tail: {where} is cut short (the file ends mid-record)"
                return ChainReport(count, tail, tuple(notes))
            return ChainReport(count, f"{where} is cut short (a torn write, or an edit)", tuple(notes))
        record = _chain_record(current.raw)
        if record is None:
            return ChainReport(count, f"{where} is not a chained JSON record (edited or damaged)", tuple(notes))
        prev = record["prev"]
        if previous is None:
            if prev is not None:
                notes.append(f"{where} continues a chain from a file not given; records before it are not checked")
        else:
            expected = hashlib.sha256(previous.raw).hexdigest()
            if prev != expected:
                here = f"{where} ({_describe(record)})"
                before = _chain_record(previous.raw) or {}
                there = f"{_where(previous)} ({_describe(before)})"
                if prev == previous_prev:
                    problem = f"{there} was inserted: {here} chains past it"
                elif following is not None and (_chain_record(following.raw) or {}).get("prev") == expected:
                    problem = f"{here} was inserted: the record after it chains past it"
                else:
                    problem = (
                        f"chain broken at {here}: {there} was edited, or records were removed between it and {where}"
                    )
                return ChainReport(count, problem, tuple(notes))
        count += 1
        previous, previous_prev, current = current, prev, following
    if not anchored:
        cut = (f"no record hashes to the head {ascii_escaped(str(head))}: records were cut from the log's tail "
               "after egressd reported that head (or the files given are not that log's)")  # fmt: skip
        return ChainReport(count, cut, tuple(notes))
    return ChainReport(count, None, tuple(notes))


def verify_files(paths: Iterable[str | os.PathLike[str]], head: str | None = None) -> ChainReport:
    """``verify_chain`` over the lines of ``paths``, oldest first, read as a stream.

    ``OSError`` (a missing or unreadable file) propagates.
    """

    def lines() -> Iterator[ChainLine]:
        for path in paths:
            name = os.fspath(path)
            with open(name, "rb") as file:
                for number, raw in enumerate(file, 1):
                    yield ChainLine(name, number, raw)

    return verify_chain(lines(), head)


def _where(line: ChainLine) -> str:
    return f"line {line.number} of {ascii_escaped(line.file)}"


def _chain_record(raw: bytes) -> dict[str, object] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or "prev" not in record:
        return None
    if record["prev"] is not None and not isinstance(record["prev"], str):
        return None
    return record


def _describe(record: Mapping[str, object]) -> str:
    shown = ("id", "event", "run")
    parts = [f"{key} {ascii_escaped(str(record[key]))}" for key in shown if record.get(key) is not None]
    return ", ".join(parts) or "no id"

