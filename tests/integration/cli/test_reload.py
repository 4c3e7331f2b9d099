"""``egressd serve`` re-reads its config and allow files on SIGHUP (DESIGN.md, "Command line").

A real ``egressd serve`` process: the new policy applies to new requests,
an open tunnel keeps working, a broken file keeps the old policy (one log
line, the process alive, an audit record), and a deny entry added by a
reload refuses a host that was allowed before, before anything reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from asyncio.subprocess import Process
from pathlib import Path
from typing import Any

from tests.harness import ORIGIN_RANGE, serve_ports

EGRESSD = str(Path(sys.executable).with_name("egressd"))


async def _connect(port: int, authority: str) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return int(head.split(b" ")[1]), reader, writer


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def _status(port: int, authority: str) -> int:
    status, _, writer = await _connect(port, authority)
    await _close(writer)
    return status


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), 5)


async def _serve(args: list[str], env: dict[str, str], stderr: Path) -> tuple[Process, dict[str, int]]:
    """Start ``egressd serve`` on ports from the kernel, its stderr to a file; its process and bound ports."""
    with stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0", *args, env=env, stderr=err
        )
    ports: dict[str, int] | None = None

    def serving() -> bool:
        nonlocal ports
        assert proc.returncode is None, f"egressd exited before serving: {stderr.read_text()}"
        ports = serve_ports(stderr.read_text(errors="replace"))
        return ports is not None

    try:
        await _until(serving, "egressd to report its ports", 15)
    except BaseException:
        await _stop(proc)
        raise
    assert ports is not None
    return proc, ports


async def _stop(proc: Process) -> int:
    """SIGTERM, then SIGKILL after 15 s; its exit status."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
    return await proc.wait()


def _records(audit: Path, event: str) -> list[dict[str, Any]]:
    lines = audit.read_text().splitlines() if audit.exists() else []
    return [r for r in map(json.loads, lines) if r.get("event") == event]


async def _until(predicate: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_sighup_reloads_the_policy_keeps_tunnels_and_refuses_a_broken_file(
    tmp_path: Path, dns: Any, echo_origin: Any
) -> None:
    target = f"origin.test:{echo_origin.port}"
    audit, stderr_path = tmp_path / "audit.jsonl", tmp_path / "serve.stderr"
    allow_file, config = tmp_path / "allow.toml", tmp_path / "egressd.toml"
    allow_file.write_text('allow = ["other.test"]\n')

    def write_config(extra: str = "") -> None:
        config.write_text(
            f'allow_file = "{allow_file}"\nask = false\nallow_private = ["{ORIGIN_RANGE}"]\n'
            f'upstream_dns = "127.0.0.1:{dns.address[1]}"\n{extra}'
        )

    write_config()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    # A secret from the environment, which egressd drops from its own once read: a reload
    # must still see it, or the control token would look changed ("needs a restart").
    env["EGRESSD_CONTROL_TOKEN"] = "reload-test-token"
    args = ["--config", str(config), "--audit-log", str(audit)]
    proc, ports = await _serve(args, env, stderr_path)

    def log_lines(text: str) -> list[str]:
        return [line for line in stderr_path.read_text().splitlines() if text in line]

    async def hup(expect_records: int) -> dict[str, Any]:
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: len(_records(audit, "policy.reloaded")) == expect_records, "policy.reloaded")
        return _records(audit, "policy.reloaded")[-1]

    try:
        port = ports["proxy"]
        assert await _status(port, target) == 403  # outside the allowlist, and not asked (ask = false)
        assert echo_origin.connections == 0

        # 1. The allow file lists the origin: allowed from the next request on.
        allow_file.write_text(f'allow = ["other.test", "{target}"]\n')
        record = await hup(1)
        assert record["ok"] is True and record["added"] == {"allow": [target], "deny": []}
        assert record["needs_restart"] == []
        status, reader, writer = await _connect(port, target)
        assert status == 200 and await _echo(reader, writer, b"opened-before") == b"opened-before"

        # 2. A broken allow file: refused whole, one clear line, the process alive, the old policy in force.
        allow_file.write_text('allow = ["other.test", "*.com"]\n')
        record = await hup(2)
        assert record["ok"] is False and "allow_file" in record["error"] and "*.com" in record["error"]
        [line] = log_lines("reload refused")
        assert str(allow_file) in line and "old policy stays in force" in line
        assert proc.returncode is None
        assert await _status(port, target) == 200

        # 3. A deny entry in the config, a fixed allow file and a setting that needs a restart.
        allow_file.write_text(f'allow = ["{target}"]\n')
        write_config('deny = ["origin.test"]\nmax_connections = 5\n')
        connections = echo_origin.connections
        record = await hup(3)
        assert record["ok"] is True and record["added"] == {"allow": [], "deny": ["origin.test"]}
        assert record["removed"] == {"allow": ["other.test"], "deny": []}
        assert record["needs_restart"] == ["max_connections"]
        assert len(log_lines("needs a restart")) == 1
        assert await _status(port, target) == 403
        assert echo_origin.connections == connections  # nothing reached the origin
        denylisted = [("denylisted", "origin.test")]
        await _until(
            lambda: (
                [(r["reason"], r["rule"]) for r in _records(audit, "egress") if r["reason"] == "denylisted"]
                == denylisted
            ),
            "the refusal's record",
        )
        # The tunnel opened before both reloads is untouched.
        assert await _echo(reader, writer, b"still-open") == b"still-open"
        await _close(writer)

        assert await _stop(proc) == 0
    finally:
        await _stop(proc)


async def test_a_bad_setting_in_the_config_file_is_refused_on_sighup(tmp_path: Path, dns: Any) -> None:
    audit, stderr_path, config = tmp_path / "audit.jsonl", tmp_path / "serve.stderr", tmp_path / "egressd.toml"
    config.write_text('allow = ["a.test"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    args = ["--config", str(config), "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--audit-log", str(audit)]
    proc, _ = await _serve(args, env, stderr_path)
    try:
        config.write_text('allow = ["b.test"]\nallow_private = ["not a network"]\n')
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: len(_records(audit, "policy.reloaded")) == 1, "policy.reloaded")
        [record] = _records(audit, "policy.reloaded")
        assert record["ok"] is False and "allow_private" in record["error"]
        assert proc.returncode is None
        config.write_text("allow = [\n")
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: len(_records(audit, "policy.reloaded")) == 2, "policy.reloaded")
        assert "config" in _records(audit, "policy.reloaded")[-1]["error"]
        assert proc.returncode is None
        lines = [line for line in stderr_path.read_text().splitlines() if "reload refused" in line]
        assert len(lines) == 2
    finally:
        await _stop(proc)


async def _policy(control_port: int, env: dict[str, str], *args: str) -> tuple[int, str]:
    """``egressd policy default ARGS`` against the serve's control API; its exit status and stderr."""
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "policy", "default", "--control", f"127.0.0.1:{control_port}", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


async def test_an_operators_live_deny_survives_sighup_and_the_reload_record_says_it_was_kept(
    tmp_path: Path, dns: Any, echo_origin: Any
) -> None:
    """The attack: an emergency ``egressd policy default --deny`` silently undone by the next SIGHUP.

    The allow file allows the origin; the operator denies it through the control
    API; a reload (the files unchanged, then changed elsewhere) must keep the
    deny in force (nothing reaches the origin), and each ``policy.reloaded``
    record names the live edit it kept. Once the allow file says the same deny,
    the edit is the file's: removing it from the file then takes effect.
    """
    target = f"origin.test:{echo_origin.port}"
    audit, stderr_path = tmp_path / "audit.jsonl", tmp_path / "serve.stderr"
    allow_file, config = tmp_path / "allow.toml", tmp_path / "egressd.toml"
    allow_file.write_text(f'allow = ["{target}"]\n')
    config.write_text(
        f'allow_file = "{allow_file}"\nask = false\nallow_private = ["{ORIGIN_RANGE}"]\n'
        f'upstream_dns = "127.0.0.1:{dns.address[1]}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env["EGRESSD_CONTROL_TOKEN"] = "live-edit-test-token"
    proc, ports = await _serve(["--config", str(config), "--audit-log", str(audit)], env, stderr_path)

    async def hup(expect_records: int) -> dict[str, Any]:
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: len(_records(audit, "policy.reloaded")) == expect_records, "policy.reloaded")
        return _records(audit, "policy.reloaded")[-1]

    try:
        port = ports["proxy"]
        assert await _status(port, target) == 200
        reached = echo_origin.connections
        assert reached == 1

        status, err = await _policy(ports["control"], env, "--deny", "origin.test")
        assert status == 0, err
        assert await _status(port, target) == 403
        assert echo_origin.connections == reached

        # 1. SIGHUP with the files unchanged: the deny stays, and the record says it was kept.
        record = await hup(1)
        assert await _status(port, target) == 403
        assert echo_origin.connections == reached  # nothing reached the origin after the reload
        assert record["ok"] is True
        assert record["live_kept"] == {"allow": {"added": [], "removed": []},
                                       "deny": {"added": ["origin.test"], "removed": []}}

        # 2. Another change in the allow file: still kept.
        allow_file.write_text(f'allow = ["{target}", "other.test"]\n')
        record = await hup(2)
        assert record["added"] == {"allow": ["other.test"], "deny": []}
        assert record["live_kept"]["deny"]["added"] == ["origin.test"]
        assert await _status(port, target) == 403
        assert echo_origin.connections == reached

        # 3. The allow file now says the deny too: the edit is the file's from here on.
        allow_file.write_text(f'allow = ["{target}"]\ndeny = ["origin.test"]\n')
        record = await hup(3)
        assert record["live_in_files"]["deny"]["added"] == ["origin.test"]
        assert record["live_kept"]["deny"]["added"] == []
        assert await _status(port, target) == 403

        # 4. ... so taking it out of the file lets the origin in again.
        allow_file.write_text(f'allow = ["{target}"]\n')
        record = await hup(4)
        assert record["removed"] == {"allow": [], "deny": ["origin.test"]}
        assert await _status(port, target) == 200

        denied = [r for r in _records(audit, "egress") if r.get("reason") == "denylisted"]
        assert len(denied) >= 3 and all(r["rule"] == "origin.test" for r in denied)
        assert await _stop(proc) == 0
    finally:
        await _stop(proc)
