"""A coverage-guided fuzzer for the parsers that read what a sandbox sends.

Targets, each with an oracle beyond "does not crash" (a parser returns its
answer or raises its own documented error, nothing else):

- ``http_head``: ``parse_request_head``, then ``request_destination``,
  ``decide`` and ``forward_request_head``. Errors are HttpError 400, 431,
  501 or 505. An accepted head is the same with more bytes after it, no
  prefix of it is a head, its method, names and values hold no CR, LF, NUL
  or other control, it has at most one Host and unambiguous framing, and
  the head forwarded upstream parses back to one Host, no hop-by-hop field
  and the same framing.
- ``chunked``: ``ChunkedScanner`` against a strict decoder written here
  from RFC 9112 §7.1: same accept/refuse/need-more, the end found is where
  the terminator ends (bytes after it are never consumed), the bytes in
  between hold exactly the sum of the chunk sizes, and feeding the input in
  1- or 7-byte pieces (some as memoryviews) gives the same answer.
- ``clienthello``: ``parse_client_hello``: a ClientHello, None (need more)
  or ClientHelloError; a complete answer does not change when more bytes
  follow, and every prefix gives None or the same answer. ``scan_client``
  (both at the start of a connection and later): ClientRecords or
  ClientHelloError; a prefix is never refused when the whole is not, never
  gives more ready bytes or other hellos; the ready bytes alone scan the
  same; its first hello is parse_client_hello's.
- ``dns``: ``read_query`` then ``plan_answer`` and ``pack_reply``: a Query
  or a DnsQueryError (whose reply, if any, is a response); a cached question
  reads the same as a fresh one; a reply repeats the question byte for byte
  and dnslib reads it back as the answer to the query.
- ``proxy_auth``: ``parse_proxy_authorization`` and
  ``RunRegistry.authenticate`` on a Proxy-Authorization value (and in a
  request head): credentials only when a strict ``Basic`` grammar written
  here gives the same ones, the run only for its own id and token, no
  exception ever.

Coverage guidance: every input runs under ``sys.settrace`` restricted to the
target's modules (a frame in any other file is not traced), which records
each (line before, line) pair as an edge. An input that reaches an edge no
earlier input reached joins the corpus, and inputs are mutated from the
corpus. Mutations know the formats: length fields and counts, CRLF, colon
and whitespace edits and header lines for HTTP, hex sizes, extensions and
trailers for chunks, base64 and colon edits for credentials, a dictionary
of tokens per target, splicing between corpus entries. Deterministic for a
seed. Standalone::

    python -m tests.fuzz.fuzz_parsers --seconds 600 [--target NAME] [--seed N] [--progress 60]

prints executions/s, lines and edges covered and corpus size per target,
and exits 1 with the input in hex on the first failure. With atheris
installed, ``python -m tests.fuzz.atheris_fuzz NAME [libFuzzer flags]`` runs
the same checks under libFuzzer.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import inspect
import random
import re
import struct
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address

import dnslib
from dnslib import DNSRecord

from egressd.names import authority, shown
from egressd.names.hosts import HostError, normalise_host
from egressd.proxy.core import clienthello as clienthello_module
from egressd.proxy.core import dns, dnsanswer, runs
from egressd.proxy.core.clienthello import ClientHello, ClientHelloError, ClientRecords, parse_client_hello, scan_client
from egressd.proxy.core.dns import DnsQueryError, read_query
from egressd.proxy.core.dnsanswer import pack_reply, plan_answer
from egressd.proxy.core.http1 import destination, forwarding, framing, heads, syntax
from egressd.proxy.core.http1.destination import request_destination
from egressd.proxy.core.http1.forwarding import forward_request_head
from egressd.proxy.core.http1.framing import BodyKind, ChunkedScanner
from egressd.proxy.core.http1.heads import RequestHead, parse_request_head, request_body_kind
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.policy import RunPolicy, decide
from egressd.proxy.core.runs import RunRegistry, parse_proxy_authorization
from egressd.vocabulary.reasons import Reason
from tests.fakes import hellos
from tests.fuzz import toy_parser

_INTERESTING16 = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0x3FFF, 0x4000, 0x4001, 0x7FFF, 0x8000, 0xFFFF)
_INTERESTING8 = (0, 1, 0x3F, 0x40, 0x7F, 0x80, 0xC0, 0xFF)


class FuzzFailure(AssertionError):
    def __init__(self, target: str, data: bytes, why: str) -> None:
        super().__init__(f"{target}: {why}\ninput: {data.hex()}")
        self.data = data


# --- coverage ---------------------------------------------------------------------


class Tracer:
    """Edges (line before, line) reached in the given files, per input, with ``sys.settrace``."""

    def __init__(self, files: Iterable[str]) -> None:
        self.files = frozenset(files)

    def run(self, check: Callable[[bytes], None], data: bytes) -> set[tuple[str, int, int]]:
        edges: set[tuple[str, int, int]] = set()
        add = edges.add
        files = self.files

        def on_call(frame: types.FrameType, event: str, arg: object) -> Callable | None:
            filename = frame.f_code.co_filename
            if filename not in files:
                return None
            prev = -frame.f_code.co_firstlineno

            def on_line(frame: types.FrameType, event: str, arg: object) -> Callable:
                nonlocal prev
                if event == "line":
                    line = frame.f_lineno
                    add((filename, prev, line))
                    prev = line
                return on_line

            return on_line

        before = sys.gettrace()
        sys.settrace(on_call)
        try:
            check(data)
        finally:
            sys.settrace(before)
        return edges


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """No tracing inside: an oracle's re-checks (prefixes, pieces) cost full speed and steer nothing."""
    before = sys.gettrace()
    sys.settrace(None)
    try:
        yield
    finally:
        sys.settrace(before)


def executable_lines(module: types.ModuleType) -> set[int]:
    """The lines of ``module``'s function bodies (what "N of M lines" counts).

    Module and class bodies run at import, and a ``def`` line is no line
    event: neither is counted.
    """
    with open(module.__file__, encoding="utf-8") as f:
        code = compile(f.read(), module.__file__, "exec")
    lines: set[int] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        if current.co_flags & inspect.CO_OPTIMIZED:  # a function, not a module or class body
            lines.update(line for _, _, line in current.co_lines() if line not in (None, current.co_firstlineno))
        stack.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return lines


def code_constants(module: types.ModuleType) -> tuple[bytes, ...]:
    """The constants the module compares input with, as tokens (AFL's auto-dictionary).

    Ints become one or two big-endian bytes, short str and bytes constants
    themselves: a mutation that writes one passes a comparison that a random
    byte would pass once in 256 tries (or 65536 for a 16-bit field).
    """
    with open(module.__file__, encoding="utf-8") as f:
        stack: list[object] = [compile(f.read(), module.__file__, "exec")]
    found: set[bytes] = set()
    while stack:
        const = stack.pop()
        if isinstance(const, types.CodeType):
            stack.extend(const.co_consts)
        elif isinstance(const, tuple | frozenset):
            stack.extend(const)
        elif isinstance(const, bool):
            continue
        elif isinstance(const, int) and 0 <= const <= 0xFFFF:
            found.add(const.to_bytes(1 if const <= 0xFF else 2, "big"))
        elif isinstance(const, bytes) and 0 < len(const) <= 32:
            found.add(const)
        elif isinstance(const, str) and 0 < len(const) <= 32 and const.isascii():
            found.add(const.encode())
    return tuple(sorted(found))


# --- mutation -----------------------------------------------------------------------

Mutator = Callable[[bytearray, random.Random], bytearray]


def _byte_mutation(buf: bytearray, rng: random.Random, pool: list[bytes], tokens: tuple[bytes, ...]) -> bytearray:
    if not buf:
        return bytearray(rng.choice(tokens) if tokens else bytes([rng.randrange(256)]))
    i = rng.randrange(len(buf))
    op = rng.randrange(12)
    if op == 0:
        buf[i] ^= 1 << rng.randrange(8)
    elif op == 1:
        buf[i] = rng.randrange(256)
    elif op == 2 and i + 1 < len(buf):
        struct.pack_into("!H", buf, i, rng.choice(_INTERESTING16))  # a length or count field
    elif op == 3:
        buf[i] = rng.choice(_INTERESTING8)
    elif op == 4:
        del buf[i : i + rng.randint(1, 16)]
    elif op == 5:
        buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif op == 6:
        buf = buf[: rng.randrange(len(buf) + 1)]
    elif op == 7:
        other = rng.choice(pool)
        j = rng.randrange(len(other) + 1)
        buf = buf[:i] + bytearray(other[j : j + rng.randint(1, 64)]) + buf[i:]
    elif op == 8:
        k = rng.randint(1, 32)
        buf[i:i] = buf[i : i + k]
    elif op == 9 and tokens:
        buf[i:i] = rng.choice(tokens)
    elif op == 10 and tokens:
        token = rng.choice(tokens)
        buf[i : i + len(token)] = token
    else:
        buf[i] = (buf[i] + rng.choice((-1, 1, -16, 16, rng.randint(-35, 35)))) & 0xFF
    return buf


@dataclass(frozen=True)
class Target:
    name: str
    seeds: Callable[[], list[bytes]]
    check: Callable[[bytes], None]
    modules: tuple[types.ModuleType, ...]
    tokens: tuple[bytes, ...] = ()
    mutators: tuple[Mutator, ...] = ()
    max_len: int = 4096
    reset: Callable[[], None] | None = None


def mutate(target: Target, data: bytes, rng: random.Random, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(1 << rng.randrange(4)):
        if target.mutators and rng.random() < 0.5:
            buf = rng.choice(target.mutators)(buf, rng)
        else:
            buf = _byte_mutation(buf, rng, pool, target.tokens)
    return bytes(buf[: target.max_len])


# --- the loop -----------------------------------------------------------------------


@dataclass
class Stats:
    target: str
    executions: int = 0
    seconds: float = 0.0
    edges: set[tuple[str, int, int]] = field(default_factory=set)
    corpus: list[bytes] = field(default_factory=list)
    executable: int = 0

    @property
    def lines(self) -> int:
        return len({(filename, line) for filename, _, line in self.edges})

    @property
    def rate(self) -> float:
        return self.executions / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        return (
            f"{self.target}: {self.executions} execs in {self.seconds:.0f} s ({self.rate:.0f}/s), "
            f"lines {self.lines} of {self.executable}, edges {len(self.edges)}, corpus {len(self.corpus)}"
        )


def fuzz(
    target: str | Target,
    *,
    seed: int,
    iterations: int | None = None,
    seconds: float | None = None,
    guided: bool = True,
    progress: float | None = None,
) -> Stats:
    """Run ``target`` for ``iterations`` inputs or ``seconds``; raises FuzzFailure on the first failure.

    ``guided=False`` is the control: the same mutations, from the seeds and
    a random 5% of earlier inputs, whatever they covered.
    """
    spec = target if isinstance(target, Target) else TARGETS[target]
    if spec.reset is not None:
        spec.reset()
    tokens = spec.tokens + tuple(token for module in spec.modules for token in code_constants(module))
    spec = dataclasses.replace(spec, tokens=tokens)
    rng = random.Random(seed)
    tracer = Tracer(module.__file__ for module in spec.modules)
    stats = Stats(spec.name, executable=sum(len(executable_lines(module)) for module in spec.modules))
    start = time.monotonic()
    deadline = start + seconds if seconds is not None else None
    next_report = start + progress if progress else None
    seeds = spec.seeds()
    for data in seeds:
        stats.edges |= tracer.run(spec.check, data)
        stats.corpus.append(data)
    pool = stats.corpus if guided else list(seeds)
    while iterations is None or stats.executions < iterations:
        if deadline is not None and stats.executions % 64 == 0:
            now = time.monotonic()
            if now >= deadline:
                break
            if next_report is not None and now >= next_report:
                stats.seconds = now - start
                print(f"  after {stats.seconds:.0f} s: {stats.summary()}", flush=True)
                next_report += progress
        # Recent finds are the frontier: a quarter of the picks go to the last 16.
        parent = rng.choice(pool[-16:] if rng.random() < 0.25 else pool)
        data = mutate(spec, parent, rng, pool)
        edges = tracer.run(spec.check, data)
        stats.executions += 1
        if guided:
            if not edges <= stats.edges:
                stats.edges |= edges
                stats.corpus.append(data)
        else:
            stats.edges |= edges
            if len(pool) < 256 and rng.random() < 0.05:
                pool.append(data)
    stats.seconds = time.monotonic() - start
    return stats


# --- http_head ------------------------------------------------------------------------

_HEAD_LIMIT = 2048
_TCHAR = set(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate"} | {
    "te",
    "trailer",
    "upgrade",
}


def http_seeds() -> list[bytes]:
    return [
        b"GET http://origin.test/path?q=1 HTTP/1.1\r\nHost: origin.test\r\nAccept: */*\r\n\r\n",
        b"CONNECT origin.test:443 HTTP/1.1\r\nHost: origin.test:443\r\nProxy-Authorization: Basic YTpi\r\n\r\n",
        b"POST http://[::1]:8080/up HTTP/1.1\r\nContent-Length: 5\r\nConnection: close, x-a\r\nx-a: 1\r\n\r\nhello",
        b"PUT http://a.test/ HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\nTE: trailers\r\n\r\n0\r\n\r\n",
        b"\r\nGET HTTP://A.TEST:80 HTTP/1.0\nContent-Length: 3, 3\nKeep-Alive: 5\n\n",
        b"HEAD http://xn--bcher-kva.test/a#b HTTP/1.1\r\nUpgrade: h2c\r\nProxy-Connection: keep-alive\r\n\r\n",
        b"GET http://a.test/ HTTP/1.1\r\nX-Long: " + b"v" * _HEAD_LIMIT + b"\r\n\r\n",  # 431
    ]


_HTTP_TOKENS = (
    b"\r\n",
    b"\n",
    b"\r",
    b":",
    b" ",
    b"\t",
    b",",
    b"\x00",
    b"\x7f",
    b"\xff",
    b"\r\n\r\n",
    b"\n\n",
    b"Content-Length: ",
    b"Transfer-Encoding: chunked\r\n",
    b"Host: ",
    b"Connection: ",
    b"CONNECT ",
    b"http://",
    b"https://",
    b"HTTP/1.1",
    b"HTTP/2.0",
    b"[",
    b"]",
    b"@",
    b"#",
    b"?",
    b"/",
    b":443",
    b":0",
    b":65536",
    b"chunked",
)
_HTTP_LINES = (
    b"Content-Length: 0",
    b"Content-Length: 1, 2",
    b"Content-Length: 7, 7",
    b"Content-Length: +5",
    b"Content-Length: 0000000000000000001",
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: chunked, gzip",
    b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding: chunked, chunked",
    b"Transfer-Encoding: br, chunked",
    b"Transfer-Encoding: ,",
    b"Transfer-Encoding : chunked",
    b"Host: a.test",
    b"Host: b.test:8080",
    b"Connection: close, content-length, x-y",
    b"Connection: keep-alive",
    b"Proxy-Authorization: Basic YTpi",
    b"X-Egress-Decision: allow",
    b" folded",
    b"\tfolded",
    b": empty-name",
    b"no-colon",
    b"Bad Name: x",
    b"Name:\x00nul",
    b"Name: a\rb",
)
_HTTP_TARGETS = (
    b"http://a.test/",
    b"http://a.test:8080/x?y#z",
    b"http://[::1]:80/",
    b"http://[::ffff:1.2.3.4]/",
    b"http://[zz]/",
    b"http://a.test:0/",
    b"http://a.test:65536/",
    b"http://a@b.test/",
    b"http://a.test\\@b.test/",
    b"HtTp://A.TEST",
    b"http://0x7f.1/",
    b"http://..../",
    b"http://-a-.test./",
    b"http://a..b/",
    b"http://" + b"a" * 70 + b".test/",
    b"http:///x",
    b"ftp://a.test/",
    b"https://a.test/",
    b"a.test:443",
    b"[::1]:443",
    b"a.test",
    b"*",
    b"/",
    b"",
)
_HTTP_METHODS = (b"GET", b"CONNECT", b"POST", b"HEAD", b"G\xe9T", b"", b"GE T", b"OPTIONS")
_HTTP_VERSIONS = (b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.10", b"http/1.1", b"HTTP/1.1 ", b"")


def _lines(buf: bytearray) -> list[bytes]:
    return bytes(buf).splitlines(keepends=True) or [b""]


def _http_line_edit(buf: bytearray, rng: random.Random) -> bytearray:
    lines = _lines(buf)
    i = rng.randrange(len(lines))
    op = rng.randrange(6)
    if op == 0:
        lines.insert(i, lines[i])
    elif op == 1 and len(lines) > 1:
        del lines[i]
    elif op == 2:
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 3:
        lines.insert(max(1, i), rng.choice(_HTTP_LINES) + rng.choice((b"\r\n", b"\r\n", b"\n")))
    elif op == 4:
        # Line ends: CRLF, LF, bare CR, OWS before CRLF.
        body = lines[i].rstrip(b"\r\n")
        lines[i] = body + rng.choice((b"\r\n", b"\n", b"\r", b" \r\n", b"\r\r\n", b"\t\n"))
    else:
        # Whitespace and case around the colon.
        name, colon, value = lines[i].partition(b":")
        if colon:
            name = rng.choice((name, name.upper(), name.lower(), name + b" ", b" " + name))
            value = rng.choice((value, b" " + value, b"\t" + value, value.lstrip()))
            lines[i] = name + b":" + value
    return bytearray(b"".join(lines))


def _http_request_line(buf: bytearray, rng: random.Random) -> bytearray:
    lines = _lines(buf)
    start = 0
    while start < len(lines) - 1 and lines[start] in (b"\r\n", b"\n"):
        start += 1
    first = lines[start].rstrip(b"\r\n")
    ending = lines[start][len(first) :] or b"\r\n"
    parts = first.split(b" ")
    while len(parts) < 3:
        parts.append(b"")
    which = rng.randrange(4)
    if which == 0:
        parts[0] = rng.choice(_HTTP_METHODS)
    elif which == 1:
        parts[1] = rng.choice(_HTTP_TARGETS)
    elif which == 2:
        parts[2] = rng.choice(_HTTP_VERSIONS)
    else:
        sep = rng.choice((b"  ", b"\t", b" \t"))
        k = rng.randrange(len(parts) - 1)
        parts[k : k + 2] = [parts[k] + sep + parts[k + 1]]
    lines[start] = b" ".join(parts) + ending
    return bytearray(b"".join(lines))


def _http_value(buf: bytearray, rng: random.Random) -> bytearray:
    lines = _lines(buf)
    i = rng.randrange(len(lines))
    name, colon, _ = lines[i].partition(b":")
    if colon and i:
        value = rng.choice(
            (b"0", b"1, 1", b"1,2", b"chunked", b"gzip, chunked", b"chunked, gzip", b" chunked ", b"-1", b"1e3")
            + (b"0" * 19, b"\xe9", b"close", b"a.test", b"", b"Basic \xe9")
        )
        lines[i] = name + b": " + value + b"\r\n"
    return bytearray(b"".join(lines))


def check_http_head(data: bytes) -> None:
    def fail(why: str) -> FuzzFailure:
        return FuzzFailure("http_head", data, why)

    try:
        parsed = parse_request_head(data, _HEAD_LIMIT)
    except HttpError as exc:
        if exc.status not in (400, 431, 501, 505):
            raise fail(f"HttpError {exc.status} for a request") from exc
        return
    except Exception as exc:  # noqa: BLE001 - the point is to catch anything else
        raise fail(f"parse_request_head raised {exc!r}") from exc
    if parsed is None:
        if len(data) >= _HEAD_LIMIT:
            raise fail("None (need more) although max_bytes are in")
        return
    head, consumed = parsed
    if not 0 < consumed <= min(len(data), _HEAD_LIMIT):
        raise fail(f"consumed {consumed} of {len(data)}")
    for more in (data[:consumed], data[:consumed] + b"GET http://b.test/ HTTP/1.1\r\n\r\n", bytearray(data)):
        if parse_request_head(more, _HEAD_LIMIT) != parsed:
            raise fail("the answer changed with the bytes after the head")
    if parse_request_head(memoryview(data), _HEAD_LIMIT) != parsed:
        raise fail("a memoryview gave another answer")
    for cut in range(0, consumed, max(1, consumed // 8)):
        try:
            with untraced():
                prefix = parse_request_head(data[:cut], _HEAD_LIMIT)
        except HttpError as exc:
            raise fail(f"prefix {cut} raised {exc!r} although the whole parsed") from exc
        if prefix is not None:
            raise fail(f"prefix {cut} is a head too")
    # What is passed on: names are tokens, values hold no control but HTAB and no edge OWS.
    if not head.method or set(head.method.encode("latin-1")) - _TCHAR:
        raise fail(f"method {head.method!r}")
    if not head.target or not head.target.isascii() or any(c <= " " or c == "\x7f" for c in head.target):
        raise fail(f"target {head.target!r}")
    if head.version not in ("HTTP/1.0", "HTTP/1.1"):
        raise fail(f"version {head.version!r}")
    for name, value in head.headers:
        if not name or set(name.encode("latin-1")) - _TCHAR:
            raise fail(f"header name {name!r}")
        if any((c < " " and c != "\t") or c == "\x7f" for c in value) or value != value.strip(" \t"):
            raise fail(f"header value {value!r}")
    keys = [name.lower() for name, _ in head.headers]
    if keys.count("host") > 1:
        raise fail("two Host fields accepted")
    if "content-length" in keys and "transfer-encoding" in keys:
        raise fail("Content-Length and Transfer-Encoding accepted together")
    try:
        kind = request_body_kind(head)
    except Exception as exc:  # noqa: BLE001
        raise fail(f"request_body_kind raised {exc!r} on an accepted head") from exc
    if kind[0] is BodyKind.LENGTH:
        lengths = {part.strip(" \t") for value in head.get_all("content-length") for part in value.split(",")}
        if lengths != {str(kind[1]).zfill(len(next(iter(lengths))))}:
            raise fail(f"Content-Length {lengths} read as {kind[1]}")
    if kind[0] is BodyKind.CHUNKED:
        codings = [c.strip(" \t").lower() for v in head.get_all("transfer-encoding") for c in v.split(",")]
        if [c for c in codings if c][-1] != "chunked" or [c for c in codings if c].count("chunked") != 1:
            raise fail(f"framing read as chunked from {codings}")
    _check_destination(head, kind, fail)


def _check_destination(head: RequestHead, kind: tuple[BodyKind, int], fail: Callable[[str], Exception]) -> None:
    try:
        dest = request_destination(head)
    except HttpError as exc:
        if exc.status != 400:
            raise fail(f"request_destination gave {exc.status}") from exc
        return
    except Exception as exc:  # noqa: BLE001
        raise fail(f"request_destination raised {exc!r}") from exc
    if not 1 <= dest.port <= 65535 or "@" in dest.host or not dest.host:
        raise fail(f"destination {dest!r}")
    if ":" in dest.host and not re.fullmatch(r"[0-9A-Fa-f:.]+", dest.host):
        raise fail(f"destination host {dest.host!r}")
    try:
        normalise_host(dest.host)
    except HostError:
        pass  # the policy refuses it: bad_request
    except Exception as exc:  # noqa: BLE001
        raise fail(f"normalise_host raised {exc!r}") from exc
    try:
        decide(RunPolicy(), dest.host, dest.port)
    except Exception as exc:  # noqa: BLE001
        raise fail(f"decide raised {exc!r}") from exc
    if dest.scheme != "http":
        return
    if not dest.path.startswith("/") or "#" in dest.path:
        raise fail(f"path {dest.path!r}")
    try:
        out = forward_request_head(head, dest)
        again = parse_request_head(out, len(out) + 1)
    except Exception as exc:  # noqa: BLE001
        raise fail(f"the forwarded head does not parse: {exc!r}") from exc
    if again is None or again[1] != len(out):
        raise fail(f"the forwarded head is not one head: {out!r}")
    sent = again[0]
    if sent.method != head.method or sent.target != dest.path or sent.version != "HTTP/1.1":
        raise fail(f"forwarded request line {out!r}")
    hosts = sent.get_all("host")
    expected = f"[{dest.host}]" if ":" in dest.host else dest.host
    if dest.port != 80:
        expected += f":{dest.port}"
    if hosts != [expected]:
        raise fail(f"forwarded Host {hosts} for {dest!r}")
    if {name.lower() for name, _ in sent.headers} & (_HOP_BY_HOP - {"connection"}):
        raise fail(f"a hop-by-hop field forwarded: {out!r}")
    if request_body_kind(sent) != kind:
        raise fail(f"framing changed on the way: {kind} became {request_body_kind(sent)}")


# --- chunked ----------------------------------------------------------------------

_CHUNK_LINE = 4096
_TRAILER_BYTES = 64 * 1024
_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:[ \t]*;.*)?", re.S)
_LINE_OK = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_TRAILER_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:.*", re.S)


def reference_chunked(data: bytes) -> tuple[str, int, int, int]:
    """RFC 9112 §7.1 read strictly: ("done", end, decoded length, sum of sizes), ("more", ...) or ("bad", ...).

    Framing lines end in CRLF and hold no control but HTAB; limits as the scanner's.
    """
    pos = 0
    decoded = bytearray()
    total = 0

    def line(limit: int) -> tuple[str, bytes]:
        nonlocal pos
        if pos == len(data):
            return "more", b""
        newline = data.find(b"\n", pos)
        if newline < 0:
            return ("bad" if len(data) - pos >= limit else "more"), b""
        if newline + 1 - pos > limit:
            return "bad", b""
        raw = data[pos : newline + 1]
        if len(raw) < 2 or raw[-2:] != b"\r\n" or not _LINE_OK.fullmatch(raw[:-2]):
            return "bad", b""
        pos = newline + 1
        return "ok", raw[:-2]

    while True:
        state, content = line(_CHUNK_LINE)
        if state != "ok":
            return state, pos, len(decoded), total
        match = _SIZE_LINE.fullmatch(content)
        if not match:
            return "bad", pos, len(decoded), total
        size = int(match.group(1), 16)
        if size == 0:
            break
        if len(data) - pos < size:
            return "more", pos, len(decoded), total
        decoded += data[pos : pos + size]
        total += size
        pos += size
        if len(data) - pos < 2 and data[pos:] == b"\r\n"[: len(data) - pos]:
            return "more", pos, len(decoded), total
        if data[pos : pos + 2] != b"\r\n":
            return "bad", pos, len(decoded), total
        pos += 2
    budget = _TRAILER_BYTES
    while True:
        start = pos
        state, content = line(budget)
        if state != "ok":
            return state, pos, len(decoded), total
        budget -= pos - start
        if not content:
            return "done", pos, len(decoded), total
        if not _TRAILER_LINE.fullmatch(content):
            return "bad", pos, len(decoded), total


def _scan(data: bytes, piece: int | None) -> tuple[str, int]:
    """("done" | "more" | "bad", bytes of the body) from a ChunkedScanner fed in pieces."""
    scanner = ChunkedScanner()
    used = 0
    step = piece or max(1, len(data))
    for i in range(0, len(data), step):
        chunk = data[i : i + step]
        try:
            took = scanner.feed(memoryview(chunk) if (i // step) % 2 else chunk)
        except HttpError as exc:
            if exc.status != 400:
                raise
            try:
                scanner.feed(b"0\r\n\r\n")
            except HttpError:
                return "bad", used
            return "a failed scanner took more input", used
        if not 0 <= took <= len(chunk) or (took < len(chunk) and not scanner.done):
            return f"feed returned {took} of {len(chunk)}", used
        used += took
        if scanner.done:
            return "done", used
    return ("done" if scanner.done else "more"), used


def chunked_seeds() -> list[bytes]:
    return [
        b"5\r\nhello\r\n0\r\n\r\n",
        b"3;name=value\r\nabc\r\nA\r\n0123456789\r\n0\r\nTrailer: yes\r\n\r\nGET / HTTP/1.1\r\n",
        b"1 ;x\r\nZ\r\n0;last\r\nA: 1\r\nB: 2\r\n\r\n",
        b"00000000000000010\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n",
        b"0\r\n\r\n",
        b"F\r\n" + b"y" * 15 + b"\r\n",
    ]


_CHUNK_TOKENS = (b"\r\n", b"\n", b"\r", b";", b" ", b"\t", b"=", b"0", b"f", b"F", b"\x00", b"\xff", b"0\r\n\r\n", b":")


def _chunk_size_edit(buf: bytearray, rng: random.Random) -> bytearray:
    sizes = [m for m in re.finditer(rb"(?:^|\n)([0-9A-Fa-f]+)", bytes(buf))]
    if not sizes:
        return bytearray(b"%x\r\n" % rng.randrange(32)) + buf
    m = rng.choice(sizes)
    actual = bytes(buf).find(b"\r\n", m.end(1))
    data_len = max(0, len(buf) - actual - 4) if actual >= 0 else 0
    next_crlf = bytes(buf).find(b"\r\n", actual + 2) if actual >= 0 else -1
    if next_crlf >= 0:
        data_len = next_crlf - actual - 2
    value = rng.choice((0, 1, data_len, data_len + 1, max(0, data_len - 1), rng.randrange(1 << 16), (1 << 64) - 1))
    text = rng.choice((b"%x" % value, b"%X" % value, b"0" * rng.randint(1, 16) + b"%x" % value, b"%x" % (1 << 64)))
    buf[m.start(1) : m.end(1)] = text
    return buf


def _chunk_extension(buf: bytearray, rng: random.Random) -> bytearray:
    ends = [m.start() for m in re.finditer(rb"\r\n", bytes(buf))] or [len(buf)]
    i = rng.choice(ends)
    buf[i:i] = rng.choice((b";a=b", b" ;x", b'\t;q="s;\\""', b";", b"; ", b" ", b";\x01", b";" + b"e" * 4100))
    return buf


def _chunk_crlf(buf: bytearray, rng: random.Random) -> bytearray:
    ends = [m.start() for m in re.finditer(rb"\r\n", bytes(buf))]
    if not ends:
        return buf + b"\r\n"
    i = rng.choice(ends)
    buf[i : i + 2] = rng.choice((b"\n", b"\r", b"\r\r\n", b"", b"\r\n\r\n", b" \r\n"))
    return buf


def _chunk_splice(buf: bytearray, rng: random.Random) -> bytearray:
    """Insert a well-formed chunk or trailer at a line start, or bytes after the end."""
    starts = [0] + [m.end() for m in re.finditer(rb"\r\n", bytes(buf))]
    i = rng.choice(starts)
    n = rng.randrange(20)
    piece = rng.choice(
        (b"%x\r\n" % n + b"d" * n + b"\r\n", b"X-T: v\r\n", b"bad trailer\r\n", b"0\r\n\r\n", b"0\r\n", b"GET /")
    )
    buf[i:i] = piece
    return buf


def check_chunked(data: bytes) -> None:
    def fail(why: str) -> FuzzFailure:
        return FuzzFailure("chunked", data, why)

    try:
        whole = _scan(data, None)
        # Byte by byte and in 7s for short inputs; a long one in pieces of 61 and 97.
        with untraced():
            pieces = [_scan(data, 1 if len(data) <= 256 else 61)]
        pieces.append(_scan(data, 7 if len(data) <= 1024 else 97))
    except Exception as exc:  # noqa: BLE001
        raise fail(f"ChunkedScanner raised {exc!r}") from exc
    if whole[0] not in ("done", "more", "bad"):
        raise fail(whole[0])
    for other in pieces:
        if other[0] != whole[0] or (whole[0] != "bad" and other[1] != whole[1]):
            raise fail(f"fed in pieces: {other}, at once: {whole}")
    state, end, decoded, total = reference_chunked(data)
    if state != whole[0]:
        raise fail(f"scanner says {whole}, RFC 9112 says {state} at {end}")
    if state == "more" and whole[1] != len(data):
        raise fail(f"need more, yet only {whole[1]} of {len(data)} bytes taken")
    if state == "done":
        if whole[1] != end or not data[:end].endswith(b"\r\n"):
            raise fail(f"the body ends at {end}, the scanner took {whole[1]}")
        if decoded != total:
            raise fail(f"decoded {decoded} bytes, the chunk sizes add up to {total}")
        if _scan(data[:end] + b"0\r\n\r\n", None) != ("done", end):
            raise fail("bytes after the last chunk were taken")


# --- clienthello ------------------------------------------------------------------


_CCS = b"\x14\x03\x03\x00\x01\x01"  # change_cipher_spec (RFC 8446 §D.4)


def hello_seeds() -> list[bytes]:
    return [
        hellos.python_hello("origin.test"),
        hellos.python_hello(None),
        hellos.client_hello("grease.example.test", grease=True, padding=100),
        hellos.client_hello("legacy.test", tls13=False, grease=False),
        hellos.client_hello(None, extensions=False),
        hellos.records(hellos.handshake(hellos.body("frag.test")), [1, 2, 3, 50]),
        hellos.client_hello("cover.test", extra=[hellos.ech_extension()]),
        hellos.client_hello("inner.test", extra=[hellos.ech_extension(outer=False)]),
        hellos.client_hello("ccs.test") + _CCS + hellos.client_hello("second.test"),
        hellos.record(hellos.handshake(hellos.body("cut.test"))[:40]) + _CCS,
    ]


_HELLO_TOKENS = (
    b"\x16\x03\x01",
    b"\x16\x03\x03",
    b"\x01\x00\x00",
    b"\x00\x00",  # server_name
    b"\x00\x2b",  # supported_versions
    b"\xfe\x0d",  # encrypted_client_hello
    b"\xfd\x00",  # ech_outer_extensions
    b"\x03\x04",
    b"\x03\x03",
    b"\x0a\x0a",
    b"\x14\x03\x03\x00\x01\x01",  # change_cipher_spec
    b"\x15\x03\x03\x00\x02\x02\x28",  # alert
)


def _hello_fix_lengths(buf: bytearray, rng: random.Random) -> bytearray:
    """Make a single-record hello's record and handshake lengths agree with its size, so edits reach deeper."""
    if len(buf) >= 9 and buf[0] == 0x16:
        struct.pack_into("!H", buf, 3, min(len(buf) - 5, 1 << 14))
        buf[6:9] = (len(buf) - 9).to_bytes(3, "big")
    return buf


def check_clienthello(data: bytes) -> None:
    _check_scan_client(data)
    try:
        result = parse_client_hello(data)
    except ClientHelloError:
        return
    except Exception as exc:  # noqa: BLE001 - the point is to catch anything else
        raise FuzzFailure("clienthello", data, f"raised {exc!r}") from exc
    if result is None:
        return
    if not isinstance(result, ClientHello):
        raise FuzzFailure("clienthello", data, f"returned {result!r}")
    if parse_client_hello(data + b"\x16\x03\x01\x00\x01\x01") != result:
        raise FuzzFailure("clienthello", data, "bytes after a complete hello changed the answer")
    for cut in range(0, len(data), max(1, len(data) // 16)):
        try:
            with untraced():
                prefix = parse_client_hello(data[:cut])
        except ClientHelloError as exc:
            raise FuzzFailure("clienthello", data, f"prefix {cut} raised although the whole parsed") from exc
        if prefix not in (None, result):
            raise FuzzFailure("clienthello", data, f"prefix {cut} gave another answer")


def _check_scan_client(data: bytes) -> None:
    """``scan_client``: whole records only, and a longer input never takes back what a shorter one gave."""

    def scan(part: bytes, first: bool) -> ClientRecords | None:
        try:
            found = scan_client(part, first=first)
        except ClientHelloError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise FuzzFailure("clienthello", data, f"scan_client raised {exc!r}") from exc
        if not isinstance(found, ClientRecords) or not 0 <= found.ready <= len(part):
            raise FuzzFailure("clienthello", data, f"scan_client returned {found!r}")
        return found

    for first in (True, False):
        whole = scan(data, first)
        with untraced():
            prefixes = [(cut, scan(data[:cut], first)) for cut in range(0, len(data), max(1, len(data) // 8))]
        for cut, prefix in prefixes:
            if prefix is None and whole is not None:
                raise FuzzFailure("clienthello", data, f"scan_client refused prefix {cut} but not the whole")
            if prefix is not None and whole is not None:
                if prefix.ready > whole.ready or whole.hellos[: len(prefix.hellos)] != prefix.hellos:
                    raise FuzzFailure("clienthello", data, f"prefix {cut} gave {prefix}, the whole {whole}")
        if whole is None:
            continue
        if scan(data[: whole.ready], first) != whole:
            raise FuzzFailure("clienthello", data, "the ready bytes alone scan differently")
        if first and whole.hellos:
            try:
                hello = parse_client_hello(data)
            except ClientHelloError as exc:
                raise FuzzFailure("clienthello", data, "parse_client_hello refused what scan_client took") from exc
            if hello != whole.hellos[0]:
                raise FuzzFailure("clienthello", data, f"scan_client found {whole.hellos[0]}, parse {hello}")


# --- dns ------------------------------------------------------------------------------


def dns_seeds() -> list[bytes]:
    seeds = [
        bytes(DNSRecord.question(name, qtype).pack())
        for name, qtype in (
            ("origin.test", "A"),
            ("a" * 63 + ".exfil.test", "AAAA"),
            ("x.test", "TXT"),
            ("_dmarc.example.test", "ANY"),
        )
    ]
    with_edns = DNSRecord.question("edns.test", "A")
    with_edns.add_ar(dnslib.EDNS0(udp_len=1232))
    seeds.append(bytes(with_edns.pack()))
    return seeds


_DNS_TOKENS = (b"\xc0\x0c", b"\x00\x01\x00\x01", b"\x00\x1c\x00\x01", b"\x00\xff\x00\xff", b"\x3f", b"\x40", b"\x00")


def _dns_label_edit(buf: bytearray, rng: random.Random) -> bytearray:
    """Rewrite a label length octet in the question (the name starts at offset 12)."""
    if len(buf) > 12:
        i = rng.randrange(12, len(buf))
        buf[i] = rng.choice((0, 1, 63, 64, 191, 192, len(buf) - i, len(buf) - i - 1, len(buf) - i - 5)) & 0xFF
    return buf


def _dns_reset() -> None:
    dns._QUESTIONS.clear()  # the same inputs cover the same lines, whatever ran before


def check_dns(data: bytes) -> None:
    try:
        query = read_query(data)
    except DnsQueryError as exc:
        if exc.reply is not None and not DNSRecord.parse(exc.reply).header.qr:
            raise FuzzFailure("dns", data, "an error reply that is not a response") from exc
        return
    except Exception as exc:  # noqa: BLE001
        raise FuzzFailure("dns", data, f"read_query raised {exc!r}") from exc
    fresh = (query.ident, query.flags, *dns._read_question(data))
    if tuple(query) != fresh or tuple(read_query(data)) != fresh or tuple(read_query(bytearray(data))) != fresh:
        raise FuzzFailure("dns", data, "a cached question reads differently from a fresh one")
    if not query.qtype_text:
        raise FuzzFailure("dns", data, "no name for the query type")
    for unreachable, answer6 in ((None, IPv6Address("fd00::1")), (None, None), (Reason.DENYLISTED, None)):
        try:
            plan = plan_answer(query, answer4=IPv4Address("10.0.0.1"), answer6=answer6, unreachable=unreachable)
            packed = pack_reply(query, plan, 5)
            reply = DNSRecord.parse(packed)
        except Exception as exc:  # noqa: BLE001
            raise FuzzFailure("dns", data, f"answering raised {exc!r}") from exc
        if reply.header.id != query.ident or not reply.header.qr or tuple(reply.q.qname.label) != query.labels:
            raise FuzzFailure("dns", data, "the reply does not answer the query")
        if packed[12 : 12 + len(query.question)] != query.question:
            raise FuzzFailure("dns", data, "the reply does not repeat the question byte for byte")
        # The reply as sent (dnslib cannot re-pack a label over 63 octets,
        # which a FORMERR reply echoes): within 512 octets, or no longer
        # than the query whose question it repeats.
        if len(packed) > max(512, len(data)):
            raise FuzzFailure("dns", data, "a reply longer than 512 octets and than the query")


# --- proxy_auth ------------------------------------------------------------------------

_RUN_ID = "r-fuzz"
_RUN_TOKEN = "T0k3n_-fuzz"
_REGISTRY = RunRegistry()
_RUN = _REGISTRY.create(task=None, allow=(), run_id=_RUN_ID)
_RUN.token = _RUN_TOKEN
_STRICT_BASIC = re.compile(r"[ \t]*[Bb][Aa][Ss][Ii][Cc] [ \t]*([A-Za-z0-9+/]+=*)[ \t]*")


def reference_basic(value: str) -> tuple[str, str] | None:
    """RFC 7617 Basic credentials read strictly: (id, token), or None for anything malformed.

    Padding past a complete quantum ("YWJj=", "YWJj===") and non-zero
    trailing bits decode (Python's base64, strict mode included) to the
    credentials the canonical text names: no other ones, so they are not
    counted as malformed.
    """
    match = _STRICT_BASIC.fullmatch(value)
    if not match:
        return None
    try:
        decoded = base64.b64decode(match.group(1), validate=True).decode("utf-8")
    except ValueError:
        return None
    run_id, colon, token = decoded.partition(":")
    return (run_id, token) if colon and run_id else None


def _b64(text: bytes) -> bytes:
    return base64.b64encode(text)


def auth_seeds() -> list[bytes]:
    return [
        b"Basic " + _b64(f"{_RUN_ID}:{_RUN_TOKEN}".encode()),
        b"basic  " + _b64(b"r-other:" + _RUN_TOKEN.encode()),
        b"Basic " + _b64(f"{_RUN_ID}:wrong".encode()),
        b"Bearer abc",
        b"Basic " + _b64(b"no-colon"),
    ]


_AUTH_TOKENS = (b" ", b"\t", b"=", b"==", b":", b"+", b"/", b"-", b"_", b"\xe9", b"\xa0", b"\x85", b"Basic ", b"\r\n")


def _auth_payload_edit(buf: bytearray, rng: random.Random) -> bytearray:
    """Decode the credentials, edit them (colon, empty id, non-UTF-8), re-encode."""
    scheme, _, payload = bytes(buf).partition(b" ")
    try:
        decoded = bytearray(base64.b64decode(payload.strip(), validate=False))
    except ValueError:
        decoded = bytearray(f"{_RUN_ID}:{_RUN_TOKEN}".encode())
    op = rng.randrange(6)
    i = rng.randrange(len(decoded) + 1)
    if op == 0:
        decoded[i:i] = b":"
    elif op == 1:
        decoded = decoded.replace(b":", b"", 1)
    elif op == 2:
        decoded[i:i] = rng.choice((b"\xff", b"\xc3\xa9", b"\xc3", b"\x00", b"\r\n"))
    elif op == 3:
        decoded = bytearray(b":" + decoded.partition(b":")[2])
    elif op == 4:
        decoded = bytearray(f"{_RUN_ID}:{_RUN_TOKEN}".encode())
    else:
        del decoded[i : i + 1]
    encoded = _b64(bytes(decoded))
    encoded = rng.choice((encoded, encoded.rstrip(b"="), encoded + b"=", base64.urlsafe_b64encode(bytes(decoded))))
    return bytearray((scheme or b"Basic") + rng.choice((b" ", b"  ", b" \t", b"\t")) + encoded)


def _auth_scheme_edit(buf: bytearray, rng: random.Random) -> bytearray:
    _, sep, payload = bytes(buf).partition(b" ")
    scheme = rng.choice((b"Basic", b"basic", b"BASIC", b"Bearer", b"Basi", b"Basic\xa0", b"\xa0Basic", b"Digest"))
    return bytearray(scheme + (sep or b" ") + payload)


def check_proxy_auth(data: bytes) -> None:
    value = data.decode("latin-1")
    values = [value]
    head = b"CONNECT a.test:443 HTTP/1.1\r\nProxy-Authorization: " + data + b"\r\n\r\n"
    try:
        parsed = parse_request_head(head, 8192)
    except HttpError:
        parsed = None
    if parsed is not None and parsed[0].get("Proxy-Authorization") is not None:
        values.append(parsed[0].get("Proxy-Authorization"))
    for text in values:
        try:
            credentials = parse_proxy_authorization(text)
        except Exception as exc:  # noqa: BLE001
            raise FuzzFailure("proxy_auth", data, f"parse_proxy_authorization raised {exc!r}") from exc
        expected = reference_basic(text)
        if credentials != expected:
            raise FuzzFailure("proxy_auth", data, f"credentials {credentials!r}, strict Basic says {expected!r}")
        try:
            run = _REGISTRY.authenticate(text)
        except Exception as exc:  # noqa: BLE001
            raise FuzzFailure("proxy_auth", data, f"authenticate raised {exc!r}") from exc
        if run is not (_RUN if credentials == (_RUN_ID, _RUN_TOKEN) else None):
            raise FuzzFailure("proxy_auth", data, f"authenticated as {run!r}")


# --- toy (for the test that guidance works) --------------------------------------------


def check_toy(data: bytes) -> None:
    try:
        toy_parser.parse_toy(data)
    except toy_parser.ToyError:
        return
    except Exception as exc:  # noqa: BLE001
        raise FuzzFailure("toy", data, f"raised {exc!r}") from exc


TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        Target(
            "http_head",
            http_seeds,
            check_http_head,
            # the request-target's authority is parsed in egressd.names.authority
            (heads, destination, forwarding, framing, syntax, authority),
            _HTTP_TOKENS,
            (_http_line_edit, _http_request_line, _http_value),
            max_len=_HEAD_LIMIT + 64,
        ),
        Target(
            "chunked",
            chunked_seeds,
            check_chunked,
            (framing, syntax),
            _CHUNK_TOKENS,
            (_chunk_size_edit, _chunk_extension, _chunk_crlf, _chunk_splice),
            max_len=8192,
        ),
        Target(
            "clienthello",
            hello_seeds,
            check_clienthello,
            (clienthello_module,),
            _HELLO_TOKENS,
            (_hello_fix_lengths,),
            max_len=8192,
        ),
        Target("dns", dns_seeds, check_dns, (dns, dnsanswer, shown), _DNS_TOKENS, (_dns_label_edit,), 700, _dns_reset),
        Target(
            "proxy_auth",
            auth_seeds,
            check_proxy_auth,
            (runs,),
            _AUTH_TOKENS,
            (_auth_payload_edit, _auth_scheme_edit),
            max_len=512,
        ),
    )
}
# Not a parser of egressd: only for the test that the loop is coverage-guided.
TOY = Target("toy", lambda: [b"T" + b"\x00" * 7], check_toy, (toy_parser,), max_len=16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="the budget, shared by the targets")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--target", choices=sorted(TARGETS), action="append")
    parser.add_argument("--progress", type=float, default=None, help="print figures every N seconds")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    targets = args.target or sorted(TARGETS)
    for target in targets:
        try:
            stats = fuzz(target, seed=seed, seconds=args.seconds / len(targets), progress=args.progress)
        except FuzzFailure as failure:
            print(f"FAIL (seed {seed}) {failure}", file=sys.stderr)
            return 1
        print(f"{stats.summary()}; no failure (seed {seed})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
