"""The SOCKS5 listener against real clients (curl, python-socks) and hostile bytes.

Each security case is checked three ways, as the HTTP proxy's attacks are
(test_attacks.py): the client got the refusal's reply code, nothing reached
the leak detector (and the upstream DNS was not asked about a refused name),
and the audit log holds the refusal with ``kind: socks``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct

import pytest
from python_socks import ProxyError
from python_socks.async_.asyncio import Proxy

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest
from egressd.proxy.core.policy import parse_entry
from egressd.vocabulary.reasons import Answer
from tests.fakes.dns import FakeDns
from tests.harness import LEAK, LEAK_SPELLINGS, ORIGIN, egress, have, mapped, wait_until

# RFC 1928 §6 REP values the tests expect.
SUCCEEDED, GENERAL_FAILURE, NOT_ALLOWED, COMMAND_NOT_SUPPORTED, ATYP_NOT_SUPPORTED = 0, 1, 2, 7, 8


def socks_on(**values: object) -> dict[str, object]:
    values.setdefault("socks", "127.0.0.1:0")
    return values


async def opened(svc) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:  # type: ignore[no-untyped-def]
    return await asyncio.open_connection(*svc.socks_address)


def domain(name: str | bytes, port: int) -> bytes:
    raw = name.encode() if isinstance(name, str) else name
    return b"\x03" + bytes([len(raw)]) + raw + struct.pack("!H", port)


def address(text: str, port: int) -> bytes:
    ip = ipaddress.ip_address(text)
    return (b"\x01" if ip.version == 4 else b"\x04") + ip.packed + struct.pack("!H", port)


async def handshake(
    svc,  # type: ignore[no-untyped-def]
    destination: bytes,
    *,
    credentials: tuple[str, str] | None = None,
    command: int = 1,
) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """Greet, authenticate if given credentials, send a request; the reply's REP (-1: closed without one)."""
    reader, writer = await opened(svc)
    writer.write(b"\x05\x01\x02" if credentials else b"\x05\x01\x00")
    assert await asyncio.wait_for(reader.readexactly(2), 5) == (b"\x05\x02" if credentials else b"\x05\x00")
    if credentials:
        user, password = (part.encode() for part in credentials)
        writer.write(bytes([1, len(user)]) + user + bytes([len(password)]) + password)
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"\x01\x00"
    writer.write(bytes([5, command, 0]) + destination)
    head = await asyncio.wait_for(reader.read(4), 5)
    if len(head) < 4:
        return -1, reader, writer
    assert head[0] == 5 and head[2] == 0
    rest = 4 if head[3] == 1 else 16
    await asyncio.wait_for(reader.readexactly(rest + 2), 5)
    return head[1], reader, writer


async def refused_with(svc, destination: bytes, rep: int = NOT_ALLOWED, **kwargs: object) -> dict:  # type: ignore[no-untyped-def]
    """Send the request, check its reply and that the connection closes; the one new socks record."""
    before = len(egress(svc))
    got, reader, writer = await handshake(svc, destination, **kwargs)  # type: ignore[arg-type]
    assert got == rep
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await wait_until(lambda: len(egress(svc)) > before)
    record = egress(svc)[-1]
    assert record["kind"] == "socks" and record["decision"] == "deny"
    return record


async def closed(reader: asyncio.StreamReader) -> bool:
    """The peer closed (a reset too: egressd sheds a connection at its cap with the greeting unread)."""
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        return True


async def curl(*args: str) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "10", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode is not None
    return proc.returncode, out, err


needs_curl = pytest.mark.skipif(not have("curl"), reason="curl is not installed")


# -- real clients -------------------------------------------------------------------


@needs_curl
async def test_curl_socks5_hostname_reaches_an_allowed_host_and_is_recorded(make_egressd, http_origin, dns) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test:*"]))
    host, port = svc.socks_address
    code, out, err = await curl("--socks5-hostname", f"{host}:{port}", f"http://origin.test:{http_origin.port}/via")
    assert code == 0, err
    assert out == b"hello from origin: GET /via 0"
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["kind"], record["decision"], record["host"], record["port"]) == (
        "socks",
        "allow",
        "origin.test",
        http_origin.port,
    )
    assert record["address"] == ORIGIN and record["bytes_up"] > 0 and record["bytes_down"] > 0
    assert svc.path.recorder.metrics.connections_total["socks"] == 1


@needs_curl
async def test_curl_with_a_runs_credentials_is_that_run(make_egressd, http_origin) -> None:
    svc = await make_egressd(**socks_on(require_auth=True))
    run = svc.runs.create(task="t", allow=[])
    run.approve("origin.test", http_origin.port)
    host, port = svc.socks_address
    proxy = f"socks5h://{run.id}:{run.token}@{host}:{port}"
    code, out, err = await curl("--proxy", proxy, f"http://origin.test:{http_origin.port}/run")
    assert code == 0, err
    assert out == b"hello from origin: GET /run 0"
    code, _, _ = await curl(
        "--proxy", f"socks5h://{run.id}:wrong@{host}:{port}", f"http://origin.test:{http_origin.port}/"
    )
    assert code != 0
    code, _, _ = await curl("--socks5-hostname", f"{host}:{port}", f"http://origin.test:{http_origin.port}/")
    assert code != 0
    await wait_until(lambda: len(egress(svc)) == 3)
    allowed, wrong, anonymous = egress(svc)
    assert (allowed["decision"], allowed["run"], allowed["kind"]) == ("allow", run.id, "socks")
    assert (wrong["reason"], wrong["run"], wrong["host"]) == ("auth_required", None, None)
    assert anonymous["reason"] == "auth_required"
    assert not http_origin.requests[1:]


async def test_python_socks_tunnels_bytes_both_ways(make_egressd, echo_origin) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test:*"]))
    host, port = svc.socks_address
    proxy = Proxy.from_url(f"socks5://{host}:{port}", rdns=True)
    sock = await proxy.connect(dest_host="origin.test", dest_port=echo_origin.port, timeout=5)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"ping" * 1000)
    assert await asyncio.wait_for(reader.readexactly(4000), 5) == b"ping" * 1000
    writer.close()
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["kind"], record["decision"], record["bytes_up"], record["bytes_down"]) == (
        "socks",
        "allow",
        4000,
        4000,
    )


async def test_python_socks_wrong_password_fails_authentication_and_is_recorded(make_egressd, leak) -> None:
    svc = await make_egressd(**socks_on(require_auth=True, allow_private=["127.0.0.0/8"]))
    run = svc.runs.create(task="t", allow=[parse_entry("leak.test:*")])
    host, port = svc.socks_address
    proxy = Proxy.from_url(f"socks5://{run.id}:{run.token}x@{host}:{port}", rdns=True)
    with pytest.raises(ProxyError):
        await proxy.connect(dest_host="leak.test", dest_port=leak.port, timeout=5)
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["kind"], record["decision"], record["reason"]) == ("socks", "deny", "auth_required")
    assert leak.connections == 0


# -- the raw protocol: authentication ------------------------------------------------


async def test_wrong_password_gets_status_1_and_the_close(make_egressd) -> None:
    svc = await make_egressd(**socks_on(require_auth=True))
    run = svc.runs.create(task="t", allow=[parse_entry("origin.test:*")])
    reader, writer = await opened(svc)
    user, password = run.id.encode(), b"not-the-token"
    writer.write(b"\x05\x02\x00\x02" + bytes([1, len(user)]) + user + bytes([len(password)]) + password)
    assert await asyncio.wait_for(reader.read(), 5) == b"\x05\x02\x01\x01"
    writer.close()
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["reason"] == "auth_required"


async def test_no_credentials_when_required_is_no_acceptable_method(make_egressd, leak) -> None:
    svc = await make_egressd(**socks_on(require_auth=True))
    reader, writer = await opened(svc)
    writer.write(b"\x05\x01\x00" + b"\x05\x01\x00" + domain("leak.test", leak.port))
    assert await asyncio.wait_for(reader.read(), 5) == b"\x05\xff"
    writer.close()
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["kind"], record["reason"]) == ("socks", "auth_required")
    assert leak.connections == 0


async def test_a_bound_source_needs_no_credentials(make_egressd, echo_origin) -> None:
    svc = await make_egressd(**socks_on(require_auth=True, socks="127.0.0.1:0"))
    run = svc.runs.create(task="t", allow=[parse_entry("origin.test:*")], sources=[ipaddress.ip_address("127.0.0.1")])
    rep, reader, writer = await handshake(svc, domain("origin.test", echo_origin.port))
    assert rep == SUCCEEDED
    writer.write(b"hi")
    assert await asyncio.wait_for(reader.readexactly(2), 5) == b"hi"
    writer.close()
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["run"] == run.id


# -- the policy's attack cases -------------------------------------------------------


@pytest.mark.parametrize("spelling", LEAK_SPELLINGS)
async def test_every_ip_literal_spelling_in_a_domain_is_refused(make_egressd, leak, spelling) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test"], allow_private=["127.0.0.0/8"]))
    record = await refused_with(svc, domain(spelling, leak.port))
    assert record["reason"] == "ip_literal"
    assert leak.connections == 0


@pytest.mark.parametrize("text", [LEAK, *mapped(LEAK)], ids=["dotted", "mapped-dotted", "mapped-hex"])
async def test_address_types_are_ip_literals(make_egressd, leak, text) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test"], allow_private=["127.0.0.0/8"]))
    record = await refused_with(svc, address(text, leak.port))
    assert record["reason"] == "ip_literal"
    assert leak.connections == 0


@needs_curl
async def test_curl_with_an_ip_address_is_refused(make_egressd, leak) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test"], allow_private=["127.0.0.0/8"]))
    host, port = svc.socks_address
    code, _, _ = await curl("--socks5", f"{host}:{port}", f"http://{LEAK}:{leak.port}/")
    assert code != 0
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["reason"] == "ip_literal"
    assert leak.connections == 0


async def test_an_ip_address_named_by_an_entry_is_still_checked_for_private_addresses(make_egressd, leak) -> None:
    svc = await make_egressd(**socks_on(allow=[f"{LEAK}:*"]))
    record = await refused_with(svc, address(LEAK, leak.port))
    assert record["reason"] == "private_address"
    assert leak.connections == 0


async def test_a_name_resolving_to_a_private_address_is_refused_after_resolving(make_egressd, leak, dns) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test:*"]))
    dns.set("origin.test", [LEAK], ttl=0)
    record = await refused_with(svc, domain("origin.test", leak.port))
    assert (record["reason"], record["address"]) == ("private_address", LEAK)
    assert leak.connections == 0


async def test_denylisted_names_are_refused_and_never_resolved(make_egressd, leak, dns: FakeDns) -> None:
    svc = await make_egressd(**socks_on(allow=["*.example.test:*"], deny=["sub.example.test"]))
    record = await refused_with(svc, domain("SUB.example.test.", leak.port))
    assert (record["reason"], record["host"]) == ("denylisted", "sub.example.test")
    assert not dns.asked("sub.example.test")
    assert leak.connections == 0


async def test_names_not_on_the_allowlist_are_never_resolved(make_egressd, leak, dns: FakeDns) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test:*"], ask=False))
    record = await refused_with(svc, domain("leak.test", leak.port))
    assert record["reason"] == "not_allowlisted"
    assert not dns.asked("leak.test")
    assert leak.connections == 0


async def test_a_port_not_allowed_is_refused(make_egressd, leak, dns: FakeDns) -> None:
    svc = await make_egressd(**socks_on(allow=["leak.test:443"], allow_private=["127.0.0.0/8"], ask=False))
    record = await refused_with(svc, domain("leak.test", leak.port))
    assert record["reason"] == "port_not_allowed"
    assert not dns.asked("leak.test")
    assert leak.connections == 0


async def test_egressds_own_socks_port_is_refused(make_egressd) -> None:
    svc = await make_egressd(**socks_on(allow=["127.0.0.1:*"], allow_private=["127.0.0.0/8"]))
    host, port = svc.socks_address
    record = await refused_with(svc, address(host, port))
    assert record["reason"] == "private_address"
    assert "egressd itself" in record["detail"]


class HeldApprover:
    """Holds every request until ``release`` is set, then allows it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.requests: list[ApprovalRequest] = []

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        self.requests.append(request)
        await self.release.wait()
        return ApprovalOutcome(Answer.ALLOW, approval_id="ap-1", channel="test", by="tester", waited_s=0.25)


async def test_a_held_request_waits_for_its_approval_unresolved(make_egressd, echo_origin, dns: FakeDns) -> None:
    approver = HeldApprover()
    svc = await make_egressd(**socks_on(approver=approver))
    task = asyncio.create_task(handshake(svc, domain("origin.test", echo_origin.port)))
    await wait_until(lambda: approver.requests)
    assert (approver.requests[0].host, approver.requests[0].port) == ("origin.test", echo_origin.port)
    await asyncio.sleep(0.2)
    assert not task.done() and echo_origin.connections == 0 and not dns.asked("origin.test")
    approver.release.set()
    rep, reader, writer = await asyncio.wait_for(task, 10)
    assert rep == SUCCEEDED
    writer.write(b"held")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"held"
    writer.close()
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["kind"], record["decision"], record["rule"]) == ("socks", "allow", "approved")
    assert record["approval"] == {"id": "ap-1", "channel": "test", "by": "tester", "waited_s": 0.25}


async def test_a_denied_approval_is_not_allowed(make_egressd, leak, dns: FakeDns) -> None:
    from egressd.approvals.deny import DenyApprover

    svc = await make_egressd(**socks_on(approver=DenyApprover(), allow_private=["127.0.0.0/8"]))
    record = await refused_with(svc, domain("leak.test", leak.port))
    assert record["reason"] == "denied"
    assert not dns.asked("leak.test") and leak.connections == 0


@pytest.mark.parametrize(("command", "name"), [(2, "BIND"), (3, "UDP ASSOCIATE")])
async def test_bind_and_udp_associate_are_refused_with_7_and_recorded(
    make_egressd, leak, command: int, name: str
) -> None:
    svc = await make_egressd(**socks_on(allow=["leak.test:*"], allow_private=["127.0.0.0/8"]))
    record = await refused_with(svc, domain("leak.test", leak.port), COMMAND_NOT_SUPPORTED, command=command)
    assert record["reason"] == "bad_request" and name in record["detail"]
    assert (record["host"], record["port"]) == ("leak.test", leak.port)
    assert leak.connections == 0


# -- hostile input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "sent",
    [
        b"\x05",  # a truncated greeting, then the close
        b"\x05\x03\x00",  # three methods promised, one sent
        b"\x04\x01\x00\x50\x7f\x00\x00\x42\x00",  # SOCKS4
        b"GET / HTTP/1.1\r\n\r\n",  # not SOCKS at all
        b"\x05\x00",  # a greeting offering no method
    ],
)
async def test_broken_greetings_are_closed_and_recorded(make_egressd, sent: bytes) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test:*"]))
    reader, writer = await opened(svc)
    writer.write(sent)
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) in (b"", b"\x05\xff")
    writer.close()
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["kind"], record["decision"], record["reason"]) == ("socks", "deny", "bad_request")


@pytest.mark.parametrize(
    ("destination", "rep"),
    [
        (domain(b"leak\x00.test", 80), GENERAL_FAILURE),  # NUL inside the name
        (domain(b"leak.test\r\nX: y", 80), GENERAL_FAILURE),
        (domain(b"\xff\xfe.test", 80), GENERAL_FAILURE),  # not UTF-8
        (domain(".".join(["a" * 63] * 4).encode()[:255], 80), GENERAL_FAILURE),  # 255 bytes: no host name
        (domain("leak test", 80), GENERAL_FAILURE),
        (b"\x03\x00" + struct.pack("!H", 80), GENERAL_FAILURE),  # an empty name
        (domain("leak.test", 0), GENERAL_FAILURE),  # port 0
        (b"\x09" + b"\x00" * 6, ATYP_NOT_SUPPORTED),
    ],
)
async def test_hostile_requests_are_refused_with_their_reply_and_recorded(
    make_egressd, leak, dns: FakeDns, destination: bytes, rep: int
) -> None:
    svc = await make_egressd(**socks_on(allow=["leak.test:*"], allow_private=["127.0.0.0/8"]))
    record = await refused_with(svc, destination, rep)
    assert record["reason"] == "bad_request"
    assert leak.connections == 0 and not dns.queries


async def test_a_slow_handshake_is_shed_at_the_head_timeout(make_egressd) -> None:
    svc = await make_egressd(**socks_on(allow=["origin.test:*"], head_timeout_s=0.3))
    reader, writer = await opened(svc)
    writer.write(b"\x05\x01\x00")
    assert await asyncio.wait_for(reader.readexactly(2), 5) == b"\x05\x00"
    writer.write(b"\x05\x01\x00\x03")  # the request, never finished
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert (record["kind"], record["reason"]) == ("socks", "limit_exceeded")


async def test_a_flood_of_half_open_handshakes_is_bounded(make_egressd, echo_origin) -> None:
    svc = await make_egressd(
        **socks_on(allow=["origin.test:*"], head_timeout_s=0.5, max_connections=20, max_refusal_records=1000)
    )
    flood = []
    for _ in range(60):  # three times the cap, each stopping after its first byte
        reader, writer = await opened(svc)
        writer.write(b"\x05")
        flood.append((reader, writer))
    await wait_until(lambda: svc.path.recorder.metrics.connections_open <= 20, 5)
    # Every one of them is closed by egressd within the head timeout (and a margin).
    for reader, _ in flood:
        assert await closed(reader)
    for _, writer in flood:
        writer.close()
    await wait_until(lambda: svc.path.recorder.metrics.connections_open == 0, 5)
    assert len(egress(svc)) == 60
    assert {r["reason"] for r in egress(svc)} == {"limit_exceeded"}
    rep, reader, writer = await handshake(svc, domain("origin.test", echo_origin.port))  # still serving
    assert rep == SUCCEEDED
    writer.close()
