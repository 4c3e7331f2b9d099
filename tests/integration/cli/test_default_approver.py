"""With no --approver, egressd asks at the terminal when a person is at one, and nobody otherwise (DESIGN.md).

``egressd serve`` is started the two ways it is met: on a pseudo-terminal
that is its controlling terminal (a person ran it), and with its stderr in a
file (a sidecar, a service). A CONNECT to a name on no list is then held and
asked about on the terminal (a typed "deny" answers it: 403 ``denied``), or
refused at once as ``no_approver``. Names are refused before any lookup, so
nothing here dials out; the upstream DNS port is one nobody listens on.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from egressd.cli.main import default_approvers, refuse_page_approver
from egressd.config.settings import SettingsError, load_settings
from tests.harness import connect_status, free_port, serve_ports, wait_until

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def test_a_person_at_a_terminal_gets_the_terminal_and_serve_its_page_too() -> None:
    plain = load_settings({})
    assert default_approvers(plain, serve=True, at_terminal=True).approver == ["terminal", "web"]
    assert default_approvers(plain, serve=False, at_terminal=True).approver == ["terminal"]
    unix = load_settings({"control": "unix:/run/egressd/control.sock"})
    assert default_approvers(unix, serve=True, at_terminal=True).approver == ["terminal"]  # no browser reaches it


def test_nobody_at_a_terminal_or_an_approver_named_leaves_the_setting_alone() -> None:
    assert default_approvers(load_settings({}), serve=True, at_terminal=False).approver == []
    named = load_settings({"approver": ["slack"]})
    assert default_approvers(named, serve=True, at_terminal=True).approver == ["slack"]


def test_run_and_agent_refuse_the_page_unless_another_egressd_decides() -> None:
    web = load_settings({"approver": ["terminal", "web"]})
    with pytest.raises(SettingsError, match="egressd run serves no approvals page"):
        refuse_page_approver(web, "run", connected=False)
    refuse_page_approver(web, "agent", connected=True)  # --connect: the egressd it connects to has the page
    refuse_page_approver(load_settings({"approver": ["terminal"]}), "run", connected=False)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    return env | {"XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "dumb"}


def _args(tmp_path: Path) -> list[str]:
    return [
        EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
        "--upstream-dns", f"127.0.0.1:{free_port()}", "--audit-log", str(tmp_path / "audit.jsonl"),
    ]  # fmt: skip


class Terminal:
    """A pseudo-terminal egressd runs on as its controlling terminal; ``text`` is what it drew."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        self.text = ""
        os.set_blocking(self.master, False)
        asyncio.get_running_loop().add_reader(self.master, self._read)

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            self.text += os.read(self.master, 65536).decode("utf-8", "replace")

    def take_as_controlling_terminal(self) -> None:
        """In the child, after setsid: this terminal becomes its controlling terminal."""
        fcntl.ioctl(self.slave, termios.TIOCSCTTY, 0)

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.master)
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
async def terminal() -> AsyncIterator[Terminal]:
    pty = Terminal()
    yield pty
    pty.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_serve_started_by_a_person_asks_at_their_terminal_and_shows_the_page(
    tmp_path: Path, terminal: Terminal
) -> None:
    proc = subprocess.Popen(  # noqa: ASYNC220 - preexec_fn (the controlling terminal) needs Popen
        _args(tmp_path),
        stdin=terminal.slave, stdout=terminal.slave, stderr=terminal.slave, env=_env(tmp_path),
        start_new_session=True, preexec_fn=terminal.take_as_controlling_terminal,
    )  # fmt: skip
    try:
        await wait_until(lambda: serve_ports(terminal.text.replace("\r\n", "\n")) is not None, 20)
        ports = serve_ports(terminal.text.replace("\r\n", "\n"))
        assert ports is not None
        # The page lives under a random path of its own, printed with its address.
        assert re.search(rf"approvals page: http://127\.0\.0\.1:{ports['control']}/web/[\w-]{{22}}/ ", terminal.text)
        asked = asyncio.create_task(connect_status(ports["proxy"], "unlisted.example:443"))
        await wait_until(lambda: "unlisted.example" in terminal.text and "deny" in terminal.text, 20)
        terminal.type("deny\r")
        assert await asked == 403
    finally:
        _stop(proc)
    records = [line for line in (tmp_path / "audit.jsonl").read_text().splitlines() if '"approval.decided"' in line]
    assert len(records) == 1 and '"channel":"terminal"' in records[0].replace(" ", "")


async def test_serve_with_its_stderr_in_a_file_asks_nobody(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    with stderr.open("wb") as err:
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, as its sibling test starts it
            _args(tmp_path), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=_env(tmp_path)
        )
    try:
        await wait_until(lambda: serve_ports(stderr.read_text(errors="replace")) is not None, 20)
        ports = serve_ports(stderr.read_text(errors="replace"))
        assert ports is not None
        assert await connect_status(ports["proxy"], "unlisted.example:443") == 403
        assert "approvals page" not in stderr.read_text(errors="replace")
    finally:
        _stop(proc)
    text = (tmp_path / "audit.jsonl").read_text()
    assert '"reason":"no_approver"' in text.replace(" ", "") and "approval.decided" not in text
