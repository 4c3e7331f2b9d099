"""A run's own certificate authority, for the names whose HTTPS the run inspects: as narrow as X.509 allows.

One CA per run (DESIGN.md "Policy", request rules), made in memory and
never written anywhere, never in the sandbox, never logged (no method
serialises its key; ``repr`` shows none):

- ECDSA P-256, valid from a few minutes before it is made (clocks drift)
  to the run's lifetime plus a margin;
- ``BasicConstraints(ca, path_length=0)``: it signs leaves, never another CA;
- ``NameConstraints``, critical: the permitted subtrees are exactly the
  run's inspected names, each as a DNS name (RFC 5280 §4.2.1.10: a DNS
  constraint ``example.com`` covers ``example.com`` and every name under it;
  a rule's ``*.example.com`` is the constraint ``example.com`` too, since no
  encoding permits the subdomains without the apex), and every IPv4 and
  IPv6 address is excluded: a leaked key could mint nothing else that a
  verifier honouring the extension (OpenSSL, Go, cryptography's) accepts.

Leaves are minted per name on demand (ECDSA P-256, the name as the only
SAN, serverAuth, ``ca=False``) and kept for the run, at most ``MAX_LEAVES``,
the oldest dropped. A ``Leaf`` carries the PEM ``ssl`` loads: the chain and
the leaf's own key (the caller hands it to ``ssl`` without a file on disk).

Pure: the time is a parameter; the keys come from ``cryptography``.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final, NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["InspectCAError", "Leaf", "RunCA", "constraint_names"]

MAX_LEAVES: Final = 4096
# Clocks in the sandbox may be a little behind egressd's.
BACKDATE: Final = _dt.timedelta(minutes=5)
MARGIN: Final = _dt.timedelta(hours=1)
_EXCLUDED_ADDRESSES: Final = (
    x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
    x509.IPAddress(ipaddress.ip_network("::/0")),
)


class InspectCAError(ValueError):
    """The run's CA cannot do what was asked (a name it does not cover, no names at all)."""


class Leaf(NamedTuple):
    """A leaf certificate for one name, as ``ssl.SSLContext.load_cert_chain`` takes it (PEM)."""

    name: str
    chain_pem: bytes  # the leaf, then the CA
    key_pem: bytes  # the leaf's key: only for the ``ssl`` context, in memory

    def __repr__(self) -> str:
        return f"Leaf({self.name!r})"


def constraint_names(names: Iterable[str]) -> tuple[str, ...]:
    """The DNS constraints for inspected names: ``*.example.com`` → ``example.com``; sorted, no duplicates."""
    return tuple(sorted({name[2:] if name.startswith("*.") else name for name in names}))


def _covered(name: str, names: tuple[str, ...]) -> bool:
    """``name`` is an inspected name, or under one of its wildcards (``*.example.com``: not the apex)."""
    return any(name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])) for pattern in names)


class RunCA:
    """One run's CA and the leaves it minted (see the module docstring)."""

    __slots__ = ("run_id", "names", "constraints", "not_before", "not_after", "_key", "_certificate", "_leaves")

    def __init__(
        self,
        run_id: str,
        names: tuple[str, ...],
        not_before: _dt.datetime,
        not_after: _dt.datetime,
        key: ec.EllipticCurvePrivateKey,
        certificate: x509.Certificate,
    ) -> None:
        self.run_id = run_id
        self.names = names  # what leaves are minted for: exactly these, and names under their wildcards
        self.constraints = constraint_names(names)  # what a verifier lets the CA sign for (wider)
        self.not_before = not_before
        self.not_after = not_after
        self._key = key
        self._certificate = certificate
        self._leaves: OrderedDict[str, Leaf] = OrderedDict()

    def __repr__(self) -> str:
        return f"RunCA({self.run_id!r}, {self.constraints!r}, until {self.not_after.isoformat()})"

    @classmethod
    def create(
        cls,
        names: Iterable[str],
        now: _dt.datetime,
        lifetime: _dt.timedelta,
        *,
        run_id: str,
        margin: _dt.timedelta = MARGIN,
    ) -> RunCA:
        """A new CA for ``names`` (normalised, ``*.`` allowed), valid from about ``now`` for ``lifetime + margin``."""
        wanted = tuple(sorted(set(names)))
        constraints = constraint_names(wanted)
        if not constraints:
            raise InspectCAError("a run's CA needs at least one inspected name")
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "egressd"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"egressd run {run_id[:40]} inspection CA"),
        ])  # fmt: skip
        not_before, not_after = now - BACKDATE, now + lifetime + margin
        public = key.public_key()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )  # fmt: skip
            .add_extension(
                x509.NameConstraints(
                    permitted_subtrees=[x509.DNSName(name) for name in constraints],
                    excluded_subtrees=list(_EXCLUDED_ADDRESSES),
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(run_id, wanted, not_before, not_after, key, certificate)

    @property
    def certificate(self) -> x509.Certificate:
        return self._certificate

    def certificate_pem(self) -> bytes:
        """The CA's certificate (never its key): what a sandbox's trust bundle adds."""
        return self._certificate.public_bytes(serialization.Encoding.PEM)

    def covers(self, name: str) -> bool:
        """Whether the CA mints a leaf for ``name`` (normalised): an inspected name, or one under its wildcard."""
        return _covered(name, self.names)

    def leaf(self, name: str) -> Leaf:
        """The leaf for ``name``, minted on first use and kept; InspectCAError for a name not covered."""
        leaf = self._leaves.get(name)
        if leaf is not None:
            self._leaves.move_to_end(name)
            return leaf
        if not self.covers(name):
            raise InspectCAError(f"the run's CA does not cover {name!r}")
        leaf = self._mint(name)
        self._leaves[name] = leaf
        while len(self._leaves) > MAX_LEAVES:
            self._leaves.popitem(last=False)
        return leaf

    def _mint(self, name: str) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        public = key.public_key()
        ca = self._certificate
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])]))
            .issuer_name(ca.subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.not_before)
            .not_valid_after(self.not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )  # fmt: skip
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        chain = certificate.public_bytes(serialization.Encoding.PEM) + self.certificate_pem()
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return Leaf(name, chain, key_pem)
