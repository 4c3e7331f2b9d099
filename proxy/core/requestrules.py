"""Request rules: which methods and paths a run may use on an inspected name, and paths made unambiguous.

The grammar (DESIGN.md "Policy", request rules), in the same lists as
today's entries; a rule names a method or a path, a plain entry neither:

- ``GET github.com/org/repo/**``: the method on the paths the pattern covers;
- ``GET|HEAD github.com/org/**``: several methods, joined by ``|`` (the comma
  already separates list items on the command line and in ``EGRESSD_*``);
- ``api.github.com/repos/org/*/pulls``: any method on that path;
- ``POST api.openai.com``: the method on every path;
- ``read_only github.com``: GET, HEAD and OPTIONS on every path (Codex's "limited");
- ``inspect github.com``: inspected, with no request allowed by this entry:
  every request is asked about.

The host part is an entry's (``example.com``, ``*.example.com``, an
optional ``:PORT``; ``policy.parse_entry`` reads it). A path pattern is a
normalised path whose segments may be ``*`` (exactly one segment) or, last,
``**`` (any rest, none included: ``/org/repo/**`` covers ``/org/repo``).
``CONNECT`` and ``TRACE`` cannot be named: one opens a tunnel inside the
tunnel, the other echoes the request (and its credentials) back.

Paths (``normalise_path``) follow RFC 3986 §6.2.2: percent-encoded
unreserved characters decoded, other escapes kept in upper case, dot
segments removed; the normalised path is what is decided and what is
forwarded. What could be read two ways is refused (``PathError``, the
request ``bad_request``): an encoded ``/`` or ``\\``, a backslash, NUL, a
``.`` or ``..`` segment made by decoding, a ``;`` (path parameters, which
some servers strip before routing), an empty segment (``//``), an escape
that is not UTF-8 (overlong forms like ``%C0%AE`` included), a control or
non-ASCII character, a ``..`` climbing above the root, a fragment.

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple

__all__ = [
    "READ_ONLY",
    "NormalisedPath",
    "PathError",
    "RequestError",
    "RequestRule",
    "RuleError",
    "approval_prefix",
    "normalise_path",
    "override_method",
    "parse_rule",
    "suggested_rule",
    "under",
]

READ_ONLY: Final = frozenset({"GET", "HEAD", "OPTIONS"})
# What a WebSocket upgrade is judged as (its GET would let ``read_only`` open a channel that carries
# anything): allowed by a rule naming it, or naming no method.
WEBSOCKET: Final = "WEBSOCKET"
# Never named by a rule (see the module docstring).
UNNAMEABLE: Final = frozenset({"CONNECT", "TRACE"})
# The headers that ask a server to treat a request as another method (Rails, Express, Google APIs, ...).
OVERRIDE_HEADERS: Final = frozenset({"x-http-method-override", "x-http-method", "x-method-override"})

_UNRESERVED: Final = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_METHOD: Final = re.compile(r"[A-Z][A-Z0-9_-]{0,31}")
_HEX: Final = frozenset("0123456789abcdefABCDEF")
# Printable ASCII, no space; '\\' and ';' are refused by name below.
_PATH_CHARS: Final = re.compile(r"[!-~]*")
# What RFC 3986 lets a path hold (pchar, "/", "%"): anything else ("|", "[", "{", "<", "^", "`", '"')
# is read differently by different servers, so it is refused rather than passed on.
_PCHARS: Final = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*")


class PathError(ValueError):
    """A request path that cannot be normalised unambiguously (the request is ``bad_request``)."""


class RequestError(ValueError):
    """A request that says two things at once (method-override headers that disagree)."""


class RuleError(ValueError):
    """A request rule that is malformed."""


class NormalisedPath(NamedTuple):
    """A request target made unambiguous: ``path`` is decided on, ``target`` forwarded."""

    path: str  # normalised, without the query
    query: str | None  # as sent (None: no ``?``)
    query_names: tuple[str, ...]  # the parameters' names, for an approver; never their values
    target: str  # ``path`` and, if there was one, ``?query``


def normalise_path(target: str) -> NormalisedPath:
    """The origin-form ``target`` normalised (see the module docstring); PathError for what is ambiguous."""
    if not target.startswith("/"):
        raise PathError("the target is not a path")
    if not _PATH_CHARS.fullmatch(target):
        raise PathError("a space, control or non-ASCII character in the target")
    if "#" in target:
        raise PathError("a fragment in the target")
    raw_path, mark, query = target.partition("?")
    if "\\" in raw_path:
        raise PathError("a backslash in the path")
    if not _PCHARS.fullmatch(raw_path):
        raise PathError("a character RFC 3986 does not allow in a path (escape it)")
    if ";" in raw_path:
        raise PathError("a ';' (path parameters) in the path")
    segments: list[str] = []
    parts = raw_path.split("/")[1:]
    for index, raw in enumerate(parts):
        if raw == "" and index != len(parts) - 1:
            raise PathError("an empty segment ('//') in the path")
        if raw == ".":
            if index == len(parts) - 1:
                segments.append("")  # "/a/." is "/a/"
            continue
        if raw == "..":
            if not segments:
                raise PathError("'..' climbs above the root")
            segments.pop()
            if index == len(parts) - 1:
                segments.append("")
            continue
        segment = _decoded(raw)
        if segment in (".", ".."):
            raise PathError(f"{raw!r} is a dot segment only once decoded")
        segments.append(segment)
    path = "/" + "/".join(segments)
    names = tuple(part.partition("=")[0] for part in query.split("&") if part) if mark else ()
    return NormalisedPath(path, query if mark else None, names, path + (f"?{query}" if mark else ""))


def _decoded(segment: str) -> str:
    """One segment: unreserved escapes decoded, the rest upper-cased; PathError for what is ambiguous."""
    if "%" not in segment:
        return segment
    out: list[str] = []
    encoded = bytearray()  # a run of escapes that are not unreserved: must be UTF-8
    i = 0
    while i < len(segment):
        char = segment[i]
        if char != "%":
            _flush(encoded, out)
            out.append(char)
            i += 1
            continue
        pair = segment[i + 1 : i + 3]
        if len(pair) != 2 or not set(pair) <= _HEX:
            raise PathError(f"an invalid escape {segment[i:i + 3]!r}")
        byte = int(pair, 16)
        if byte in (0x2F, 0x5C):
            raise PathError("an encoded '/' or '\\' in the path")
        if byte == 0:
            raise PathError("an encoded NUL in the path")
        if byte in _UNRESERVED:
            _flush(encoded, out)
            out.append(chr(byte))
        else:
            encoded.append(byte)
        i += 3
    _flush(encoded, out)
    return "".join(out)


def _flush(encoded: bytearray, out: list[str]) -> None:
    """Keep a run of escapes, upper-cased, if it is strict UTF-8 (no overlong form) or printable ASCII."""
    if not encoded:
        return
    try:
        encoded.decode("utf-8", "strict")
    except UnicodeDecodeError:
        raise PathError("an escape that is not UTF-8 (an overlong form?)") from None
    out.append("".join(f"%{byte:02X}" for byte in encoded))
    encoded.clear()


def under(path: str, prefix: str) -> bool:
    """Whether a normalised ``path`` is ``prefix`` or below it, segment by segment."""
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def approval_prefix(path: str) -> str:
    """The prefix an answer *for the run* covers: the path's first two segments (``/org/repo``), else the path."""
    segments = [segment for segment in path.split("/")[1:] if segment]
    return "/" + "/".join(segments[:2])


@dataclass(frozen=True, slots=True)
class RequestRule:
    """One request rule: methods (None: any; empty: none) on the paths ``pattern`` covers, on ``authority``."""

    text: str  # canonical: the audit record's ``rule``
    methods: frozenset[str] | None
    authority: str  # ``host[:port]`` as an entry writes it (``policy.parse_entry`` reads it)
    pattern: tuple[str, ...]  # segments; ``*`` one, ``**`` (last) any rest

    def covers(self, method: str, path: str) -> bool:
        """Whether the rule allows ``method`` on the normalised ``path`` (its host checked by the caller)."""
        if self.methods is not None and method not in self.methods:
            return False
        return _matches(self.pattern, path.split("/")[1:])


def _matches(pattern: tuple[str, ...], segments: list[str]) -> bool:
    for index, want in enumerate(pattern):
        if want == "**":
            return True
        if index >= len(segments):
            return False
        if want != "*" and want != segments[index]:
            return False
        if want == "*" and not segments[index]:
            return False
    return len(segments) == len(pattern)


def parse_rule(text: str) -> RequestRule | None:
    """The request rule ``text`` is, or None for a plain entry (no method, no path); RuleError if malformed."""
    words = text.split()
    if len(words) == 1 and "/" not in text:
        return None
    if len(words) > 2 or not words:
        raise RuleError("a rule is 'METHOD host/path', 'host/path', 'read_only host' or 'inspect host'")
    if len(words) == 2:
        verb, target = words
        if verb == "read_only":
            methods: frozenset[str] | None = READ_ONLY
        elif verb == "inspect":
            methods = frozenset()
        else:
            methods = _methods(verb)
        if verb in ("read_only", "inspect") and "/" in target:
            raise RuleError(f"{verb!r} names a host, not a path")
    else:
        methods, target = None, words[0]
    authority, slash, path = target.partition("/")
    if not authority:
        raise RuleError("a rule names a host before its path")
    pattern = _pattern("/" + path if slash else "/**")
    if methods is None:
        canonical = f"{authority}{'/' + '/'.join(pattern)}"
    elif words[0] in ("read_only", "inspect"):
        canonical = f"{words[0]} {authority}"
    else:
        canonical = f"{'|'.join(sorted(methods))} {authority}/{'/'.join(pattern)}"
    return RequestRule(canonical, methods, authority, pattern)


def _methods(text: str) -> frozenset[str]:
    methods = frozenset(text.split("|"))
    for method in methods:
        if not _METHOD.fullmatch(method):
            raise RuleError(f"{method!r} is not a method (upper case, like GET or POST), and a host name has no spaces")
        if method in UNNAMEABLE:
            raise RuleError(f"{method} cannot be allowed by a rule")
    return methods


def _pattern(path: str) -> tuple[str, ...]:
    """A path pattern's segments; RuleError unless it is a normalised path with ``*`` and a last ``**``."""
    if "?" in path:
        raise RuleError("a rule's path has no query")
    try:
        normal = normalise_path(path)
    except PathError as exc:
        raise RuleError(f"the path {path!r}: {exc}") from None
    if normal.path != path:
        raise RuleError(f"the path {path!r} is not normalised: write {normal.path!r}")
    segments = tuple(path.split("/")[1:])
    for index, segment in enumerate(segments):
        if "*" in segment and segment not in ("*", "**"):
            raise RuleError(f"'*' stands for a whole segment, not part of {segment!r}")
        if segment == "**" and index != len(segments) - 1:
            raise RuleError("'**' comes last in a path")
        if not segment and index != len(segments) - 1:
            raise RuleError("an empty segment in the path")
    return segments


def suggested_rule(method: str, host: str, port: int, path: str) -> str:
    """The rule an *always* answer keeps: ``method`` under the path's ``approval_prefix`` on ``host``."""
    prefix = approval_prefix(path)
    authority = host if port == 443 else f"{host}:{port}"
    rest = "/**" if prefix == "/" else f"{prefix}/**"
    return f"{method} {authority}{rest}"


def override_method(headers: Iterable[tuple[str, str]]) -> str | None:
    """The method an override header names (judged as that one), None when none does; RequestError if two disagree."""
    named = {value.strip().upper() for name, value in headers if name.lower() in OVERRIDE_HEADERS}
    if not named:
        return None
    if len(named) > 1:
        raise RequestError("method-override headers name different methods")
    method = named.pop()
    if not _METHOD.fullmatch(method):
        raise RequestError("a method-override header names no method")
    return method
