"""The approvals page in a real browser: Debian's chromium, headless, driven by Selenium through chromedriver.

Nothing is downloaded: the browser and the driver are the system's
(``/usr/bin/chromium``, ``/usr/bin/chromedriver``; apt ``chromium
chromium-driver``), the driver's path is given so Selenium Manager never
runs, and ``SE_OFFLINE`` forbids it anyway. Missing, the test skips with the
reason, and fails under CI. Screenshots go to ``$EGRESSD_TEST_ARTIFACTS``
(default ``test-artifacts/`` in the checkout).

Selenium is blocking: its calls run in a thread while this test's event
loop serves egressd.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Listener
from tests.harness import have, require, wait_until
from tests.integration.approvals.test_web import (  # noqa: F401  (page_egressd is a fixture)
    HOSTILE_COMMAND,
    HOSTILE_TASK,
    decided,
    held,
    page_egressd,
)
from tests.integration.approvals.webclient import TOKEN

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

    await run(browser.get, base + "/web/")
    await run(lambda: browser.find_element(By.NAME, "token").send_keys(TOKEN))
    await run(lambda: browser.find_element(By.NAME, "name").send_keys("alice"))
    await run(browser.save_screenshot, str(out / "web-01-sign-in.png"))
    await run(lambda: browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click())
    await until(browser, "document.querySelector('.who') && document.querySelector('.who').textContent")
    cookies = await run(browser.get_cookies)
    [session] = [c for c in cookies if c["name"] == "egressd_session"]
    assert session["httpOnly"] and session["sameSite"] == "Strict" and session["path"] == "/web"
    # The event stream is open: the page counts as watched.
    await until(browser, "document.getElementById('status').textContent === 'Live updates: on'")

    task = await held(svc, f"origin.test:{echo_origin.port}")
    approval_id = svc.gate.approver.pending()[0].id  # type: ignore[union-attr]
    # It shows up without a reload (server-sent events), built by the script.
    await until(browser, f"document.getElementById('approval-{approval_id}')")
    await run(browser.save_screenshot, str(out / "web-02-held-approval.png"))

    shown = await run(
        browser.execute_script,
        f"const li = document.getElementById('approval-{approval_id}');"
        "return {command: li.querySelector('.line.command').textContent,"
        " task: li.querySelector('.line.task').textContent,"
        " images: document.querySelectorAll('img').length,"
        " scripts: Array.from(document.scripts).map(s => s.src),"
        " bold: li.querySelectorAll('b, a, script').length,"
        " countdown: li.querySelector('.countdown').textContent};",
    )
    assert shown["command"] == f"Command: curl origin.test {HOSTILE_COMMAND}"
    assert shown["task"] == f"Task: {HOSTILE_TASK}"
    assert shown["images"] == 0 and shown["bold"] == 0  # nothing the sandbox wrote became an element
    assert shown["scripts"] == [base + "/web/app.js"]
    assert shown["countdown"].startswith("expires in ")
    assert await run(no_alert, browser)

    await run(lambda: browser.find_element(By.CSS_SELECTOR, f"#approval-{approval_id} button.allow").click())
    status, _, _, reader, writer = await asyncio.wait_for(task, STEP_S)
    assert status == 200
    writer.write(b"ping")
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    writer.close()
    await until(browser, "document.querySelector('.flash') && document.querySelector('.flash').textContent")
    flash = await run(lambda: browser.find_element(By.CSS_SELECTOR, ".flash").text)
    assert flash == f"Approval {approval_id}: allowed by alice via web."
    await wait_until(lambda: decided(svc))
    [record] = decided(svc)
    assert record["channel"] == "web" and record["by"] == "alice" and record["decision"] == "allow"
    # The egress tail shows the tunnel once it ended.
    await until(browser, "Array.from(document.querySelectorAll('#tail td.host')).some(td => td.textContent === 'origin.test')")
    await run(browser.save_screenshot, str(out / "web-03-allowed.png"))
    assert await run(no_alert, browser)
