"""Edges of the policy: wildcards beneath public suffixes.

Wildcards (DESIGN.md "Policy"): a wildcard never reaches across a public
suffix beneath its base. ``*.amazonaws.com`` stays a valid entry (it covers
``ec2.amazonaws.com``, whose registrable domain is amazonaws.com itself) but
does not match ``attacker-bucket.s3.amazonaws.com``: ``s3.amazonaws.com`` is
on the Public Suffix List's private section, so anyone can own a name under
it. Such a host matches no entry, so the usual ask/refuse flow applies.
"""

from __future__ import annotations

from pathlib import Path

import idna
import publicsuffixlist
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from approvals.message import render
from config.suffixes import public_suffix
from proxy.hosts import HostError, normalise_host
from proxy.policy import EntryError, Reason, RunPolicy, Verdict, decide, parse_entry
from tests.conftest import Listener, MakeEgressd
from tests.fakedns import FakeDns
from tests.harness import LEAK, ORIGIN, egress, open_proxy, read_response


def _policy(allow: list[str], deny: tuple[str, ...] = (), ask: bool = True) -> RunPolicy:
    return RunPolicy(allow=tuple(map(parse_entry, allow)), deny=tuple(map(parse_entry, deny)), ask=ask)


# --- a wildcard and the public suffixes beneath its base ----------------------------------

ACROSS = [
    ("*.amazonaws.com", "attacker-bucket.s3.amazonaws.com"),
    ("*.amazonaws.com", "s3.amazonaws.com"),  # the suffix itself: path-style access to anyone's bucket
    ("*.amazonaws.com", "x.s3.us-east-1.amazonaws.com"),
    ("*.amazonaws.com", "a.b.s3.amazonaws.com"),
    ("*.core.windows.net", "x.blob.core.windows.net"),
    ("*.windows.net", "x.blob.core.windows.net"),
]


@pytest.mark.parametrize(
    ("entry", "host"), ACROSS, ids=[f"{e} does not match {h}" for e, h in ACROSS]
)
def test_a_wildcard_does_not_reach_across_a_public_suffix_beneath_its_base(entry: str, host: str) -> None:
    asked = decide(_policy([entry]), host, 443)
    assert asked.verdict is Verdict.ASK and asked.rule is None
    refused = decide(_policy([entry], ask=False), host, 443)
    assert refused.reason is Reason.NOT_ALLOWLISTED and refused.rule is None


WITHIN = [
    ("*.amazonaws.com", "ec2.amazonaws.com"),
    ("*.amazonaws.com", "sts.amazonaws.com"),
    ("*.mybucket.s3.amazonaws.com", "x.mybucket.s3.amazonaws.com"),  # a base below the suffix is one owner's
    ("*.example.co.uk", "a.b.example.co.uk"),
    ("*.alice.github.io", "x.y.alice.github.io"),
    ("*.example.com", "deep.sub.example.com"),
    ("*.corp.internal", "build.corp.internal"),
]


@pytest.mark.parametrize(
    ("entry", "host"), WITHIN, ids=[f"{e} matches {h}" for e, h in WITHIN]
)
def test_a_wildcard_still_matches_names_its_owner_controls(entry: str, host: str) -> None:
    decision = decide(_policy([entry]), host, 443)
    assert decision.verdict is Verdict.ALLOW and decision.rule == entry


@pytest.mark.parametrize(
    "entry",
    ["*.s3.amazonaws.com", "*.blob.core.windows.net", "*.s3.us-east-1.amazonaws.com", "*.appspot.com"],
)
def test_a_wildcard_on_a_private_section_suffix_is_refused(entry: str) -> None:
    with pytest.raises(EntryError, match="public suffix"):
        parse_entry(entry)


def test_a_deny_wildcard_still_covers_every_name_beneath_it() -> None:
    # Refusing more is safe: a deny entry keeps matching across suffixes.
    decision = decide(_policy(["bucket.s3.amazonaws.com"], deny=("*.amazonaws.com",)), "bucket.s3.amazonaws.com", 443)
    assert decision.reason is Reason.DENYLISTED and decision.rule == "*.amazonaws.com"


def test_an_exact_entry_beneath_a_suffix_is_allowed_as_named() -> None:
    decision = decide(_policy(["my-bucket.s3.amazonaws.com"]), "my-bucket.s3.amazonaws.com", 443)
    assert decision.verdict is Verdict.ALLOW


def test_the_approval_message_calls_a_bucket_beneath_a_suffix_unrelated() -> None:
    message = render(
        host="attacker-bucket.s3.amazonaws.com", port=443, command="aws s3 ls", task="list instances",
        allowed=["*.amazonaws.com"],
    )
    assert message.unrelated
    own = render(host="ec2.amazonaws.com", port=443, command="x", task="y", allowed=["*.amazonaws.com"])
    assert not own.unrelated


async def test_a_bucket_under_an_allowed_wildcard_is_not_reached_or_resolved(
    make_egressd: MakeEgressd, dns: FakeDns, leak: Listener
) -> None:
    dns.set("attacker-bucket.s3.amazonaws.com", [LEAK])
    dns.set("ec2.amazonaws.com", [ORIGIN])
    svc = await make_egressd(allow=["*.amazonaws.com:*"], ask=False)
    reader, writer = await open_proxy(svc)
    writer.write(b"GET http://attacker-bucket.s3.amazonaws.com:%d/x HTTP/1.1\r\nHost: x\r\n\r\n" % leak.port)
    await writer.drain()
    status, headers, body = await read_response(reader)
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "not_allowlisted", body
    assert leak.connections == 0 and not dns.asked("attacker-bucket.s3.amazonaws.com")
    [record] = egress(svc)
    assert record["host"] == "attacker-bucket.s3.amazonaws.com" and record["reason"] == "not_allowlisted"
    assert record["rule"] is None


# --- the same, as properties over the real Public Suffix List ----------------------------


def _psl_rules() -> tuple[list[str], list[str]]:
    """The bundled list's plain rules (no wildcard or exception), in A-label form: (ICANN, private)."""
    path = Path(publicsuffixlist.__file__).with_name("public_suffix_list.dat")
    sections: tuple[list[str], list[str]] = ([], [])
    private = False
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if "===BEGIN PRIVATE DOMAINS===" in line:
            private = True
        if not line or line.startswith("//") or line.startswith("!") or "*" in line:
            continue
        try:
            rule = idna.encode(line, uts46=True).decode("ascii")
            normalise_host(rule)
        except (idna.IDNAError, UnicodeError, HostError):
            continue
        sections[private].append(rule)
    return sections


ICANN_RULES, PRIVATE_RULES = _psl_rules()
DEEP_RULES = [rule for rule in ICANN_RULES + PRIVATE_RULES if rule.count(".") >= 1]


def test_the_bundled_list_has_both_sections() -> None:
    assert len(ICANN_RULES) > 5000 and len(PRIVATE_RULES) > 1000
    assert "s3.amazonaws.com" in PRIVATE_RULES and "blob.core.windows.net" in PRIVATE_RULES


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ICANN_RULES + PRIVATE_RULES))
def test_no_real_public_suffix_can_be_a_wildcard_base(rule: str) -> None:
    with pytest.raises(EntryError, match="public suffix"):
        parse_entry("*." + rule)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(DEEP_RULES), st.data())
def test_no_wildcard_above_a_real_public_suffix_reaches_below_it(rule: str, data: st.DataObject) -> None:
    labels = rule.split(".")
    bases = [".".join(labels[i:]) for i in range(1, len(labels))]
    bases = [b for b in bases if public_suffix(b) != b]  # a base that is itself a suffix is refused above
    if not bases:
        return
    base = data.draw(st.sampled_from(bases))
    owner = data.draw(st.sampled_from(["attacker", "x-1", "bucket"]))
    host = f"{owner}.{rule}"
    for candidate in (host, rule, "deep." + host):
        decision = decide(_policy(["*." + base]), candidate, 443)
        assert decision.verdict is Verdict.ASK, (base, candidate)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ICANN_RULES + PRIVATE_RULES), st.lists(st.sampled_from(["a", "b-1", "www"]), max_size=3))
def test_a_wildcard_on_a_registrable_domain_matches_every_name_of_its_owner(rule: str, labels: list[str]) -> None:
    base = "egressd-owner." + rule
    if public_suffix(base) != rule:
        return  # a wildcard rule makes the owner label a suffix too: not a registrable domain
    host = ".".join([*labels, "leaf", base])
    assert decide(_policy(["*." + base]), host, 443).verdict is Verdict.ALLOW
