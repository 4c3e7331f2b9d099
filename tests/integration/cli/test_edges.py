"""Rough edges a new user hit (issue 16), each as the console script shows it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return env


def _egressd(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EGRESSD, *args], capture_output=True, text=True, timeout=60, env=_env(tmp_path))


# The settings `run` and `agent` fix for their sandbox: once listed in their help and silently ignored.
SERVICE_ONLY = [
    ["--listen", "127.0.0.1:1"],
    ["--control", "127.0.0.1:1"],
    ["--dns-listen", "127.0.0.1:1"],
    ["--dns-answer", "127.0.0.1"],
    ["--transparent-tls", "127.0.0.1:1"],
    ["--transparent-http", "127.0.0.1:1"],
    ["--socks", "127.0.0.1:1"],
    ["--require-auth"],
]


@pytest.mark.parametrize("command", ["run", "agent"])
@pytest.mark.parametrize("flag", SERVICE_ONLY, ids=[f[0] for f in SERVICE_ONLY])
def test_run_and_agent_refuse_the_flags_they_would_ignore(tmp_path: Path, command: str, flag: list[str]) -> None:
    needed = ["--task", "t", "--model", "script:none"] if command == "agent" else []
    done = _egressd(tmp_path, command, *needed, *flag, "--", "true")
    # Not taken as an abbreviation of another flag either (--dns-answer of --dns-answer6).
    assert done.returncode == 2 and f"unrecognized arguments: {flag[0]}" in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["run", "agent"])
def test_run_and_agent_help_lists_none_of_them(tmp_path: Path, command: str) -> None:
    shown = _egressd(tmp_path, command, "--help").stdout
    served = _egressd(tmp_path, "serve", "--help").stdout

    def options(text: str) -> set[str]:  # the flags --help lists, each at the start of its line
        return {line.split()[0].rstrip(",") for line in text.splitlines() if line.startswith("  -")}

    for flag in SERVICE_ONLY:
        assert flag[0] not in options(shown) and flag[0] in options(served), flag


def _egress(ident: str, ts: str, decision: str) -> dict[str, object]:
    return {
        "event": "egress", "id": ident, "ts": ts, "run": "r-1", "kind": "connect", "client": "127.0.0.1:5",
        "host": f"{ident}.test", "port": 443, "address": None, "decision": decision,
        "reason": None if decision == "allow" else "denied", "rule": None, "approval": None, "command": "x",
        "bytes_up": 0, "bytes_down": 0, "duration_s": 0.0,
    }  # fmt: skip


def test_audit_takes_the_decision_as_the_table_prints_it_and_since_as_people_write_it(tmp_path: Path) -> None:
    import datetime as dt
    import json

    now = dt.datetime.now(dt.UTC)
    old = (now - dt.timedelta(days=3)).strftime("%Y-%m-%dT%H:%M:%S.000000Z")
    recent = now.strftime("%Y-%m-%dT%H:%M:%S.000000Z")
    log = tmp_path / "audit.jsonl"
    records = [_egress("old", old, "deny"), _egress("new", recent, "deny"), _egress("fine", recent, "allow")]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    two_days_ago = (now - dt.timedelta(days=2)).strftime("%Y-%m-%d")
    offset = (now - dt.timedelta(days=2)).astimezone(dt.timezone(dt.timedelta(hours=-5))).isoformat()
    for since in ("yesterday", "today", two_days_ago, offset, "1d"):
        done = _egressd(tmp_path, "audit", "--audit-log", str(log), "--decision", "DENY", "--since", since, "--json")
        assert done.returncode == 0, (since, done.stderr)
        assert [json.loads(line)["id"] for line in done.stdout.splitlines()] == ["new"], since
    table = _egressd(tmp_path, "audit", "--audit-log", str(log), "--decision", "Deny")
    assert table.returncode == 0 and "DENY" in table.stdout and "fine.test" not in table.stdout


def _commands() -> dict[str, object]:
    import argparse

    from egressd.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_has_one_short_usage_line(tmp_path: Path) -> None:
    # Issue 16: run's usage was written by hand, agent's a 30-line dump of every option.
    for name in _commands():
        shown = _egressd(tmp_path, name, "--help")
        assert shown.returncode == 0, shown.stderr
        first, second = shown.stdout.splitlines()[:2]
        assert first.startswith(f"usage: egressd {name} [options]") and len(first) <= 80, first
        assert not second.startswith(" "), f"{name}: the usage line goes on: {second!r}"


def test_every_setting_flag_names_its_variable_and_the_token_file_is_named(tmp_path: Path) -> None:
    import argparse

    from egressd.config.settings import Settings

    for name in ("serve", "run", "agent"):
        parser = _commands()[name]
        assert isinstance(parser, argparse.ArgumentParser)
        setting_flags = [a for a in parser._actions if a.dest in Settings.model_fields and a.option_strings]
        assert len(setting_flags) > 30
        for action in setting_flags:
            assert f"EGRESSD_{action.dest.upper()}" in (action.help or ""), (name, action.option_strings)
        headings = [g.title for g in parser._action_groups]
        assert {"policy", "approvals", "audit log"} <= set(headings), headings
    shown = _egressd(tmp_path, "serve", "--help").stdout
    assert "written to a file" not in shown and "control.token" in " ".join(shown.split())


@pytest.mark.parametrize("command", ["run", "agent"])
@pytest.mark.parametrize("how", [["--approver", "web"], ["--approver", "terminal", "--approver", "web"], ["env"]])
def test_run_and_agent_refuse_a_web_approver_they_have_no_page_for(
    tmp_path: Path, command: str, how: list[str]
) -> None:
    """Issue 26 item 10: `--approver web` was accepted, no page was served, and every new domain refused at once.

    Refused at start with one line naming the setting, before any sandbox is made (no approvals hint).
    """
    script = tmp_path / "script.json"
    script.write_text('[{"final": "done"}]')
    needed = ["--task", "t", "--model", f"script:{script}"] if command == "agent" else ["--", "true"]
    env = _env(tmp_path)
    if how == ["env"]:
        env["EGRESSD_APPROVER"] = "web"
        how = []
    done = subprocess.run([EGRESSD, command, *how, *needed], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("egressd: bad setting approver: ") and "web" in line and "egressd serve" in line, line


@pytest.mark.parametrize(
    ("args", "usage", "meant"),
    [
        (["serve", "--alow", "example.com"], "usage: egressd serve", "--allow"),
        (["run", "--allow-privat", "10.0.0.0/8", "--", "true"], "usage: egressd run", "--allow-private"),
        (["pending", "--jsn"], "usage: egressd pending", "--json"),
    ],
)
def test_a_mistyped_flag_gets_the_subcommands_usage_and_the_flag_meant(
    tmp_path: Path, args: list[str], usage: str, meant: str
) -> None:
    """Issue 29: `--alow` got the top level's usage and no hint."""
    done = _egressd(tmp_path, *args)
    assert done.returncode == 2 and done.stderr.startswith(usage), done.stderr
    assert f"unrecognized arguments: {args[1]}" in done.stderr and f"(did you mean {meant}?)" in done.stderr


def test_an_egressd_variable_no_setting_reads_is_warned_about_with_the_one_meant(tmp_path: Path) -> None:
    env = _env(tmp_path) | {"EGRESSD_ALOW": "example.com", "EGRESSD_NOTHING_LIKE_IT": "1", "EGRESSD_CONFIG": ""}
    done = subprocess.run([EGRESSD, "policy", "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0  # --help reads no settings: nothing to say yet
    done = subprocess.run([EGRESSD, "pending"], capture_output=True, text=True, timeout=60, env=env)
    said = [line for line in done.stderr.splitlines() if "is no setting" in line]
    assert said == ["egressd: warning: EGRESSD_ALOW is no setting of egressd and is ignored (did you mean "
                    "EGRESSD_ALLOW?)",
                    "egressd: warning: EGRESSD_NOTHING_LIKE_IT is no setting of egressd and is ignored"], done.stderr


def test_run_on_docker_refuses_a_fleet_before_asking_the_engine_anything(tmp_path: Path) -> None:
    done = subprocess.run(
        [EGRESSD, "run", "--backend", "docker", "--state", "postgresql://egressd@/fleet?host=/nonexistent", "--",
         "true"],
        capture_output=True, text=True, timeout=60,
        env=_env(tmp_path) | {"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"},
    )  # fmt: skip
    assert done.returncode != 0 and "does not join a fleet yet: use --backend bwrap" in done.stderr, done.stderr
    assert "no-engine.sock" not in done.stderr  # refused before the engine was dialled
