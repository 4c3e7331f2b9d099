"""The approvals page's pure parts: the Host rule, sessions, the sign-in limiter, and escaping in the HTML."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from egressd.approvals.control import Scope
from egressd.approvals.interface import ApprovalRequest, PendingApproval
from egressd.approvals.message import render
from egressd.approvals.webpage import (
    CHANGE_SITES,
    PAGE_SITES,
    Session,
    SessionStore,
    SignInLimiter,
    expected_origin,
    fetch_site_ok,
    host_allowed,
)
from egressd.approvals.webview import (
    approval_event,
    approval_html,
    countdown,
    page_html,
    run_row,
    runs_html,
    tail_html,
    tail_row,
)

LOOPBACK = ("127.0.0.1", 8080)


@pytest.mark.parametrize(
    ("host", "local", "public_url", "allowed"),
    [
        pytest.param("127.0.0.1:8080", LOOPBACK, None, True, id="the address the request arrived on"),
        pytest.param("localhost:8080", LOOPBACK, None, True, id="localhost, on a loopback address"),
        pytest.param("LocalHost:8080", LOOPBACK, None, True, id="names are case-insensitive"),
        pytest.param("rebound.attacker.test:8080", LOOPBACK, None, False, id="a name pointed here is refused"),
        pytest.param("127.0.0.1:8081", LOOPBACK, None, False, id="another port is refused"),
        pytest.param("127.0.0.1", LOOPBACK, None, False, id="no port means 80, not ours"),
        pytest.param("127.0.0.2:8080", LOOPBACK, None, False, id="another loopback address is refused"),
        pytest.param("127.1:8080", LOOPBACK, None, False, id="a short IPv4 spelling is not an address literal"),
        pytest.param("[::1]:8080", ("::1", 8080), None, True, id="a bracketed IPv6 literal"),
        pytest.param("[::1:8080", ("::1", 8080), None, False, id="an unclosed bracket"),
        pytest.param("127.0.0.1:8080", ("::ffff:127.0.0.1", 8080), None, True, id="an IPv4-mapped socket address"),
        pytest.param("10.0.0.5:8080", ("10.0.0.5", 8080), None, True, id="a non-loopback address by its literal"),
        pytest.param("localhost:8080", ("10.0.0.5", 8080), None, False, id="localhost is not a LAN address"),
        pytest.param("egressd.example.com", LOOPBACK, "https://egressd.example.com", True, id="the public URL"),
        pytest.param("egressd.example.com:443", LOOPBACK, "https://egressd.example.com/", True, id="its port spelled"),
        pytest.param("egressd.example.com:8443", LOOPBACK, "https://egressd.example.com", False, id="another port"),
        pytest.param("user@127.0.0.1:8080", LOOPBACK, None, False, id="userinfo is malformed"),
        pytest.param("127.0.0.1:99999", LOOPBACK, None, False, id="a port out of range"),
        pytest.param("127.0.0.1:8080/x", LOOPBACK, None, False, id="a path is malformed"),
        pytest.param("", LOOPBACK, None, False, id="an empty Host"),
        pytest.param(None, LOOPBACK, None, False, id="no Host"),
        pytest.param("127.0.0.1:8080", None, None, False, id="no local address known"),
    ],
)
def test_host_rule(host: str | None, local: tuple[str, int] | None, public_url: str | None, allowed: bool) -> None:
    assert host_allowed(host, local=local, public_url=public_url) is allowed


def test_expected_origin_follows_the_host_and_the_public_url() -> None:
    assert expected_origin("127.0.0.1:8080", secure=False, public_url=None) == "http://127.0.0.1:8080"
    assert expected_origin("LOCALHOST:8080", secure=True, public_url=None) == "https://localhost:8080"
    public = "https://egressd.example.com"
    assert expected_origin("egressd.example.com", secure=False, public_url=public) == public


def secrets_counter() -> SessionStore:
    numbers = itertools.count()
    return SessionStore(new_secret=lambda: f"secret-{next(numbers)}", idle_s=100.0, max_s=1000.0, limit=3)


def test_a_session_expires_when_unused_and_at_its_maximum_age_even_while_open() -> None:
    store = secrets_counter()
    sid, session = store.open("alice", Scope(None), now=0.0)
    assert session.csrf != sid
    assert store.get(sid, 99.0) is session  # touched: idle from 99 on
    assert store.get(sid, 198.0) is session
    assert store.get(sid, 298.0) is None and len(store) == 0
    sid, session = store.open("alice", Scope(None), now=0.0)
    session.streams = 1  # an open page keeps it from idling out ...
    assert store.get(sid, 900.0, touch=False) is session
    assert store.get(sid, 1000.0) is None  # ... but not past its maximum age


def test_sessions_are_bounded_and_the_one_seen_longest_ago_goes_first() -> None:
    store = secrets_counter()
    first, _ = store.open("a", Scope(None), now=0.0)
    second, _ = store.open("b", Scope(None), now=1.0)
    third, _ = store.open("c", Scope(None), now=2.0)
    store.get(first, 3.0)
    fourth, _ = store.open("d", Scope(None), now=4.0)
    assert len(store) == 3 and store.get(second, 5.0) is None
    assert all(store.get(s, 5.0) is not None for s in (first, third, fourth))
    store.close(first)
    assert store.get(first, 5.0) is None


def test_a_page_counts_as_open_for_the_grace_after_its_stream_closed() -> None:
    session = Session(name="a", scope=Scope(None), csrf="c", created=0.0, seen=0.0)
    assert not session.present(10.0, 30.0)  # signed in, never opened the page
    session.streams = 1
    assert session.present(10.0, 30.0)
    session.streams, session.stream_ended = 0, 10.0
    assert session.present(40.0, 30.0) and not session.present(40.1, 30.0)


def test_failed_sign_ins_are_limited_per_address_never_in_all() -> None:
    limiter = SignInLimiter(per_address=2, window_s=60.0)
    for _ in range(2):
        assert limiter.allowed("10.0.0.1", 0.0)
        limiter.failed("10.0.0.1", 0.0)
    assert not limiter.allowed("10.0.0.1", 1.0) and limiter.allowed("10.0.0.2", 1.0)
    for address in (f"10.0.1.{i}" for i in range(50)):  # many addresses' failures lock out none but themselves
        limiter.failed(address, 1.0)
        limiter.failed(address, 1.0)
    assert limiter.allowed("10.0.0.3", 2.0)
    assert limiter.allowed("10.0.0.1", 61.0)  # the window moved on
    # One IPv6 host has a /64 of addresses: counted as one client.
    limiter.failed("2001:db8::1", 0.0)
    limiter.failed("2001:db8::2", 0.0)
    assert not limiter.allowed("2001:db8::ffff", 1.0) and limiter.allowed("2001:db8:0:1::1", 1.0)


def test_sessions_are_capped_per_scope_and_one_with_an_open_page_is_never_evicted() -> None:
    store = secrets_counter()  # limit 3 per scope
    operator, session = store.open("op", Scope(None), now=0.0)  # type: ignore[misc]
    for i in range(20):  # a run's token signs in again and again
        assert store.open(f"x{i}", Scope("r-1"), now=1.0 + i) is not None
    assert store.get(operator, 30.0) is session  # another scope's sign-ins never push it out
    session.streams = 1
    for i in range(2):
        store.open(f"op{i}", Scope(None), now=31.0 + i)
    assert store.open("op-3", Scope(None), now=40.0) is not None  # an idle global session went
    assert store.get(operator, 41.0) is session  # not the one with its page open
    others = [s for s in store.live(41.0) if s.scope == Scope(None) and s is not session]
    for other in others:
        other.streams = 1
    assert store.open("op-4", Scope(None), now=42.0) is None  # all open: refused, nobody evicted
    assert store.get(operator, 43.0) is session


def test_a_session_needs_its_key() -> None:
    store = secrets_counter()
    sid, session = store.open("a", Scope(None), now=0.0)  # type: ignore[misc]
    assert store.get(sid, 1.0, key=session.key) is session
    assert store.get(sid, 1.0, key="wrong") is None and store.get(sid, 1.0, key="") is None


def test_fetch_metadata_rule() -> None:
    assert fetch_site_ok(None, PAGE_SITES) and fetch_site_ok("same-origin", CHANGE_SITES)
    assert fetch_site_ok("none", PAGE_SITES) and not fetch_site_ok("none", CHANGE_SITES)
    assert not fetch_site_ok("same-site", PAGE_SITES) and not fetch_site_ok("cross-site", PAGE_SITES)


HOSTILE = "curl <script>alert(1)</script> \"><img src=x onerror=alert(2)> 'x'"


def pending(command: str, task: str, host: str = "xn--l-7sba6dbr.com") -> PendingApproval:
    request = ApprovalRequest(
        run_id="<run>", host=host, port=443, command=command, task=task, allowed=("<b>pypi.org</b>",)
    )
    message = render(host=host, port=443, command=command, task=task, allowed=request.allowed)
    return PendingApproval(
        id='a-"x"', request=request, message=message, created_at=0.0, expires_at=600.0, deadline=600.0
    )


def test_approval_html_escapes_every_text_from_the_sandbox() -> None:
    html = approval_html(approval_event(pending(HOSTILE, "<i>task</i> & more"), Scope(None)), csrf='c"srf', now=0.0)
    for raw in ("<script>", "<img", "<i>", "<b>", "<run>", "'x'"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &quot;&gt;&lt;img src=x onerror=alert(2)&gt; &#x27;x&#x27;" in html
    assert "&lt;i&gt;task&lt;/i&gt; &amp; more" in html and "&lt;b&gt;pypi.org&lt;/b&gt;" in html
    # Issue 29: a card of fields: the registered domain emphasised, the unrelated warning and punycode as
    # badges, the message's lines as labelled fields (the punycode's shown form in the Domain field).
    assert '<span class="sub"></span><strong class="site">xn--l-7sba6dbr.com</strong><span class="port">:443' in html
    assert '<span class="badge unrelated">unrelated</span><span class="badge idn">punycode</span>' in html
    assert ('<dt>Domain</dt><dd class="field domain">xn--l-7sba6dbr.com:443 (shown as раураl.com; registered '
            "domain xn--l-7sba6dbr.com)</dd>") in html  # fmt: skip
    assert '<dt>Run</dt><dd class="field run">&lt;run&gt;</dd>' in html
    assert "<dt>Held since</dt><dd class=\"field held\">00:00:00 UTC</dd>" in html
    assert '<p class="hint">Reply allow (this run only) or deny. If you did not expect' in html
    assert 'value="c&quot;srf"' in html and 'value="a-&quot;x&quot;"' in html
    assert 'action="answer"' in html and 'method="post"' in html  # relative: the page's path is random
    assert "expires in 10:00" in html


def test_a_subdomain_is_split_from_its_registered_domain_and_the_client_shown() -> None:
    approval = pending("pip install x", "build", host="files.pythonhosted.org")
    approval = replace(approval, request=replace(approval.request, client="10.0.0.2:40000"))
    event = approval_event(approval, Scope("r-1"))
    assert event["domain"] == ["files.", "pythonhosted.org", ":443"] and not event["punycode"]
    fields = [kind for kind, _, _ in event["fields"]]
    assert fields == ["domain", "command", "task", "allowed", "run", "client", "held"]
    assert "always" not in event["scopes"]  # a run's own session is never offered always


def test_history_and_revoke_forms_escape_what_they_show() -> None:
    from egressd.approvals.interface import Settlement
    from egressd.approvals.webview import always_html, decision_row, history_html
    from egressd.vocabulary.reasons import Answer

    settled = Settlement(Answer.ALLOW, "web", "<b>bob</b>", at=3600.0, waited_s=1.0)
    row = decision_row(pending("c", "t", host="a.example"), settled)
    assert row["at"] == "01:00:00 UTC" and row["domain"] == "a.example:443" and row["allowed"]
    html = history_html([row])
    assert "<b>" not in html and "allowed by &lt;b&gt;bob&lt;/b&gt; via web" in html
    runs = runs_html([{"id": "r", "approved": ['"><x>']}], csrf="k")
    assert '<input type="hidden" name="entry" value="&quot;&gt;&lt;x&gt;">' in runs and 'action="revoke"' in runs
    assert '<input type="hidden" name="run" value="r">' in runs
    lasting = always_html([{"entry": "<e>:443", "by": "a", "channel": "web", "at": "t"}], csrf="k")
    assert "<e>" not in lasting and 'name="run"' not in lasting  # an always entry is revoked for every run


def test_runs_and_the_tail_escape_what_they_show() -> None:
    runs = runs_html([{"id": "<r>", "task": "<t>", "command": "<c>", "allow": ["<a>"], "approved": [], "denied": []}])
    assert "<r>" not in runs and "<t>" not in runs and "&lt;c&gt;" in runs and "&lt;a&gt;" in runs
    lists = runs_html([{"id": "r", "allow": ["A1"], "approved": ["P1"], "denied": ["D1"], "deny": ["X1"]}])
    at = [lists.index(f"<code>{v}</code>") for v in ("A1", "P1", "D1", "X1")]
    assert at == sorted(at)  # the columns' order: Allowed, Approved, Denied, Deny entries
    row = tail_row({"ts": 0.5, "run": "r", "host": "<h>.test", "decision": "deny", "reason": "denied", "port": 443})
    assert row["ts"] == "1970-01-01T00:00:00.500000Z"
    assert "&lt;h&gt;.test" in tail_html([row]) and "<h>" not in tail_html([row])


def test_the_page_holds_no_inline_script_or_style() -> None:
    session = Session(name="<n>", scope=Scope("run-1"), csrf="tok", created=0.0, seen=0.0)
    html = page_html(session=session, approvals=[], runs=[], tail=[], now=0.0, flash="<f>")
    assert "<script>" not in html and "<style" not in html and " style=" not in html and " on" not in html.lower()
    assert '<script src="app.js" defer></script>' in html
    assert "&lt;n&gt; · run run-1" in html and "&lt;f&gt;" in html and "<f>" not in html


BIDI = "safe\u202egpj.exe\u200b\u3164"


def test_the_runs_table_and_the_tail_escape_bidi_and_invisible_characters_as_the_card_does() -> None:
    row = run_row({"id": "r", "task": BIDI, "command": BIDI, "allow": [BIDI], "approved": [BIDI], "denied": []})
    html = runs_html([row])
    for text in (html, str(row)):
        assert "\u202e" not in text and "\u200b" not in text and "\u3164" not in text
    assert html.count("safe\\u202egpj.exe\\u200b\\u3164") == 4
    tail = tail_row({"ts": 0.0, "run": BIDI, "host": "x.test", "kind": "connect", "reason": BIDI, "port": 443})
    assert "\u202e" not in tail_html([tail]) and tail["reason"] == "safe\\u202egpj.exe\\u200b\\u3164"


def test_a_run_session_is_never_offered_always() -> None:
    from egressd.approvals.interface import ApprovalScope

    approval = pending("c", "t")
    offered = replace(approval, scopes=(ApprovalScope.ONCE, ApprovalScope.RUN, ApprovalScope.ALWAYS))
    assert approval_event(offered, Scope(None))["scopes"] == ["once", "run", "always"]
    assert approval_event(offered, Scope("<run>"))["scopes"] == ["once", "run"]
    assert 'value="always"' not in approval_html(approval_event(offered, Scope("<run>")), csrf="c", now=0.0)


def test_countdown_says_minutes_and_seconds() -> None:
    assert countdown(605.9) == "expires in 10:05"
    assert countdown(0.4) == "expired"


def test_the_sign_in_page_says_where_the_global_token_is_when_egressd_wrote_it() -> None:
    from egressd.approvals.webview import signin_html

    shown = signin_html(token_file="/home/alice/.local/state/egressd/control.token")
    assert "<code>/home/alice/.local/state/egressd/control.token</code>" in shown
    assert "control.token" not in signin_html()  # a token given on the command line: no file to name
    assert "&lt;b&gt;" in signin_html(token_file="/tmp/<b>.token")  # a path is text, never markup
