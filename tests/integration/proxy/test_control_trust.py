"""The control token goes only to an endpoint the sender can trust, and its file is ours alone.

DESIGN.md, "Secrets (control token, ...)": the control token is sent only to
an endpoint the sender can trust (a unix socket with a checked owner,
loopback TCP owned by the same user, or https).

The attacker is another local user (``nobody``): they listen first on the
control port, or put a socket or a token file where egressd will look. Their
listeners here are real processes that drop to ``nobody`` before they listen
(so the kernel records them as nobody's) and report every byte they received;
the token must not be among them, and the CLI must not show what they answer.
"""

from __future__ import annotations

import json
import os
import select
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.harness import have, require

EGRESSD = str(Path(sys.executable).with_name("egressd"))
NOBODY = 65534
TOKEN = "the-control-token-3f9a"

# A listener that becomes ``uid`` (when it is not us already) before it
# listens, answers each HTTP request with a fake pending list, and prints the
# hex of all it received once its stdin closes.
_LISTENER = r"""
import json, os, select, socket, sys
uid, kind, where = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def drop():
    if uid != os.geteuid():
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
if kind == "tcp":
    drop()  # a TCP socket belongs to whoever created it
    server = socket.socket(); server.bind(("127.0.0.1", 0))
else:
    server = socket.socket(socket.AF_UNIX); server.bind(where)
    drop()  # a unix socket's peer credentials are whoever listened: the file stays ours
server.listen()
print(server.getsockname()[1] if kind == "tcp" else where, flush=True)
body = json.dumps({"approvals": [{"id": "a-planted", "run": "r", "host": "evil.example", "port": 443,
                                  "expires_at": "2099-01-01T00:00:00Z", "command": "x"}]}).encode()
got = b""
while True:
    ready = select.select([server, sys.stdin], [], [], 30)[0]
    if not ready or sys.stdin in ready:
        break
    conn, _ = server.accept()
    conn.settimeout(5)
    request = b""
    try:
        while b"\r\n\r\n" not in request:
            chunk = conn.recv(65536)
            if not chunk:
                break
            request += chunk
        if request:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass
    conn.close()
    got += request
print(got.hex(), flush=True)
"""


class Listened:
    def __init__(self, where: str) -> None:
        self.where = where
        self.received = b""


@contextmanager
def listener(uid: int, kind: str, where: str = "") -> Iterator[Listened]:
    """A listener run as ``uid`` (see _LISTENER); ``received`` is filled in when the block ends."""
    with subprocess.Popen(
        [sys.executable, "-c", _LISTENER, str(uid), kind, where],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert select.select([proc.stdout], [], [], 10)[0], "the listener did not start"
            listened = Listened(proc.stdout.readline().strip())
            yield listened
            proc.stdin.close()
            listened.received = bytes.fromhex(proc.stdout.readline().strip())
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and "proxy" not in k.lower()}
    return env | {"XDG_STATE_HOME": str(tmp_path / "state")}


def _egressd(tmp_path: Path, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, EGRESSD, *args], capture_output=True, text=True, env=_env(tmp_path), timeout=60,
                          stdin=subprocess.DEVNULL)


# A network namespace of the test's own where the "remote" address is assigned to its
# loopback: even a CLI that dialled it anyway would reach nothing beyond this namespace.
OWN_NAMESPACE = ("unshare", "--net", "sh", "-c",
                 'ip link set lo up && ip addr add 203.0.113.7/32 dev lo && exec "$@"', "sh")


def _needs_root() -> None:
    require(os.geteuid() == 0, "acting as another local user (nobody) needs root")


# -- loopback TCP ----------------------------------------------------------------------------


def test_pending_sends_no_token_to_a_loopback_listener_of_another_user(tmp_path: Path) -> None:
    _needs_root()
    with listener(NOBODY, "tcp") as nobody:
        result = _egressd(tmp_path, "pending", "--control", f"127.0.0.1:{nobody.where}", "--control-token", TOKEN)
    assert TOKEN.encode() not in nobody.received and nobody.received == b""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "a-planted" not in result.stdout  # the fake pending list is not shown
    assert f"uid {NOBODY}" in result.stderr and "control token" in result.stderr, result.stderr


def test_pending_talks_to_a_loopback_listener_of_its_own_user(tmp_path: Path) -> None:
    with listener(os.geteuid(), "tcp") as ours:
        result = _egressd(tmp_path, "pending", "--json", "--control", f"127.0.0.1:{ours.where}",
                          "--control-token", TOKEN)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["id"] == "a-planted"
    assert f"Bearer {TOKEN}".encode() in ours.received


def test_allow_refuses_a_control_address_that_is_not_loopback_before_connecting(tmp_path: Path) -> None:
    # Nothing can leave the fresh network namespace, whatever the CLI tries.
    _needs_root()
    require(have("unshare") and have("ip"), "unshare (util-linux) and ip are needed for a namespace of our own")
    result = _egressd(tmp_path, "allow", "a-x", "--control", "203.0.113.7:3129", "--control-token", TOKEN,
                      prefix=OWN_NAMESPACE)
    assert result.returncode == 2, result.stderr
    assert "203.0.113.7" in result.stderr and "loopback" in result.stderr, result.stderr
    assert "cannot reach" not in result.stderr


# -- unix sockets ----------------------------------------------------------------------------


def test_pending_sends_no_token_to_a_unix_socket_another_user_listens_on(tmp_path: Path) -> None:
    # The socket file is ours; only the kernel's peer credentials say nobody listens on it.
    _needs_root()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with listener(NOBODY, "unix", str(private / "ctl.sock")) as nobody:
        result = _egressd(tmp_path, "pending", "--control", f"unix:{nobody.where}", "--control-token", TOKEN)
    assert nobody.received == b""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "a-planted" not in result.stdout
    assert f"uid {NOBODY}" in result.stderr, result.stderr


def test_pending_refuses_a_unix_socket_in_a_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could have swapped the socket for their own
    with listener(os.geteuid(), "unix", str(shared / "ctl.sock")) as ours:
        result = _egressd(tmp_path, "pending", "--control", f"unix:{ours.where}", "--control-token", TOKEN)
    assert ours.received == b""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "writable by others" in result.stderr, result.stderr


def test_pending_talks_to_a_unix_socket_of_its_own_user(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with listener(os.geteuid(), "unix", str(private / "ctl.sock")) as ours:
        result = _egressd(tmp_path, "pending", "--json", "--control", f"unix:{ours.where}", "--control-token", TOKEN)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["id"] == "a-planted"


# -- --connect ---------------------------------------------------------------------------------


def test_connect_refuses_plain_http_to_an_address_that_is_not_loopback_before_anything(tmp_path: Path) -> None:
    _needs_root()
    require(have("unshare") and have("ip"), "unshare (util-linux) and ip are needed for a namespace of our own")
    result = _egressd(tmp_path, "run", "--backend", "docker", "--connect", "http://203.0.113.7:3129",
                      "--control-token", TOKEN, "--", "true", prefix=OWN_NAMESPACE)
    assert result.returncode == 2, result.stderr
    assert "--connect" in result.stderr and "https" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("https://egressd.example:8443", None),
        ("http://127.0.0.1:3129", None),
        ("http://127.8.9.10:3129/", None),
        ("http://[::1]:3129", None),
        ("http://localhost:3129", None),
        ("http://203.0.113.7:3129", "https"),
        ("http://egressd.example:3129", "https"),
        ("http://[2001:db8::1]:3129", "https"),
        ("ftp://127.0.0.1/", "http"),
        ("127.0.0.1:3129", "http"),
        ("https://", "host"),
    ],
)
def test_a_control_url_is_trusted_only_over_https_or_to_loopback(url: str, refused: str | None) -> None:
    from egressd.cli.wiring.controltoken import UntrustedEndpoint, check_url

    if refused is None:
        check_url(url)
    else:
        with pytest.raises(UntrustedEndpoint, match=refused):
            check_url(url)


# /proc/net/tcp and tcp6 as the kernel prints them on a little-endian machine: a listener and
# both ends of one connection (127.0.0.1:54321 -> 127.0.0.1:3129), and a dual-stack listener's
# accepted IPv4 connection and an IPv6 one (lines cut after the inode).
_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:0C39 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 11 1 0 100 0 0 10 0
   1: 0100007F:0C39 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 12 1 0 20 4 30 10 -1
   2: 0100007F:D431 0100007F:0C39 01 00000000:00000000 00:00000000 00000000     0        0 13 1 0 20 4 30 10 -1
"""
_MAPPED, _V6_LOOPBACK, _REST = "0000000000000000FFFF00000100007F", "00000000000000000000000001000000", "01 0:0 0:0 0"
_TCP6 = f"""\
  sl  local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt uid timeout inode
   0: {_MAPPED}:0C3A {_MAPPED}:D432 {_REST} 65534 0 14
   1: {_V6_LOOPBACK}:0C3B {_V6_LOOPBACK}:D433 {_REST} 1001 0 15
"""


@pytest.mark.parametrize(
    ("table", "local", "remote", "owner"),
    [
        (_TCP, ("127.0.0.1", 3129), ("127.0.0.1", 54321), 1000),  # the server's end of our connection
        (_TCP, ("127.0.0.1", 54321), ("127.0.0.1", 3129), 0),  # our own end
        (_TCP, ("127.0.0.1", 3129), ("127.0.0.1", 1), None),  # no such connection (the listener does not count)
        (_TCP6, ("127.0.0.1", 3130), ("127.0.0.1", 54322), 65534),  # IPv4-mapped compares as IPv4
        (_TCP6, ("::1", 3131), ("::1", 54323), 1001),
        ("garbage\n 0: zz:zz yy:yy 01 a b c 1 2\n", ("127.0.0.1", 1), ("127.0.0.1", 2), None),
    ],
)
def test_the_owner_of_a_connections_far_end_is_read_from_the_kernels_table(
    table: str, local: tuple[str, int], remote: tuple[str, int], owner: int | None
) -> None:
    import ipaddress

    from egressd.cli.wiring.controltoken import socket_owner

    if sys.byteorder != "little":
        pytest.skip("the sample tables are as a little-endian kernel prints them")
    as_address = lambda a: (ipaddress.ip_address(a[0]), a[1])  # noqa: E731
    assert socket_owner(table, as_address(local), as_address(remote)) == owner


# -- the token file --------------------------------------------------------------------------


def _serve_on(tmp_path: Path) -> tuple[str, os.stat_result, str]:
    """Run egressd with its control API on tmp_path/ctl.sock and no token given: (the token it
    chose, its token file's lstat, the file's text), as they were while it ran."""
    import asyncio

    from egressd.cli.wiring.service import EgressService
    from egressd.config.settings import load_settings

    settings = load_settings({"listen": "127.0.0.1:0", "control": f"unix:{tmp_path / 'ctl.sock'}",
                              "audit_log": str(tmp_path / "audit.jsonl")})
    token_file = tmp_path / "ctl.sock.token"

    async def serve() -> tuple[str, os.stat_result, str]:
        async with EgressService(settings) as svc:
            return svc.control_token, token_file.lstat(), token_file.read_text()  # noqa: ASYNC240 - a test's look

    return asyncio.run(serve())


def test_a_token_file_another_user_planted_is_replaced_by_a_private_one_of_ours(tmp_path: Path) -> None:
    _needs_root()
    planted = tmp_path / "ctl.sock.token"
    planted.write_text("")
    os.chown(planted, NOBODY, NOBODY)
    planted.chmod(0o666)  # nobody keeps reading it, and hopes egressd writes into it
    planted_inode = planted.stat().st_ino
    token, info, text = _serve_on(tmp_path)
    assert stat.S_ISREG(info.st_mode) and (info.st_uid, info.st_mode & 0o777) == (os.geteuid(), 0o600)
    assert info.st_ino != planted_inode  # a new file took the name; nobody's was never written into
    assert text.strip() == token


def test_a_token_file_planted_as_a_link_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("the owner's file\n")
    (tmp_path / "ctl.sock.token").symlink_to(victim)
    token, info, text = _serve_on(tmp_path)
    assert victim.read_text() == "the owner's file\n"
    assert stat.S_ISREG(info.st_mode) and text.strip() == token


def test_pending_refuses_a_token_file_others_can_read(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with listener(os.geteuid(), "unix", str(private / "ctl.sock")) as ours:
        token_file = Path(f"{ours.where}.token")
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o644)
        result = _egressd(tmp_path, "pending", "--control", f"unix:{ours.where}")
    assert ours.received == b""
    assert result.returncode == 2, result.stderr
    assert "readable by others" in result.stderr, result.stderr
