"""The terminal channel in a real pseudo-terminal: the test reads the screen and types the answer."""

from __future__ import annotations

import asyncio
import os
import termios
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import ChannelUnavailable, Choice
from egressd.approvals.prompt import countdown
from egressd.approvals.terminal import TerminalChannel
from egressd.audit.log import MemoryAuditSink
from egressd.vocabulary.reasons import Answer
from tests.fakes.terminal import Pty
from tests.harness import wait_until
from tests.integration.approvals.test_broker import Clock, RecordingChannel, request


@pytest.fixture
async def pty() -> AsyncIterator[Pty]:
    terminal = Pty()
    yield terminal
    terminal.close()


async def terminal_broker(
    pty: Pty, *others: RecordingChannel, clock: Clock | None = None, **kwargs
) -> tuple[ApprovalBroker, TerminalChannel]:  # type: ignore[no-untyped-def]
    clock = clock or Clock()
    channel = TerminalChannel(tty_path=pty.path, clock=clock, who="alice", tick_s=kwargs.pop("tick_s", 1.0))
    broker = ApprovalBroker([channel, *others], audit=MemoryAuditSink(), clock=clock, **kwargs)
    await broker.start()
    return broker, channel


async def test_no_controlling_terminal_means_the_channel_is_not_attached(tmp_path: Path) -> None:
    with pytest.raises(ChannelUnavailable, match="no controlling terminal"):
        await TerminalChannel(tty_path=str(tmp_path / "no-such-tty")).start(RecordingChannel().answerer)  # type: ignore[arg-type]
    plain = tmp_path / "file"
    plain.write_text("")
    with pytest.raises(ChannelUnavailable, match="not a terminal"):
        await TerminalChannel(tty_path=str(plain)).start(RecordingChannel().answerer)  # type: ignore[arg-type]
    broker = ApprovalBroker([TerminalChannel(tty_path=str(tmp_path / "no-such-tty"))], audit=MemoryAuditSink())
    await broker.start()
    assert broker.attached == ()
    assert (await broker.ask(request())).answer is Answer.NO_APPROVER
    await broker.close()


async def test_typing_allow_at_the_prompt_allows(pty: Pty) -> None:
    broker, _ = await terminal_broker(pty)
    held = asyncio.create_task(broker.ask(request()))
    await pty.shows("allow or deny evil.example:443?")
    assert "\x1b[1mDomain: evil.example:443" in pty.output  # the domain stands out
    assert "\x1b[1;33mUnrelated:" in pty.output  # and so does the warning
    assert "Command: curl evil" in pty.output and "Task: build" in pty.output
    assert not pty.lflag() & termios.ICANON  # key by key while the prompt is up
    pty.type("allow")
    await pty.shows("> allow")  # echoed by the channel itself
    pty.type("\r")
    outcome = await asyncio.wait_for(held, 5)
    assert outcome.allowed and outcome.channel == "terminal" and outcome.by == "alice"
    await pty.shows("evil.example:443: allowed for this run")
    await wait_until(lambda: pty.lflag() & termios.ICANON)  # modes restored once nothing waits
    await broker.close()


async def test_the_answer_ends_its_line_before_the_log_says_allowed(pty: Pty) -> None:
    # Issue 16: "> allow2026-12-01T04:27:18 egressd ALLOWED": the log line ran into the typed answer.
    import logging

    class ToTheTerminal(logging.Handler):  # the log shares the terminal, as egressd's stderr does
        def emit(self, record: logging.LogRecord) -> None:
            os.write(pty.slave, f"LOG {record.getMessage()}\n".encode())

    handler = ToTheTerminal(logging.INFO)
    logger = logging.getLogger("egressd.approvals")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        broker, _ = await terminal_broker(pty)
        held = asyncio.create_task(broker.ask(request()))
        await pty.shows("allow or deny evil.example:443?")
        pty.type("allow\r")
        assert (await asyncio.wait_for(held, 5)).allowed
        await pty.shows("evil.example:443: allowed for this run")
        await pty.shows("LOG ALLOWED")
        typed = pty.output.rindex("> allow")
        between = pty.output[typed + len("> allow") : pty.output.index("LOG ALLOWED")]
        assert between.strip("\r") == "\n", repr(pty.output[typed:])  # the line ends, and nothing else
        await broker.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


async def test_a_bare_enter_denies(pty: Pty) -> None:
    broker, _ = await terminal_broker(pty)
    held = asyncio.create_task(broker.ask(request()))
    await pty.shows("Enter = deny] > ")
    pty.type("\r")
    outcome = await asyncio.wait_for(held, 5)
    assert outcome.answer is Answer.DENY and outcome.by == "alice"
    await pty.shows("denied for this run")
    await broker.close()


async def test_input_typed_before_the_prompt_appeared_is_thrown_away(pty: Pty) -> None:
    broker, _ = await terminal_broker(pty)
    pty.type("allow\r")
    await pty.shows("allow")  # the line discipline has it (echoed): typed ahead
    held = asyncio.create_task(broker.ask(request()))
    await pty.shows("Enter = deny] > ")
    await asyncio.sleep(0.1)
    assert not held.done()  # the early "allow" did not answer
    pty.type("deny\r")
    assert (await asyncio.wait_for(held, 5)).answer is Answer.DENY
    await broker.close()


async def test_unknown_words_and_arrow_keys_ask_again(pty: Pty) -> None:
    broker, _ = await terminal_broker(pty)
    held = asyncio.create_task(broker.ask(request()))
    await pty.shows("Enter = deny] > ")
    pty.type("\x1b[Ayes\r")
    await pty.shows("type allow or deny")
    assert not held.done()
    pty.type("allox\x7fw\r")  # backspace works
    assert (await asyncio.wait_for(held, 5)).allowed
    await broker.close()


async def test_several_requests_are_queued_and_shown_one_after_another(pty: Pty) -> None:
    broker, _ = await terminal_broker(pty)
    first = asyncio.create_task(broker.ask(request("one.example")))
    await pty.shows("allow or deny one.example:443?")
    second = asyncio.create_task(broker.ask(request("two.example")))
    await pty.shows("1 more waiting")
    assert "Domain: two.example" not in pty.output
    pty.type("deny\r")
    await pty.shows("allow or deny two.example:443?")
    pty.type("allow\r")
    assert (await first).answer is Answer.DENY
    assert (await second).allowed
    await broker.close()


async def test_an_approval_settled_elsewhere_is_withdrawn_from_the_prompt_and_the_queue(pty: Pty) -> None:
    other = RecordingChannel("slack")
    broker, _ = await terminal_broker(pty, other)
    first = asyncio.create_task(broker.ask(request("one.example")))
    second = asyncio.create_task(broker.ask(request("two.example")))
    third = asyncio.create_task(broker.ask(request("three.example")))
    await pty.shows("2 more waiting")
    await wait_until(lambda: len(other.delivered) == 3)
    other.answer(Choice.ALLOW, by="@bob (U2)", index=0)  # the one on screen
    await pty.shows("one.example:443: allowed by @bob (U2) via slack")
    await pty.shows("allow or deny two.example:443? ")
    other.answer(Choice.DENY, by="@bob (U2)", index=2)  # the one still queued
    await wait_until(lambda: third.done())
    await pty.shows("Enter = deny] > ")
    pty.type("allow\r")
    assert (await first).allowed and (await second).allowed and (await third).answer is Answer.DENY
    assert "Domain: three.example" not in pty.output
    await broker.close()


async def test_the_agent_cannot_repaint_the_terminal(pty: Pty) -> None:
    broker, _ = await terminal_broker(pty)
    hostile = request()
    hostile = type(hostile)(
        run_id="r-1",
        host="evil.example",
        port=443,
        command="curl evil\x1b[2J\x1b[1;1H\rallow or deny pypi.org:443?",
        task="\u202etask\x07",
        allowed=(),
    )
    held = asyncio.create_task(broker.ask(hostile))
    await pty.shows("Enter = deny] > ")
    assert "\x1b[2J" not in pty.output and "\x07" not in pty.output and "\u202e" not in pty.output
    assert "curl evil\\x1b[2J\\x1b[1;1H\\x0dallow or deny pypi.org:443?" in pty.output
    pty.type("\r")
    await held
    await broker.close()


async def test_the_countdown_shows_the_time_left(pty: Pty) -> None:
    clock = Clock()
    broker, _ = await terminal_broker(pty, clock=clock, tick_s=0.02)
    held = asyncio.create_task(broker.ask(request()))
    await pty.shows("[10:00 left; Enter = deny]")
    clock.now += 62
    await pty.shows(" 8:58\x1b[")  # only the countdown is redrawn, in place, as wide as "10:00" was
    assert pty.output.count("allow or deny") == 1
    pty.type("\r")
    await held
    await broker.close()
    assert countdown(3725) == "1:02:05" and countdown(-3) == "0:00" and countdown(0.2) == "0:01"


async def test_closing_says_what_was_denied_and_restores_the_terminal(pty: Pty) -> None:
    broker, _ = await terminal_broker(pty)
    held = asyncio.create_task(broker.ask(request()))
    await pty.shows("Enter = deny] > ")
    await broker.close()
    assert (await held).answer is Answer.SHUTTING_DOWN
    await pty.shows("denied: egressd stopped")
    assert pty.lflag() & termios.ICANON and pty.lflag() & termios.ECHO


async def test_answers_typed_in_one_go_answer_only_the_prompt_on_screen(pty: Pty) -> None:
    broker, _ = await terminal_broker(pty)
    first = asyncio.create_task(broker.ask(request("one.example")))
    second = asyncio.create_task(broker.ask(request("two.example")))
    await pty.shows("1 more waiting")
    pty.type("deny\rallow\r")  # pasted: the "allow" was typed before the second prompt appeared
    assert (await asyncio.wait_for(first, 5)).answer is Answer.DENY
    await pty.shows("allow or deny two.example:443?")
    await asyncio.sleep(0.1)
    assert not second.done()
    pty.type("deny\r")
    assert (await asyncio.wait_for(second, 5)).answer is Answer.DENY
    await broker.close()


async def test_in_the_background_of_its_terminal_egressd_neither_reads_nor_changes_modes(
    pty: Pty, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading or setting modes from the background would stop the whole process (SIGTTIN/SIGTTOU).
    monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp() + 1)
    broker, _ = await terminal_broker(pty, tick_s=0.02)
    held = asyncio.create_task(broker.ask(request()))
    await pty.shows("Enter = deny] > ")
    assert pty.lflag() & termios.ICANON  # modes untouched
    pty.type("deny\r")
    await asyncio.sleep(0.1)
    assert not held.done()  # not read while in the background
    monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp())  # `fg`
    await wait_until(lambda: not pty.lflag() & termios.ICANON)
    pty.type("allow\r")  # what was typed in the background was thrown away; this counts
    assert (await asyncio.wait_for(held, 5)).allowed
    await broker.close()
