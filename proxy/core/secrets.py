"""Credentials the sandbox never holds: declared secrets, their placeholders, and where each may go.

A secret is declared with the names it may go to and the header that
carries it (DESIGN.md "Policy": declared secrets):

- ``GITHUB_TOKEN@api.github.com``: in ``Authorization`` (``Bearer {}``,
  ``token {}``, or ``Basic`` with the placeholder as the password);
- ``ANTHROPIC_API_KEY@api.anthropic.com x-api-key``: in the named header;
- several names: ``NAME@api.example.com|uploads.example.com`` (entries, as
  in an allowlist: ``*.example.com`` and ``:PORT`` too).

The sandbox's environment gets a random placeholder under the secret's name
(``egressd-secret-`` and 32 hex digits); egressd puts the real value in its
place in requests to the declared names only, on inspected connections
(``substitute``), in the declared header only. The placeholder anywhere else
(another name, plain HTTP, the request target, another header) is the sign of
an attempt to send it where it does not belong: the request is refused,
``secret_misdirected`` (``misdirected``). The real value is never in a
record, a log line, the sandbox or a command line (``repr`` hides it).

Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from egressd.proxy.core.http1.heads import RequestHead
from egressd.proxy.core.policy import Entry, EntryError, parse_entry

__all__ = ["PLACEHOLDER_PREFIX", "Secret", "SecretError", "Secrets", "parse_secret", "placeholder"]

PLACEHOLDER_PREFIX: Final = "egressd-secret-"
DEFAULT_HEADER: Final = "authorization"
_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_HEADER: Final = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")


class SecretError(ValueError):
    """A secret declaration that is malformed."""


def placeholder(random_hex: str) -> str:
    """The placeholder made of 32 random hex digits (the caller draws them)."""
    if not re.fullmatch(r"[0-9a-f]{32}", random_hex):
        raise ValueError("a placeholder needs 32 lowercase hex digits")
    return PLACEHOLDER_PREFIX + random_hex


@dataclass(frozen=True, slots=True)
class Secret:
    """One declared secret: its name, where it may go, the header that carries it, its placeholder."""

    name: str
    hosts: tuple[Entry, ...]
    header: str  # lowercase
    placeholder: str
    value: str = field(repr=False)

    def goes_to(self, host: str, port: int) -> bool:
        """Whether ``host`` (normalised) on ``port`` is one of the secret's names."""
        return any(entry.reaches(host) and entry.allows_port(port) for entry in self.hosts)


def parse_secret(text: str, *, value: str, placeholder: str) -> Secret:
    """``NAME@HOST[|HOST...][ HEADER]`` → a Secret with ``value``; SecretError when malformed."""
    name, at, rest = text.strip().partition("@")
    if not at or not _NAME.fullmatch(name):
        raise SecretError(f"secret {text!r}: write NAME@HOST[|HOST...][ HEADER], NAME a variable's name")
    hosts_text, _, header = rest.strip().partition(" ")
    header = header.strip() or DEFAULT_HEADER
    if not _HEADER.fullmatch(header):
        raise SecretError(f"secret {name}: {header!r} is not a header name")
    hosts: list[Entry] = []
    for host in hosts_text.split("|"):
        try:
            entry = parse_entry(host)
        except EntryError as exc:
            raise SecretError(f"secret {name}: {exc}") from None
        if entry.request is not None or entry.address is not None:
            raise SecretError(f"secret {name}: {host!r} must name a host (no method, path or IP address)")
        hosts.append(entry)
    if not value:
        raise SecretError(f"secret {name}: its value is empty")
    return Secret(name, tuple(hosts), header.lower(), placeholder, value)


class Secrets:
    """The declared secrets, checked and put into requests (see the module docstring)."""

    __slots__ = ("declared",)

    def __init__(self, declared: Sequence[Secret]) -> None:
        self.declared = tuple(declared)

    def __repr__(self) -> str:
        return f"Secrets({', '.join(secret.name for secret in self.declared)})"

    def misdirected(self, head: RequestHead, host: str, port: int, *, inspected: bool) -> tuple[Secret, str] | None:
        """The secret whose placeholder ``head`` carries where it may not go, and where; None when none does.

        Where it may go: an inspected request to one of the secret's names, in its header.
        """
        for secret in self.declared:
            mark = secret.placeholder
            if mark in head.target:
                return secret, "in the request target"
            for name, value in head.headers:
                if mark not in value and mark not in _basic_password(name, value):
                    continue
                if not inspected:
                    return secret, "over a connection egressd does not inspect"
                if not secret.goes_to(host, port):
                    return secret, f"to {host}, not one of its names"
                if name.lower() != secret.header:
                    return secret, f"in the header {name}, not {secret.header}"
        return None

    def substitute(self, head: RequestHead, host: str, port: int) -> bool:
        """Put each secret's value in place of its placeholder in its header (an inspected request to its names).

        Returns whether anything was put in. Call only after ``misdirected`` said None.
        """
        changed = False
        for secret in self.declared:
            if not secret.goes_to(host, port):
                continue
            for index, (name, value) in enumerate(head.headers):
                if name.lower() != secret.header:
                    continue
                if secret.placeholder in value:
                    head.headers[index] = (name, value.replace(secret.placeholder, secret.value))
                    changed = True
                elif secret.placeholder in _basic_password(name, value):
                    head.headers[index] = (name, _basic_with(value, secret.placeholder, secret.value))
                    changed = True
        if changed:
            head.lowered = None  # the fields changed: no stale lowercased copy
        return changed


def _basic_password(name: str, value: str) -> str:
    """``Authorization: Basic BASE64`` decoded (the placeholder may be its password), else ""."""
    if value[:6].lower() != "basic " or name.lower() not in ("authorization", "proxy-authorization"):
        return ""
    try:
        return base64.b64decode(value[6:].strip(), validate=True).decode("utf-8", "replace")
    except (binascii.Error, ValueError):
        return ""


def _basic_with(value: str, mark: str, real: str) -> str:
    decoded = _basic_password("authorization", value)
    return "Basic " + base64.b64encode(decoded.replace(mark, real).encode()).decode("ascii")
