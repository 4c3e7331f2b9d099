"""The console script as a user runs it: `egressd serve` with curl, bad settings, `egressd audit`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ORIGIN_RANGE, have, require, wait_serve_ports

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env.pop("http_proxy", None)
    env.pop("HTTP_PROXY", None)
    return env


@pytest.fixture
def serve(tmp_path: Path, dns):  # type: ignore[no-untyped-def]
    """Start `egressd serve` as a subprocess; yields (proxy port, audit path, process)."""
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]

    def start(*args: str) -> tuple[int, Path, subprocess.Popen]:  # type: ignore[type-arg]
        audit = tmp_path / "audit.jsonl"
        proc = subprocess.Popen(
            [EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
             "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--audit-log", str(audit),
             "--allow-private", ORIGIN_RANGE, *args],
            env=_env(tmp_path), stderr=subprocess.PIPE, text=True,
        )
        procs.append(proc)
        ports = wait_serve_ports(proc)  # the ports it bound: none picked here and taken by another first
        start.ports = ports  # type: ignore[attr-defined]  # the other listeners', for a test that asks
        return ports["proxy"], audit, proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _curl(port: int, url: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run(
        ["curl", "-sS", "-i", "--max-time", "10", "-x", f"http://127.0.0.1:{port}", url],
        capture_output=True, text=True, timeout=20,
    )


async def test_every_decision_is_a_line_a_refusal_before_the_policy_and_a_failed_dial_too(serve, dns) -> None:
    """Issue 29: auth_required and an allowed connection whose dial failed said nothing on stderr."""
    require(have("curl"), "curl is not installed")
    import asyncio
    import socket

    with socket.socket() as probe:  # a port from the kernel, then closed: nothing listens there
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    dns.set("gone.test", ["127.0.0.1"])
    port, _, proc = serve("--allow", "gone.test:*", "--allow-private", "127.0.0.1/32")
    failed = await asyncio.to_thread(_curl, port, f"https://gone.test:{closed_port}/")
    assert failed.returncode != 0
    proc.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.to_thread(proc.communicate, timeout=20)
    assert f"ALLOW connect gone.test:{closed_port}" in stderr, stderr
    assert f"END   connect gone.test:{closed_port} run=default end=upstream_unreachable" in stderr, stderr

    port, _, proc = serve("--require-auth")
    refused = await asyncio.to_thread(_curl, port, "http://origin.test/")
    assert "407" in refused.stdout.splitlines()[0], refused.stdout
    proc.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.to_thread(proc.communicate, timeout=20)
    assert "DENY  http origin.test:80 run=- reason=auth_required" in stderr, stderr


async def test_serve_works_as_a_proxy_for_curl_and_stops_cleanly(serve, http_origin, dns) -> None:
    require(have("curl"), "curl is not installed")
    import asyncio

    port, audit, proc = serve("--allow", "origin.test:*")
    ok = await asyncio.to_thread(_curl, port, f"http://origin.test:{http_origin.port}/via-curl")
    assert ok.returncode == 0 and "hello from origin: GET /via-curl" in ok.stdout
    refused = await asyncio.to_thread(_curl, port, "http://leak.test/")
    assert "403" in refused.stdout.splitlines()[0]
    assert "X-Egress-Reason: no_approver" in refused.stdout
    assert "egressd: blocked leak.test:80 (no approver attached) in run default" in refused.stdout
    assert not dns.asked("leak.test")

    proc.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.to_thread(proc.communicate, timeout=20)
    assert proc.returncode == 0
    assert "ALLOW http origin.test" in stderr and "DENY  http leak.test:80" in stderr
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [r["event"] for r in records][0] == "run.start" and records[-1]["event"] == "run.end"
    assert [r["decision"] for r in records if r["event"] == "egress"] == ["allow", "deny"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--allow", "*.com"], "bad setting allow"),
        (["--listen", "nonsense"], "bad setting listen"),
        (["--allow-private", "10.0.0.0/33"], "bad setting allow_private"),
        (["--preset", "nosuchpreset"], "bad setting preset"),
        (["--approval-timeout", "-5"], "bad setting approval_timeout"),
        (["--config", "/nonexistent/egressd.toml"], "bad setting config"),
    ],
)
def test_a_bad_setting_stops_start_up_with_one_message(tmp_path: Path, args: list[str], message: str) -> None:
    result = subprocess.run(
        [EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
         "--audit-log", str(tmp_path / "a.jsonl"), *args],
        env=_env(tmp_path), capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "a.jsonl").exists(), "a bad setting must stop egressd before it creates anything"


def test_environment_and_config_file_are_read_with_the_command_line_winning(tmp_path: Path) -> None:
    config = tmp_path / "egressd.toml"
    config.write_text('allow = ["from-file.test"]\nlisten = "nonsense-from-file"\n')
    env = _env(tmp_path) | {"EGRESSD_LISTEN": "also nonsense"}
    result = subprocess.run(
        [EGRESSD, "serve", "--config", str(config), "--control", "127.0.0.1:0",
         "--audit-log", str(tmp_path / "a.jsonl")],
        env=env, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2 and "also nonsense" in result.stderr  # env beats the file


def test_audit_command_filters_and_prints_a_table_and_json(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    records = [
        {"event": "egress", "id": "q-1", "ts": "2026-11-29T10:00:00.000000Z", "run": "r-1", "kind": "connect",
         "client": "127.0.0.1:5", "host": "pypi.org", "port": 443, "address": "127.0.0.2", "decision": "allow",
         "reason": None, "rule": "pypi.org", "approval": None, "command": "pip install x", "bytes_up": 10,
         "bytes_down": 2048, "duration_s": 0.5},
        {"event": "egress", "id": "q-2", "ts": "2026-11-29T10:00:01.000000Z", "run": "r-1", "kind": "connect",
         "client": "127.0.0.1:6", "host": "evil\x1b[2J.test", "port": 443, "address": None, "decision": "deny",
         "reason": "denied", "rule": None, "approval": None, "command": None, "bytes_up": 0, "bytes_down": 0,
         "duration_s": 0.1},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = subprocess.run([EGRESSD, "audit", "--audit-log", str(log), "--decision", "deny"],
                           env=_env(tmp_path), capture_output=True, text=True, timeout=30)
    assert table.returncode == 0
    assert "\x1b" not in table.stdout and "denied" in table.stdout and "pypi.org" not in table.stdout
    as_json = subprocess.run([EGRESSD, "audit", "--audit-log", str(log), "--json", "--run", "r-1"],
                             env=_env(tmp_path), capture_output=True, text=True, timeout=30)
    assert [json.loads(line)["id"] for line in as_json.stdout.splitlines()] == ["q-1", "q-2"]
    missing = subprocess.run([EGRESSD, "audit", "--audit-log", str(tmp_path / "none.jsonl")],
                             env=_env(tmp_path), capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1 and "no audit log" in missing.stderr


def test_help_explains_every_command() -> None:
    result = subprocess.run([EGRESSD, "serve", "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    for flag in (
        "--allow", "--deny", "--preset", "--allow-private", "--approver", "--upstream-dns", "--audit-log", "--no-ask"
    ):
        assert flag in result.stdout


async def test_serve_socks_listens_where_told_and_curl_goes_through_it(serve, http_origin, dns) -> None:
    require(have("curl"), "curl is not installed")
    import asyncio

    _, audit, proc = serve("--socks", "127.0.0.1:0", "--allow", "origin.test:*")
    socks = serve.ports["socks"]
    url = f"http://origin.test:{http_origin.port}/via-socks"
    argv = ["curl", "-sS", "--max-time", "10", "--socks5-hostname", f"127.0.0.1:{socks}", url]
    ok = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=20)
    assert ok.returncode == 0 and "hello from origin: GET /via-socks" in ok.stdout, ok.stderr
    proc.send_signal(signal.SIGTERM)
    await asyncio.to_thread(proc.communicate, timeout=20)
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["kind"], r["decision"]) for r in records if r["event"] == "egress"] == [("socks", "allow")]
