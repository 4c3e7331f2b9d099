"""The run's inspection CA: its extensions, its name constraints as verifiers read them, its leaves, its cache.

cryptography's own verifier (``x509.verification``, the Web PKI profile)
judges every chain here; a forged leaf, signed directly with the CA's key
for a name the run does not inspect, proves the name constraints hold even
when ``RunCA.leaf`` is bypassed. TLS handshakes run over memory BIOs (no
socket); OpenSSL's ``verify`` and handshakes on loopback are in
tests/integration/proxy/test_inspectca_tls.py.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from egressd.proxy.core.inspectca import BACKDATE, DEFAULT_MARGIN, InspectCAError, Leaf, RunCA
from tests import REPO
from tests.fakes.leafcontext import client_context, forge, forged_leaf, server_context

NOW = dt.datetime(2026, 12, 5, 12, 0, 0, tzinfo=dt.UTC)
LIFETIME = dt.timedelta(hours=8)
NAMES = ("api.github.com", "*.example.com")


@pytest.fixture(scope="module")
def ca() -> RunCA:
    return RunCA.create(NAMES, NOW, LIFETIME, run_id="r-1234abcd")


@pytest.fixture(scope="module")
def live_ca() -> RunCA:
    """A CA valid now, for handshakes: ssl checks validity against the real clock."""
    return RunCA.create(NAMES, dt.datetime.now(dt.UTC), LIFETIME, run_id="r-live")


def _certificate(leaf: Leaf) -> x509.Certificate:
    return x509.load_pem_x509_certificates(leaf.chain_pem)[0]


def _verify(ca: RunCA, certificate: x509.Certificate, subject: x509.DNSName | x509.IPAddress,
            at: dt.datetime = NOW) -> None:
    """cryptography's Web PKI verifier, trusting only the run's CA; raises VerificationError on refusal."""
    verifier = PolicyBuilder().store(Store([ca.certificate])).time(at).build_server_verifier(subject)
    verifier.verify(certificate, [])


def _forged(ca: RunCA, san: x509.GeneralName) -> x509.Certificate:
    """A leaf signed with the CA's own key, bypassing ``leaf``'s check: only the name constraints stop it."""
    return forge(ca, san)[0]


def _handshake(ca: RunCA, leaf: Leaf, server_name: str) -> None:
    """A full TLS handshake over memory BIOs; the client trusts only ``ca`` and checks ``server_name``."""
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_context(ca).wrap_bio(client_in, client_out, server_hostname=server_name)
    server = server_context(leaf).wrap_bio(server_in, server_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for side, tls in (("client", client), ("server", server)):
            if not done[side]:
                try:
                    tls.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
        server_in.write(client_out.read())
        client_in.write(server_out.read())
        if all(done.values()):
            return
    raise AssertionError("the handshake did not finish")


# --- the CA certificate ------------------------------------------------------------------------------


def test_the_ca_signs_leaves_only_and_no_ca_below_it(ca: RunCA) -> None:
    constraints = ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = ca.certificate.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    assert not usage.value.digital_signature and not usage.value.key_encipherment
    ski = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert ski == x509.SubjectKeyIdentifier.from_public_key(ca.certificate.public_key())


def test_the_name_constraints_permit_exactly_the_inspected_names_and_exclude_every_address(ca: RunCA) -> None:
    extension = ca.certificate.extensions.get_extension_for_class(x509.NameConstraints)
    assert extension.critical
    assert extension.value.permitted_subtrees == [x509.DNSName("api.github.com"), x509.DNSName("example.com")]
    assert extension.value.excluded_subtrees == [
        x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
        x509.IPAddress(ipaddress.ip_network("::/0")),
    ]


def test_the_key_is_p256_and_the_subject_names_the_run(ca: RunCA) -> None:
    key = ca.certificate.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1)
    assert ca.certificate.subject.rfc4514_string() == "CN=egressd run r-1234abcd inspection CA,O=egressd"
    assert ca.certificate.issuer == ca.certificate.subject


def test_the_validity_runs_from_a_little_before_now_to_lifetime_and_margin_after(ca: RunCA) -> None:
    assert ca.certificate.not_valid_before_utc == NOW - BACKDATE
    assert ca.certificate.not_valid_after_utc == NOW + LIFETIME + DEFAULT_MARGIN


def test_the_pem_is_the_certificate_and_no_key(ca: RunCA) -> None:
    pem = ca.certificate_pem()
    assert pem.startswith(b"-----BEGIN CERTIFICATE-----") and pem.count(b"BEGIN") == 1
    assert x509.load_pem_x509_certificate(pem) == ca.certificate
    assert b"PRIVATE KEY" not in pem


def test_a_long_run_id_is_cut_to_fit_the_common_name() -> None:
    ca = RunCA.create(["example.com"], NOW, LIFETIME, run_id="r" * 100)
    common = ca.certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
    assert isinstance(common, str) and len(common) == 64 and common.endswith("... inspection CA")


@pytest.mark.parametrize(
    ("names", "now", "lifetime"),
    [
        ([], NOW, LIFETIME),
        (["Example.com"], NOW, LIFETIME),
        (["127.0.0.1"], NOW, LIFETIME),
        (["*.127.0.0.1"], NOW, LIFETIME),
        (["bücher.example"], NOW, LIFETIME),
        (["a..example.com"], NOW, LIFETIME),
        (["example.com."], NOW, LIFETIME),
        (["example.com"], NOW.replace(tzinfo=None), LIFETIME),
        (["example.com"], NOW, dt.timedelta(0)),
    ],
    ids=["no names", "uppercase", "an IP", "a wildcard IP", "a U-label", "an empty label", "a trailing dot",
         "a naive now", "no lifetime"],
)
def test_a_ca_is_refused_for(names: list[str], now: dt.datetime, lifetime: dt.timedelta) -> None:
    with pytest.raises(InspectCAError):
        RunCA.create(names, now, lifetime, run_id="r-1")


# --- leaves, as cryptography's verifier reads them ----------------------------------------------------


@pytest.mark.parametrize("name", ["api.github.com", "www.example.com", "a.b.example.com"])
def test_a_leaf_for_an_inspected_name_verifies(ca: RunCA, name: str) -> None:
    leaf = ca.leaf(name)
    certificate = _certificate(leaf)
    _verify(ca, certificate, x509.DNSName(name))
    san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [name]
    assert certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH]
    )
    assert not certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = certificate.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1)


def test_a_leaf_verifies_for_its_own_name_only(ca: RunCA) -> None:
    certificate = _certificate(ca.leaf("www.example.com"))
    with pytest.raises(VerificationError):
        _verify(ca, certificate, x509.DNSName("api.example.com"))


def test_a_leaf_chain_is_the_leaf_then_the_ca_and_its_key_is_the_leafs(ca: RunCA) -> None:
    leaf = ca.leaf("api.github.com")
    chain = x509.load_pem_x509_certificates(leaf.chain_pem)
    assert len(chain) == 2 and chain[1] == ca.certificate
    assert chain[0].issuer == ca.certificate.subject
    assert leaf.key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")


def test_a_leaf_lives_within_the_ca(ca: RunCA) -> None:
    certificate = _certificate(ca.leaf("api.github.com"))
    assert certificate.not_valid_before_utc >= ca.certificate.not_valid_before_utc
    assert certificate.not_valid_after_utc <= ca.certificate.not_valid_after_utc


@pytest.mark.parametrize(
    "name",
    ["evil.com", "github.com", "badexample.com", "example.com.evil.com", "xapi.github.com", "api.github.com.evil"],
)
def test_a_forged_leaf_for_a_name_outside_the_constraints_is_refused(ca: RunCA, name: str) -> None:
    forged = _forged(ca, x509.DNSName(name))
    with pytest.raises(VerificationError, match="name constraint"):
        _verify(ca, forged, x509.DNSName(name))


def test_the_forging_works_for_a_name_inside_the_constraints(ca: RunCA) -> None:
    """The forgery above is refused for its name, not for how it was made."""
    _verify(ca, _forged(ca, x509.DNSName("other.example.com")), x509.DNSName("other.example.com"))


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.1", "::1"])
def test_a_forged_leaf_for_an_ip_address_is_refused(ca: RunCA, address: str) -> None:
    ip = ipaddress.ip_address(address)
    forged = _forged(ca, x509.IPAddress(ip))
    with pytest.raises(VerificationError):
        _verify(ca, forged, x509.IPAddress(ip))


def test_a_plain_entry_permits_its_subdomains_in_the_constraints_but_mints_no_leaf_for_them(ca: RunCA) -> None:
    """RFC 5280 §4.2.1.10: a DNSName subtree covers the names below it; ``leaf`` matches as the policy does."""
    _verify(ca, _forged(ca, x509.DNSName("x.api.github.com")), x509.DNSName("x.api.github.com"))
    with pytest.raises(InspectCAError, match="not an inspected name"):
        ca.leaf("x.api.github.com")


def test_a_wildcard_entry_mints_no_leaf_for_its_apex(ca: RunCA) -> None:
    """``*.example.com`` is encoded as the subtree ``example.com`` (no leading-dot form verifies everywhere)."""
    assert not ca.covers("example.com")
    with pytest.raises(InspectCAError, match="not an inspected name"):
        ca.leaf("example.com")


@pytest.mark.parametrize("name", ["evil.com", "github.com", "127.0.0.1", "a..example.com", "WWW.example.com", ""])
def test_a_leaf_for_an_uncovered_or_malformed_name_is_refused(ca: RunCA, name: str) -> None:
    with pytest.raises(InspectCAError):
        ca.leaf(name)


def test_a_leaf_is_refused_once_the_ca_expires(ca: RunCA) -> None:
    certificate = _certificate(ca.leaf("api.github.com"))
    end = NOW + LIFETIME + DEFAULT_MARGIN
    _verify(ca, certificate, x509.DNSName("api.github.com"), at=end)
    _verify(ca, certificate, x509.DNSName("api.github.com"), at=NOW - BACKDATE)
    with pytest.raises(VerificationError):
        _verify(ca, certificate, x509.DNSName("api.github.com"), at=end + dt.timedelta(seconds=1))
    with pytest.raises(VerificationError):
        _verify(ca, certificate, x509.DNSName("api.github.com"), at=NOW - BACKDATE - dt.timedelta(seconds=1))


def test_a_now_in_another_zone_or_with_microseconds_gives_the_same_window() -> None:
    zone = dt.timezone(dt.timedelta(hours=2))
    ca = RunCA.create(["example.com"], NOW.astimezone(zone).replace(microsecond=999_999), LIFETIME,
                      margin=dt.timedelta(0), run_id="r-1")
    assert ca.certificate.not_valid_before_utc == NOW - BACKDATE
    assert ca.certificate.not_valid_after_utc == NOW + LIFETIME


# --- the cache --------------------------------------------------------------------------------------------


def test_a_second_leaf_for_a_name_is_the_same_leaf(ca: RunCA) -> None:
    assert ca.leaf("www.example.com") is ca.leaf("www.example.com")


def test_each_name_gets_its_own_key(ca: RunCA) -> None:
    assert ca.leaf("one.example.com").key_pem != ca.leaf("two.example.com").key_pem


def test_the_least_recently_used_leaf_is_evicted() -> None:
    ca = RunCA.create(["*.example.com"], NOW, LIFETIME, run_id="r-1", max_leaves=2)
    a, b = ca.leaf("a.example.com"), ca.leaf("b.example.com")
    assert ca.leaf("a.example.com") is a  # a is now the most recent
    ca.leaf("c.example.com")  # evicts b
    assert ca.leaf("a.example.com") is a
    fresh_b = ca.leaf("b.example.com")  # evicts c
    assert fresh_b is not b and fresh_b.key_pem != b.key_pem
    assert ca.leaf("a.example.com") is a


# --- nothing shows a key ------------------------------------------------------------------------------


def test_no_repr_or_str_shows_a_key(ca: RunCA) -> None:
    leaf = ca.leaf("api.github.com")
    for text in (repr(ca), str(ca), repr(leaf), str(leaf)):
        assert "PRIVATE KEY" not in text and "BEGIN" not in text
    assert "api.github.com" in repr(leaf) and "*.example.com" in repr(ca)


def test_the_ca_offers_one_way_to_its_key_and_only_the_workers_hand_over_use_it(ca: RunCA) -> None:
    public = {name for name in dir(ca) if not name.startswith("_")}
    assert public == {"certificate", "certificate_pem", "covers", "create", "handed", "leaf", "names", "taken"}
    # ``handed`` is for a worker of the same egressd (--workers): the one module that calls it is the
    # inspector, from the one method the owner's worker pool calls.
    callers = sorted(
        str(path.relative_to(REPO))
        for path in REPO.glob("**/*.py")
        if ".venv" not in path.parts and "tests" not in path.parts and ".handed(" in path.read_text()
    )
    assert callers == ["cli/wiring/workers.py", "proxy/net/inspector.py"]
    taken = RunCA.taken(ca.handed())  # and what a worker takes is the same CA
    assert taken.certificate_pem() == ca.certificate_pem() and taken.names == ca.names


# --- TLS, in memory ---------------------------------------------------------------------------------------


def test_a_tls_client_trusting_the_ca_accepts_a_leaf_for_its_name(live_ca: RunCA) -> None:
    _handshake(live_ca, live_ca.leaf("api.github.com"), "api.github.com")


def test_a_tls_client_refuses_a_leaf_for_another_name(live_ca: RunCA) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        _handshake(live_ca, live_ca.leaf("api.github.com"), "www.example.com")


def test_a_tls_client_refuses_a_forged_leaf_outside_the_constraints(live_ca: RunCA) -> None:
    """OpenSSL, through Python's ssl, enforces the name constraints too."""
    with pytest.raises(ssl.SSLCertVerificationError, match="permitted subtree violation"):
        _handshake(live_ca, forged_leaf(live_ca, "evil.com"), "evil.com")


def test_a_tls_client_accepts_a_forged_leaf_inside_the_constraints(live_ca: RunCA) -> None:
    """The forgery above is refused for its name, not for how it was made."""
    _handshake(live_ca, forged_leaf(live_ca, "other.example.com"), "other.example.com")
