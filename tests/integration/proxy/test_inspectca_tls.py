"""The run's inspection CA against OpenSSL's own verifier and real TLS handshakes on loopback.

``openssl verify -CAfile ca.pem -verify_hostname NAME leaf.pem`` is the
check a curl or a Python client in the sandbox makes; a leaf forged with the
CA's key for a name the run does not inspect (or for an IP address) must fail
it on the name constraints alone. The handshakes use asyncio's TLS server
with a leaf's context and a client that trusts only the run's CA
(``ssl.create_default_context(cafile=...)``, host names checked).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from egressd.proxy.core.inspectca import Leaf, RunCA
from tests.fakes.leafcontext import forge, server_context

NAMES = ("api.github.com", "*.example.com")
LIFETIME = dt.timedelta(hours=1)
OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="the openssl binary is not installed")


@pytest.fixture
def ca() -> RunCA:
    return RunCA.create(NAMES, dt.datetime.now(dt.UTC), LIFETIME, run_id="r-tls")


@pytest.fixture
def ca_file(ca: RunCA, tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    path.write_bytes(ca.certificate_pem())
    return path


def _openssl_verify(ca_file: Path, leaf_pem: bytes, *options: str) -> subprocess.CompletedProcess[str]:
    leaf = ca_file.parent / "leaf.pem"
    leaf.write_bytes(leaf_pem)
    assert OPENSSL is not None
    command = [OPENSSL, "verify", "-CAfile", str(ca_file), *options, str(leaf)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def _leaf_only(leaf: Leaf) -> bytes:
    return x509.load_pem_x509_certificates(leaf.chain_pem)[0].public_bytes(Encoding.PEM)


@needs_openssl
@pytest.mark.parametrize("name", ["api.github.com", "www.example.com"])
def test_openssl_accepts_a_leaf_for_an_inspected_name(ca: RunCA, ca_file: Path, name: str) -> None:
    result = _openssl_verify(ca_file, _leaf_only(ca.leaf(name)), "-verify_hostname", name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith(": OK")


@needs_openssl
def test_openssl_refuses_a_leaf_for_another_name(ca: RunCA, ca_file: Path) -> None:
    result = _openssl_verify(ca_file, _leaf_only(ca.leaf("api.github.com")), "-verify_hostname", "www.example.com")
    assert result.returncode != 0 and "hostname mismatch" in result.stdout + result.stderr


@needs_openssl
@pytest.mark.parametrize("name", ["evil.com", "github.com", "badexample.com"])
def test_openssl_refuses_a_forged_leaf_outside_the_name_constraints(ca: RunCA, ca_file: Path, name: str) -> None:
    certificate, _ = forge(ca, x509.DNSName(name))
    result = _openssl_verify(ca_file, certificate.public_bytes(Encoding.PEM), "-verify_hostname", name)
    assert result.returncode != 0
    assert "permitted subtree violation" in result.stdout + result.stderr


@needs_openssl
def test_openssl_accepts_a_forged_leaf_inside_the_name_constraints(ca: RunCA, ca_file: Path) -> None:
    """The forgeries above fail for their names, not for how they were made."""
    certificate, _ = forge(ca, x509.DNSName("other.example.com"))
    result = _openssl_verify(ca_file, certificate.public_bytes(Encoding.PEM), "-verify_hostname", "other.example.com")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_openssl
@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
def test_openssl_refuses_a_forged_leaf_for_an_ip_address(ca: RunCA, ca_file: Path, address: str) -> None:
    certificate, _ = forge(ca, x509.IPAddress(ipaddress.ip_address(address)))
    result = _openssl_verify(ca_file, certificate.public_bytes(Encoding.PEM), "-verify_ip", address)
    assert result.returncode != 0
    assert "excluded subtree violation" in result.stdout + result.stderr


@needs_openssl
def test_openssl_refuses_a_leaf_after_the_ca_expires(ca: RunCA, ca_file: Path) -> None:
    end = int(ca.certificate.not_valid_after_utc.timestamp())
    leaf_pem = _leaf_only(ca.leaf("api.github.com"))
    # OpenSSL counts notAfter itself as expired (RFC 5280 §4.1.2.5 says inclusive): a second before, then after
    assert _openssl_verify(ca_file, leaf_pem, "-attime", str(end - 1)).returncode == 0
    result = _openssl_verify(ca_file, leaf_pem, "-attime", str(end + 1))
    assert result.returncode != 0 and "expired" in result.stdout + result.stderr


async def _exchange(leaf: Leaf, ca_file: Path, server_name: str) -> bytes:
    """One TLS connection on loopback: the server serves ``leaf`` and echoes a line; returns what came back."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(await reader.readline())
            await writer.drain()
        except (ssl.SSLError, ConnectionError):
            pass  # the client refused our certificate
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=server_context(leaf))
    try:
        port = server.sockets[0].getsockname()[1]
        client = ssl.create_default_context(cafile=str(ca_file))
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=server_name)
            writer.write(b"hello\n")
            answer = await reader.readline()
            writer.close()
            await writer.wait_closed()
        return answer
    finally:
        server.close()
        await server.wait_closed()


async def test_a_client_trusting_the_ca_completes_a_handshake_for_the_leafs_name(ca: RunCA, ca_file: Path) -> None:
    assert await _exchange(ca.leaf("api.github.com"), ca_file, "api.github.com") == b"hello\n"


async def test_a_client_refuses_the_leaf_for_another_name(ca: RunCA, ca_file: Path) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        await _exchange(ca.leaf("api.github.com"), ca_file, "www.example.com")


async def test_a_client_trusting_another_runs_ca_refuses_the_leaf(ca: RunCA, tmp_path: Path) -> None:
    other = RunCA.create(NAMES, dt.datetime.now(dt.UTC), LIFETIME, run_id="r-other")
    other_file = tmp_path / "other.pem"
    other_file.write_bytes(other.certificate_pem())
    with pytest.raises(ssl.SSLCertVerificationError, match="self-signed certificate in certificate chain"):
        await _exchange(ca.leaf("api.github.com"), other_file, "api.github.com")
