"""SOCKS5 as values: the handshake's messages parsed from bytes and the replies built, without I/O.

What the SOCKS listener (``ways.SocksWay``) reads, in order:

1. the greeting (RFC 1928 §3): VER 5, NMETHODS (1..255), METHODS;
2. when the method chosen is username/password, its sub-negotiation
   (RFC 1929 §2): VER 1, ULEN (1..255), UNAME, PLEN (0..255), PASSWD;
3. the request (RFC 1928 §4): VER 5, CMD, RSV 0, ATYP, DST.ADDR, DST.PORT,
   the address an IPv4 address (ATYP 1), a domain name (ATYP 3: one length
   octet, 1..255, then the name) or an IPv6 address (ATYP 4).

Each ``parse_*`` takes the bytes read so far and answers ``None`` (need
more), or the message and how many bytes it used, or raises ``SocksError``
saying which reply the client gets. Nothing here resolves a name: a domain
is handed on as the text the client sent (checked to be printable text of at
most 255 bytes), and ``egressd.names.hosts`` normalises it where the policy
decides, as for an HTTP request's host; an address type is an IP literal.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from egressd.names.addresses import IPAddress
from egressd.vocabulary.wire import SocksReply

__all__ = [
    "AUTH_OK",
    "AUTH_FAILED",
    "Command",
    "Credentials",
    "Method",
    "SocksError",
    "SocksRequest",
    "method_reply",
    "parse_credentials",
    "parse_greeting",
    "parse_request",
    "reply",
]

VERSION = 5
AUTH_VERSION = 1  # RFC 1929 §2: the sub-negotiation's own version


class Method(enum.IntEnum):
    """RFC 1928 §3 authentication methods egressd knows."""

    NO_AUTH = 0
    USERNAME_PASSWORD = 2
    NO_ACCEPTABLE = 0xFF


class Command(enum.IntEnum):
    """RFC 1928 §4 CMD."""

    CONNECT = 1
    BIND = 2
    UDP_ASSOCIATE = 3


_COMMANDS = frozenset(Command)


class _Atyp(enum.IntEnum):
    IPV4 = 1
    DOMAIN = 3
    IPV6 = 4


class SocksError(ValueError):
    """The client's bytes are not a message egressd accepts.

    ``reply``: the REP the client gets (a request); None where no reply fits
    (a greeting or sub-negotiation that is not one: the connection is closed).
    """

    def __init__(self, detail: str, reply: SocksReply | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.reply = reply


@dataclass(frozen=True, slots=True)
class Credentials:
    """RFC 1929's username and password: a run's id and its token (as ``Proxy-Authorization`` carries them)."""

    username: str
    password: str


@dataclass(frozen=True, slots=True)
class SocksRequest:
    """A request: its command and destination (``host`` the client's text, or an IP address's text)."""

    command: int
    host: str
    port: int
    literal: bool  # the address type was an IP address (ATYP 1 or 4)


def parse_greeting(buf: bytes | bytearray) -> tuple[frozenset[int], int] | None:
    """The methods offered and the bytes used; None: need more. SocksError: not a SOCKS5 greeting."""
    if not buf:
        return None
    if buf[0] != VERSION:
        raise SocksError(f"not SOCKS version 5 (version byte {buf[0]})")
    if len(buf) < 2:
        return None
    count = buf[1]
    if count == 0:
        raise SocksError("a greeting offering no method")
    if len(buf) < 2 + count:
        return None
    return frozenset(buf[2 : 2 + count]), 2 + count


def choose_method(offered: frozenset[int], *, credentials: bool, anonymous: bool) -> Method:
    """The method egressd answers with.

    Username/password when offered and ``credentials`` (the listener
    attributes by them): a client that has a run's credentials is that run,
    as with ``Proxy-Authorization``. Otherwise no authentication when offered
    and ``anonymous`` (the source address finds a run). Else none acceptable.
    """
    if credentials and Method.USERNAME_PASSWORD in offered:
        return Method.USERNAME_PASSWORD
    if anonymous and Method.NO_AUTH in offered:
        return Method.NO_AUTH
    return Method.NO_ACCEPTABLE


def method_reply(method: Method) -> bytes:
    return bytes((VERSION, method))


def _text(raw: bytes | bytearray, what: str) -> str:
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise SocksError(f"{what} is not UTF-8") from None
    if not text.isprintable():
        raise SocksError(f"{what} holds a control character")
    return text


def parse_credentials(buf: bytes | bytearray) -> tuple[Credentials, int] | None:
    """RFC 1929's username and password and the bytes used; None: need more. SocksError: malformed."""
    if not buf:
        return None
    if buf[0] != AUTH_VERSION:
        raise SocksError(f"username/password version {buf[0]}, not 1")
    if len(buf) < 2:
        return None
    ulen = buf[1]
    if ulen == 0:
        raise SocksError("an empty username")
    if len(buf) < 3 + ulen:
        return None
    plen = buf[2 + ulen]
    end = 3 + ulen + plen
    if len(buf) < end:
        return None
    username = _text(buf[2 : 2 + ulen], "the username")
    password = _text(buf[3 + ulen : end], "the password")
    return Credentials(username, password), end


# RFC 1929 §2: STATUS 0 is success, anything else a failure (the server then closes).
AUTH_OK = bytes((AUTH_VERSION, 0))
AUTH_FAILED = bytes((AUTH_VERSION, 1))


def parse_request(buf: bytes | bytearray) -> tuple[SocksRequest, int] | None:
    """The request and the bytes used; None: need more. SocksError with the REP to answer."""
    if len(buf) < 4:
        if buf and buf[0] != VERSION:
            raise SocksError(f"a request of version {buf[0]}, not 5", SocksReply.GENERAL_FAILURE)
        return None
    version, command, reserved, atyp = buf[0], buf[1], buf[2], buf[3]
    if version != VERSION:
        raise SocksError(f"a request of version {version}, not 5", SocksReply.GENERAL_FAILURE)
    if reserved != 0:
        raise SocksError(f"reserved byte {reserved}, not 0", SocksReply.GENERAL_FAILURE)
    if atyp == _Atyp.IPV4:
        end = 4 + 4
        if len(buf) < end + 2:
            return None
        host = str(ipaddress.IPv4Address(bytes(buf[4:end])))
    elif atyp == _Atyp.IPV6:
        end = 4 + 16
        if len(buf) < end + 2:
            return None
        host = ipaddress.IPv6Address(bytes(buf[4:end])).compressed
    elif atyp == _Atyp.DOMAIN:
        if len(buf) < 5:
            return None
        length = buf[4]
        if length == 0:
            raise SocksError("an empty domain name", SocksReply.GENERAL_FAILURE)
        end = 5 + length
        if len(buf) < end + 2:
            return None
        host = _domain(buf[5:end])
    else:
        raise SocksError(f"address type {atyp}", SocksReply.ADDRESS_TYPE_NOT_SUPPORTED)
    port = int.from_bytes(buf[end : end + 2], "big")
    if command not in _COMMANDS:
        raise SocksError(f"command {command}", SocksReply.COMMAND_NOT_SUPPORTED)
    return SocksRequest(command, host, port, literal=atyp != _Atyp.DOMAIN), end + 2


def _domain(raw: bytes | bytearray) -> str:
    """A domain's text, as sent: UTF-8 without control characters, spaces or NULs (the policy normalises it)."""
    try:
        text = _text(raw, "the domain name")
    except SocksError as exc:
        raise SocksError(exc.detail, SocksReply.GENERAL_FAILURE) from None
    if " " in text:
        raise SocksError("the domain name holds a space", SocksReply.GENERAL_FAILURE)
    return text


def reply(rep: SocksReply, address: IPAddress | None = None, port: int = 0) -> bytes:
    """A request's reply: REP and the bound address (0.0.0.0:0 when there is none to say)."""
    if address is None:
        address = ipaddress.IPv4Address(0)
    atyp = _Atyp.IPV4 if address.version == 4 else _Atyp.IPV6
    return bytes((VERSION, rep, 0, atyp)) + address.packed + port.to_bytes(2, "big")
