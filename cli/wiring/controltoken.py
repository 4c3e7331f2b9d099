"""The control token: kept in a file only we can read, sent only to an endpoint we can trust.

DESIGN.md, "Secrets": the control token is sent only to an endpoint the
sender can trust. Whoever holds the token can allow any egress, so the
attacker here is another local user: one who listens first on the control
port, or puts a socket or a token file where egressd will look.

Where the token may go (``connector`` for ``--control``, ``url_connector``
for a URL such as ``--connect``):

1. ``unix:PATH``: the socket and its directory belong to us (or root), and the
   directory is writable by no one else (who could swap the socket); once
   connected, the kernel's peer credentials (``SO_PEERCRED``) say who listens,
   and that must be us (or root) as well.
2. plain ``http`` (and ``HOST:PORT``): only to a loopback address, and once
   connected the kernel's socket table (``/proc/net/tcp``, ``tcp6``) must
   show that the other end of this very connection is a socket of ours (or
   root's). Checked on the connection itself, after the connect and before a
   byte is sent: no window between checking a listener and using it.
3. ``https``: anyone whose certificate verifies (the default TLS checks).

Root is trusted with the token because it can read our token file anyway.

The token file (``write_token_file``, ``read_token_file``) is made as a new
file (``O_EXCL | O_NOFOLLOW``, mode 0600, relative to its directory's
descriptor) and renamed over the name, so a file another user placed first is
replaced, never written into; it is read only if it is ours, not a link and
readable by no one else.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import secrets
import socket
import stat
import struct
import sys
from pathlib import Path
from typing import Any

import aiohttp
from yarl import URL

from egressd.config.trusted import UntrustedFile, open_directory
from egressd.names.addresses import IPAddress, unmapped

__all__ = [
    "TokenFileError",
    "UntrustedEndpoint",
    "check_socket_directory",
    "check_url",
    "connector",
    "read_token_file",
    "socket_owner",
    "url_connector",
    "write_token_file",
]

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted at the name must not hang the CLI (fstat then refuses it).
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# A token is 43 characters; anything much longer is not a token file.
_MAX_TOKEN_BYTES = 4096
# The server's side of a fresh loopback connection shows up in the socket table
# as the handshake's last ACK is processed: look a few times, briefly.
_LOOKUPS = 20
_LOOKUP_PAUSE_S = 0.005
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")

Address = tuple[IPAddress, int]


class UntrustedEndpoint(Exception):
    """The control token is not sent there; the message says why."""


class TokenFileError(Exception):
    """The token file cannot be written or is not to be trusted; the message says why."""


def _trusted_uids() -> tuple[int, int]:
    return os.geteuid(), 0


# -- which URLs (pure) -------------------------------------------------------------------------


def _loopback_host(host: str) -> bool:
    if host == "localhost":  # resolved when connecting; the connection's peer is checked again
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_url(url: str) -> URL:
    """``url`` parsed if the token may go there (https, or http to loopback); UntrustedEndpoint otherwise (pure)."""
    parsed = URL(url)
    if parsed.scheme not in ("http", "https"):
        raise UntrustedEndpoint(f"{url!r} is not an http(s) URL")
    if not parsed.host:
        raise UntrustedEndpoint(f"{url!r} names no host")
    if parsed.scheme == "http" and not _loopback_host(parsed.host):
        raise UntrustedEndpoint(
            f"{url} is plain http to {parsed.host}, which is not a loopback address: the control token would "
            "cross the network in the clear; use https"
        )
    return parsed


# -- who owns a TCP socket (the parser is pure) ---------------------------------------------------


def _proc_address(text: str) -> Address:
    """``0100007F:0CBA`` or a 32-digit IPv6 form, as /proc/net/tcp* print them (words in host order)."""
    hex_ip, _, hex_port = text.partition(":")
    raw = bytes.fromhex(hex_ip)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return unmapped(ipaddress.ip_address(raw)), int(hex_port, 16)


def socket_owner(table: str, local: Address, remote: Address) -> int | None:
    """The uid of the socket whose local end is ``local`` and remote end ``remote``, or None (pure).

    ``table`` is the text of /proc/net/tcp or /proc/net/tcp6. A connection
    accepted by a listener (even one still waiting in its queue) is listed
    with the listener's owner. IPv4-mapped IPv6 addresses compare as IPv4.
    """
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            if _proc_address(fields[1]) == local and _proc_address(fields[2]) == remote:
                return int(fields[7])
        except ValueError:
            continue
    return None


def _address(sockaddr: Any) -> Address:
    return unmapped(ipaddress.ip_address(sockaddr[0].split("%")[0])), int(sockaddr[1])


def _shown(address: Address) -> str:
    ip, port = address
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _lookup_owner(server: Address, ours: Address) -> int | None:
    """The owner of the server's end of our connection ``ours`` -> ``server``, from the kernel's tables."""
    for table in _TABLES:
        with contextlib.suppress(OSError):
            owner = socket_owner(Path(table).read_text(), server, ours)
            if owner is not None:
                return owner
    return None


async def _check_tcp_peer(transport: asyncio.BaseTransport | None) -> None:
    """UntrustedEndpoint unless the other end of this connection is a loopback socket of ours (or root's)."""
    if transport is None:
        raise UntrustedEndpoint("the connection to the control API closed at once")
    server = _address(transport.get_extra_info("peername"))
    ours = _address(transport.get_extra_info("sockname"))
    if not server[0].is_loopback:
        raise UntrustedEndpoint(
            f"the control API at {_shown(server)} is not on a loopback address: plain http would carry the "
            "control token across the network; use https or a unix: socket"
        )
    owner = None
    for _ in range(_LOOKUPS):
        owner = _lookup_owner(server, ours)
        if owner is not None:
            break
        await asyncio.sleep(_LOOKUP_PAUSE_S)
    if owner is None:
        raise UntrustedEndpoint(
            f"cannot tell whose socket answers at {_shown(server)} (it is not in this network namespace's "
            "/proc/net/tcp): the control token is not sent to it; use a unix: socket or https"
        )
    me = os.geteuid()
    if owner not in _trusted_uids():
        raise UntrustedEndpoint(
            f"the socket listening on {_shown(server)} belongs to uid {owner}, not to you (uid {me}): "
            "the control token is not sent to it (is another user's program on that port?)"
        )


def _check_unix_peer(transport: asyncio.BaseTransport | None, path: str) -> None:
    """UntrustedEndpoint unless the process listening on this unix connection is us (or root)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        raise UntrustedEndpoint(f"the connection to the control socket {path} closed at once")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid not in _trusted_uids():
        raise UntrustedEndpoint(
            f"the control socket {path} is listened on by uid {uid}, not by you (uid {os.geteuid()}): "
            "the control token is not sent to it"
        )


# -- connectors that check before the first byte ---------------------------------------------------


class _PeerCheckedTCPConnector(aiohttp.TCPConnector):
    """Plain http only to a loopback socket of ours (or root's), checked on each connection before use."""

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:  # noqa: ASYNC109 - aiohttp's signature
        conn = await super().connect(req, traces, timeout)
        try:
            await _check_tcp_peer(conn.transport)
        except BaseException:
            conn.close()
            raise
        return conn


class _PeerCheckedUnixConnector(aiohttp.UnixConnector):
    """A unix socket whose listener is us (or root), checked on each connection before use."""

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:  # noqa: ASYNC109 - aiohttp's signature
        conn = await super().connect(req, traces, timeout)
        try:
            _check_unix_peer(conn.transport, self.path)
        except BaseException:
            conn.close()
            raise
        return conn


def check_socket_directory(path: str) -> None:
    """UntrustedEndpoint if the directory of the socket ``path`` is not ours (or root's) or others can write it."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return  # nothing there to trust: connecting or binding fails on its own
    except OSError as exc:
        raise UntrustedEndpoint(f"cannot look at {directory}: {exc.strerror}") from None
    if info.st_uid not in _trusted_uids():
        raise UntrustedEndpoint(f"{directory} (where the control socket is) belongs to uid {info.st_uid}, not to you")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedEndpoint(
            f"{directory} (where the control socket is) is writable by others, who could put their own socket "
            "there; use a directory only you can write"
        )


def _check_unix_socket(path: str) -> None:
    check_socket_directory(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return  # connecting fails ("is egressd running?"); one that appears meanwhile is checked once connected
    except OSError as exc:
        raise UntrustedEndpoint(f"cannot look at the control socket {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise UntrustedEndpoint(f"{path} is not a socket")
    if info.st_uid not in _trusted_uids():
        raise UntrustedEndpoint(f"the control socket {path} belongs to uid {info.st_uid}, not to you")


def connector(control: str) -> tuple[aiohttp.BaseConnector, str]:
    """A connector for the control API at ``control`` (``HOST:PORT`` or ``unix:PATH``) and its base URL.

    UntrustedEndpoint for an address the token may not go to (checked again
    on each connection).
    """
    if control.startswith("unix:"):
        path = control.removeprefix("unix:")
        _check_unix_socket(path)
        return _PeerCheckedUnixConnector(path=path), "http://egressd"
    host, _, port = control.rpartition(":")
    if not _loopback_host(host):
        raise UntrustedEndpoint(
            f"the control API at {control} is not on a loopback address: plain http would carry the control "
            "token across the network; use a loopback address or a unix: socket"
        )
    return _PeerCheckedTCPConnector(), f"http://{host}:{port}"


def url_connector(url: str) -> aiohttp.BaseConnector:
    """A connector for the control API at ``url`` (see ``check_url``); UntrustedEndpoint if refused."""
    if check_url(url).scheme == "https":
        return aiohttp.TCPConnector()  # the default certificate checks
    return _PeerCheckedTCPConnector()


# -- the token file ----------------------------------------------------------------------------


def write_token_file(path: Path, token: str) -> None:
    """Put ``token`` in a new file at ``path`` that only we can read; TokenFileError when it cannot be done.

    Whatever had the name (another user's file, a link) is replaced, never
    written into or followed; no link on the way to it is followed either
    (``egressd.config.trusted``); the result is checked to be ours, mode 0600.
    """
    try:
        dir_fd = open_directory(path.parent, for_file=path)
    except UntrustedFile as exc:
        raise TokenFileError(str(exc)) from None
    except OSError as exc:
        raise TokenFileError(f"cannot open its directory: {exc.strerror}") from None
    temp = f".egressd-token-{secrets.token_hex(8)}"
    made = renamed = False
    try:
        fd = os.open(temp, _NEW_FILE, 0o600, dir_fd=dir_fd)
        made = True
        try:
            os.fchmod(fd, 0o600)
            data = (token + "\n").encode()
            if os.write(fd, data) != len(data):
                raise TokenFileError("short write")
            written = os.fstat(fd)
            try:
                os.rename(temp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except PermissionError:
                raise TokenFileError(
                    "another user's file has that name and cannot be replaced (a directory with the sticky bit); "
                    "remove it or use another path"
                ) from None
            renamed = True
            there = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
            if (there.st_dev, there.st_ino) != (written.st_dev, written.st_ino) or there.st_uid != os.geteuid():
                raise TokenFileError("it was replaced by another file as it was written")
        finally:
            os.close(fd)
    except OSError as exc:
        raise TokenFileError(exc.strerror or str(exc)) from None
    finally:
        if made and not renamed:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
        os.close(dir_fd)


def read_token_file(path: Path) -> str:
    """The token in ``path``; OSError if it cannot be read, TokenFileError if it is not to be trusted.

    Not a link, nor reached through one (``egressd.config.trusted``), a
    regular file of ours (or root's), readable by no one else (if others
    could read it, the token is no secret any more).
    """
    try:
        dir_fd = open_directory(path.parent, for_file=path)
    except UntrustedFile as exc:
        raise TokenFileError(f"the control token file {exc}") from None
    try:
        fd = os.open(path.name, _READ, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TokenFileError(f"the control token file {path} is a link, and it is never read through one") from None
        raise
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TokenFileError(f"the control token file {path} is not a regular file")
        if info.st_uid not in _trusted_uids():
            raise TokenFileError(f"the control token file {path} belongs to uid {info.st_uid}, not to you")
        if info.st_mode & 0o077:
            how = "readable" if info.st_mode & 0o044 else "writable"
            raise TokenFileError(
                f"the control token file {path} is {how} by others (mode {info.st_mode & 0o777:04o}), so the "
                "token may be known or planted: restart egressd to make a new one"
            )
        return os.read(fd, _MAX_TOKEN_BYTES).decode("utf-8", errors="replace").strip()
    finally:
        os.close(fd)

