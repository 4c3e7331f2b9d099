"""Edges of the policy: wildcards beneath public suffixes, and webhook URLs that can be forged on the wire.

Wildcards (DESIGN.md "Policy"): a wildcard never reaches across a public
suffix beneath its base. ``*.amazonaws.com`` stays a valid entry (it covers
``ec2.amazonaws.com``, whose registrable domain is amazonaws.com itself) but
does not match ``attacker-bucket.s3.amazonaws.com``: ``s3.amazonaws.com`` is
on the Public Suffix List's private section, so anyone can own a name under
it. Such a host matches no entry, so the usual ask/refuse flow applies.

Webhooks (DESIGN.md "Channels"): ``--webhook-url`` is https, or plain http
only to a loopback address; anything else stops start-up with one line.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import subprocess
import sys
from pathlib import Path

import idna
import publicsuffixlist
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.message import render
from egressd.approvals.signing import parse_secret
from egressd.approvals.webhook import WebhookChannel
from egressd.audit.log import MemoryAuditSink
from egressd.config.settings import SettingsError, load_settings, protected_url
from egressd.names.hosts import HostError, normalise_host
from egressd.names.suffixes import public_suffix
from egressd.proxy.core.policy import EntryError, RunPolicy, Verdict, decide, parse_entry
from egressd.vocabulary.reasons import Answer, Reason
from tests.conftest import Listener, MakeEgressd
from tests.fakes.control import control_server
from tests.fakes.dns import FakeDns
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import LEAK, ORIGIN, egress, listening_socket, open_proxy, read_response, wait_until
from tests.integration.approvals.test_broker import request

EGRESSD = str(Path(sys.executable).with_name("egressd"))


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


# --- webhook URLs ---------------------------------------------------------------------------

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def _env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}


def test_a_plain_http_webhook_to_a_remote_host_stops_serve_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0", "--control-token", "t" * 32,
            "--audit-log", str(tmp_path / "a.jsonl"), "--approver", "webhook",
            "--webhook-url", "http://example.test/hook", "--webhook-secret", SECRET,
        ],
        env=_env(tmp_path), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "bad setting webhook_url" in lines[0] and "https" in lines[0] and "loopback" in lines[0]


REFUSED_URLS = [
    "http://example.test/hook",
    "http://localhost:8080/hook",  # a name: whatever it resolves to is not ours to check
    "http://10.1.2.3/hook",
    "http://[fe80::1]/hook",
    "http://127.0.0.1@example.test/hook",  # userinfo: the host is example.test
    "http://127.0.0.1:80@example.test/hook",
    "http://127.0.0.1.example.test/hook",
    "http://0x7f.1/hook",  # a spelling of loopback that not every client reads so
]


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_a_plain_http_webhook_off_loopback_is_a_bad_setting(url: str) -> None:
    with pytest.raises(SettingsError, match=r"^bad setting webhook_url: .*https") as caught:
        load_settings({"webhook_url": url})
    assert "\n" not in str(caught.value)
    assert not protected_url(url)


ACCEPTED_URLS = [
    "http://127.0.0.1:{port}/",
    "http://127.0.0.1:{port}/hook",
    "http://127.5.6.7:{port}/hook",
    "http://[::1]:{port}/hook",
    "https://hooks.example.test/egressd",
    "https://10.1.2.3:8443/hook",
]


@pytest.mark.parametrize("url", ACCEPTED_URLS)
def test_https_or_loopback_http_webhooks_are_accepted(url: str) -> None:
    url = url.format(port=48123)
    assert load_settings({"webhook_url": url}).webhook_url == url


def test_the_unsafe_setting_allows_plain_http_off_loopback_and_says_so_in_its_name() -> None:
    settings = load_settings({"webhook_url": "http://example.test/hook", "unsafe_webhook_http": True})
    assert settings.webhook_url == "http://example.test/hook"


@pytest.mark.parametrize(
    ("url", "trusted"),
    [
        ("https://hooks.example.test/h", True),
        ("http://127.0.0.1:9/h", True),
        ("http://[::1]:9/h", True),
        ("http://example.test/h", False),
        ("http://172.17.0.1:9/h", False),
    ],
)
def test_an_answer_in_the_response_counts_only_when_the_wire_is_protected(url: str, trusted: bool) -> None:
    # Over plain http off loopback (only with unsafe_webhook_http) anyone on the path could
    # write {"decision": "allow"}: answers then come only by the signed callback or the control API.
    channel = WebhookChannel(url=url, secret=b"k" * 24)
    assert channel.answers_in_response is trusted


async def test_an_answer_in_a_plain_http_response_off_loopback_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    # "localhost" is no loopback literal, so the channel treats the wire as open (as with
    # unsafe_webhook_http); the receiver still sits on 127.0.0.1. Its {"decision": "allow"}
    # must not decide: only the signed callback does.
    secret, key = make_secret()
    _, callback_key = make_secret()
    sock = listening_socket()  # bound before its port is named in public_url: nobody else can take it
    port = sock.getsockname()[1]
    async with WebhookReceiver(key, callback_key=callback_key, mode="now", decision="allow") as receiver:
        channel = WebhookChannel(
            url=receiver.url.replace("127.0.0.1", "localhost"),
            secret=parse_secret(secret),
            callback_secret=callback_key,
            public_url=f"http://127.0.0.1:{port}/",
        )
        broker = ApprovalBroker([channel], audit=MemoryAuditSink(), timeout_s=10)
        async with control_server(broker.routes, sock):
            await broker.start()
            try:
                with caplog.at_level(logging.WARNING, logger="egressd.approvals.webhook"):
                    held = asyncio.create_task(broker.ask(request()))
                    await wait_until(lambda: receiver.requests and "ignoring the answer" in caplog.text)
                    await asyncio.sleep(0.05)
                    assert not held.done()  # the forged-looking "allow" decided nothing
                    approval_id = receiver.requests[0].payload["id"]
                    status, _, _ = await receiver.callback(approval_id, "deny", by="bob")
                    assert status == 200
                    outcome = await asyncio.wait_for(held, 5)
            finally:
                await broker.close()
    assert outcome.answer is Answer.DENY and outcome.by == "bob"
