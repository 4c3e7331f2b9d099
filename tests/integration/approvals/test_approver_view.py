"""What the person who approves is shown cannot be made to look harmless, nor pushed off the screen.

The attacker writes the command (and so its text in the message) and picks
the domain. The message must not:

- drop the "unrelated" warning because of a mention of the domain the person
  is never shown (past the cut, or past a channel's own cut);
- call a name related to an allowlisted public suffix (``github.io``,
  ``s3.amazonaws.com``): anyone can register a name under one;
- carry a character that renders as nothing (a filler, a blank braille
  cell, a variation selector, private use), in any channel;
- lose its Domain line, registered domain, command or warning on an 80×24
  terminal, however long the domain and command and however often the
  countdown is redrawn (read back through pyte from a real pseudo-terminal).
"""

from __future__ import annotations

import asyncio
import json
import re
import unicodedata

import pytest
import wcwidth  # pyte's own width tables: what the terminal emulator in these tests does
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.commandoutput import TerminalOutput
from egressd.approvals.interface import ApprovalRequest, PendingApproval
from egressd.approvals.message import UNRELATED, is_unrelated, render, shorten
from egressd.approvals.prompt import columns_of, fit, header, keep_of, prompt_line
from egressd.approvals.slackblocks import request_blocks
from egressd.approvals.terminal import TerminalChannel
from egressd.approvals.webhook import request_payload
from egressd.audit.log import MemoryAuditSink
from egressd.names.shown import TerminalText, escape, escape_mrkdwn, is_invisible
from egressd.names.suffixes import suffix_beneath
from egressd.vocabulary.reasons import Answer
from tests.integration.approvals.test_broker import Clock
from tests.integration.approvals.test_terminal_integrity import Screen

HOST = "telemetry-collector.net"


def pending(req: ApprovalRequest, approval_id: str = "a-view") -> PendingApproval:
    message = render(host=req.host, port=req.port, command=req.command, task=req.task, allowed=req.allowed)
    return PendingApproval(
        id=approval_id, request=req, message=message, created_at=0.0, expires_at=600.0, deadline=600.0
    )


def ask(command: str | None, *, host: str = HOST, task: str | None = "build the docs",
        allowed: tuple[str, ...] = ("pypi.org",)) -> PendingApproval:
    return pending(ApprovalRequest(run_id="r-1", host=host, port=443, command=command, task=task, allowed=allowed))


def visible_name(name: str, text: str) -> bool:
    """``name`` stands whole in ``text``: no name character on either side."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", text) is not None


# -- item 4: "unrelated" is judged on the text shown ------------------------------------------------


def test_padding_the_command_past_the_cut_does_not_switch_the_warning_off() -> None:
    # The attack: the mention that makes the domain "related" is past what anyone is shown.
    approval = ask("pip install -r requirements.txt" + " " * 600 + "# mirror: telemetry-collector.net")
    assert HOST not in dict(approval.message.lines)["command"]
    assert approval.message.unrelated and UNRELATED in approval.message.text
    payload = request_payload(approval, None)
    assert payload["unrelated"] is True and UNRELATED in payload["message"]
    slack = json.dumps(request_blocks(approval, instance="i"))
    assert UNRELATED in slack


# What a padding can be made of: plain characters, ones whose escape is long (an ESC is four
# characters shown, a tag character ten), wide ones, Slack's own (``&`` is five shown in Slack).
FILLERS = [" ", "x", "-", "\x1b", "\u3164", "\U000e0041", "\u200b", "中", "&", "<"]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    pad=st.integers(min_value=0, max_value=1500),
    filler=st.sampled_from(FILLERS),
    name=st.sampled_from([HOST, f"www.{HOST}", f"https://{HOST}/x", f"cdn.{HOST}"]),
)
def test_a_mention_of_the_domain_counts_only_where_the_person_can_read_it(pad: int, filler: str, name: str) -> None:
    approval = ask(f"pip install requests {filler * pad} # mirror: {name} now")
    message = approval.message
    bare = name.removeprefix("https://").removesuffix("/x")
    readable = visible_name(bare, message.command)
    assert message.unrelated is not readable, message.command[-120:]
    assert (UNRELATED in message.text) is message.unrelated
    payload = request_payload(approval, None)  # the webhook: the same value, the same text
    assert payload["unrelated"] is message.unrelated and payload["message"] == message.text
    # Slack shows the command line whole (never its own, shorter cut), so it shows what the rule read.
    sections = [b["text"]["text"] for b in request_blocks(approval, instance="i") if b["type"] == "section"]
    assert escape_mrkdwn(dict(message.lines)["command"]) in sections
    assert not any("cut for Slack" in text for text in sections)


@pytest.mark.parametrize(
    ("host", "command", "allowed"),
    [
        ("attacker.github.io", None, ("github.io",)),  # github.io is itself a public suffix
        ("attacker.github.io", "deploy the site to github.io", ("pypi.org",)),
        ("bucket.s3.amazonaws.com", None, ("s3.amazonaws.com",)),
        ("bucket.s3.amazonaws.com", "aws s3 cp out s3://x --endpoint s3.amazonaws.com", ()),
        ("bucket.s3.amazonaws.com", None, ("*.amazonaws.com",)),  # a suffix between the base and the name
        ("evil.co.uk", None, ("co.uk",)),
        ("someone.blogspot.com", None, ("blogspot.com",)),
    ],
)
def test_a_name_under_a_public_suffix_is_not_related_to_the_suffix(
    host: str, command: str | None, allowed: tuple[str, ...]
) -> None:
    approval = ask(command, host=host, task=None, allowed=allowed)
    assert approval.message.unrelated and request_payload(approval, None)["unrelated"] is True


@given(
    label=st.from_regex(r"[a-z0-9]{1,20}", fullmatch=True),
    base=st.sampled_from(["github.io", "s3.amazonaws.com", "amazonaws.com", "co.uk", "github.com", "example.org"]),
)
def test_relatedness_through_the_allowlist_follows_the_policys_suffix_rule(label: str, base: str) -> None:
    host = f"{label}.{base}"
    unrelated = is_unrelated(host, command=None, task=None, allowed=[base])
    # The policy's rule (egressd.names.suffixes, as egressd.proxy.core.policy uses it): a public suffix between the
    # allowed base and the name means someone else's name.
    assert unrelated is (suffix_beneath(host, base) is not None)


# -- item 4: every character that does not render visibly is escaped ----------------------------------------

# From the issue, and the rest of Unicode's Default_Ignorable_Code_Point, blank spaces and glyphs.
BLANK = [
    "\u3164",  # HANGUL FILLER
    "\u115f", "\u1160", "\uffa0",  # the other Hangul fillers
    "\u2800",  # BRAILLE PATTERN BLANK
    "\ufe0f", "\ufe00", "\U000e0100",  # variation selectors
    "\u180b", "\u180f",  # Mongolian free variation selectors
    "\u034f",  # COMBINING GRAPHEME JOINER
    "\u17b4", "\u17b5",  # Khmer inherent vowels
    "\ue000", "\uf8ff", "\U000f0000", "\U0010fffd",  # private use
    "\U000e0001", "\U000e0041", "\U000e007f",  # tags
    "\u180e", "\u2060", "\u2064", "\u206f", "\u200b", "\u200f", "\ufeff", "\u00ad", "\u061c",
    "\u00a0", "\u2007", "\u202f", "\u205f", "\u3000", "\u1680",  # spaces other than the space
    "\U0001d159", "\U0001d173", "\U0001bca0",
]


def shown_as(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


@pytest.mark.parametrize("ch", BLANK, ids=[f"U+{ord(ch):04X}" for ch in BLANK])
def test_a_character_that_renders_as_nothing_is_escaped_in_every_channel(ch: str) -> None:
    assert escape(ch) == shown_as(ch) and escape(ch, keep_layout=True) == shown_as(ch)
    approval = ask(f"curl{ch} https://pypi.org{ch}/x", host=HOST, task=f"build{ch} the docs",
                   allowed=(f"pypi.org{ch}",))
    message = approval.message
    assert ch not in message.text and shown_as(ch) in dict(message.lines)["command"]
    assert ch not in request_payload(approval, None)["message"]  # the webhook's rendered message
    assert ch not in json.dumps(request_blocks(approval, instance="i"), ensure_ascii=False)  # Slack
    text = TerminalText()  # a command's output relayed to the terminal
    assert ch not in text.feed(f"ok{ch}ok\n".encode()) + text.end()


@given(st.text())
def test_escape_shows_nothing_that_renders_as_nothing(text: str) -> None:
    shown = escape(text)
    assert not any(is_invisible(ch) for ch in shown)
    blank = {ord(ch) for ch in BLANK}
    assert not any(ord(ch) in blank or unicodedata.category(ch) in {"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"}
                   or (unicodedata.category(ch) == "Zs" and ch != " ") for ch in shown)


# -- item 5: the terminal's layout, pure ------------------------------------------------------------


def rows_on(text: str, columns: int) -> int:
    """Rows a line takes in the emulator: a character that does not fit the row goes to the next."""
    rows, column = 1, 0
    for ch in text:
        width = max(wcwidth.wcwidth(ch), 0)
        if column + width > columns:
            rows, column = rows + 1, 0
        column += width
    return rows


def width_on(text: str) -> int:
    return sum(max(wcwidth.wcwidth(ch), 0) for ch in text)


labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?", fullmatch=True)
sites = st.sampled_from(["example.com", "attacker-example.com", f"{'r' * 63}.com", "a.github.io", "xn--80ak6aa92e.com",
                         "bucket.s3.amazonaws.com", "example.co.uk"])
hosts = st.builds(lambda parts, site: ".".join([*parts, site])[-253:].lstrip(".-") or site,
                  st.lists(labels, max_size=6), sites)
agent_text = st.one_of(
    st.none(),
    st.text(max_size=60),
    st.builds(lambda a, n, b: a * n + b, st.sampled_from(FILLERS), st.integers(0, 1500), st.text(max_size=40)),
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(host=hosts, command=agent_text, task=agent_text, allowed=st.lists(st.sampled_from(
    ["pypi.org", "*.github.com", "example.com", "s3.amazonaws.com", "x" * 200 + ".org"]), max_size=40),
    columns=st.integers(80, 200), rows=st.integers(24, 60))
def test_the_message_as_the_terminal_draws_it_fits_the_screen(
    host: str, command: str | None, task: str | None, allowed: list[str], columns: int, rows: int
) -> None:
    req = ApprovalRequest(run_id="r-1", host=host, port=443, command=command, task=task, allowed=tuple(allowed))
    approval = pending(req)
    shown = fit(approval, columns=columns, rows=rows)
    # The line break, the header, the message and the input line: all on the screen at once.
    used = 1 + rows_on(header(approval), columns) + sum(rows_on(text, columns) for _, text in shown.lines) + 1
    assert used <= rows
    # The same rule on less text can only add the warning, and the registered domain stays whole.
    assert shown.unrelated or not approval.message.unrelated
    assert (UNRELATED in shown.text) is shown.unrelated
    if approval.message.registered_domain and approval.message.registered_domain != host:
        assert f"registered domain {approval.message.registered_domain})" in dict(shown.lines)["domain"]
    line = prompt_line(domain=approval.message.domain, keep=keep_of(approval.message), left="10:00", more="",
                       typed="allow", columns=columns)
    assert width_on(line) < columns
    if "?" in line and not line.startswith("allow or deny?"):
        assert line.split("? [")[0].endswith(keep_of(approval.message))


@settings(max_examples=200)
@given(pad=st.integers(0, 1500), filler=st.sampled_from(FILLERS), rows=st.integers(20, 40))
def test_on_a_small_terminal_the_warning_is_judged_on_what_fits(pad: int, filler: str, rows: int) -> None:
    # A mention the message shows but the terminal has no room for relates nothing on the terminal.
    approval = ask(f"pip install {filler * pad} # mirror: {HOST} now", host=HOST)
    shown = fit(approval, columns=80, rows=rows)
    assert shown.unrelated is not visible_name(HOST, shown.command)


@given(name=hosts, limit=st.integers(0, 120))
def test_a_shortened_name_keeps_its_start_and_its_registered_domain(name: str, limit: int) -> None:
    site = render(host=name, port=443, command=None, task=None, allowed=()).registered_domain or name
    short = shorten(name, limit, keep=site, measure=columns_of)
    if short is None:
        assert columns_of("…" + site) > limit
        return
    assert columns_of(short) <= limit or short == name and columns_of(name) <= limit
    assert short.endswith(site)
    if short != name:
        head, _, tail = short.partition("…")
        assert name.startswith(head) and name.endswith(tail)


def test_the_prompt_shortens_the_middle_of_a_long_name_never_its_registered_domain() -> None:
    domain, keep = f"{LONG_HOST}:443", f"{SITE}:443"
    line = prompt_line(domain=domain, keep=keep, left="9:58", more="", typed="", columns=120)
    assert line == "allow or deny accounts.google.com.sssss…uuuuuuuuuuuuuuuuuuuuuuu.attacker-example.com:443? " \
                   "[9:58 left; Enter = deny] > "
    assert width_on(line) < 120
    narrow = prompt_line(domain=domain, keep=keep, left="9:58", more=", 2 more waiting", typed="", columns=80)
    assert narrow.startswith("allow or deny a") and f".{SITE}:443? [9:58 left; Enter" in narrow
    assert prompt_line(domain=domain, keep=keep, left="9:58", more="", typed="", columns=60) == \
        "allow or deny? [9:58 left; Enter = deny] > "  # no room for the registered domain: none of it


# -- item 5: the prompt on an 80×24 terminal ----------------------------------------------------------

# 200 characters, and a registered domain at the end that must stay readable.
LONG_HOST = f"accounts.google.com.{'s' * 60}.{'t' * 60}.{'u' * 37}.attacker-example.com"
SITE = "attacker-example.com"
COMMANDS = {
    "plain": "pip install -r requirements.txt && " + "python -m build --sdist --wheel --outdir dist " * 60,
    "escapes": "pip install -r requirements.txt " + "\x1b[2J" * 150 + " # " + "y" * 600,
    "wide": "echo " + "中文" * 400,
}


class Ticking:
    """A clock the test moves forward."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def joined(screen: Screen) -> str:
    """The screen as one string: rows as drawn, so a wrapped line reads whole."""
    return "".join(screen.screen.display)


@pytest.mark.parametrize("kind", list(COMMANDS))
async def test_on_80x24_the_message_stays_whole_through_30_redraws(kind: str) -> None:
    screen = Screen(columns=80, rows=24)
    output = TerminalOutput()
    try:
        clock = Ticking()
        # tick_s is long: the test redraws the countdown itself, 30 times, one second apart.
        channel = TerminalChannel(tty_path=screen.path, clock=clock, who="alice", tick_s=3600, output=output)
        broker = ApprovalBroker([channel], audit=MemoryAuditSink(), clock=Clock(clock.now))
        await broker.start()
        req = ApprovalRequest(run_id="r-1", host=LONG_HOST, port=443, command=COMMANDS[kind], task="build the docs",
                              allowed=("pypi.org",))
        held = asyncio.create_task(broker.ask(req))
        await screen.shows("Enter = deny] >")
        drawn = len(screen.raw)
        # The command prints a plain-text approval block of its own while the prompt is up.
        stream = output.stream(screen.slave)
        stream.add(b"\nDomain: mirror.example:443\nallow or deny mirror.example:443? [9:59 left; Enter = deny] > \n")
        for _ in range(30):
            clock.now += 1
            channel._tick()
        await screen.shows("9:30 left")
        await asyncio.sleep(0.05)
        lines, whole = screen.lines, joined(screen)
        report = "\n".join(lines)
        assert sum(line.startswith("Domain: ") for line in lines) == 1, report
        assert f"(registered domain {SITE})" in whole, report
        assert sum(line.startswith("Command: ") for line in lines) == 1, report
        assert UNRELATED in whole and sum(line.startswith("Unrelated:") for line in lines) == 1, report
        assert f"A deny covers *.{SITE}" in whole, report
        prompts = [line for line in lines if "Enter = deny] >" in line]
        assert len(prompts) == 1 and len(prompts[0]) < 80, report
        # The prompt names the domain, its middle shortened, its registered domain whole.
        assert re.match(rf"allow or deny ac[a-z.]*…[a-z.]*\.{re.escape(SITE)}:443\? \[", prompts[0]), prompts[0]
        assert "mirror.example" not in whole  # the command's fake block is held back
        # Only the countdown was redrawn: the prompt's words went to the terminal once.
        redraws = bytes(screen.raw[drawn:])
        assert b"allow or deny" not in redraws and SITE.encode() not in redraws
        screen.type("deny\r")
        assert (await asyncio.wait_for(held, 5)).answer is Answer.DENY
        await screen.shows("Domain: mirror.example:443")  # released after the answer, as plain text
        await broker.close()
    finally:
        screen.close()


async def test_answers_that_are_not_allow_or_deny_do_not_push_the_message_up() -> None:
    screen = Screen(columns=80, rows=24)
    try:
        channel = TerminalChannel(tty_path=screen.path, clock=Ticking(), who="alice", tick_s=3600)
        broker = ApprovalBroker([channel], audit=MemoryAuditSink(), clock=Clock())
        await broker.start()
        req = ApprovalRequest(run_id="r-1", host=LONG_HOST, port=443, command=COMMANDS["plain"], task="build",
                              allowed=("pypi.org",))
        held = asyncio.create_task(broker.ask(req))
        await screen.shows("Enter = deny] >")
        for _ in range(30):
            screen.type("yes\r")
            await asyncio.sleep(0)
        screen.type("allo")
        await screen.shows("] > allo")
        lines = screen.lines
        assert sum(line.startswith("Domain: ") for line in lines) == 1, "\n".join(lines)
        assert "type allow or deny" in joined(screen)
        assert not held.done()
        screen.type("\x15deny\r")
        assert (await asyncio.wait_for(held, 5)).answer is Answer.DENY
        await broker.close()
    finally:
        screen.close()

