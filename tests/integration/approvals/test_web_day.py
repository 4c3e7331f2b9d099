"""The approvals page as a person keeps it open all day (issue 29), in Debian's chromium.

One walk through it: a request held while nobody had the page open (inbox
mode) is there at sign-in; the notification button shows until the browser
has granted notifications; a request that arrives later raises a desktop
notification and, with Sound on, a chime; answering puts the decision in the
history; the run's approval and an *always* entry of the allow file are
revoked from the page (each recorded, each asked again from then on); the
page fits a phone. Screenshots go to the test artifacts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from egressd.config.allowfile import read_allow_file
from tests.conftest import Listener
from tests.harness import open_proxy, wait_until
from tests.integration.approvals import test_web
from tests.integration.approvals.test_web import STEP_S, artifacts, decided, no_alert, run, until
from tests.integration.approvals.webclient import TOKEN

# The fixtures of the page's other tests: a real chromium, an egressd answering through the page.
browser = test_web.browser
page_egressd = test_web.page_egressd

# Counts the page's desktop notifications while passing them on to the browser's own.
NOTIFICATION_SPY = """
const Real = window.Notification;
window.notified = [];
window.Notification = function (title, options) { window.notified.push(title); return new Real(title, options); };
Object.defineProperty(window.Notification, "permission", {get: () => Real.permission});
window.Notification.requestPermission = Real.requestPermission.bind(Real);
"""


async def sign_in(browser: Any, url: str) -> None:
    from selenium.webdriver.common.by import By

    await run(browser.get, url)
    await run(lambda: browser.find_element(By.NAME, "token").send_keys(TOKEN))
    await run(lambda: browser.find_element(By.NAME, "name").send_keys("alice"))
    await run(lambda: browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click())
    await live(browser)


async def live(browser: Any) -> None:
    await until(
        browser,
        "document.getElementById('status') && document.getElementById('status').textContent === 'Live updates: on'",
    )


async def click(browser: Any, selector: str) -> None:
    from selenium.webdriver.common.by import By

    await until(browser, f"document.querySelector({selector!r})")
    await run(lambda: browser.find_element(By.CSS_SELECTOR, selector).click())
    await live(browser)


class Held:
    """A CONNECT held for a person, read with no deadline of its own (a sign-in in chromium may take
    longer than a plain read's 5 s on a busy machine); closed by the test, whatever happens."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []

    async def hold(self, svc: Any, authority: str) -> asyncio.Task[int]:
        reader, writer = await open_proxy(svc)
        self.writers.append(writer)
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        await writer.drain()
        before = len(svc.path.approver.pending())
        task = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        await wait_until(lambda: len(svc.path.approver.pending()) > before or task.done())
        assert not task.done(), "the request was not held"

        async def status() -> int:
            return int((await task).split(b" ", 2)[1])

        return asyncio.ensure_future(status())

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


async def test_a_day_with_the_page_open_inbox_notification_sound_history_revoke_phone(
    browser: Any, page_egressd: Callable[..., Any], echo_origin: Listener, tmp_path: Path
) -> None:
    allow_file = tmp_path / "allow.toml"
    allow_file.write_text('[[approved]]\nentry = "kept.test:443"\nat = "2026-12-01T00:00:00Z"\nby = "carol"\n'
                          'channel = "slack"\n')  # fmt: skip
    allow_file.chmod(0o600)
    svc = await page_egressd(allow_file=allow_file, inbox=True)
    run_ = svc.default_run
    assert run_ is not None
    run_.command = "pip install -r requirements.txt"
    run_.task = "Package the report tool and run its tests"
    base = svc.control_address
    page = base + svc.web_channel.prefix + "/"
    out = artifacts()
    connections = Held()
    try:
        await walk(browser, svc, echo_origin, allow_file, page, out, connections)
    finally:
        connections.close()


async def walk(browser: Any, svc: Any, echo_origin: Listener, allow_file: Path, page: str, out: Path,
               connections: Held) -> None:
    base = svc.control_address
    run_ = svc.default_run

    # Inbox: held while nobody had the page open, shown at sign-in; the tab's title counts it.
    first = await connections.hold(svc, f"origin.test:{echo_origin.port}")
    first_id = svc.path.approver.pending()[0].id  # type: ignore[union-attr]
    await sign_in(browser, page)
    await until(browser, f"document.getElementById('approval-{first_id}')")
    card = await run(
        browser.execute_script,
        f"const li = document.getElementById('approval-{first_id}');"
        "return {title: document.title, site: li.querySelector('.domain .site').textContent,"
        " fields: Array.from(li.querySelectorAll('dt')).map(d => d.textContent),"
        " client: li.querySelector('.field.client').textContent,"
        " history: document.getElementById('history-table').hidden,"
        " notify: !document.getElementById('notify').hidden};",
    )
    assert card["history"]  # no decision yet: the page says so, no empty table
    assert card["title"] == "(1) egressd approvals" and card["site"] == "origin.test", card
    assert card["fields"] == ["Domain", "Command", "Task", "Allowed domains", "Run", "Client", "Held since"]
    assert card["client"].startswith("127.0.0.1:")
    assert card["notify"]  # notifications not granted yet: the page offers to ask, once
    await run(browser.save_screenshot, str(out / "web-day-01-inbox.png"))
    await click(browser, f"#approval-{first_id} button[value='allow']")
    assert await asyncio.wait_for(first, STEP_S) == 200

    # Notifications granted (as the browser records a person's yes), Sound on: the next request is announced.
    await run(browser.execute_cdp_cmd, "Browser.grantPermissions", {"origin": base, "permissions": ["notifications"]})
    await run(browser.get, page)
    await live(browser)
    assert await run(browser.execute_script, "return document.getElementById('notify').hidden;")
    await run(browser.execute_script, NOTIFICATION_SPY)
    await run(lambda: browser.find_element("id", "sound").click())
    second = await connections.hold(svc, f"second.test:{echo_origin.port}")
    pending = svc.path.approver.pending()  # type: ignore[union-attr]
    second_id = next(a.id for a in pending if a.request.host == "second.test")
    await until(browser, f"document.getElementById('approval-{second_id}')")
    said = await run(browser.execute_script, "return {notified: notified, chimes: document.body.dataset.chimes};")
    assert said["notified"] == [f"egressd: second.test:{echo_origin.port} is waiting for an answer"], said
    assert said["chimes"] == "1", said
    await run(browser.save_screenshot, str(out / "web-day-02-notified.png"))
    await click(browser, f"#approval-{second_id} button[value='deny']")
    assert await asyncio.wait_for(second, STEP_S) == 403

    # The history: newest first, who and how.
    await until(browser, "document.querySelectorAll('#history tr').length === 2")
    history = await run(
        browser.execute_script,
        "return Array.from(document.querySelectorAll('#history tr')).map(r => [r.querySelector('.domain')"
        ".textContent, r.querySelector('.text').textContent]);",
    )
    assert history == [
        [f"second.test:{echo_origin.port}", "denied by alice via web"],
        [f"origin.test:{echo_origin.port}", "allowed by alice via web"],
    ], history
    assert await run(browser.execute_script, "return document.getElementById('sound').checked;")  # remembered
    assert not await run(browser.execute_script, "return document.getElementById('history-table').hidden;")

    # Revoke the run's approval from the runs table: recorded with who, asked again from the next request.
    assert "origin.test" in run_.approved
    await click(browser, "#runs form.revoke input[name=entry][value='origin.test'] ~ button")
    flash = await run(browser.execute_script, "return document.querySelector('.flash').textContent;")
    assert flash == "Revoked origin.test in run default: asked again from its next request.", flash
    assert "origin.test" not in run_.approved
    changed = [r for r in svc.audit_records if r["event"] == "run.changed"]  # type: ignore[attr-defined]
    assert changed[-1]["revoked"] == ["origin.test"] and "alice" in changed[-1]["auth"]

    # Revoke the allow file's always entry: appended to the file, gone from the section.
    await run(browser.save_screenshot, str(out / "web-day-03-history-and-revoke.png"))
    await click(browser, "#always form.revoke button")
    await until(browser, "document.querySelector('#always .none')")
    held_file = read_allow_file(allow_file)
    assert held_file.standing == () and [(r.entry, r.by, r.channel) for r in held_file.revoked] == [
        ("kept.test:443", "alice", "web")
    ]
    changed = [r for r in svc.audit_records if r["event"] == "run.changed"]  # type: ignore[attr-defined]
    assert changed[-1]["always_revoked"] == ["kept.test:443"] and changed[-1]["run"] is None
    assert len(decided(svc)) == 2

    # A phone: nothing runs off the side.
    await run(browser.set_window_size, 390, 844)
    wide = await run(browser.execute_script, "return document.documentElement.scrollWidth;")
    await run(browser.save_screenshot, str(out / "web-day-04-phone.png"))
    await run(browser.set_window_size, 1280, 1400)
    assert wide <= 390, wide
    assert await run(no_alert, browser)
