"""A run's CA: as narrow as X.509 allows, and a leaked key mints nothing a verifier accepts elsewhere."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from egressd.proxy.core.inspectca import MAX_LEAVES, InspectCAError, RunCA, constraint_names

NOW = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)
LIFETIME = dt.timedelta(days=2)


def _ca(*names: str) -> RunCA:
    return RunCA.create(names, NOW, LIFETIME, run_id="r-1")


def _verify(ca: RunCA, leaf_pem: bytes, name: str, at: dt.datetime = NOW) -> None:
    leaf = x509.load_pem_x509_certificates(leaf_pem)[0]
    verifier = PolicyBuilder().store(Store([ca.certificate])).time(at).build_server_verifier(x509.DNSName(name))
    verifier.verify(leaf, [])


def test_the_ca_is_p256_path_length_0_and_constrained_to_the_runs_names_critically() -> None:
    ca = _ca("api.github.com", "*.example.test")
    cert = ca.certificate
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey) and cert.public_key().curve.name == "secp256r1"
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    constraints = cert.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    assert [n.value for n in constraints.value.permitted_subtrees or []] == ["api.github.com", "example.test"]
    assert len(constraints.value.excluded_subtrees or []) == 2  # every IPv4 and IPv6 address
    assert cert.not_valid_before_utc == NOW - dt.timedelta(minutes=5)
    assert cert.not_valid_after_utc == NOW + LIFETIME + dt.timedelta(hours=1)
    assert constraint_names(["*.a.test", "a.test", "b.test"]) == ("a.test", "b.test")


def test_a_leaf_for_an_inspected_name_verifies_and_is_minted_once() -> None:
    ca = _ca("api.github.com", "*.example.test")
    leaf = ca.leaf("api.github.com")
    _verify(ca, leaf.chain_pem, "api.github.com")
    assert ca.leaf("api.github.com") is leaf
    _verify(ca, ca.leaf("x.example.test").chain_pem, "x.example.test")
    cert = x509.load_pem_x509_certificates(leaf.chain_pem)[0]
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH])
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


@pytest.mark.parametrize("name", ["github.com", "evil.test", "example.test", "x.api.github.com"])
def test_no_leaf_is_minted_for_a_name_the_run_does_not_inspect(name: str) -> None:
    with pytest.raises(InspectCAError):
        _ca("api.github.com", "*.example.test").leaf(name)


def _forged(ca: RunCA, name: str) -> bytes:
    """What a thief with the CA's key could sign: a leaf for ``name``."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.certificate.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(minutes=1)).not_valid_after(NOW + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca._key.public_key()), critical=False)
        .sign(ca._key, hashes.SHA256())
    )  # fmt: skip
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def test_a_leaf_forged_with_the_cas_key_for_another_name_does_not_verify() -> None:
    ca = _ca("api.github.com")
    _verify(ca, _forged(ca, "api.github.com"), "api.github.com")  # the forgery itself is well made
    with pytest.raises(VerificationError):
        _verify(ca, _forged(ca, "accounts.google.com"), "accounts.google.com")


def test_the_ca_expires_as_stated() -> None:
    ca = _ca("api.github.com")
    leaf = ca.leaf("api.github.com").chain_pem
    _verify(ca, leaf, "api.github.com", NOW + LIFETIME)
    with pytest.raises(VerificationError):
        _verify(ca, leaf, "api.github.com", NOW + LIFETIME + dt.timedelta(hours=1, seconds=1))


def test_no_key_is_shown_and_the_leaf_cache_is_bounded() -> None:
    ca = _ca("*.example.test")
    leaf = ca.leaf("a.example.test")
    assert "PRIVATE" not in repr(ca) + str(ca) + repr(leaf) + str(leaf)
    assert b"PRIVATE KEY" not in ca.certificate_pem()
    for i in range(MAX_LEAVES + 1):
        ca._leaves[f"n{i}.example.test"] = leaf  # filled by hand: minting 4097 keys takes seconds
    ca.leaf("b.example.test")
    assert len(ca._leaves) == MAX_LEAVES and "a.example.test" not in ca._leaves


def test_a_run_without_names_gets_no_ca() -> None:
    with pytest.raises(InspectCAError):
        _ca()
