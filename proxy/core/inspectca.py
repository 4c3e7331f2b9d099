"""The run's own certificate authority, which HTTPS inspection terminates TLS with (DESIGN.md, "Policy").

A name with request rules is inspected: the proxy answers the sandbox's TLS
itself, with a leaf certificate this module mints, and the sandbox trusts the
run's CA certificate (``certificate_pem``). That CA could impersonate any
site to the sandbox, so it is held as tightly as X.509 allows:

- one CA per run, ECDSA P-256 (small, fast to sign, accepted by every TLS
  stack), its key made in memory and never serialised: no method returns
  it, ``repr`` never shows it, nothing here writes a file;
- BasicConstraints ``ca=True, path_length=0`` (critical): it signs leaves,
  never another CA; KeyUsage ``keyCertSign, cRLSign`` (critical) and nothing
  else, so the CA certificate cannot itself serve TLS;
- NameConstraints (critical, RFC 5280 §4.2.1.10): the permitted subtrees are
  exactly the run's inspected names as DNSName, and the excluded subtrees
  all IPv4 and IPv6 addresses (0.0.0.0/0, ::/0), since a constraint on DNS
  names says nothing about an IP SAN. A DNSName subtree ``example.com``
  permits ``example.com`` and every name below it ("adding zero or more
  labels to the left-hand side"), never ``badexample.com``;
- a wildcard entry ``*.example.com`` is encoded as the subtree
  ``example.com`` too. RFC 5280 gives DNSName constraints no leading-dot
  form: OpenSSL reads ``.example.com`` as "below only", but cryptography's
  verifier (like x509-limbo's reading of the RFC) rejects the whole chain as
  "malformed DNS name constraint". The RFC form is the narrowest every
  verifier accepts; it admits the apex, which ``leaf`` never mints for a
  wildcard entry (an excluded ``example.com`` would exclude its subdomains
  as well);
- validity from ``now`` minus ``BACKDATE`` (a sandbox clock slightly behind
  ours) to ``now + lifetime + margin``; every leaf shares that window, so no
  certificate of the run outlives it.

``leaf(name)`` mints on first use, for a name an entry covers exactly as the
policy matches it (``policy.Entry.matches_host``: a plain entry its own name,
a wildcard the names below it), a certificate with an empty subject, a
critical SAN ``DNSName(name)``, EKU serverAuth and its own P-256 key, and
keeps it for the run in a bounded cache (``MAX_LEAVES``, least recently used
evicted). The CA's name
constraints are a second wall behind that check: a leaf for any other name
fails verification even if this code were wrong.

Pure: no clock (``now`` is passed in), no file, no socket, no ssl. Keys and
serial numbers draw on OpenSSL's random generator through ``cryptography``.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from egressd.names.hosts import HostError, parse_host
from egressd.names.shown import quoted

BACKDATE = datetime.timedelta(minutes=5)  # a sandbox whose clock runs a little behind still accepts our leaves
DEFAULT_MARGIN = datetime.timedelta(hours=1)  # a run that overstays its planned lifetime a little keeps working
MAX_LEAVES = 4096  # leaves kept per run: far more names than a run inspects, a bound on memory if it asks for many
_CN_LIMIT = 64  # ub-common-name, RFC 5280 Appendix A: cryptography refuses a longer CommonName
_ALL_ADDRESSES = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))


class InspectCAError(ValueError):
    """The CA cannot be made as asked, or cannot mint a leaf for a name it does not cover."""


@dataclass(frozen=True, slots=True, repr=False)
class Leaf:
    """What ``ssl.SSLContext.load_cert_chain`` needs to serve TLS for one inspected name.

    ``chain_pem`` is the leaf certificate then the CA certificate; ``key_pem``
    is the leaf's own private key (PKCS#8 PEM, unencrypted), never the CA's.
    Hand it to ssl in memory: ``load_cert_chain`` reads only paths, so the
    caller writes it to a memfd (``os.memfd_create``, read as
    ``/proc/self/fd/N``) or a private temporary file removed at once — never
    anywhere the sandbox can read.
    """

    name: str
    chain_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:
        return f"Leaf(name={self.name!r})"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class _Covered:
    """One inspected entry: ``base`` is its name, or the suffix after ``*.`` when ``wildcard``."""

    base: str
    wildcard: bool

    def covers(self, name: str) -> bool:
        return name.endswith("." + self.base) if self.wildcard else name == self.base


def _dns_name(text: str) -> str:
    """``text`` if it is a normalised DNS name (no IP literal), else InspectCAError."""
    try:
        host = parse_host(text)
    except HostError as error:
        raise InspectCAError(f"not a host name: {quoted(text)}") from error
    if host.address is not None or host.name != text:
        raise InspectCAError(f"not a normalised DNS name: {quoted(text)}")
    return text


def _entry(text: str) -> _Covered:
    if text.startswith("*."):
        return _Covered(_dns_name(text[2:]), wildcard=True)
    return _Covered(_dns_name(text), wildcard=False)


def _common_name(run_id: str) -> str:
    room = _CN_LIMIT - len("egressd run  inspection CA")
    shown = run_id if len(run_id) <= room else run_id[: room - 3] + "..."
    return f"egressd run {shown} inspection CA"


class RunCA:
    """One run's inspection CA: its certificate, its name constraints and the leaves it has minted.

    Make one with ``RunCA.create``. The private key stays inside this object,
    but for ``handed``: the one way it leaves, to a worker process of the
    same egressd (``--workers``), which takes it with ``RunCA.taken``.
    """

    __slots__ = ("_covered", "_certificate", "_key", "_leaves", "_max_leaves", "_pem", "_ski")

    def __init__(
        self,
        key: ec.EllipticCurvePrivateKey,
        certificate: x509.Certificate,
        covered: tuple[_Covered, ...],
        max_leaves: int,
    ) -> None:
        self._key = key
        self._certificate = certificate
        self._covered = covered
        self._max_leaves = max_leaves
        self._pem = certificate.public_bytes(serialization.Encoding.PEM)
        self._ski = certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        self._leaves: OrderedDict[str, Leaf] = OrderedDict()

    @classmethod
    def create(
        cls,
        names: Iterable[str],
        now: datetime.datetime,
        lifetime: datetime.timedelta,
        margin: datetime.timedelta = DEFAULT_MARGIN,
        *,
        run_id: str,
        max_leaves: int = MAX_LEAVES,
    ) -> RunCA:
        """A new CA for the run ``run_id``, constrained to ``names``, valid for ``lifetime + margin`` from ``now``.

        ``names`` are the inspected entries, already normalised (lowercase
        A-labels): ``example.com`` or ``*.example.com``. ``now`` must be an
        aware datetime (UTC); it is truncated to the second, as X.509 times
        are. Raises InspectCAError for no names, a malformed name, an IP
        literal, a naive ``now`` or a non-positive lifetime.
        """
        covered = tuple(dict.fromkeys(_entry(text) for text in names))
        if not covered:
            raise InspectCAError("an inspection CA needs at least one name")
        if now.tzinfo is None:
            raise InspectCAError("now must be an aware datetime (UTC)")
        if lifetime <= datetime.timedelta(0) or margin < datetime.timedelta(0) or max_leaves < 1:
            raise InspectCAError("lifetime must be positive, margin not negative, max_leaves at least 1")
        start = now.astimezone(datetime.UTC).replace(microsecond=0)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "egressd"),
            x509.NameAttribute(NameOID.COMMON_NAME, _common_name(run_id)),
        ])
        subtrees = sorted({entry.base for entry in covered})
        constraints = x509.NameConstraints(
            permitted_subtrees=[x509.DNSName(base) for base in subtrees],
            excluded_subtrees=[x509.IPAddress(network) for network in _ALL_ADDRESSES],
        )
        usage = x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
        )
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start - BACKDATE)
            .not_valid_after(start + lifetime + margin)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(constraints, critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(key, certificate, covered, max_leaves)

    def handed(self) -> tuple[bytes, bytes, tuple[str, ...]]:
        """The key (PKCS #8, PEM), the certificate (PEM) and the names: for a worker of this egressd only."""
        key = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return key, self._pem, self.names

    @classmethod
    def taken(cls, handed: tuple[bytes, bytes, tuple[str, ...]], *, max_leaves: int = MAX_LEAVES) -> RunCA:
        """The CA another process of this egressd made (``handed``): the same key, certificate and names."""
        key_pem, certificate_pem, names = handed
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InspectCAError("a handed CA key must be an elliptic-curve key")
        covered = tuple(dict.fromkeys(_entry(text) for text in names))
        return cls(key, x509.load_pem_x509_certificate(certificate_pem), covered, max_leaves)

    @property
    def certificate(self) -> x509.Certificate:
        """The CA certificate (public: no key material)."""
        return self._certificate

    @property
    def names(self) -> tuple[str, ...]:
        """The inspected entries the CA was made for, as given (duplicates dropped)."""
        return tuple(("*." if entry.wildcard else "") + entry.base for entry in self._covered)

    def certificate_pem(self) -> bytes:
        """The CA certificate in PEM, for the sandbox's trust bundle and the control API; never the key."""
        return self._pem

    def covers(self, name: str) -> bool:
        """Whether ``leaf(name)`` would mint: an entry matches the normalised ``name`` as the policy does."""
        return any(entry.covers(name) for entry in self._covered)

    def leaf(self, name: str) -> Leaf:
        """The leaf for the normalised host ``name``, minted on first use and kept for the run.

        Raises InspectCAError when no inspected entry covers ``name``.
        """
        cached = self._leaves.get(name)
        if cached is not None:
            self._leaves.move_to_end(name)
            return cached
        if not self.covers(_dns_name(name)):
            raise InspectCAError(f"{quoted(name)} is not an inspected name of this run")
        leaf = self._mint(name)
        self._leaves[name] = leaf
        if len(self._leaves) > self._max_leaves:
            self._leaves.popitem(last=False)
        return leaf

    def _mint(self, name: str) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        ca = self._certificate
        usage = x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
        )
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))  # RFC 5280 §4.2.1.6: the critical SAN names it (a CN holds 64 at most)
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(ca.not_valid_before_utc)
            .not_valid_after(ca.not_valid_after_utc)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(self._ski), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return Leaf(name, certificate.public_bytes(serialization.Encoding.PEM) + self._pem, key_pem)

    def __repr__(self) -> str:
        return f"RunCA(names={self.names!r}, not_after={self._certificate.not_valid_after_utc.isoformat()})"

    __str__ = __repr__
