"""Nothing from the sandbox reaches the terminal raw, and nothing can paint over an approval prompt.

The attacker is the command in the sandbox: its output is relayed to the
terminal the approval prompt is drawn on. The screen is read back through
pyte, a terminal emulator, from a real pseudo-terminal.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import unicodedata
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyte
import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.commandoutput import MAX_HELD_OUTPUT, TerminalOutput
from egressd.approvals.prompt import prompt_line
from egressd.approvals.terminal import TerminalChannel
from egressd.audit.log import MemoryAuditSink
from egressd.names.shown import TerminalText, escape, is_invisible
from egressd.vocabulary.reasons import Answer
from tests.fakes.dockerbed import ORIGIN_NAME, ORIGIN_PORT
from tests.harness import ORIGIN_RANGE, connect_status, free_port, have, require, serve_ports, wait_until
from tests.integration.approvals.test_broker import Clock, request
from tests.integration.sandbox.test_docker import engine, make_bed  # noqa: F401 - the Docker test bed, as fixtures

EGRESSD = str(Path(sys.executable).with_name("egressd"))

# What a hostile command prints: C1 controls (raw and UTF-8) and a bidi override, a
# cleared screen, a prompt of its own, a scroll region, a window title, cursor moves,
# and then hidden, black-on-black, reversed text for whatever is drawn next.
ATTACK = (
    b"\x9b2J\xc2\x9bH\xe2\x80\xae"
    b"\x1b[2J\x1b[HDomain: pypi.org:443\n"
    b"allow or deny pypi.org:443? [9:59 left; Enter = deny] > "
    b"\x1b[3;4r\x1b]0;egressd\x07\x1b[5;1H\x08\x08\r"
    b"\x1b[8m\x1b[30;40m\x1b[7m"
)


# -- the escaper: pure ----------------------------------------------------------------------------


def relayed(*chunks: bytes) -> str:
    text = TerminalText()
    return "".join(text.feed(chunk) for chunk in chunks) + text.end()


def invisible(ch: str) -> bool:
    """Renders nothing a person can see, or controls the terminal (message.py's rule, which covers these categories)."""
    assert is_invisible(ch) or unicodedata.category(ch) not in {"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"}
    return is_invisible(ch)


# Bytes weighted towards what attacks a terminal: ESC, C0, C1 (raw and UTF-8), DEL, bidi overrides, CR.
hostile_bytes = st.lists(
    st.one_of(
        st.binary(max_size=8),
        st.sampled_from([b"\x1b", b"\x1b[", b"\x9b", b"\xc2\x9b", b"\x7f", b"\r", b"\n", b"\t", b"\x08", b"\x00",
                         "\u202e".encode(), "\u200b".encode(), "é".encode(), "中".encode(), "🙂".encode()]),
        st.text(max_size=4).map(str.encode),
    ),
    max_size=40,
).map(b"".join)


@given(hostile_bytes)
def test_relayed_output_never_carries_a_control_or_invisible_character(data: bytes) -> None:
    shown = relayed(data)
    assert not [ch for ch in shown if ch not in "\n\t" and invisible(ch)]
    assert "\x1b" not in shown and "\r" not in shown and "\x7f" not in shown
    assert not [ch for ch in shown if ord(ch) < 0x20 and ch not in "\n\t"]
    assert not [ch for ch in shown if 0x80 <= ord(ch) <= 0x9F]  # C1, CSI (0x9b) among them


@given(hostile_bytes, st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_relayed_output_is_the_same_however_the_reads_split_it(data: bytes, cuts: list[int]) -> None:
    points = sorted({min(c, len(data)) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert relayed(*chunks) == relayed(data)


def test_a_character_split_between_two_reads_stays_a_character() -> None:
    data = "é中🙂 ok".encode()
    for cut in range(len(data) + 1):
        assert relayed(data[:cut], data[cut:]) == "é中🙂 ok"


def test_newline_and_tab_pass_crlf_is_a_newline_and_a_lone_carriage_return_is_escaped() -> None:
    assert relayed(b"a\tb\nc\r\nd") == "a\tb\nc\nd"
    # A lone CR would let the command overwrite the line it is on (its own, or what is drawn there).
    assert relayed(b"rm -rf ~\rls      \n") == "rm -rf ~\\x0dls      \n"
    assert relayed(b"progress\r") == "progress\\x0d"
    assert relayed(b"x\r", b"\ny") == "x\ny"


def test_escape_sequences_bytes_that_are_not_utf8_and_format_characters_show_as_text() -> None:
    assert relayed(b"\x1b[8mhidden") == "\\x1b[8mhidden"
    assert relayed(b"\x9b2J") == "\\x9b2J"  # a raw C1 CSI, not UTF-8: shown as the byte it is
    assert relayed("\u009b2J".encode()) == "\\x9b2J"  # the same CSI, UTF-8 encoded
    assert relayed("abc\u202edef\u200b".encode()) == "abc\\u202edef\\u200b"
    assert relayed(b"\x00\x07\x7f") == "\\x00\\x07\\x7f"


def shown_as(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


@given(st.text())
def test_escape_is_the_per_character_rule_of_the_message(text: str) -> None:
    assert escape(text) == "".join(shown_as(ch) if invisible(ch) else ch for ch in text)
    kept = "".join(shown_as(ch) if invisible(ch) and ch not in "\n\t" else ch for ch in text)
    assert escape(text, keep_layout=True) == kept


def test_the_prompt_line_is_fitted_to_the_width_without_ever_cutting_into_the_domain() -> None:
    def line(columns: int, domain: str = "evil.example:443", typed: str = "allo") -> str:
        return prompt_line(domain=domain, left="9:58", more=", 1 more waiting", typed=typed, columns=columns)

    whole = "allow or deny evil.example:443? [9:58 left, 1 more waiting; Enter = deny] > allo"
    assert line(0) == line(len(whole) + 1) == whole  # width not known, or room enough
    # First the count waiting goes, then the domain, which is shown above.
    assert line(len(whole)) == "allow or deny evil.example:443? [9:58 left; Enter = deny] > allo"
    assert line(60) == "allow or deny? [9:58 left; Enter = deny] > allo"
    assert line(20) == "left; Enter = deny] > allo"[-19:]
    assert line(200, domain="еvil.example:443").startswith("allow or deny? [")  # only ASCII is measured
    assert all(len(line(n)) < n for n in range(2, 120))


# -- holding back: the gate the terminal channel controls ---------------------------------------------


def read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1 << 20)
    except BlockingIOError:
        return b""


def test_output_is_escaped_held_while_a_prompt_is_shown_and_written_in_order_after() -> None:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        screen = TerminalOutput()
        out, err = screen.stream(out_w), screen.stream(err_w)
        out.add(b"one \x1b[2J\n")
        assert read_all(out_r) == b"one \\x1b[2J\n"
        screen.hold()
        out.add(b"two\n")
        err.add(b"three\n")
        out.add(b"four\r")
        out.end()
        assert read_all(out_r) == b"" and read_all(err_r) == b""
        screen.release()
        assert read_all(out_r) == b"two\nfour\\x0d" and read_all(err_r) == b"three\n"
    finally:
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)


def test_output_held_past_its_bound_is_dropped_and_the_drop_is_said() -> None:
    read_fd, write_fd = os.pipe()
    try:
        os.set_blocking(read_fd, False)
        screen = TerminalOutput(max_held=10)
        stream = screen.stream(write_fd)
        screen.hold()
        stream.add(b"0123456789")
        stream.add(b"abcdef")
        screen.release()
        shown = read_all(read_fd)
        assert shown.startswith(b"0123456789") and b"abcdef" not in shown
        assert b"6 bytes of output were dropped while an approval prompt was shown" in shown
        assert MAX_HELD_OUTPUT >= 256 * 1024  # a command's chatter while a person reads stays
    finally:
        os.close(read_fd)
        os.close(write_fd)


# -- the prompt on a real pseudo-terminal, read back through pyte ---------------------------------------


class Screen:
    """A pseudo-terminal of a given size and what a terminal emulator shows of it."""

    def __init__(self, columns: int = 100, rows: int = 40) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.path = os.ttyname(self.slave)
        self.screen = pyte.Screen(columns, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = bytearray()
        os.set_blocking(self.master, False)
        asyncio.get_running_loop().add_reader(self.master, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:
            return
        self.raw += data
        self.stream.feed(data)

    @property
    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def row(self, text: str) -> int:
        """The row on which a line starts with ``text`` (exactly one)."""
        rows = [y for y, line in enumerate(self.lines) if line.startswith(text)]
        assert len(rows) == 1, f"{text!r} starts {len(rows)} lines:\n" + "\n".join(self.lines)
        return rows[0]

    def plain(self, y: int) -> bool:
        """Row ``y`` is drawn in the terminal's own colours, not reversed (bold allowed)."""
        cells = [self.screen.buffer[y][x] for x in range(len(self.lines[y]))]
        return all(c.fg == "default" and c.bg == "default" and not c.reverse for c in cells)

    async def shows(self, text: str, timeout_s: float = 10.0) -> None:
        try:
            await wait_until(lambda: any(text in line for line in self.lines), timeout_s)
        except AssertionError:
            raise AssertionError(f"{text!r} not on screen:\n" + "\n".join(self.lines)) from None

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.master)
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
async def screen() -> AsyncIterator[Screen]:
    terminal = Screen()
    yield terminal
    terminal.close()


async def prompt_on(screen: Screen, output: TerminalOutput | None = None, **kwargs) -> ApprovalBroker:  # type: ignore[no-untyped-def]
    channel = TerminalChannel(tty_path=screen.path, clock=Clock(), who="alice", tick_s=0.02, output=output)
    broker = ApprovalBroker([channel], audit=MemoryAuditSink(), clock=Clock(), **kwargs)
    await broker.start()
    return broker


async def test_each_prompt_redraw_resets_attributes_and_the_scroll_region(screen: Screen) -> None:
    # Whatever wrote to this terminal before (a program that bypassed the relay, a cat of a
    # file) left it hidden, black on black, reversed, with a three-line scroll region.
    os.write(screen.slave, b"\x1b[8m\x1b[30;40m\x1b[7m\x1b[1;3r\x1b(0\x0e")
    broker = await prompt_on(screen)
    held = asyncio.create_task(broker.ask(request()))
    await screen.shows("allow or deny evil.example:443?")
    os.write(screen.slave, b"\x1b[8m\x1b[31;41m\x1b[7m")  # and again, while the prompt is up
    await asyncio.sleep(0.1)  # several redraws (tick 0.02 s)
    assert screen.screen.margins is None  # the whole screen scrolls again
    domain, prompt = screen.row("Domain: evil.example:443"), screen.row("allow or deny evil.example:443?")
    assert screen.plain(domain) and screen.plain(prompt)
    assert screen.screen.buffer[domain][0].bold  # the domain stands out, in the terminal's own colours
    screen.type("deny\r")
    assert (await asyncio.wait_for(held, 5)).answer is Answer.DENY
    await broker.close()


async def test_the_prompt_line_fits_the_terminal_and_keeps_one_line_however_often_it_is_redrawn() -> None:
    screen = Screen(columns=50, rows=30)
    try:
        broker = await prompt_on(screen)
        long_host = "a-rather-long-label-for-the-prompt." * 3 + "example"
        held = asyncio.create_task(broker.ask(request(long_host)))
        await screen.shows("Enter = deny] >")
        screen.type("allo")
        await screen.shows("Enter = deny] > allo")
        await asyncio.sleep(0.1)  # several redraws
        lines = [line for line in screen.lines if "Enter = deny]" in line]
        assert len(lines) == 1 and len(lines[0]) < 50, "\n".join(screen.lines)
        assert "Domain: " + long_host[:40] in "".join(screen.lines)  # the whole domain is above, wrapped
        screen.type("\x15deny\r")
        assert (await asyncio.wait_for(held, 5)).answer is Answer.DENY
        await broker.close()
    finally:
        screen.close()


async def test_relayed_output_waits_while_the_prompt_is_shown(screen: Screen) -> None:
    output = TerminalOutput()
    broker = await prompt_on(screen, output=output)
    stream = output.stream(screen.slave)
    stream.add(b"before the prompt\n")
    await screen.shows("before the prompt")
    held = asyncio.create_task(broker.ask(request()))
    await screen.shows("allow or deny evil.example:443?")
    stream.add(ATTACK)
    await asyncio.sleep(0.1)
    assert not any("pypi.org:443" in line for line in screen.lines)  # held back: the prompt stays as it is
    assert screen.plain(screen.row("allow or deny evil.example:443?"))
    screen.type("deny\r")
    assert (await asyncio.wait_for(held, 5)).answer is Answer.DENY
    await screen.shows("pypi.org:443")  # released after the answer, inert
    assert b"\\x1b[2J\\x1b[HDomain: pypi.org:443" in screen.raw
    assert not any(line.startswith("Domain: pypi.org") for line in screen.lines)
    assert screen.screen.margins is None
    await broker.close()


async def test_log_lines_to_the_prompts_terminal_go_above_the_input_line_escaped(screen: Screen) -> None:
    """A logging handler writing to the same terminal by another descriptor (the pty's path, not /dev/tty)."""
    clock = Clock()
    channel = TerminalChannel(tty_path=screen.path, clock=clock, who="alice", tick_s=0.02)
    with open(screen.path, "w") as stream:  # noqa: ASYNC230 - a pty, written at once
        handler = logging.StreamHandler(stream)
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            broker = ApprovalBroker([channel], audit=MemoryAuditSink(), clock=clock)
            await broker.start()
            held = asyncio.create_task(broker.ask(request()))
            await screen.shows("allow or deny evil.example:443?")
            screen.type("all")
            await screen.shows("Enter = deny] > all")
            for n in range(3):
                logging.getLogger("egressd").warning("log line %d \x1b[2J", n)
                clock.now += 1  # the countdown changes: redrawn at the next tick
                await asyncio.sleep(0.06)
            shown = "\n".join(screen.lines)
            logged = [screen.row(f"log line {n} \\x1b[2J") for n in range(3)]  # whole, escaped
            assert all(screen.lines[y] == f"log line {n} \\x1b[2J" for n, y in enumerate(logged)), shown
            prompt = screen.row("allow or deny evil.example:443?")
            assert logged == sorted(logged) and logged[-1] < prompt, shown
            assert screen.lines[prompt].endswith("Enter = deny] > all") and "9:57 left" in screen.lines[prompt]
            screen.type("\x15deny\r")
            assert (await asyncio.wait_for(held, 5)).answer is Answer.DENY
            await broker.close()
            assert handler.filters == []  # taken off when the channel closed
            logging.getLogger("egressd").warning("after the prompt")
            await screen.shows("after the prompt")
        finally:
            root.removeHandler(handler)


# -- `egressd run` for real: bubblewrap, a held approval, a hostile command ------------------------------


async def test_a_command_in_the_sandbox_cannot_paint_over_the_approval_prompt(
    tmp_path: Path, workdir: Path, dns, http_origin  # type: ignore[no-untyped-def]
) -> None:
    require(os.geteuid() == 0, "egressd run needs root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter", "curl", "setsid"):
        require(have(tool), f"{tool} is not installed")
    (workdir / "attack").write_bytes(ATTACK)
    held_url = f"http://origin.test:{http_origin.port}/held"
    # The command asks for origin.test (held: a prompt appears), waits until the test says the
    # prompt is up, then prints its attack and says it has.
    script = (
        f"curl -sS -m 60 -o /dev/null {held_url} & "
        "while [ ! -e go ]; do sleep 0.05; done; cat attack; cat attack >&2; touch printed; wait"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and "proxy" not in k.lower()}
    env |= {"XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm"}
    screen = Screen(columns=120, rows=50)
    # setsid -c: a session whose controlling terminal is the pty, as in a real shell.
    proc = await asyncio.create_subprocess_exec(
        "setsid", "-c", EGRESSD, "run", "--approver", "terminal", "--upstream-dns", f"127.0.0.1:{dns.address[1]}",
        "--allow-private", ORIGIN_RANGE, "--audit-log", str(tmp_path / "audit.jsonl"), "--workdir", str(workdir),
        "--", "sh", "-c", script,
        stdin=screen.slave, stdout=screen.slave, stderr=screen.slave, env=env,
    )
    try:
        await screen.shows(f"allow or deny origin.test:{http_origin.port}?", timeout_s=60)
        (workdir / "go").touch()
        await wait_until(lambda: (workdir / "printed").exists(), 20)
        await asyncio.sleep(0.5)  # time enough for a relay to pass the attack on
        lines = "\n".join(screen.lines)
        assert "pypi.org" not in lines, lines  # held back while the prompt is shown
        domain = screen.row(f"Domain: origin.test:{http_origin.port}")
        prompt = screen.row(f"allow or deny origin.test:{http_origin.port}?")
        assert screen.plain(domain) and screen.plain(prompt) and screen.screen.buffer[domain][0].bold
        assert screen.screen.margins is None
        screen.type("deny\r")
        await screen.shows("denied for this run")
        await wait_until(lambda: proc.returncode is not None, 30)
        await screen.shows("pypi.org")  # the attack, after the prompt, as inert text
        assert not any(line.startswith("Domain: pypi.org") for line in screen.lines)
        # Its fake prompt line is plain text, below the real prompt's outcome: not over it.
        answered = screen.row(f"origin.test:{http_origin.port}: denied for this run")
        assert all(y > answered for y, line in enumerate(screen.lines) if "pypi.org:443" in line)
        assert b"\\x9b2J\\x9bH\\u202e\\x1b[2J\\x1b[HDomain: pypi.org:443" in screen.raw
        assert b"\\x1b[8m\\x1b[30;40m\\x1b[7m" in screen.raw
        assert screen.screen.margins is None
        assert all(screen.plain(y) for y in range(len(screen.lines)))
        assert http_origin.requests == []  # denied: nothing reached the origin
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
        screen.close()
    assert proc.returncode == 0


# -- the Docker backend: the same relay, the same hold ---------------------------------------------------


async def test_on_docker_a_command_cannot_paint_over_the_prompt_either(
    make_bed: Any, screen: Screen  # noqa: F811 - the fixture imported above
) -> None:
    async with make_bed(approver=["terminal"], allow=[], tty_path=screen.path) as bed:
        session = bed.session
        assert session.relay is not None and session.relay.terminal.output is session.terminal_output
        stream = session.terminal_output.stream(screen.slave)
        (session.workdir / "attack").write_bytes(ATTACK)
        session.set_command("curl origin")
        script = (
            f"curl -sS -m 60 -o /dev/null http://{ORIGIN_NAME}:{ORIGIN_PORT}/held & "
            "while [ ! -e go ]; do sleep 0.05; done; cat attack; cat attack >&2; touch printed; wait"
        )
        run = asyncio.ensure_future(bed.sh(script, capture=False, relay=(stream, stream)))
        try:
            await screen.shows(f"allow or deny {ORIGIN_NAME}:{ORIGIN_PORT}?", timeout_s=60)
            (session.workdir / "go").touch()
            await wait_until(lambda: (session.workdir / "printed").exists(), 20)
            await asyncio.sleep(0.5)  # time enough for a relay to pass the attack on
            assert not any("pypi.org:443" in line for line in screen.lines)  # held back
            domain = screen.row(f"Domain: {ORIGIN_NAME}:{ORIGIN_PORT}")
            assert screen.plain(domain) and screen.plain(screen.row(f"allow or deny {ORIGIN_NAME}:{ORIGIN_PORT}?"))
            screen.type("deny\r")
            obs = await asyncio.wait_for(run, 60)
        finally:
            run.cancel()
        assert obs.exit_code == 0
        await screen.shows("pypi.org:443")  # after the prompt, inert
        assert b"\\x9b2J\\x9bH\\u202e\\x1b[2J\\x1b[HDomain: pypi.org:443" in screen.raw
        assert screen.screen.margins is None  # and all but the prompt's own warning in the terminal's colours:
        assert all(screen.plain(y) for y, line in enumerate(screen.lines) if not line.startswith("Unrelated:"))


# -- `egressd serve` for real: its own log lines while a prompt is up ------------------------------------

LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d egressd DENY  connect blocked\.test:443 run=default reason=denylisted$"
)


async def test_serves_log_lines_go_above_the_prompt_and_no_countdown_redraw_writes_over_one(
    tmp_path: Path, screen: Screen
) -> None:
    """Issue 26 item 10: log lines were printed after the prompt's ``> ``, and each countdown redraw wrote over them.

    ``egressd serve`` on a pty that is its controlling terminal (stderr too, as a
    person runs it), a request held at its prompt, and traffic that logs a line
    at a time, each followed by a countdown redraw (every second): every log
    line stays whole, above the input line, which stays whole below them.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env |= {"XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm"}
    args = [
        EGRESSD, "serve", "--approver", "terminal", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
        "--deny", "blocked.test", "--upstream-dns", f"127.0.0.1:{free_port()}",
        "--audit-log", str(tmp_path / "audit.jsonl"),
    ]  # fmt: skip

    def controlling_terminal() -> None:
        fcntl.ioctl(screen.slave, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(  # noqa: ASYNC220 - preexec_fn (the controlling terminal) needs Popen
        args, stdin=screen.slave, stdout=screen.slave, stderr=screen.slave, env=env,
        start_new_session=True, preexec_fn=controlling_terminal,
    )  # fmt: skip
    try:
        await wait_until(lambda: serve_ports(bytes(screen.raw).decode(errors="replace").replace("\r\n", "\n")), 20)
        ports = serve_ports(bytes(screen.raw).decode(errors="replace").replace("\r\n", "\n"))
        assert ports is not None
        held = asyncio.create_task(connect_status(ports["proxy"], "unlisted.example:443"))
        await screen.shows("allow or deny unlisted.example:443?")
        screen.type("al")  # typed, not yet answered: must stay on the input line
        await screen.shows("Enter = deny] > al")
        for _ in range(3):
            assert await connect_status(ports["proxy"], "blocked.test:443") == 403
            await asyncio.sleep(1.2)  # a countdown redraw (every second) after each log line
        shown = "\n".join(screen.lines)
        logged = [y for y, line in enumerate(screen.lines) if "blocked.test" in line]
        assert len(logged) == 3, shown
        assert all(LOG_LINE.match(screen.lines[y]) for y in logged), shown  # whole: nothing written over them
        prompt = screen.row("allow or deny unlisted.example:443?")
        assert screen.lines[prompt].endswith("Enter = deny] > al"), shown
        assert max(logged) < prompt, shown  # above the input line, which is redrawn below them
        assert all(not line for line in screen.lines[prompt + 1:]), shown
        assert screen.row("Domain: unlisted.example:443") < min(logged)
        screen.type("\x15deny\r")
        assert await asyncio.wait_for(held, 10) == 403
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
