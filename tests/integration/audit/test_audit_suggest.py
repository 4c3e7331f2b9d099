"""``egressd audit suggest`` as a user runs it: the console script, real files, exit codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

from egressd.audit.log import JsonlAuditSink
from egressd.audit.records import run_record
from egressd.proxy.core.policy import parse_entry

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def _suggest(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EGRESSD, "audit", "suggest", *args], capture_output=True, text=True, timeout=30, env=env)


def _log(path: Path) -> None:
    with JsonlAuditSink(path) as sink:
        sink.write(run_record("run.start", ts=1_764_000_000.0, run="r-abc", learn=True))
        for n, host in enumerate(["pypi.org", "a.example.com", "b.example.com", "c.example.com", "evil.example"]):
            refused = host == "evil.example"
            sink.write(
                {
                    "event": "egress",
                    "id": f"e-{n}",
                    "ts": "2026-12-01T10:00:00Z",
                    "run": "r-abc",
                    "kind": "connect",
                    "client": "127.0.0.1",
                    "host": host,
                    "port": 443,
                    "address": None,
                    "decision": "deny" if refused else "allow",
                    "reason": "denylisted" if refused else None,
                    "rule": "evil.example" if refused else None,
                    "approval": None,
                    "command": None,
                    "bytes_up": None,
                    "bytes_down": None,
                    "duration_s": None,
                    **({} if refused else {"learned": "not_allowlisted"}),
                }
            )


def test_suggest_prints_toml_the_policy_accepts(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _log(log)
    done = _suggest("--audit-log", str(log))
    assert done.returncode == 0, done.stderr
    allow = tomllib.loads(done.stdout)["allow"]
    assert allow == ["*.example.com", "pypi.org"]
    for entry in allow:
        parse_entry(entry)
    assert done.stdout.startswith("# egressd audit suggest: 4 hosts from run r-abc")
    assert "# refused, not suggested: evil.example (denylisted)" in done.stdout
    assert _suggest("--run", "r-abc", str(log)).stdout == done.stdout  # FILE... as audit verify takes them


def test_an_unknown_run_is_one_line_and_exit_2(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _log(log)
    done = _suggest("--run", "r-nope", str(log))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "egressd: no run 'r-nope' in the audit records\n"


def test_an_unreadable_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = _suggest(str(tmp_path / "missing.jsonl"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"egressd: cannot read {tmp_path / 'missing.jsonl'}: No such file or directory\n"
    assert json.dumps(done.stderr).count("\\n") == 1
