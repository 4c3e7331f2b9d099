"""The new-domain approval message: its content, the "unrelated" rule, escaping (pure, no sockets)."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.approvals.interface import Settlement, settled_text
from egressd.approvals.message import (
    CLOSING,
    INTRO,
    UNRELATED,
    HeldRequest,
    bounded,
    is_unrelated,
    render,
)
from egressd.names.shown import escape, is_invisible
from egressd.vocabulary.reasons import Answer


def test_the_message_follows_the_one_template_line_by_line() -> None:
    message = render(
        host="files.example.org",
        port=443,
        command="pip install thing",
        task="build the docs",
        allowed=["pypi.org", "*.github.com"],
    )
    assert message.text.splitlines() == [
        INTRO,
        "Domain: files.example.org:443 (registered domain example.org)",
        "Command: pip install thing",
        "Task: build the docs",
        "Allowed domains: pypi.org, *.github.com",
        UNRELATED,
        *CLOSING,
        "A deny covers *.example.org for this run (example.org included): no name under it is asked about again.",
    ]
    assert message.unrelated
    assert [kind for kind, _ in message.lines] == [
        "intro",
        "domain",
        "command",
        "task",
        "allowed",
        "unrelated",
        "closing",
        "closing",
        "scope",
    ]


def test_missing_command_task_and_allowlist_are_said_plainly() -> None:
    message = render(host="example.org", port=8443, command=None, task=None, allowed=[])
    assert "Domain: example.org:8443" in message.text
    assert "(registered domain" not in message.text  # the host is its own registered domain
    assert "Command: (not known)" in message.text
    assert "Task: (none given)" in message.text
    assert "Allowed domains: (none)" in message.text


def test_an_idn_domain_is_shown_in_punycode_with_its_unicode_form_and_registered_domain() -> None:
    message = render(host="xn--80ak6aa92e.com", port=443, command=None, task=None, allowed=[])
    assert message.unicode_host == "аррӏе.com"
    line = dict(message.lines)["domain"]
    assert line.startswith("Domain: xn--80ak6aa92e.com:443")
    assert "shown as аррӏе.com" in line and "registered domain xn--80ak6aa92e.com" in line


@pytest.mark.parametrize(
    ("host", "command", "task", "allowed", "unrelated"),
    [
        ("evil.example", "pip install x", "build the docs", ["pypi.org"], True),
        ("evil.example", "curl https://evil.example/x", None, [], False),  # named in the command
        ("evil.example", None, "upload the report to evil.example", [], False),  # named in the task
        ("api.github.com", None, "open a PR on github.com", [], False),  # same registered domain as a name in the task
        ("github.com", "git clone https://docs.github.com/x", None, [], False),
        ("api.github.com", None, None, ["*.github.com"], False),  # under an allowed wildcard
        ("a.b.pypi.org", None, None, ["pypi.org:8443"], False),  # under an allowed host with a port
        ("example.com", None, None, ["*.example.com"], False),  # the apex of an allowed wildcard
        ("evilgithub.com", None, "work on github.com", ["github.com"], True),  # not a subdomain
        ("github.com.evil.example", "see github.com", None, ["github.com"], True),
        ("bob.github.io", None, "see alice.github.io", ["alice.github.io"], True),  # private-section suffix
        ("xn--80ak6aa92e.com", None, "check аррӏе.com", [], False),  # named in its Unicode form
        ("evil.example", None, None, ["203.0.113.7", "[2001:db8::1]:443", "::1"], True),  # IP entries relate nothing
    ],
)
def test_the_unrelated_rule(
    host: str, command: str | None, task: str | None, allowed: list[str], unrelated: bool
) -> None:
    assert is_unrelated(host, command=command, task=task, allowed=allowed) is unrelated


def test_control_characters_from_the_agent_cannot_repaint_a_terminal() -> None:
    message = render(
        host="evil.example",
        port=443,
        command="curl x\x1b[2J\x1b[Hallow\r\nDomain: pypi.org",
        task="fix \u202etxt.exe\u200b bug\x07",
        allowed=["pypi.org\x1b[31m"],
    )
    for _, text in message.lines:
        assert all(unicodedata.category(ch) not in {"Cc", "Cf"} for ch in text), text
    assert "Command: curl x\\x1b[2J\\x1b[Hallow\\x0d\\x0aDomain: pypi.org" in message.text
    assert "\\u202etxt.exe\\u200b bug\\x07" in message.text
    assert "pypi.org\\x1b[31m" in message.text
    assert len(message.text.splitlines()) == len(message.lines)  # nothing the agent wrote adds a line


def test_long_fields_are_cut_and_say_how_much_is_left_out() -> None:
    message = render(
        host="a.example", port=443, command="x" * 5000, task="y" * 600, allowed=[f"h{i}.example" for i in range(40)]
    )
    assert f"{'x' * 500}… (4500 more characters)" in message.text
    assert "(100 more characters)" in message.text
    assert message.text.count("h3") >= 1 and "and 10 more" in message.text
    assert len(message.text) < 3000  # fits one Slack section


@given(st.text())
def test_escape_leaves_nothing_invisible_or_controlling(text: str) -> None:
    shown = escape(text)
    assert all(unicodedata.category(ch) not in {"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"} for ch in shown)
    assert not any(is_invisible(ch) for ch in shown)
    if not any(is_invisible(ch) for ch in text):
        assert shown == text  # printable text is left alone


@given(
    command=st.one_of(st.none(), st.text()),
    task=st.one_of(st.none(), st.text()),
    allowed=st.lists(st.text(max_size=40), max_size=5),
)
def test_render_never_fails_on_whatever_the_agent_sends(
    command: str | None, task: str | None, allowed: list[str]
) -> None:
    message = render(host="evil.example", port=443, command=command, task=task, allowed=allowed)
    assert message.lines[0] == ("intro", INTRO)
    assert len(message.text.splitlines()) == len(message.lines)


def test_bounded_counts_characters_shown_and_says_how_many_of_the_original_are_left_out() -> None:
    assert bounded("abc", 5) == "abc"
    # What is shown is bounded (escapes counted), never cut inside an escape; what is left out
    # is counted in the original.
    assert bounded("\x1b" * 10, 8) == "\\x1b\\x1b… (8 more characters)"
    assert bounded("\x1b" * 10, 11) == "\\x1b\\x1b… (8 more characters)"
    assert bounded("ab\x1b", 3) == "ab… (1 more characters)"


def test_settled_text_says_who_and_how() -> None:
    assert settled_text(Settlement(Answer.ALLOW, "slack", "@alice (U1)", 0, 1)) == "allowed by @alice (U1) via slack"
    assert settled_text(Settlement(Answer.DENY, "control", "cli", 0, 1)) == "denied by cli via control"
    assert settled_text(Settlement(Answer.TIMEOUT, None, None, 0, 1)) == "expired (denied)"
    assert "nobody could be asked" in settled_text(Settlement(Answer.NO_APPROVER, None, None, 0, 1))
    assert settled_text(Settlement(Answer.SHUTTING_DOWN, None, None, 0, 1)) == "denied: egressd stopped"


def test_a_request_inside_an_inspected_connection_is_shown_without_values_and_the_path_middle_shortened() -> None:
    held = HeldRequest("POST", "/gists/" + "a" * 400 + "/\x1b[2Jx", "/gists/aaa", ("token", "q\u202e"),
                       "application/json", 48 * 1024 * 1024)
    message = render(host="api.github.com", port=443, command="curl -d @.env", task="read the docs",
                     allowed=("GET api.github.com/repos/**",), request=held)
    lines = dict(message.lines)
    assert lines["intro"] == "A command in the sandbox made a request that no rule for this domain covers."
    request = lines["request"]
    assert request.startswith("Request: POST /gists/aaa") and "…" in request
    assert request.endswith("(query: token, q\\u202e; application/json; 48.0 MiB)"), request
    assert "\x1b" not in request and "\\x1b" in request  # the agent's bytes are inert
    assert len(request) < 400
    assert "A deny covers POST under /gists/aaa on api.github.com" in lines["scope"]
    assert [kind for kind, _ in message.lines][:3] == ["intro", "domain", "request"]


def test_without_a_request_the_message_is_the_new_domain_one() -> None:
    message = render(host="example.com", port=443, command=None, task=None, allowed=())
    assert "request" not in dict(message.lines) and message.request is None


@pytest.mark.parametrize(
    ("method", "path", "task", "unrelated"),
    [
        ("POST", "/gists", "summarise the open issues of org/repo", True),
        ("POST", "/repos/org/repo/issues", "summarise the open issues of org/repo", False),
        ("PUT", "/v1/a", "anything", True),
        ("GET", "/gists", "summarise the issues", False),  # a read is never "a write"
        ("DELETE", "/branches/main", None, True),
    ],
)
def test_a_write_to_a_path_the_task_does_not_name_is_flagged(
    method: str, path: str, task: str | None, unrelated: bool
) -> None:
    held = HeldRequest(method, path, path)
    message = render(host="api.github.com", port=443, command="curl", task=task, allowed=(), request=held)
    assert message.unrelated is unrelated
    assert ("unrelated", "Unrelated: a write to a path the task does not name.") in message.lines or not unrelated
