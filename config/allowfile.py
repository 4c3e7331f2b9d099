"""Allowlist files (``--allow-file FILE``): the lasting part of a policy, and where *always* answers go.

The file is TOML::

    allow = ["pypi.org", "*.pythonhosted.org"]   # optional, entries as for --allow
    deny = ["tracker.example"]                   # optional, entries as for --deny

    [[approved]]                                 # appended by egressd: one per *always* answer
    entry = "api.github.com:443"
    at = "2026-12-01T22:10:00.000000Z"
    approval = "a-4f1c9e2b7d30a8c1"
    by = "alice"
    channel = "slack"
    run = "r-7c2e"

    [[revoked]]                                  # appended by egressd: one per revoked *always* entry
    entry = "api.github.com:443"
    at = "2026-12-02T09:00:00.000000Z"
    by = "bob"

An ``[[approved]]`` entry holds until a ``[[revoked]]`` table names the same
entry at the same time or later (an answer after the revocation holds again).
A missing file holds nothing (the first *always* answer creates it). egressd
never rewrites the file, so the operator's comments and order survive: an
answer is appended as one ``[[approved]]`` table in one write, under an
exclusive ``flock``, after checking that the file with it still parses. A
reader sees the file before the table or after it, never half of it. A
revocation is appended the same way: the answer it takes back stays on
record.

Entries are plain strings here; whether each is a valid policy entry is the
policy's to say (``egressd.proxy.core.policy.parse_entry``), where the file
is turned into a policy.
"""

from __future__ import annotations

import fcntl
import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from egressd.config.trusted import UntrustedFile, open_trusted, read_trusted
from egressd.names.shown import toml_string

__all__ = ["AllowFile", "AllowFileError", "Approved", "LastingError", "Revoked", "append_approved", "append_revoked",
           "read_allow_file"]

_APPROVED_KEYS = ("entry", "at", "approval", "by", "channel", "run", "auth")
_REVOKED_KEYS = ("entry", "at", "by", "channel", "auth")


class LastingError(Exception):
    """An *always* answer could not be kept, or taken back, where lasting answers are kept; the message says why."""


class AllowFileError(LastingError):
    """An allowlist file could not be read or appended to; the message names the file and why."""


@dataclass(frozen=True, slots=True)
class Approved:
    """One *always* answer, as its ``[[approved]]`` table records it."""

    entry: str  # the lasting allowlist entry, never broader than the host asked about
    at: str  # RFC 3339 time of the answer
    approval: str | None = None  # the approval's id
    by: str | None = None  # who answered, as the channel names them
    channel: str | None = None
    run: str | None = None  # the run that asked
    auth: str | None = None  # the credential that answered, as egressd names it (never the answerer's own words)


@dataclass(frozen=True, slots=True)
class Revoked:
    """One *always* entry taken back, as its ``[[revoked]]`` table records it."""

    entry: str
    at: str  # RFC 3339: it takes back the answers for ``entry`` given at this time or before
    by: str | None = None
    channel: str | None = None
    auth: str | None = None


@dataclass(frozen=True, slots=True)
class AllowFile:
    """What an allowlist file holds: its ``allow`` and ``deny`` entries, its appended answers and revocations."""

    path: Path
    allow: tuple[str, ...]
    deny: tuple[str, ...]
    approved: tuple[Approved, ...]
    revoked: tuple[Revoked, ...] = ()

    @property
    def standing(self) -> tuple[Approved, ...]:
        """The *always* answers no later ``[[revoked]]`` took back, in file order."""
        last: dict[str, datetime] = {}
        for revoked in self.revoked:
            when = _time(revoked.at)
            if revoked.entry not in last or when > last[revoked.entry]:
                last[revoked.entry] = when
        return tuple(a for a in self.approved if a.entry not in last or _time(a.at) > last[a.entry])

    @property
    def allowed(self) -> tuple[str, ...]:
        """Every entry that allows: ``allow``, then each standing approved entry, in file order."""
        return self.allow + tuple(answer.entry for answer in self.standing)


def _time(text: str) -> datetime:
    """An RFC 3339 time of the file (checked by ``_parse``), comparable across offsets."""
    when = datetime.fromisoformat(text)
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def read_allow_file(path: Path) -> AllowFile:
    """Read and check an allowlist file (a missing one is empty); ``AllowFileError`` names what is wrong.

    Opened and checked by ``egressd.config.trusted`` (no link on the way, a
    regular file of ours or root's that nobody else may change): whoever could
    write it would set the policy of every run that reads it.
    """
    try:
        text = read_trusted(path).decode("utf-8")
    except FileNotFoundError:
        return AllowFile(path, (), (), ())
    except UntrustedFile as exc:
        raise AllowFileError(f"allow file {exc}") from None
    except OSError as exc:
        raise AllowFileError(f"allow file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise AllowFileError(f"allow file {path}: {exc}") from None
    return _parse(path, text)


def append_approved(path: Path, approved: Approved) -> None:
    """Append one ``[[approved]]`` table to the allowlist file at ``path``, creating it (0600) if missing.

    ``AllowFileError`` when it cannot be written or the file on disk is not
    a valid allowlist file (nothing is written then): ``_append``.
    """
    if not approved.entry or not approved.at:
        raise AllowFileError(f"allow file {path}: an approved entry needs an entry and a time")
    _append(path, render_approved(approved))


def append_revoked(path: Path, revoked: Revoked) -> AllowFile:
    """Append one ``[[revoked]]`` table taking back the *always* answers for ``revoked.entry``; the file after it.

    ``AllowFileError`` when the file holds no standing answer for the entry
    (nothing is written), or as ``append_approved``.
    """
    if not revoked.entry or not revoked.at:
        raise AllowFileError(f"allow file {path}: a revocation needs an entry and a time")
    before = read_allow_file(path)
    if revoked.entry not in {a.entry for a in before.standing}:
        raise AllowFileError(f"allow file {path}: no standing always answer for {revoked.entry!r}")
    return _append(path, _table("revoked", revoked, _REVOKED_KEYS))


def _append(path: Path, table: str) -> AllowFile:
    """Append ``table`` to the file in one write under an exclusive lock, after checking the file still parses.

    Opened as ``read_allow_file`` opens it (``egressd.config.trusted``), made
    with ``O_EXCL`` if missing.
    """
    try:
        fd = open_trusted(path, flags=os.O_RDWR | os.O_APPEND, create=True)
    except UntrustedFile as exc:
        raise AllowFileError(f"allow file {exc}") from None
    except OSError as exc:
        raise AllowFileError(f"allow file {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        current = os.pread(fd, size, 0).decode("utf-8") if size else ""
        separator = "\n" if current and not current.endswith("\n") else ""
        block = separator + "\n" + table
        after = _parse(path, current + block)  # the file stays valid TOML, and an allowlist file, with it
        data = block.encode("utf-8")
        if os.write(fd, data) != len(data):
            raise AllowFileError(f"allow file {path}: short write")
        os.fsync(fd)
    except UnicodeDecodeError as exc:
        raise AllowFileError(f"allow file {path}: {exc}") from None
    except OSError as exc:
        raise AllowFileError(f"allow file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)  # closing releases the lock
    return after


def render_approved(approved: Approved) -> str:
    """The ``[[approved]]`` table of one answer, keys with no value left out."""
    return _table("approved", approved, _APPROVED_KEYS)


def _table(name: str, value: Approved | Revoked, keys: Sequence[str]) -> str:
    lines = [f"[[{name}]]"]
    for key in keys:
        item = getattr(value, key)
        if item is not None:
            lines.append(f"{key} = {toml_string(item)}")
    return "\n".join(lines) + "\n"


def _parse(path: Path, text: str) -> AllowFile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AllowFileError(f"allow file {path}: not TOML: {exc}") from None
    unknown = sorted(set(data) - {"allow", "deny", "approved", "revoked"})
    if unknown:
        raise AllowFileError(
            f"allow file {path}: unknown key {unknown[0]!r} (allow, deny, [[approved]] and [[revoked]] only)"
        )
    allow = _strings(path, data.get("allow", []), "allow")
    deny = _strings(path, data.get("deny", []), "deny")
    approved = [Approved(**t) for t in _tables(path, data, "approved", _APPROVED_KEYS)]
    revoked = [Revoked(**t) for t in _tables(path, data, "revoked", _REVOKED_KEYS)]
    return AllowFile(path, allow, deny, tuple(approved), tuple(revoked))


def _tables(path: Path, data: dict[str, object], name: str, keys: Sequence[str]) -> list[dict[str, str]]:
    """The ``[[name]]`` tables, each checked: known keys, string values, an ``entry`` and an RFC 3339 ``at``."""
    tables = data.get(name, [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise AllowFileError(f"allow file {path}: {name} must be [[{name}]] tables")
    for number, table in enumerate(tables, 1):
        strange = sorted(set(table) - set(keys))
        if strange:
            raise AllowFileError(f"allow file {path}: [[{name}]] number {number}: unknown key {strange[0]!r}")
        if not all(isinstance(value, str) for value in table.values()):
            raise AllowFileError(f"allow file {path}: [[{name}]] number {number}: every value must be a string")
        if not table.get("entry") or not table.get("at"):
            raise AllowFileError(f"allow file {path}: [[{name}]] number {number}: needs entry and at")
        try:
            _time(table["at"])
        except ValueError:
            raise AllowFileError(
                f"allow file {path}: [[{name}]] number {number}: at {table['at']!r} is not an RFC 3339 time"
            ) from None
    return tables


def _strings(path: Path, value: object, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise AllowFileError(f"allow file {path}: {key} must be a list of strings")
    items: Sequence[str] = value
    return tuple(items)
