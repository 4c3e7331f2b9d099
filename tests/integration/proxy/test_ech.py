"""ECH and HelloRetryRequest: no ClientHello reaches an origin unchecked.

Two ways a client could name one server to egressd and another to the
origin, each tried through a CONNECT tunnel and on the transparent TLS
listener:

- encrypted_client_hello (ECH): the outer ClientHello names the allowed
  host, the encrypted inner one the host really asked for. Refused
  (``sni_mismatch``) before a byte reaches the origin.
- a second ClientHello (RFC 8446 §4.1.4): the origin answers the first with
  a HelloRetryRequest and the client's second ClientHello names another
  host. Refused (``sni_mismatch``) before a byte of it reaches the origin.

The fake origin (``HandshakeOrigin``) plays the server's side of the first
flights on a real socket and keeps every byte it read; the real-TLS tests
use an origin that accepts only P-256, so OpenSSL's client (which offers an
X25519 key share) gets a HelloRetryRequest and sends its second ClientHello
after a change_cipher_spec (middlebox compatibility, RFC 8446 §D.4).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from egressd.approvals.deny import DenyApprover
from egressd.proxy.core.modes import transparent_tls
from tests.fakes import hellos
from tests.fakes.dns import FakeDns
from tests.fakes.tls import Pki, TlsOrigin, make_pki
from tests.harness import ORIGIN, connect_via, egress, read_response, wait_until

ALERT_ACCESS_DENIED = b"\x15\x03\x03\x00\x02\x02\x31"
ALERT_MISSING_EXTENSION = b"\x15\x03\x03\x00\x02\x02\x6d"


@dataclass
class HandshakeOrigin:
    """A TLS server as far as the first flights, on ORIGIN.

    The first ClientHello record on a connection gets a HelloRetryRequest
    and a change_cipher_spec, the second a ServerHello; application-data
    records are echoed. ``received`` holds every byte read, ``hellos`` the
    ClientHello records seen, ``connections`` the connections accepted.
    """

    port: int = 0
    connections: int = 0
    hellos: int = 0
    received: bytearray = field(default_factory=bytearray)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None

    async def start(self) -> HandshakeOrigin:
        self.server = await asyncio.start_server(self._serve, ORIGIN, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        hellos_here = 0
        try:
            while True:
                header = await reader.readexactly(5)
                fragment = await reader.readexactly(int.from_bytes(header[3:5], "big"))
                self.received += header + fragment
                if header[0] == 22 and fragment[:1] == b"\x01":
                    self.hellos += 1
                    hellos_here += 1
                    retry = hellos_here == 1
                    writer.write(hellos.server_hello(hrr=True) + hellos.CCS if retry else hellos.server_hello())
                elif header[0] == 23:
                    writer.write(header + fragment)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed.set()


@pytest.fixture
async def hrr_origin() -> AsyncIterator[HandshakeOrigin]:
    origin = await HandshakeOrigin().start()
    yield origin
    assert origin.server is not None
    origin.server.close()
    await origin.server.wait_closed()


@dataclass(frozen=True)
class P256OnlyPki(Pki):
    """Server contexts that accept only P-256: a client offering an X25519 key share gets a HelloRetryRequest."""

    def server_context(self) -> ssl.SSLContext:
        ctx = super().server_context()
        ctx.set_ecdh_curve("prime256v1")  # OpenSSL: the server's groups become this one alone
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> P256OnlyPki:
    made = make_pki(tmp_path_factory.mktemp("pki"), ["origin.test", "other.test"])
    return P256OnlyPki(made.ca_pem, made.cert_pem, made.key_pem)


@pytest.fixture
async def retrying_origin(pki: P256OnlyPki) -> AsyncIterator[TlsOrigin]:
    origin = await TlsOrigin(pki, ORIGIN, 0).start()
    yield origin
    await origin.close()


async def transparent_to(make_egressd, port: int, **values):  # type: ignore[no-untyped-def]
    """An egressd whose transparent TLS listener decides and dials port ``port`` (not 443)."""
    values.setdefault("allow", [f"origin.test:{port}"])
    svc = await make_egressd(transparent_tls="127.0.0.1:0", **values)
    svc.transparent_tls.mode = transparent_tls(port)
    return svc


async def open_tls_path(svc, via: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:  # type: ignore[no-untyped-def]
    """A connection on which the next bytes go towards ORIGIN:port: a CONNECT tunnel or the transparent listener."""
    if via == "connect":
        status, _, _, reader, writer = await connect_via(svc, f"origin.test:{port}")
        assert status == 200
        return reader, writer
    return await asyncio.open_connection(*svc.transparent_tls.address)


async def read_record(reader: asyncio.StreamReader) -> bytes:
    header = await asyncio.wait_for(reader.readexactly(5), 5)
    return header + await asyncio.wait_for(reader.readexactly(int.from_bytes(header[3:5], "big")), 5)


async def read_to_close(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(), 5)
    except ConnectionError:
        return b""


def last(svc, kind: str) -> dict:  # type: ignore[no-untyped-def]
    return [r for r in egress(svc) if r["kind"] == kind][-1]


def kind_of(via: str) -> str:
    return "connect" if via == "connect" else "tls"


VIA = ["connect", "transparent"]


# --- encrypted_client_hello ----------------------------------------------------------------


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("outer", [True, False], ids=["outer", "inner"])
async def test_a_hello_carrying_ech_is_refused_before_any_byte_reaches_the_origin(
    make_egressd, hrr_origin, dns: FakeDns, via, outer
) -> None:
    svc = await (
        make_egressd(allow=[f"origin.test:{hrr_origin.port}"])
        if via == "connect"
        else transparent_to(make_egressd, hrr_origin.port)
    )
    reader, writer = await open_tls_path(svc, via, hrr_origin.port)
    writer.write(hellos.client_hello("origin.test", extra=[hellos.ech_extension(outer)]))
    assert await read_to_close(reader) == ALERT_ACCESS_DENIED
    writer.close()
    await wait_until(lambda: any(r["kind"] == kind_of(via) for r in egress(svc)))
    record = last(svc, kind_of(via))
    assert (record["host"], record["decision"], record["reason"]) == ("origin.test", "deny", "sni_mismatch")
    assert "encrypted_client_hello" in record["detail"]
    assert hrr_origin.received == b"" and hrr_origin.hellos == 0
    # CONNECT dials before the first client byte; the transparent listener never dials.
    assert hrr_origin.connections == (1 if via == "connect" else 0)
    assert svc.path.recorder.metrics.decisions[("deny", "sni_mismatch")] == 1
    await wait_until(lambda: svc.path.recorder.metrics.connections_open == 0)


async def test_an_ech_hello_on_the_transparent_listener_never_asks_an_approver(make_egressd, dns: FakeDns) -> None:
    asked: list[str] = []

    class Recording(DenyApprover):
        async def ask(self, request):  # type: ignore[no-untyped-def]
            asked.append(request.host)
            return await super().ask(request)

    svc = await transparent_to(make_egressd, 443, allow=[], approver=Recording())
    reader, writer = await asyncio.open_connection(*svc.transparent_tls.address)
    writer.write(hellos.client_hello("cover.test", extra=[hellos.ech_extension()]))
    assert await read_to_close(reader) == ALERT_ACCESS_DENIED
    writer.close()
    await wait_until(lambda: egress(svc))
    assert last(svc, "tls")["reason"] == "sni_mismatch"
    assert asked == [] and not dns.asked("cover.test")


# --- a second ClientHello after a HelloRetryRequest ------------------------------------------------


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("compat", [True, False], ids=["ccs-first", "no-ccs"])
async def test_a_second_hello_naming_another_host_is_cut_before_it_reaches_the_origin(
    make_egressd, hrr_origin, dns: FakeDns, via, compat
) -> None:
    svc = await (
        make_egressd(allow=[f"origin.test:{hrr_origin.port}"])
        if via == "connect"
        else transparent_to(make_egressd, hrr_origin.port)
    )
    reader, writer = await open_tls_path(svc, via, hrr_origin.port)
    first = hellos.client_hello("origin.test")
    writer.write(first)
    retry = await read_record(reader)
    assert retry[11:43] == hellos.HRR_RANDOM
    assert await read_record(reader) == hellos.CCS
    second = hellos.client_hello("other.test")
    writer.write((hellos.CCS if compat else b"") + second)
    assert await read_to_close(reader) == ALERT_ACCESS_DENIED
    writer.close()
    await asyncio.wait_for(hrr_origin.closed.wait(), 5)
    # The first hello went through (it was allowed); nothing of the second did.
    assert bytes(hrr_origin.received) in (first, first + hellos.CCS)
    assert hrr_origin.hellos == 1
    await wait_until(lambda: any(r["kind"] == kind_of(via) for r in egress(svc)))
    record = last(svc, kind_of(via))
    assert (record["decision"], record["reason"], record["sni"]) == ("deny", "sni_mismatch", "other.test")
    assert svc.path.recorder.metrics.decisions[("deny", "sni_mismatch")] == 1
    assert svc.path.recorder.metrics.decisions[("allow", "")] == 0
    await wait_until(lambda: svc.path.recorder.metrics.connections_open == 0)


@pytest.mark.parametrize("via", VIA)
async def test_a_second_hello_sent_before_the_retry_request_is_checked_too(
    make_egressd, hrr_origin, dns: FakeDns, via
) -> None:
    """A client that expects the retry need not wait for it: both hellos in one write."""
    svc = await (
        make_egressd(allow=[f"origin.test:{hrr_origin.port}"])
        if via == "connect"
        else transparent_to(make_egressd, hrr_origin.port)
    )
    reader, writer = await open_tls_path(svc, via, hrr_origin.port)
    writer.write(hellos.client_hello("origin.test") + hellos.CCS + hellos.client_hello("other.test"))
    answer = await read_to_close(reader)
    assert answer.endswith(ALERT_ACCESS_DENIED)
    writer.close()
    assert b"other.test" not in hrr_origin.received and hrr_origin.hellos <= 1
    await wait_until(lambda: any(r["kind"] == kind_of(via) for r in egress(svc)))
    assert last(svc, kind_of(via))["reason"] == "sni_mismatch"


@pytest.mark.parametrize("via", VIA)
async def test_a_second_hello_inside_the_first_hellos_record_is_checked_too(
    make_egressd, hrr_origin, dns: FakeDns, via
) -> None:
    svc = await (
        make_egressd(allow=[f"origin.test:{hrr_origin.port}"])
        if via == "connect"
        else transparent_to(make_egressd, hrr_origin.port)
    )
    reader, writer = await open_tls_path(svc, via, hrr_origin.port)
    both = hellos.handshake(hellos.body("origin.test")) + hellos.handshake(hellos.body("other.test"))
    writer.write(hellos.record(both))
    assert await read_to_close(reader) == ALERT_ACCESS_DENIED
    writer.close()
    assert hrr_origin.received == b""
    await wait_until(lambda: any(r["kind"] == kind_of(via) for r in egress(svc)))
    assert last(svc, kind_of(via))["reason"] == "sni_mismatch"


async def test_a_second_hello_without_a_name_is_refused_on_the_transparent_listener(
    make_egressd, hrr_origin, dns: FakeDns
) -> None:
    """The transparent listener refuses a hello without SNI; the second hello is checked like the first."""
    svc = await transparent_to(make_egressd, hrr_origin.port)
    reader, writer = await asyncio.open_connection(*svc.transparent_tls.address)
    writer.write(hellos.client_hello("origin.test"))
    await read_record(reader)
    await read_record(reader)
    writer.write(hellos.CCS + hellos.client_hello(None))
    assert await read_to_close(reader) == ALERT_MISSING_EXTENSION
    writer.close()
    await wait_until(lambda: egress(svc))
    record = last(svc, "tls")
    assert (record["reason"], hrr_origin.hellos) == ("bad_request", 1)
    assert "server_name" in record["detail"]


@pytest.mark.parametrize("via", VIA)
async def test_a_second_hello_with_the_same_name_goes_through_and_then_bytes_flow(
    make_egressd, hrr_origin, dns: FakeDns, via
) -> None:
    svc = await (
        make_egressd(allow=[f"origin.test:{hrr_origin.port}"])
        if via == "connect"
        else transparent_to(make_egressd, hrr_origin.port)
    )
    reader, writer = await open_tls_path(svc, via, hrr_origin.port)
    writer.write(hellos.client_hello("origin.test"))
    await read_record(reader)
    await read_record(reader)
    writer.write(hellos.CCS + hellos.client_hello("ORIGIN.test."))  # the same name, spelled differently
    server_hello = await read_record(reader)
    assert server_hello[5] == 2 and server_hello[11:43] != hellos.HRR_RANDOM
    # The handshake is settled: what follows is relayed as it is (here, echoed).
    data = hellos.record(b"\x17" * 300, content_type=23, version=0x0303)
    writer.write(data)
    assert await read_record(reader) == data
    writer.close()
    await asyncio.wait_for(hrr_origin.closed.wait(), 5)
    assert hrr_origin.hellos == 2
    await wait_until(lambda: any(r["kind"] == kind_of(via) for r in egress(svc)))
    assert last(svc, kind_of(via))["decision"] == "allow"


# --- real TLS with a HelloRetryRequest -------------------------------------------------------------


async def test_a_real_retried_handshake_through_connect_still_works(
    make_egressd, retrying_origin, pki, dns: FakeDns
) -> None:
    svc = await make_egressd(allow=[f"origin.test:{retrying_origin.port}"])
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{retrying_origin.port}")
    assert status == 200
    await writer.start_tls(pki.client_context(), server_hostname="origin.test", ssl_handshake_timeout=5)
    writer.write(b"GET /retried HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    _, _, body = await read_response(reader)
    writer.close()
    assert body == b"hello from tls origin origin.test /retried"
    assert retrying_origin.snis == ["origin.test", "origin.test"]  # two ClientHellos: the retry happened
    await wait_until(lambda: egress(svc))
    assert last(svc, "connect")["decision"] == "allow"


async def test_a_real_retried_handshake_on_the_transparent_listener_still_works(
    make_egressd, retrying_origin, pki, dns: FakeDns
) -> None:
    svc = await transparent_to(make_egressd, retrying_origin.port)
    reader, writer = await asyncio.open_connection(
        *svc.transparent_tls.address, ssl=pki.client_context(), server_hostname="origin.test", ssl_handshake_timeout=5
    )
    writer.write(b"GET /retried HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    _, _, body = await read_response(reader)
    writer.close()
    assert body == b"hello from tls origin origin.test /retried"
    assert retrying_origin.snis == ["origin.test", "origin.test"]
    await wait_until(lambda: egress(svc))
    assert last(svc, "tls")["decision"] == "allow"
