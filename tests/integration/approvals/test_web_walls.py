"""The approvals page's walls against its neighbours: other ports of the host, run tokens, floods of sign-ins.

Attacks, each over real sockets (and the first in a real chromium):

- a page on another port of the same host, opened by the signed-in
  approver, reaches for the session: cookies are not isolated by port and
  such a page is same-site, so its server must never receive the session
  cookie (the page lives under a random path the cookie is scoped to) and
  its script's requests carrying the cookie must change nothing (Origin,
  Sec-Fetch-Site, and the session's own CSRF token);
- a run's own token signs in and asks for *always* (it outlives the run:
  refused, and no button offers it);
- failed sign-ins from many addresses, sign-ins with a run token, and event
  streams by the dozen must not lock out or evict the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.conftest import Listener
from tests.harness import NET
from tests.integration.approvals.test_web import (
    STEP_S,
    browser,  # noqa: F401  # the fixture
    decided,
    events,
    held,
    page_egressd,  # noqa: F401  # the fixture
    pending,
    run,
    until,
)
from tests.integration.approvals.webclient import TOKEN, PageClient


def prefix_of(svc: Any) -> str:
    """The page's own path (``/web/<random>``) of this egressd."""
    return str(svc.web_channel.prefix)


@contextlib.asynccontextmanager
async def hostile_server(handler: Callable[[web.Request], Any]) -> AsyncIterator[str]:
    """Another server on the same host (127.0.0.1, a port of the kernel's): its base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


# The other port's page: its script reads the approvals page with the browser's cookies and answers
# *always*, every way a script can (fetch, a form posted into a frame), at the path it guesses (/web)
# and at the real one (an attacker who learned the URL); then says it is done in its title.
HOSTILE_PAGE = """<!doctype html><html><head><title>cat pictures</title></head><body><script>
(async () => {
  const base = BASE, id = ID, log = [];
  for (const p of PREFIXES) {
    try {
      const r = await fetch(base + p + "/", {credentials: "include"});
      log.push("read " + p + " " + r.status + " " + /name="csrf"/.test(await r.text()));
    } catch (e) { log.push("read " + p + " refused"); }
    try {
      await fetch(base + p + "/", {credentials: "include", mode: "no-cors"});
      const form = new URLSearchParams({id: id, decision: "always", csrf: "guess"});
      await fetch(base + p + "/answer", {method: "POST", credentials: "include", mode: "no-cors", body: form});
      log.push("posted " + p);
    } catch (e) { log.push("post " + p + " failed"); }
  }
  const frame = document.createElement("iframe");
  frame.name = "sink";
  document.body.appendChild(frame);
  const form = document.createElement("form");
  form.method = "post"; form.target = "sink"; form.action = base + PREFIXES[PREFIXES.length - 1] + "/answer";
  for (const [k, v] of [["id", id], ["decision", "always"], ["csrf", "guess"]]) {
    const input = document.createElement("input"); input.name = k; input.value = v; form.appendChild(input);
  }
  document.body.appendChild(form);
  await new Promise(done => { frame.onload = done; form.submit(); setTimeout(done, 3000); });
  document.body.dataset.log = JSON.stringify(log);
  document.title = "done";
})();
</script></body></html>"""


async def test_a_page_on_another_port_cannot_use_the_approvers_session_in_chromium(
    browser: Any,  # noqa: F811
    page_egressd: Callable[..., Any],  # noqa: F811
    echo_origin: Listener,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    allow_file = tmp_path / "allow.toml"
    svc = await page_egressd(allow_file=allow_file)
    base, prefix = svc.control_address, prefix_of(svc)
    await run(browser.get, base + prefix + "/")
    await run(lambda: browser.find_element(By.NAME, "token").send_keys(TOKEN))
    await run(lambda: browser.find_element(By.NAME, "name").send_keys("alice"))
    await run(lambda: browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click())
    await until(
        browser,
        "document.getElementById('status') && document.getElementById('status').textContent === 'Live updates: on'",
    )
    task = await held(svc, f"origin.test:{echo_origin.port}")
    approval_id = pending(svc)[0].id
    await until(browser, f"document.getElementById('approval-{approval_id}')")

    cookies_seen: list[str] = []
    replayed: list[int] = []

    async def other_port(request: web.Request) -> web.Response:
        cookie = request.headers.get("Cookie", "")
        cookies_seen.append(cookie)
        if "egressd" in cookie:
            # The server side of the attack: the cookie it was sent, replayed with any headers it likes.
            async with aiohttp.ClientSession(trust_env=False) as http:
                sent = {"Cookie": cookie, "Origin": base}
                for path in ("/web", prefix):
                    async with http.get(base + path + "/", headers=sent) as resp:
                        found = re.search(r'name="csrf" content="([^"]+)"', await resp.text())
                    if found:
                        form = {"id": approval_id, "decision": "always", "csrf": found.group(1)}
                        async with http.post(
                            base + path + "/answer", data=form, headers=sent, allow_redirects=False
                        ) as resp:
                            replayed.append(resp.status)
        text = (
            HOSTILE_PAGE.replace("BASE", json.dumps(base))
            .replace("ID", json.dumps(approval_id))
            .replace("PREFIXES", json.dumps(["/web", prefix]))
        )
        return web.Response(text=text, content_type="text/html")

    async with hostile_server(other_port) as hostile:
        await run(browser.get, hostile + "/web/")  # the approver follows a link to a local page
        await until(browser, "document.title === 'done'", timeout_s=STEP_S)
        log = json.loads(await run(browser.execute_script, "return document.body.dataset.log;"))
    await asyncio.sleep(0.2)
    assert cookies_seen and not [c for c in cookies_seen if "egressd" in c], cookies_seen
    assert not replayed
    assert log and not [line for line in log if line.endswith(" true")], log  # never read a CSRF token
    assert [a.id for a in pending(svc)] == [approval_id] and not task.done()
    assert not decided(svc) and not allow_file.exists()
    assert echo_origin.connections == 0
    # The approver's own page still answers.
    await run(lambda: browser.get(base + prefix + "/"))
    await until(browser, f"document.querySelector('#approval-{approval_id} button[value=deny]')")
    await run(lambda: browser.find_element(By.CSS_SELECTOR, f"#approval-{approval_id} button[value=deny]").click())
    status, _, _, _, writer = await asyncio.wait_for(task, STEP_S)
    writer.close()
    assert status == 403
    [record] = decided(svc)
    by_page = ("deny", "alice", 'page session "alice" (global token)')
    assert (record["decision"], record["by"], record["auth"]) == by_page


async def test_a_cookie_alone_gets_no_csrf_token_from_another_site_nor_answers(
    page_egressd: Callable[..., Any],  # noqa: F811
    echo_origin: Listener,
) -> None:
    """Requests carrying the session cookie but sent by another origin's page (Sec-Fetch-Site, Origin)."""
    svc = await page_egressd()
    prefix = prefix_of(svc)
    async with PageClient(svc.control_address, prefix) as page:
        await page.sign_in()
        csrf = page.csrf
        assert csrf
        async with events(page):
            task = await held(svc, f"origin.test:{echo_origin.port}")
            approval_id = pending(svc)[0].id
            for site in ("same-site", "cross-site"):
                status, _, text = await page.get(headers={"Sec-Fetch-Site": site})
                assert status == 403 and csrf not in text and 'name="csrf"' not in text, site
                async with page.http.get(page.url("events"), headers={"Sec-Fetch-Site": site}) as resp:
                    assert resp.status == 403, site
                form = {"csrf": csrf, "id": approval_id, "decision": "allow"}
                status, _, _ = await page.post("answer", form, headers={"Sec-Fetch-Site": site})
                assert status == 403, site
            other = "http://127.0.0.1:1"
            status, _, text = await page.get(headers={"Origin": other})
            assert status == 403 and csrf not in text
            await asyncio.sleep(0.05)
            assert [a.id for a in pending(svc)] == [approval_id] and not decided(svc)
            # The page's own requests still work: a typed address ("none"), its own script ("same-origin").
            for site in ("none", "same-origin"):
                status, _, text = await page.get(headers={"Sec-Fetch-Site": site})
                assert status == 200 and csrf in text, site
            status, _, _ = await page.answer(approval_id, "deny", headers={"Sec-Fetch-Site": "same-origin"})
            assert status == 303
            status, _, _, _, writer = await task
            writer.close()
            assert status == 403 and echo_origin.connections == 0


async def test_nothing_answers_at_the_old_path_and_the_cookie_is_scoped_to_the_random_one(
    page_egressd: Callable[..., Any],  # noqa: F811
) -> None:
    first, second = await page_egressd(), await page_egressd()
    assert prefix_of(first) != prefix_of(second)
    prefix = prefix_of(first)
    assert re.fullmatch(r"/web/[A-Za-z0-9_-]{22,}", prefix)
    async with PageClient(first.control_address, prefix) as page:
        status, headers, _ = await page.post("signin", {"token": TOKEN, "name": "alice"})
        assert status == 303 and headers["Location"] == prefix + "/"
        cookies = headers.getall("Set-Cookie")
        assert cookies and all(f"Path={prefix};" in c or c.endswith(f"Path={prefix}") for c in cookies), cookies
        for path in ("/web/", "/web/signin", "/"):
            async with page.http.get(first.control_address + path, allow_redirects=False) as resp:
                assert resp.status in (401, 404), path
                assert prefix not in await resp.text()


# -- run tokens on the page (item: always needs the global token) ---------------------------------------


async def create_run(svc: Any) -> dict[str, Any]:
    async with aiohttp.ClientSession(trust_env=False) as http:
        async with http.post(
            svc.control_address + "/runs", json={"task": "run b"}, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:
            assert resp.status == 201
            created: dict[str, Any] = await resp.json()
            return created


async def test_a_run_session_is_never_offered_always_and_its_always_is_refused(
    page_egressd: Callable[..., Any],  # noqa: F811
    echo_origin: Listener,
    tmp_path: Path,
) -> None:
    import base64

    allow_file = tmp_path / "allow.toml"
    svc = await page_egressd(allow_file=allow_file)
    created = await create_run(svc)
    async with PageClient(svc.control_address, prefix_of(svc)) as page:
        await page.sign_in(token=created["control_token"], name="alice (operator)")
        async with events(page) as stream:
            creds = base64.b64encode(f"{created['id']}:{created['token']}".encode()).decode()
            task = await held(svc, f"origin.test:{echo_origin.port}", f"Proxy-Authorization: Basic {creds}\r\n")
            shown = await stream.until("approval")
            assert "always" not in shown["scopes"], shown
            _, _, text = await page.get()
            assert 'value="always"' not in text and "Allow always" not in text
            status, _, text = await page.answer(shown["id"], "always")
            assert status == 403, text
            await asyncio.sleep(0.05)
            assert [a.id for a in pending(svc)] == [shown["id"]] and not decided(svc) and not allow_file.exists()
            status, _, _ = await page.answer(shown["id"], "allow")
            assert status == 303
            status, _, _, _, writer = await task
            writer.close()
            assert status == 200
    [record] = decided(svc)
    assert record["by"] == "alice (operator)" and record["scope"] == "run"
    assert record["auth"] == f'page session "alice (operator)" (run token of {created["id"]})'


async def test_a_global_page_session_answers_always_and_is_recorded_as_such(
    page_egressd: Callable[..., Any],  # noqa: F811
    echo_origin: Listener,
    tmp_path: Path,
) -> None:
    allow_file = tmp_path / "allow.toml"
    svc = await page_egressd(allow_file=allow_file)
    async with PageClient(svc.control_address, prefix_of(svc)) as page:
        await page.sign_in(name="alice")
        async with events(page) as stream:
            task = await held(svc, f"origin.test:{echo_origin.port}")
            shown = await stream.until("approval")
            assert "always" in shown["scopes"]
            status, _, _ = await page.answer(shown["id"], "always")
            assert status == 303
            status, _, _, _, writer = await task
            writer.close()
    [record] = decided(svc)
    assert record["scope"] == "always" and record["auth"] == 'page session "alice" (global token)'


# -- floods: sign-ins, sessions, streams (item: no lock-out, no eviction) ----------------------------------


async def test_failed_sign_ins_from_many_addresses_do_not_lock_out_the_operator(
    page_egressd: Callable[..., Any],  # noqa: F811
) -> None:
    svc = await page_egressd()
    prefix = prefix_of(svc)
    attackers = [str(NET[100 + i]) for i in range(10)]
    for address in attackers:
        async with PageClient(svc.control_address, prefix, local_address=address) as page:
            for _ in range(5):
                status, _, _ = await page.post("signin", {"token": "guess"})
                assert status == 401
            status, _, _ = await page.post("signin", {"token": TOKEN})
            assert status == 429  # this address is limited
    async with PageClient(svc.control_address, prefix, local_address=str(NET[120])) as operator:
        status, headers, _ = await operator.post("signin", {"token": TOKEN, "name": "op"})
        assert status == 303 and "Set-Cookie" in headers
        status, _, text = await operator.get()
        assert status == 200 and "signed in as op" in text


async def test_run_token_sign_ins_evict_neither_the_operators_sessions_nor_their_streams(
    page_egressd: Callable[..., Any],  # noqa: F811
) -> None:
    svc = await page_egressd()
    prefix = prefix_of(svc)
    created = await create_run(svc)
    async with (
        PageClient(svc.control_address, prefix) as idle_operator,
        PageClient(svc.control_address, prefix) as watching_operator,
    ):
        await idle_operator.sign_in(name="op-idle")
        await watching_operator.sign_in(name="op-watching")
        async with events(watching_operator) as stream:
            refused = 0
            for _ in range(70):
                async with PageClient(svc.control_address, prefix) as flood:
                    status, _, _ = await flood.post("signin", {"token": created["control_token"], "name": "x"})
                    assert status in (303, 429, 503)
                    refused += status != 303
            for page, name in ((idle_operator, "op-idle"), (watching_operator, "op-watching")):
                status, _, text = await page.get()
                assert status == 200 and f"signed in as {name}" in text, name
            # The stream is still served: a change to the runs reaches it.
            await create_run(svc)
            await stream.until("runs")


async def test_streams_are_capped_per_session_so_one_cannot_starve_the_operator(
    page_egressd: Callable[..., Any],  # noqa: F811
) -> None:
    svc = await page_egressd()
    prefix = prefix_of(svc)
    created = await create_run(svc)
    async with (
        PageClient(svc.control_address, prefix) as hog,
        PageClient(svc.control_address, prefix) as operator,
        contextlib.AsyncExitStack() as open_streams,
    ):
        await hog.sign_in(token=created["control_token"], name="hog")
        statuses = []
        for _ in range(40):
            resp = await open_streams.enter_async_context(hog.http.get(hog.url("events")))
            statuses.append(resp.status)
        assert 503 in statuses and statuses.count(200) < 40
        await operator.sign_in(name="op")
        async with events(operator):
            pass  # served: the hog's streams are its own session's
