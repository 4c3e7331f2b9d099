"""Real TLS for the tests: a throwaway CA, a leaf certificate, and TLS origins.

``make_pki(directory, names)`` writes a CA certificate and a leaf (EC P-256,
every name in ``names`` as a DNS SAN) made with ``cryptography``;
``client_context`` trusts only that CA, so a handshake that completes proves
the client reached the origin holding the leaf's key.

``TlsOrigin`` listens on a given address and port (ORIGIN:443 in the tests,
ORIGIN being this session's own, tests/harness.py: they run as root, so the
transparent listener dials the real port 443). TLS
starts with the first byte (asyncio's SSL server, so bytes that arrive with
the connection are never lost); it records the SNI of every ClientHello it
saw (``snis``), counts completed handshakes (``handshakes``), and answers
each HTTP/1.1 request with ``hello from tls origin <sni> <path>``; ``/big``
answers 1 MiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

BIG = 1024 * 1024


@dataclass(frozen=True)
class Pki:
    ca_pem: Path
    cert_pem: Path
    key_pem: Path

    def client_context(self, *, max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_pem))
        if max_version is not None:
            ctx.maximum_version = max_version
        return ctx

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(self.cert_pem), str(self.key_pem))
        return ctx


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_pki(directory: Path, names: Sequence[str]) -> Pki:
    """A CA and a leaf for ``names``, valid from a day ago for a week."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("egressd test CA"))
        .issuer_name(_name("egressd test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(directory / "ca.pem", directory / "leaf.pem", directory / "leaf.key")
    pki.ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert_pem.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    pki.key_pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pki


@dataclass
class TlsOrigin:
    """A TLS origin on ``host:port``; see the module docstring."""

    pki: Pki
    host: str
    port: int
    handshakes: int = 0
    snis: list[str | None] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _names: dict[int, str | None] = field(default_factory=dict)

    async def start(self) -> TlsOrigin:
        ctx = self.pki.server_context()

        def on_sni(sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
            self.snis.append(name)
            self._names[id(sock)] = name

        ctx.sni_callback = on_sni  # type: ignore[assignment]
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, reuse_address=True, ssl=ctx, ssl_handshake_timeout=5
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        try:
            sni = self._names.pop(id(writer.get_extra_info("ssl_object")), None)
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                self.requests.append(path)
                body = b"x" * BIG if path == "/big" else f"hello from tls origin {sni} {path}".encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
