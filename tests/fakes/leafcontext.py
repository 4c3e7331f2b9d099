"""ssl contexts around the run's inspection CA (``egressd.proxy.core.inspectca``), for the tests.

``ssl.SSLContext.load_cert_chain`` reads only paths, so ``server_context``
writes a ``Leaf``'s chain and key into a private temporary directory (0700),
loads them and removes them at once; the network layer does the same with a
memfd. ``client_context`` trusts the run's CA and nothing else, and checks
host names, as a client inside the sandbox does.

``forge`` and ``forged_leaf`` sign a leaf with the CA's own key, bypassing
``RunCA.leaf``'s check (they reach into the object: nothing public gives the
key), so a test can show the CA's name constraints refuse it by themselves.
"""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from cryptography.x509.oid import ExtendedKeyUsageOID

from egressd.proxy.core.inspectca import Leaf, RunCA


def server_context(leaf: Leaf) -> ssl.SSLContext:
    """A TLS server context serving ``leaf`` (its chain and its key)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="egressd-leaf-") as directory:
        chain, key = Path(directory) / "chain.pem", Path(directory) / "key.pem"
        chain.write_bytes(leaf.chain_pem)
        key.touch(mode=0o600)
        key.write_bytes(leaf.key_pem)
        context.load_cert_chain(chain, key)
    return context


def client_context(ca: RunCA) -> ssl.SSLContext:
    """A TLS client context that trusts only ``ca`` and checks the server's host name."""
    return ssl.create_default_context(cadata=ca.certificate_pem().decode("ascii"))


def forge(ca: RunCA, san: x509.GeneralName) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A server leaf for ``san`` signed with ``ca``'s key, valid as long as the CA, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    ca_key = ca._key
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(ca.certificate.not_valid_before_utc)
        .not_valid_after(ca.certificate.not_valid_after_utc)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([san]), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return certificate, key


def forged_leaf(ca: RunCA, name: str) -> Leaf:
    """``forge`` for the DNS name ``name``, as a ``Leaf`` a server context can serve."""
    certificate, key = forge(ca, x509.DNSName(name))
    key_pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    return Leaf(name, certificate.public_bytes(Encoding.PEM) + ca.certificate_pem(), key_pem)
