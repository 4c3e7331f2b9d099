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

A missing file holds nothing (the first *always* answer creates it). egressd
never rewrites the file, so the operator's comments and order survive: an
answer is appended as one ``[[approved]]`` table in one write, under an
exclusive ``flock``, after checking that the file with it still parses. A
reader sees the file before the table or after it, never half of it.

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
from pathlib import Path

from egressd.config.trusted import UntrustedFile, open_trusted, read_trusted
from egressd.names.shown import toml_string

__all__ = ["AllowFile", "AllowFileError", "Approved", "append_approved", "read_allow_file"]

_APPROVED_KEYS = ("entry", "at", "approval", "by", "channel", "run", "auth")


class AllowFileError(Exception):
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
class AllowFile:
    """What an allowlist file holds: its ``allow`` and ``deny`` entries and its appended answers."""

    path: Path
    allow: tuple[str, ...]
    deny: tuple[str, ...]
    approved: tuple[Approved, ...]

    @property
    def allowed(self) -> tuple[str, ...]:
        """Every entry that allows: ``allow``, then each approved entry, in file order."""
        return self.allow + tuple(answer.entry for answer in self.approved)


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

    Opened as ``read_allow_file`` opens it (``egressd.config.trusted``), made
    with ``O_EXCL`` if missing.

    One write under an exclusive lock, after checking that the file with the
    table still parses; ``AllowFileError`` when it cannot be written or the
    file on disk is not a valid allowlist file (nothing is written then).
    """
    if not approved.entry or not approved.at:
        raise AllowFileError(f"allow file {path}: an approved entry needs an entry and a time")
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
        block = separator + "\n" + render_approved(approved)
        _parse(path, current + block)  # the file stays valid TOML, and an allowlist file, with it
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


def render_approved(approved: Approved) -> str:
    """The ``[[approved]]`` table of one answer, keys with no value left out."""
    lines = ["[[approved]]"]
    for key in _APPROVED_KEYS:
        value = getattr(approved, key)
        if value is not None:
            lines.append(f"{key} = {toml_string(value)}")
    return "\n".join(lines) + "\n"


def _parse(path: Path, text: str) -> AllowFile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AllowFileError(f"allow file {path}: not TOML: {exc}") from None
    unknown = sorted(set(data) - {"allow", "deny", "approved"})
    if unknown:
        raise AllowFileError(f"allow file {path}: unknown key {unknown[0]!r} (allow, deny and [[approved]] only)")
    allow = _strings(path, data.get("allow", []), "allow")
    deny = _strings(path, data.get("deny", []), "deny")
    tables = data.get("approved", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise AllowFileError(f"allow file {path}: approved must be [[approved]] tables")
    approved = []
    for number, table in enumerate(tables, 1):
        strange = sorted(set(table) - set(_APPROVED_KEYS))
        if strange:
            raise AllowFileError(f"allow file {path}: [[approved]] number {number}: unknown key {strange[0]!r}")
        if not all(isinstance(value, str) for value in table.values()):
            raise AllowFileError(f"allow file {path}: [[approved]] number {number}: every value must be a string")
        if not table.get("entry") or not table.get("at"):
            raise AllowFileError(f"allow file {path}: [[approved]] number {number}: needs entry and at")
        approved.append(Approved(**table))
    return AllowFile(path, allow, deny, tuple(approved))


def _strings(path: Path, value: object, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise AllowFileError(f"allow file {path}: {key} must be a list of strings")
    items: Sequence[str] = value
    return tuple(items)
