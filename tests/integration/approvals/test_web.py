"""The approvals page (``--approver web``) over real sockets: sign-in, cookie, CSRF, Host, CSP, events, escaping.

Each test starts an egressd whose approver is a broker over a ``WebChannel``
(its clock one the test can move), talks to the page as a browser would
(``PageClient``: a cookie jar, an ``Origin`` header) and holds requests with
real CONNECTs through the proxy. The last test does it all again in a
real chromium.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import Channel, Choice
from egressd.approvals.web import CSP, WebChannel
from egressd.audit.log import MemoryAuditSink
from egressd.cli.wiring.service import EgressService
from egressd.config.allowfile import read_allow_file
from egressd.config.settings import load_settings
from tests.conftest import Listener, MakeEgressd
from tests.fakes.dns import FakeDns
from tests.harness import ORIGIN_RANGE, connect_via, egress, have, require, wait_until
from tests.integration.approvals.test_broker import RecordingChannel
from tests.integration.approvals.webclient import TOKEN, EventReader, PageClient

HOSTILE_COMMAND = 'curl x <script>alert(1)</script> "><img src=x onerror=alert(2)>'
HOSTILE_TASK = "<b>bold</b> & <a href=javascript:alert(3)>click</a>"
LOOKALIKE = "раураl.com"  # Cyrillic р а у а р а, then a Latin l
LOOKALIKE_ACE = "xn--l-7sba6dbr.com"


class Clock:
    """Real time, plus what a test adds to it."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture
async def page_egressd(make_egressd: MakeEgressd) -> AsyncIterator[Callable[..., Any]]:
    """``await page_egressd(...)``: an egressd answering through the page; ``svc.web_clock`` moves sessions' time."""
    brokers: list[ApprovalBroker] = []

    async def make(
        *,
        grace_s: float = 30.0,
        timeout_s: float = 30.0,
        public_url: str | None = None,
        others: Sequence[Channel] = (),
        allow_file: Path | None = None,
        inbox: bool = False,
        **values: Any,
    ) -> EgressService:
        sink = MemoryAuditSink()
        clock = Clock()
        channel = WebChannel(clock=clock, presence_grace_s=grace_s, keepalive_s=0.2, public_url=public_url, inbox=inbox)
        broker = ApprovalBroker([channel, *others], audit=sink, timeout_s=timeout_s, allow_file=allow_file)
        await broker.start()
        brokers.append(broker)
        if allow_file is not None:
            values["allow_file"] = str(allow_file)  # the service lists and revokes its always entries
        svc = await make_egressd(approver=broker, audit=sink, **values)
        svc.web_clock = clock  # type: ignore[attr-defined]
        svc.web_channel = channel  # type: ignore[attr-defined]
        return svc

    yield make
    for broker in brokers:
        await broker.close()


@contextlib.asynccontextmanager
async def events(page: PageClient) -> AsyncIterator[EventReader]:
    async with page.http.get(page.url("events")) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        reader = EventReader(resp)
        await reader.until("ready")
        yield reader


def decided(svc: EgressService) -> list[dict[str, Any]]:
    return [r for r in svc.audit_records if r["event"] == "approval.decided"]  # type: ignore[attr-defined]


def pending(svc: EgressService) -> list[Any]:
    return list(svc.path.approver.pending())  # type: ignore[union-attr]


async def held(svc: EgressService, authority: str, extra: str = "") -> asyncio.Task[Any]:
    task = asyncio.create_task(connect_via(svc, authority, extra))
    await wait_until(lambda: pending(svc) or task.done())
    assert not task.done(), "the request was not held"
    return task


# -- sign-in and the session cookie ---------------------------------------------------------


async def test_a_wrong_token_is_refused_and_gets_no_cookie(page_egressd: Callable[..., Any]) -> None:
    svc = await page_egressd()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        status, headers, text = await page.post("signin", {"token": "not-the-token", "name": "mallory"})
        assert status == 401 and "Set-Cookie" not in headers and "not a control token" in text
        status, _, text = await page.get()
        assert status == 200 and 'name="token"' in text and page.csrf is None  # still the sign-in form
        status, _, _ = await page.get("events")
        assert status == 204  # no session: no stream


async def test_sign_in_sets_strict_http_only_cookies_scoped_to_the_page(page_egressd: Callable[..., Any]) -> None:
    svc = await page_egressd()
    prefix = svc.web_channel.prefix
    async with PageClient(svc.control_address, prefix) as page:
        status, headers, _ = await page.post("signin", {"token": TOKEN, "name": "alice"})
        assert status == 303 and headers["Location"] == prefix + "/"
        cookies = {c.split("=", 1)[0]: c for c in headers.getall("Set-Cookie")}
        assert set(cookies) == {"egressd_session", "egressd_key"}
        for cookie in cookies.values():
            attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
            assert {"httponly", "path", "samesite"} <= attributes
            assert "SameSite=Strict" in cookie and f"Path={prefix}" in cookie
            assert "secure" not in attributes  # plain http on loopback; Secure when the page is reached over https
            value = re.match(r"egressd_\w+=([^;]+)", cookie)
            assert value is not None and len(value.group(1)) >= 43  # 32 random bytes, base64url
            assert TOKEN not in cookie
        status, _, text = await page.get()
        assert status == 200 and "signed in as alice" in text and page.csrf
        # The id alone is no session: the key, scoped to the page's path, is needed too.
        page.http.cookie_jar.clear(lambda morsel: morsel.key == "egressd_key")
        status, _, text = await page.get()
        assert status == 200 and "signed in as" not in text


async def test_failed_sign_ins_are_limited_even_before_the_right_token(page_egressd: Callable[..., Any]) -> None:
    svc = await page_egressd()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        for _ in range(5):
            status, _, _ = await page.post("signin", {"token": "guess"})
            assert status == 401
        status, headers, _ = await page.post("signin", {"token": TOKEN})
        assert status == 429 and "Set-Cookie" not in headers
        svc.web_clock.offset += 61  # type: ignore[attr-defined]
        status, _, _ = await page.post("signin", {"token": TOKEN})
        assert status == 303


async def test_a_session_expires_when_unused_and_sign_out_ends_it(page_egressd: Callable[..., Any]) -> None:
    svc = await page_egressd()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        await page.sign_in()
        old_csrf = page.csrf
        svc.web_clock.offset += 3601  # type: ignore[attr-defined]
        status, _, text = await page.get()
        assert 'name="token"' in text and "signed in as" not in text
        status, _, _ = await page.post("signout", {"csrf": old_csrf or ""})
        assert status == 403
        await page.sign_in()
        status, headers, _ = await page.post("signout", {"csrf": page.csrf or ""})
        assert status == 303 and "egressd_session=" in headers["Set-Cookie"]
        page.csrf = None
        status, _, text = await page.get()
        assert 'name="token"' in text


async def test_a_run_token_signs_in_to_its_own_run_only(
    page_egressd: Callable[..., Any], echo_origin: Listener
) -> None:
    svc = await page_egressd()
    async with aiohttp.ClientSession(trust_env=False) as http:
        async with http.post(
            svc.control_address + "/runs", json={"task": "run b"}, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:
            created = await resp.json()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        await page.sign_in(token=created["control_token"], name="bob")
        _, _, text = await page.get()
        assert f"run {created['id']}" in text and 'data-run="default"' not in text
        async with events(page):
            # The default run's approval: not this session's to see; nobody else is watching, so nobody is asked.
            status, _, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
            writer.close()
            assert status == 403 and egress(svc)[-1]["reason"] == "no_approver"


# -- the Host, Origin and CSRF checks ---------------------------------------------------------


async def test_a_revoke_without_the_pages_token_or_beyond_the_sessions_run_is_refused_and_takes_nothing_back(
    page_egressd: Callable[..., Any], tmp_path: Path
) -> None:
    """Issue 29's revoke: a form another page could post, or a run's session reaching past its run."""
    allow_file = tmp_path / "allow.toml"
    allow_file.write_text('[[approved]]\nentry = "kept.test:443"\nat = "2026-12-01T00:00:00Z"\n')
    allow_file.chmod(0o600)
    svc = await page_egressd(allow_file=allow_file)
    run_ = svc.default_run
    assert run_ is not None
    run_.approved["origin.test"] = frozenset({443})
    before = allow_file.read_text()
    async with aiohttp.ClientSession(trust_env=False) as http:
        async with http.post(
            svc.control_address + "/runs", json={"task": "run b"}, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:
            created = await resp.json()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as operator, \
            PageClient(svc.control_address, svc.web_channel.prefix) as bob:  # fmt: skip
        await operator.sign_in()
        await bob.sign_in(token=created["control_token"], name="bob")
        assert operator.csrf is not None and bob.csrf is not None
        attempts = [
            (operator, {"entry": "origin.test", "run": "default"}, {}),  # no CSRF token: another page's form
            (operator, {"csrf": operator.csrf, "entry": "origin.test", "run": "default"},
             {"origin": "http://evil.test"}),  # another origin
            (bob, {"csrf": bob.csrf, "entry": "origin.test", "run": "default"}, {}),  # another run's approval
            (bob, {"csrf": bob.csrf, "entry": "kept.test:443"}, {}),  # an always entry: every run's
        ]  # fmt: skip
        for page, form, more in attempts:
            status, _, _ = await page.post("revoke", form, **more)
            assert status == 403, (form, more)
        assert run_.approved.get("origin.test") == frozenset({443}) and allow_file.read_text() == before
        assert not [r for r in svc.audit_records if r["event"] == "run.changed"]  # type: ignore[attr-defined]
        # The operator's own page, with its token: taken back.
        status, _, _ = await operator.post("revoke", {"csrf": operator.csrf, "entry": "origin.test", "run": "default"})
        assert status == 303 and "origin.test" not in run_.approved


async def test_a_host_header_of_another_name_is_refused(page_egressd: Callable[..., Any]) -> None:
    svc = await page_egressd()
    port = svc.control_address.rsplit(":", 1)[1]
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        for host in (f"rebound.attacker.test:{port}", f"127.0.0.1:{int(port) + 1}", "localhost", ""):
            status, headers, _ = await page.get(headers={"Host": host})
            assert status in (421, 400), host
            status, headers, _ = await page.post(
                "signin", {"token": TOKEN}, headers={"Host": host}, origin=f"http://{host}"
            )
            assert status in (421, 400) and "Set-Cookie" not in headers, host
        status, headers, _ = await page.get(headers={"Host": f"localhost:{port}"})
        assert status == 200


async def test_every_response_carries_the_strict_headers(page_egressd: Callable[..., Any]) -> None:
    svc = await page_egressd()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        for path, headers in (
            ("", {}),
            ("app.js", {}),
            ("style.css", {}),
            ("", {"Host": "x.test"}),
        ):
            _, got, _ = await page.get(path, headers=headers)
            assert got["Content-Security-Policy"] == CSP
            assert "default-src 'none'" in CSP and "script-src 'self'" in CSP and "frame-ancestors 'none'" in CSP
            assert got["X-Content-Type-Options"] == "nosniff"
            # same-origin, not no-referrer: under no-referrer a browser posts the page's own forms with Origin: null.
            assert got["Referrer-Policy"] == "same-origin"
        _, _, text = await page.get()
        assert "<script>" not in text and "style=" not in text and "<style" not in text  # nothing inline


async def test_an_answer_without_its_csrf_token_or_origin_is_refused_and_nothing_answered(
    page_egressd: Callable[..., Any], echo_origin: Listener
) -> None:
    svc = await page_egressd()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        await page.sign_in()
        async with events(page):
            task = await held(svc, f"origin.test:{echo_origin.port}")
            approval_id = pending(svc)[0].id
            attempts = [
                ({"id": approval_id, "decision": "allow"}, ""),
                ({"id": approval_id, "decision": "allow", "csrf": "x" * 43}, ""),
                ({"id": approval_id, "decision": "allow", "csrf": page.csrf or ""}, "http://attacker.test"),
                ({"id": approval_id, "decision": "allow", "csrf": page.csrf or ""}, "null"),
                ({"id": approval_id, "decision": "allow", "csrf": page.csrf or ""}, None),
            ]
            for form, origin in attempts:
                status, _, _ = await page.post("answer", form, origin=origin)
                assert status == 403, (form, origin)
            # Another browser with no session, holding the token it saw: refused too.
            async with PageClient(svc.control_address, svc.web_channel.prefix) as stranger:
                status, _, _ = await stranger.post("answer", attempts[2][0])
                assert status == 403
            # Nothing decides by a GET, whatever it carries.
            query = f"answer?id={approval_id}&decision=allow&csrf={page.csrf}"
            status, _, _ = await page.get(query)
            assert status == 405
            await asyncio.sleep(0.1)
            assert [a.id for a in pending(svc)] == [approval_id] and not decided(svc) and not task.done()
            assert echo_origin.connections == 0
            status, headers, _ = await page.answer(approval_id, "deny")
            assert status == 303
            status, _, _, _, writer = await task
            writer.close()
            assert status == 403
            [record] = decided(svc)
            assert record["decision"] == "deny" and record["channel"] == "web" and record["by"] == "alice"
            assert echo_origin.connections == 0


# -- attached, live events ------------------------------------------------------------------------


async def test_the_event_stream_delivers_a_new_approval_and_its_settlement(
    page_egressd: Callable[..., Any], echo_origin: Listener
) -> None:
    svc = await page_egressd()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        await page.sign_in()
        async with events(page) as stream:
            task = await held(svc, f"origin.test:{echo_origin.port}")
            shown = await stream.until("approval")
            assert shown["id"] == pending(svc)[0].id and shown["run"] == "default"
            assert shown["domain"] == ["", "origin.test", f":{echo_origin.port}"]
            fields = {kind: text for kind, _, text in shown["fields"]}
            assert fields["run"] == "default" and fields["client"].startswith("127.0.0.1:")  # who is asking
            assert shown["expires_at"] > time.time()
            async with aiohttp.ClientSession(trust_env=False) as http:
                async with http.post(
                    f"{svc.control_address}/approvals/{shown['id']}/deny", headers={"Authorization": f"Bearer {TOKEN}"}
                ) as resp:
                    assert resp.status == 200
            settled = await stream.until("settled")
            assert settled == {"id": shown["id"], "text": "denied by cli via control"}
            # The history gets the decision: who, when, how.
            row = await stream.until("decided")
            assert (row["domain"], row["text"], row["allowed"]) == (
                f"origin.test:{echo_origin.port}", "denied by cli via control", False)
            status, _, _, _, writer = await task
            writer.close()
            # The refusal's egress record may come before the settlement (the gate writes it as it wakes).
            rows = [data for event, data in stream.seen if event == "egress"] or [await stream.until("egress")]
            row = rows[0]
            assert row["host"] == "origin.test" and row["decision"] == "deny" and row["run"] == "default"


async def test_an_approval_held_by_another_channel_shows_and_is_marked_when_settled_there(
    page_egressd: Callable[..., Any], echo_origin: Listener
) -> None:
    terminal = RecordingChannel("terminal")
    svc = await page_egressd(grace_s=0.0, others=[terminal])
    task = await held(svc, f"origin.test:{echo_origin.port}")  # nobody has the page open: the terminal holds it
    await wait_until(lambda: terminal.delivered)
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        await page.sign_in()
        async with page.http.get(page.url("events")) as resp:
            stream = EventReader(resp)
            shown = await stream.until("approval")  # the page shows every waiting approval of its scope
            assert shown["id"] == terminal.delivered[0].id
            await stream.until("ready")
            terminal.answer(Choice.ALLOW, by="bob")
            settled = await stream.until("settled")
            assert settled["id"] == shown["id"] and "no longer waiting" in settled["text"]
    status, _, _, _, writer = await task
    writer.close()
    assert status == 200 and decided(svc)[0]["channel"] == "terminal"


async def test_behind_an_https_public_url_the_cookie_is_secure_and_the_origin_is_https(
    page_egressd: Callable[..., Any],
) -> None:
    svc = await page_egressd(public_url="https://egressd.example.test/")
    host = {"Host": "egressd.example.test"}
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        status, _, _ = await page.post("signin", {"token": TOKEN}, headers=host)
        assert status == 403  # the Origin a browser there sends is https://egressd.example.test
        status, headers, _ = await page.post(
            "signin", {"token": TOKEN}, headers=host, origin="https://egressd.example.test"
        )
        assert status == 303
        cookies = {c.split("=", 1)[0]: c for c in headers.getall("Set-Cookie")}
        # __Host-: Secure, this host only, Path=/ (the prefix demands it); the key stays on the page's path.
        assert set(cookies) == {"__Host-egressd_session", "__Secure-egressd_key"}
        host_cookie = cookies["__Host-egressd_session"]
        assert "Path=/;" in host_cookie + ";" and "Domain" not in host_cookie
        assert f"Path={svc.web_channel.prefix}" in cookies["__Secure-egressd_key"]
        for cookie in cookies.values():
            assert "secure" in {part.strip().lower() for part in cookie.split(";")}


async def test_nobody_with_the_page_open_means_no_approver(
    page_egressd: Callable[..., Any], echo_origin: Listener
) -> None:
    svc = await page_egressd(grace_s=0.0)
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        status, _, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        writer.close()
        assert status == 403 and egress(svc)[-1]["reason"] == "no_approver"
        await page.sign_in()  # signed in, but no page open: nobody is watching
        status, _, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        writer.close()
        assert status == 403 and egress(svc)[-1]["reason"] == "no_approver"
        assert echo_origin.connections == 0


def _web_alone(tmp_path: Any, dns: FakeDns, **more: Any) -> Any:
    return load_settings(
        {
            "listen": "127.0.0.1:0",
            "control": "127.0.0.1:0",
            "control_token": TOKEN,
            "upstream_dns": f"{dns.address[0]}:{dns.address[1]}",
            "allow_private": [ORIGIN_RANGE],
            "audit_log": str(tmp_path / "audit.jsonl"),
            "log_level": "info",
            "approver": ["web"],
            **more,
        }
    )


async def test_web_alone_is_an_inbox_a_request_waits_for_whoever_opens_the_page(
    tmp_path: Any, dns: FakeDns, echo_origin: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29: with --approver web alone and nobody signed in, a new domain was refused at once."""
    svc = EgressService(_web_alone(tmp_path, dns, approval_timeout=30), audit=MemoryAuditSink())
    with caplog.at_level("INFO", logger="egressd"):
        await svc.start()
    try:
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("approvals page:")]
        assert said and "an inbox: a new domain is held up to 30s for whoever opens it" in said[0], said
        task = await held(svc, f"origin.test:{echo_origin.port}")  # nobody has the page open: held all the same
        [page_path] = [r.path for r in svc.path.approver.routes() if r.page]  # type: ignore[union-attr]
        async with PageClient(svc.control_address, page_path.rstrip("/")) as page:
            await page.sign_in()
            async with events(page):  # the page opened later shows what waits, and answers it
                await page.answer(pending(svc)[0].id, "allow")
                status, _, _, _, writer = await task
                writer.close()
                assert status == 200
    finally:
        await svc.close(grace_s=0)


async def test_web_from_settings_with_no_inbox_refuses_as_no_approver_until_someone_watches(
    tmp_path: Any, dns: FakeDns, echo_origin: Listener
) -> None:
    settings = _web_alone(tmp_path, dns, log_level="warning", web_inbox=False)
    svc = EgressService(settings, audit=MemoryAuditSink())
    await svc.start()
    try:
        status, _, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        writer.close()
        assert status == 403
        [page_path] = [r.path for r in svc.path.approver.routes() if r.page]  # type: ignore[union-attr]
        async with PageClient(svc.control_address, page_path.rstrip("/")) as page:
            await page.sign_in()
            async with events(page):
                task = await held(svc, f"origin.test:{echo_origin.port}")
                await page.answer(pending(svc)[0].id, "allow")
                status, _, _, _, writer = await task
                writer.close()
                assert status == 200
    finally:
        await svc.close(grace_s=0)


# -- hostile values ---------------------------------------------------------------------------------


async def test_hostile_commands_tasks_and_look_alike_names_are_shown_as_text(
    page_egressd: Callable[..., Any],
) -> None:
    svc = await page_egressd()
    run = svc.default_run
    assert run is not None
    run.command = HOSTILE_COMMAND
    run.task = HOSTILE_TASK
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        await page.sign_in(name='<img src=x onerror=alert("name")>')
        async with events(page) as stream:
            task = await held(svc, f"{LOOKALIKE_ACE}:443")
            shown = await stream.until("approval")
            fields = {kind: text for kind, _, text in shown["fields"]}
            assert fields["command"] == HOSTILE_COMMAND and fields["task"] == HOSTILE_TASK  # raw: textContent only
            _, _, text = await page.get()
        for raw in ("<script>alert", "<img src=x", "<b>bold", "<a href=javascript", 'onerror=alert("name'):
            assert raw not in text, raw
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
        assert "&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in text
        assert "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;a href=javascript:alert(3)&gt;click&lt;/a&gt;" in text
        assert f'<strong class="site">{LOOKALIKE_ACE}</strong>' in text and '<span class="badge idn">' in text
        assert f"(shown as {LOOKALIKE}; registered domain {LOOKALIKE_ACE})</dd>" in text  # beside its punycode
        assert '<span class="badge unrelated">' in text and "Unrelated: this domain" in text
        assert "signed in as &lt;img src=x onerror=alert(&quot;name&quot;)&gt;" in text
        status, _, _ = await page.answer(shown["id"], "deny")
        assert status == 303
        status, _, _, _, writer = await task
        writer.close()
        assert status == 403


# -- end to end through the proxy ------------------------------------------------------------------


async def test_a_held_connect_allowed_on_the_page_tunnels_and_is_recorded_as_web(
    page_egressd: Callable[..., Any], echo_origin: Listener
) -> None:
    svc = await page_egressd()
    async with PageClient(svc.control_address, svc.web_channel.prefix) as page:
        await page.sign_in(name="alice")
        async with events(page) as stream:
            task = await held(svc, f"origin.test:{echo_origin.port}")
            shown = await stream.until("approval")
            await asyncio.sleep(0.1)
            assert echo_origin.connections == 0
            status, headers, _ = await page.answer(shown["id"], "allow")
            assert status == 303 and headers["Location"] == svc.web_channel.prefix + "/"
            status, _, _, reader, writer = await task
            assert status == 200
            writer.write(b"ping")
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
            writer.close()
            assert (await stream.until("settled"))["text"] == "allowed by alice via web"
            _, _, text = await page.get()
            assert f"origin.test:{echo_origin.port} (approval {shown['id']}): allowed by alice via web." in text
            # A second answer hears it was settled; nothing changes.
            await page.answer(shown["id"], "deny")
            _, _, text = await page.get()
            assert "was already settled: allowed by alice via web" in text
    [record] = decided(svc)
    assert record["id"] == shown["id"] and record["decision"] == "allow"
    assert record["channel"] == "web" and record["by"] == "alice"
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["approval"]["channel"] == "web"


# -- in a real browser -------------------------------------------------------------------------------
#
# Debian's chromium, headless, driven by Selenium through chromedriver. Nothing
# is downloaded: the browser and the driver are the system's (apt chromium
# chromium-driver), the driver's path is given so Selenium Manager never runs,
# and SE_OFFLINE forbids it anyway. Missing, the test skips with the reason, and
# fails under CI. Screenshots go to $EGRESSD_TEST_ARTIFACTS (default
# test-artifacts/ in the checkout). Selenium blocks: its calls run in a thread
# while this test's event loop serves egressd.

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHECKOUT = Path(__file__).resolve().parents[3]
# A step of the browser's (a page load, an element showing up) gets this long.
STEP_S = 15.0


def artifacts() -> Path:
    path = Path(os.environ.get("EGRESSD_TEST_ARTIFACTS") or CHECKOUT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        require(False, "selenium is not installed (pip install -e '.[test]')")
        raise
    require(
        have("chromium") and have("chromedriver") and Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(),
        f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium "
        "chromium-driver",
    )
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must never fetch a browser or a driver
    profile = tempfile.mkdtemp(prefix="egressd-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # tests run as root; chromium's own sandbox refuses root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1400",
        f"--user-data-dir={profile}",
        "--no-proxy-server",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(STEP_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


async def run(call: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(call, *args)


async def until(driver: Any, script: str, timeout_s: float = STEP_S) -> Any:
    """Poll a JavaScript expression in the page until it is truthy (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await run(driver.execute_script, f"return ({script});")
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"the page never showed: {script}")
        await asyncio.sleep(0.1)


def no_alert(driver: Any) -> bool:
    from selenium.common.exceptions import NoAlertPresentException

    try:
        driver.switch_to.alert.text  # noqa: B018
    except NoAlertPresentException:
        return True
    return False


async def test_the_page_in_chromium_shows_a_hostile_request_as_text_and_allows_it(
    browser: Any, page_egressd: Callable[..., Any], echo_origin: Listener
) -> None:
    from selenium.webdriver.common.by import By

    svc = await page_egressd()
    run_ = svc.default_run
    assert run_ is not None
    run_.command = f"curl origin.test {HOSTILE_COMMAND}"
    run_.task = HOSTILE_TASK
    out = artifacts()
    base = svc.control_address

    await run(browser.get, base + svc.web_channel.prefix + "/")
    await run(lambda: browser.find_element(By.NAME, "token").send_keys(TOKEN))
    await run(lambda: browser.find_element(By.NAME, "name").send_keys("alice"))
    await run(browser.save_screenshot, str(out / "web-01-sign-in.png"))
    await run(lambda: browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click())
    await until(browser, "document.querySelector('.who') && document.querySelector('.who').textContent")
    cookies = await run(browser.get_cookies)
    named = {c["name"]: c for c in cookies}
    for name in ("egressd_session", "egressd_key"):
        assert named[name]["httpOnly"] and named[name]["sameSite"] == "Strict"
        assert named[name]["path"] == svc.web_channel.prefix
    # The event stream is open: the page counts as watched.
    await until(browser, "document.getElementById('status').textContent === 'Live updates: on'")

    task = await held(svc, f"origin.test:{echo_origin.port}")
    approval_id = svc.path.approver.pending()[0].id  # type: ignore[union-attr]
    # It shows up without a reload (server-sent events), built by the script.
    await until(browser, f"document.getElementById('approval-{approval_id}')")
    await run(browser.save_screenshot, str(out / "web-02-held-approval.png"))

    shown = await run(
        browser.execute_script,
        f"const li = document.getElementById('approval-{approval_id}');"
        "return {command: li.querySelector('.field.command').textContent,"
        " task: li.querySelector('.field.task').textContent,"
        " images: document.querySelectorAll('img').length,"
        " scripts: Array.from(document.scripts).map(s => s.src),"
        " bold: li.querySelectorAll('b, a, script').length,"
        " countdown: li.querySelector('.countdown').textContent};",
    )
    assert shown["command"] == f"curl origin.test {HOSTILE_COMMAND}"
    assert shown["task"] == HOSTILE_TASK
    assert shown["images"] == 0 and shown["bold"] == 0  # nothing the sandbox wrote became an element
    assert shown["scripts"] == [base + svc.web_channel.prefix + "/app.js"]
    assert shown["countdown"].startswith("expires in ")
    assert await run(no_alert, browser)

    await run(lambda: browser.find_element(By.CSS_SELECTOR, f"#approval-{approval_id} button[value='allow']").click())
    status, _, _, reader, writer = await asyncio.wait_for(task, STEP_S)
    assert status == 200
    writer.write(b"ping")
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    writer.close()
    await until(browser, "document.querySelector('.flash') && document.querySelector('.flash').textContent")
    flash = await run(lambda: browser.find_element(By.CSS_SELECTOR, ".flash").text)
    assert flash == f"origin.test:{echo_origin.port} (approval {approval_id}): allowed by alice via web."
    await wait_until(lambda: decided(svc))
    [record] = decided(svc)
    assert record["channel"] == "web" and record["by"] == "alice" and record["decision"] == "allow"
    # The egress tail shows the tunnel once it ended.
    await until(
        browser, "Array.from(document.querySelectorAll('#tail td.host')).some(t => t.textContent == 'origin.test')"
    )
    await run(browser.save_screenshot, str(out / "web-03-allowed.png"))
    assert await run(no_alert, browser)


async def test_the_page_offers_every_scope_with_an_allow_file_and_always_appends_to_it(
    browser: Any, page_egressd: Callable[..., Any], echo_origin: Listener, tmp_path: Path
) -> None:
    """A plain request, as README's screenshot shows it (docs/images/approvals-page.png comes from here)."""
    from selenium.webdriver.common.by import By

    allow_file = tmp_path / "allow.toml"
    svc = await page_egressd(allow_file=allow_file)
    run_ = svc.default_run
    assert run_ is not None
    run_.command = "pip install -r requirements.txt"
    run_.task = "Package the report tool and run its tests"
    base = svc.control_address
    await run(browser.get, base + svc.web_channel.prefix + "/")
    await run(lambda: browser.find_element(By.NAME, "token").send_keys(TOKEN))
    await run(lambda: browser.find_element(By.NAME, "name").send_keys("alice"))
    await run(lambda: browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click())
    # The signed-in page may not have loaded yet: its status element first, then its text.
    await until(
        browser,
        "document.getElementById('status') && document.getElementById('status').textContent === 'Live updates: on'",
    )

    task = await held(svc, f"origin.test:{echo_origin.port}")
    approval_id = svc.path.approver.pending()[0].id  # type: ignore[union-attr]
    await until(browser, f"document.getElementById('approval-{approval_id}')")
    labels = await run(
        browser.execute_script,
        f"return Array.from(document.querySelectorAll('#approval-{approval_id} button')).map(b => b.textContent);",
    )
    assert labels == ["Allow once", "Allow for this run", "Allow always", "Deny"]
    # Issue 29: the tab's title counts what waits; Allow always looks like the risky choice it is.
    looks = await run(
        browser.execute_script,
        f"return {{title: document.title, risky: document.querySelector('#approval-{approval_id} "
        "button[value=always]').className, notify: !!document.getElementById('notify')};",
    )
    assert looks["title"].startswith("(1) ") and "risky" in looks["risky"] and looks["notify"], looks
    await run(browser.save_screenshot, str(artifacts() / "web-approvals-page.png"))
    # At a phone's width nothing runs off the side of the screen.
    await run(browser.set_window_size, 390, 844)
    wide = await run(browser.execute_script, "return document.documentElement.scrollWidth;")
    await run(browser.save_screenshot, str(artifacts() / "web-approvals-page-phone.png"))
    await run(browser.set_window_size, 1280, 1400)
    assert wide <= 390, wide

    await run(lambda: browser.find_element(By.CSS_SELECTOR, f"#approval-{approval_id} button[value='always']").click())
    status, _, _, _, writer = await asyncio.wait_for(task, STEP_S)
    assert status == 200
    writer.close()
    await wait_until(lambda: decided(svc))
    [record] = decided(svc)
    assert (record["channel"], record["scope"], record["entry"]) == ("web", "always", f"origin.test:{echo_origin.port}")
    [kept] = read_allow_file(allow_file).approved
    assert (kept.entry, kept.by, kept.channel) == (f"origin.test:{echo_origin.port}", "alice", "web")
