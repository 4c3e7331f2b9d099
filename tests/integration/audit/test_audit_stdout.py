"""``egressd serve --audit-log -``: the audit log as JSON Lines on standard output.

For a cluster's log collector (deploy/kubernetes/). A real ``egressd serve``
subprocess: its standard output must hold the chained records and nothing
else (its log lines go to standard error), and a reader that went away
(EPIPE) must stop egress (``audit_unavailable``), as a full disk does. The
same egress written by the compiled audit line and by the Python one
(``EGRESSD_NATIVE=0``) is the same records, chained, and the start-up says
which wrote them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import Listener
from tests.fakes.dns import FakeDns
from tests.harness import ORIGIN_RANGE, aserve_ports, read_response

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return env


def _verify(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EGRESSD, "audit", "verify", str(path)], capture_output=True, text=True, timeout=30)


async def _serve(
    tmp_path: Path, dns: FakeDns, stdout: int, *args: str, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, dict[str, int], list[str]]:
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
        "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--allow-private", ORIGIN_RANGE,
        "--audit-log", "-", *args,
        env={**_env(tmp_path), **(env or {})}, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE,
    )  # fmt: skip
    seen: list[str] = []
    assert proc.stderr is not None
    try:
        ports = await aserve_ports(proc.stderr, read=seen)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, ports, seen


async def _connect(port: int, target: str) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    await writer.drain()
    status, headers, _ = await asyncio.wait_for(read_response(reader), 10)
    return status, headers, reader, writer


async def _health(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    await writer.drain()
    status, _, _ = await asyncio.wait_for(read_response(reader), 10)
    writer.close()
    return status


async def _one_allowed_one_refused(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, env: dict[str, str], refused: str
) -> tuple[bytes, str, str]:
    """A serve on stdout that let one tunnel through (one echo) and refused ``refused`` (no approver):
    its standard output, its log (stderr) and the refusal's request id."""
    proc, ports, seen = await _serve(
        tmp_path, dns, subprocess.PIPE, "--allow", f"origin.test:{echo_origin.port}", env=env
    )
    try:
        status, _, reader, writer = await _connect(ports["proxy"], f"origin.test:{echo_origin.port}")
        assert status == 200
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
        writer.close()
        status, headers, _, writer = await _connect(ports["proxy"], refused)
        writer.close()
        assert (status, headers["x-egress-reason"]) == (403, "no_approver")
        await asyncio.sleep(0.2)  # the tunnel's end record
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err
    return out, "".join(seen) + err.decode(errors="replace"), headers["x-egress-request-id"]


async def test_egress_records_go_to_stdout_chained_and_nothing_else_does(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, leak: Listener
) -> None:
    out, text, refused_id = await _one_allowed_one_refused(tmp_path, dns, echo_origin, {}, f"leak.test:{leak.port}")
    assert leak.connections == 0 and echo_origin.connections == 1
    lines = out.splitlines(keepends=True)
    records = [json.loads(line) for line in lines]  # every line of stdout is a record: nothing else is there
    assert all(line.endswith(b"}\n") for line in lines)
    events = [r["event"] for r in records]
    assert (events[0], events[-1], sorted(events[1:-1])) == ("run.start", "run.end", ["egress", "egress", "egress.end"])
    allowed, refused = (next(r for r in records if r.get("host") == host) for host in ("origin.test", "leak.test"))
    assert next(r for r in records if r["event"] == "egress.end")["id"] == allowed["id"]
    assert (allowed["host"], allowed["decision"], allowed["kind"]) == ("origin.test", "allow", "connect")
    assert (refused["host"], refused["decision"], refused["reason"]) == ("leak.test", "deny", "no_approver")
    assert refused["id"] == refused_id
    assert records[0]["prev"] is None
    for before, line in zip(lines, lines[1:], strict=False):
        assert json.loads(line)["prev"] == hashlib.sha256(before).hexdigest()
    # The log lines, "serving:" among them, went to stderr.
    assert "serving:" in text and "audit log standard output" in text
    assert b"serving" not in out
    captured = tmp_path / "captured.jsonl"
    captured.write_bytes(out)
    verify = await asyncio.to_thread(_verify, captured)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "5 records" in verify.stdout
    # An edit in the captured stream is caught like one in a file.
    captured.write_bytes(out.replace(b'"leak.test"', b'"other.test"', 1))
    verify = await asyncio.to_thread(_verify, captured)
    assert verify.returncode == 1, verify.stdout + verify.stderr


_VARYING = ("ts", "id", "prev", "client", "duration_s", "started", "pid", "ended", "address")


async def test_the_compiled_and_the_python_audit_line_write_the_same_records_and_say_which(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    (tmp_path / "compiled").mkdir()
    (tmp_path / "python").mkdir()
    refused = "caf\u00e9.test:443".encode("idna").decode()
    out, compiled_log, _ = await _one_allowed_one_refused(tmp_path / "compiled", dns, echo_origin, {}, refused)
    compiled = out.splitlines(keepends=True)
    out, python_log, _ = await _one_allowed_one_refused(
        tmp_path / "python", dns, echo_origin, {"EGRESSD_NATIVE": "0"}, refused
    )
    python = out.splitlines(keepends=True)
    assert "audit line: Python (EGRESSD_NATIVE=0)" in python_log
    if os.environ.get("CI") == "true":  # CI's install builds it; elsewhere it is there where cargo was
        assert "audit line: compiled (egressd_native " in compiled_log
    for lines, name in ((compiled, "compiled"), (python, "python")):
        path = tmp_path / name / "audit.jsonl"
        path.write_bytes(b"".join(lines))
        verify = await asyncio.to_thread(_verify, path)
        assert verify.returncode == 0 and "5 records" in verify.stdout, verify.stdout + verify.stderr

    def facts(lines: list[bytes]) -> list[tuple[str, list[str]]]:
        """Each record less what varies from run to run, with its keys in order; sorted (the first tunnel's end
        and the second's refusal may be written in either order)."""
        records = [json.loads(line) for line in lines]
        kept = [{k: v for k, v in r.items() if k not in _VARYING} for r in records]
        return sorted((json.dumps(r, sort_keys=True), list(r)) for r in kept)

    assert facts(compiled) == facts(python)


async def test_a_closed_stdout_makes_the_log_unavailable_and_egress_is_refused(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    read_end, write_end = os.pipe()
    try:
        proc, ports, _ = await _serve(tmp_path, dns, write_end, "--allow", f"origin.test:{echo_origin.port}")
    finally:
        os.close(write_end)
    try:
        first = await asyncio.wait_for(asyncio.to_thread(os.read, read_end, 65536), 10)
        assert json.loads(first.splitlines()[0])["event"] == "run.start"
        assert await _health(ports["control"]) == 200
        os.close(read_end)  # the log collector went away
        read_end = -1
        status, headers, _, writer = await _connect(ports["proxy"], f"origin.test:{echo_origin.port}")
        writer.close()
        assert (status, headers["x-egress-reason"]) == (503, "audit_unavailable")
        assert echo_origin.connections == 0  # nothing went out unrecorded
        assert await _health(ports["control"]) == 503
        assert proc.returncode is None  # still serving, refusing
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if read_end >= 0:
            os.close(read_end)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert "Broken pipe" in err.decode(errors="replace")


def test_audit_and_run_refuse_dash_with_one_line(tmp_path: Path) -> None:
    for argv in (["audit", "--audit-log", "-"], ["audit", "verify", "-"], ["run", "--audit-log", "-", "--", "true"]):
        result = subprocess.run([EGRESSD, *argv], capture_output=True, text=True, timeout=30, env=_env(tmp_path))
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "bad setting audit_log: -" in lines[0], (argv, result.stderr)


_SINK_SCRIPT = """
import os, sys
from egressd.audit.log import JsonlAuditSink
sink = JsonlAuditSink("-", fsync=True, max_bytes=10, keep=1)  # a pipe: no fsync, never rotated
print("a stray print", flush=True)
os.write(1, b"a stray write to fd 1\\n")
sink.write({"event": "one"})
sink.reopen()  # nothing to reopen
sink.write({"event": "two"})
os.system("echo a child output")
sink.close()
"""


def test_the_sink_owns_stdout_and_everything_else_goes_to_stderr(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SINK_SCRIPT], capture_output=True, timeout=60, cwd=tmp_path, env=_env(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines(keepends=True)
    assert [json.loads(line)["event"] for line in lines] == ["one", "two"]
    assert json.loads(lines[1])["prev"] == hashlib.sha256(lines[0]).hexdigest()
    for stray in (b"a stray print", b"a stray write to fd 1", b"a child output"):
        assert stray in result.stderr
    assert list(tmp_path.iterdir()) == []  # no file named "-" made, nothing rotated
