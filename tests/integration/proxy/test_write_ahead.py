"""Nothing goes out unrecorded: the write-ahead ``egress`` record and the ``egress.end`` that follows.

Each test is the attack or the accident the design names: the origin looks
in the log at the moment a connection or request reaches it (the record must
be there already); a full disk (a 64 KiB tmpfs) must not let one request out
without its record; ``kill -9`` must leave a log that holds every connection
that was dialled. The sink's batching (one write per loop iteration) is
checked by counting the writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from egressd.audit.chain import verify_files
from egressd.audit.log import AuditError, JsonlAuditSink
from egressd.audit.query import join_ends
from egressd.audit.records import EgressDecided, EgressEnded
from egressd.vocabulary.egress import Decision, EgressKind
from tests.fakes import hellos
from tests.harness import (
    IN_CI,
    ORIGIN,
    ORIGIN_RANGE,
    connect_via,
    open_proxy,
    read_response,
    wait_serve_ports,
    wait_until,
)

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def file_records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a log, parsed (a torn last line is not a record)."""
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


@dataclass
class WatchingOrigin:
    """An origin on ORIGIN that, when a connection or a request head arrives, copies what the log holds."""

    log: Path
    port: int = 0
    seen_at_accept: list[list[dict[str, Any]]] = field(default_factory=list)
    seen_at_request: list[list[dict[str, Any]]] = field(default_factory=list)
    requests: int = 0


@contextlib.asynccontextmanager
async def watching_origin(log: Path, *, http: bool) -> AsyncIterator[WatchingOrigin]:
    state = WatchingOrigin(log)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.seen_at_accept.append(file_records(log))
        try:
            if not http:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
                return
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                state.seen_at_request.append(file_records(log))
                state.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                if b"connection: close" in head.lower():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, ORIGIN, 0)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


def allowed(records: list[dict[str, Any]], host: str = "origin.test") -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == "egress" and r["decision"] == "allow" and r["host"] == host]


async def test_a_tunnel_is_in_the_log_before_the_origin_sees_it_and_ends_with_an_end_record(
    make_egressd, tmp_path: Path
) -> None:
    log = tmp_path / "audit.jsonl"
    async with watching_origin(log, http=False) as origin:
        svc = await make_egressd(allow=["origin.test:*"], audit=JsonlAuditSink(log))
        status, _, _, reader, writer = await connect_via(svc, f"origin.test:{origin.port}")
        assert status == 200
        [before] = origin.seen_at_accept
        [ahead] = allowed(before)
        assert (ahead["bytes_up"], ahead["bytes_down"], ahead["duration_s"]) == (None, None, None)
        assert ahead["address"] == ORIGIN and ahead["kind"] == "connect"
        writer.write(b"x" * 1000)
        assert await reader.readexactly(1000) == b"x" * 1000
        # Open: the log has the connection, and `egressd audit` shows it as open.
        [shown] = [r for r in join_ends(file_records(log)) if r["event"] == "egress"]
        assert shown["end"] == "open"
        writer.close()
        await wait_until(lambda: any(r["event"] == "egress.end" for r in file_records(log)))
    records = file_records(log)
    [end] = [r for r in records if r["event"] == "egress.end"]
    assert end["id"] == ahead["id"] and end["run"] == ahead["run"]
    assert (end["bytes_up"], end["bytes_down"], end["end"], end["address"]) == (1000, 1000, "closed", ORIGIN)
    assert end["duration_s"] > 0
    assert len(allowed(records)) == 1  # refusals and ends are not a second allow
    assert verify_files([log]).problem is None


async def test_every_plain_http_request_is_in_the_log_before_it_reaches_the_origin(
    make_egressd, tmp_path: Path
) -> None:
    """Keep-alive included: the second request rides the kept upstream connection, no new dial."""
    log = tmp_path / "audit.jsonl"
    async with watching_origin(log, http=True) as origin:
        svc = await make_egressd(allow=["origin.test:*"], audit=JsonlAuditSink(log))
        reader, writer = await open_proxy(svc)
        for path in ("/one", "/two"):
            writer.write(f"GET http://origin.test:{origin.port}{path} HTTP/1.1\r\nHost: origin.test\r\n\r\n".encode())
            status, _, body = await read_response(reader)
            assert (status, body) == (200, b"ok")
        writer.close()
        assert len(origin.seen_at_accept) == 1  # one upstream connection carried both
        for n, seen in enumerate(origin.seen_at_request, start=1):
            assert len(allowed(seen)) == n, f"request {n} reached the origin before its record"
        await wait_until(lambda: len([r for r in file_records(log) if r["event"] == "egress.end"]) == 2)
    joined = [r for r in join_ends(file_records(log)) if r["event"] == "egress"]
    assert [(r["decision"], r["end"], r["status"]) for r in joined] == [("allow", "closed", 200)] * 2


async def test_a_tunnel_cut_after_its_clienthello_ends_with_the_reason(make_egressd, tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    async with watching_origin(log, http=False) as origin:
        svc = await make_egressd(allow=["origin.test:*"], audit=JsonlAuditSink(log))
        status, _, _, reader, writer = await connect_via(svc, f"origin.test:{origin.port}")
        assert status == 200
        writer.write(hellos.python_hello("elsewhere.test"))
        await asyncio.wait_for(reader.read(), 5)  # the alert, then the close
        writer.close()
        await wait_until(lambda: any(r["event"] == "egress.end" for r in file_records(log)))
    [end] = [r for r in file_records(log) if r["event"] == "egress.end"]
    assert (end["end"], end["sni"], end["bytes_up"]) == ("sni_mismatch", "elsewhere.test", 0)
    [joined] = [r for r in join_ends(file_records(log)) if r["event"] == "egress"]
    assert (joined["decision"], joined["reason"]) == ("deny", "sni_mismatch")


async def test_a_tunnel_cut_when_the_grace_period_ends_says_shutdown(make_egressd, tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    async with watching_origin(log, http=False) as origin:
        svc = await make_egressd(allow=["origin.test:*"], audit=JsonlAuditSink(log))
        status, _, _, _, writer = await connect_via(svc, f"origin.test:{origin.port}")
        assert status == 200
        await svc.close(grace_s=0.2)
        writer.close()
    [end] = [r for r in file_records(log) if r["event"] == "egress.end"]
    assert end["end"] == "shutdown"
    assert file_records(log)[-1]["event"] == "run.end"  # flushed on the way out, after the end


@contextlib.contextmanager
def tiny_filesystem(kib: int) -> Iterator[Path]:
    """A tmpfs of ``kib`` KiB, mounted for this test alone and unmounted after."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root: mounting a tmpfs must work")
        pytest.skip("mounting a small tmpfs needs root")
    mountpoint = Path(tempfile.mkdtemp(prefix="egressd-test-fullfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0700", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        mountpoint.rmdir()


async def test_a_full_disk_lets_no_request_out_unrecorded(make_egressd, http_origin, caplog) -> None:
    """The reported breach: 67 requests at the origin, 66 allow records. Now: equal, then 503 audit_unavailable."""
    with tiny_filesystem(64) as fs:
        log = fs / "audit.jsonl"
        svc = await make_egressd(allow=["origin.test:*"], audit=JsonlAuditSink(log))
        url = f"http://origin.test:{http_origin.port}/r"
        refused: dict[str, str] = {}
        for _ in range(2000):  # 64 KiB holds a few hundred records
            reader, writer = await open_proxy(svc)
            writer.write(f"GET {url} HTTP/1.1\r\nHost: origin.test\r\nConnection: close\r\n\r\n".encode())
            status, headers, _ = await read_response(reader)
            writer.close()
            if status != 200:
                refused = headers
                break
        assert refused.get("x-egress-reason") == "audit_unavailable", refused
        reached = len(http_origin.requests)
        assert reached > 10
        assert len(allowed(file_records(log))) == reached  # every request that went out has its record
        for _ in range(3):  # and it stays shut
            reader, writer = await open_proxy(svc)
            writer.write(f"GET {url} HTTP/1.1\r\nHost: origin.test\r\nConnection: close\r\n\r\n".encode())
            status, headers, _ = await read_response(reader)
            writer.close()
            assert (status, headers["x-egress-reason"]) == (503, "audit_unavailable")
        assert len(http_origin.requests) == reached
        async with aiohttp.ClientSession(svc.control_address) as http:  # says why, to a monitor
            async with http.get("/health") as resp:
                assert (resp.status, (await resp.json())["audit"]) == (503, False)
        assert any("No space left on device" in r.getMessage() for r in caplog.records if r.name == "egressd.audit")
        await svc.close(grace_s=0)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (its workers), read before it is killed."""
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return env


async def test_kill_9_leaves_a_valid_log_that_holds_every_dialled_connection(tmp_path: Path, dns) -> None:
    log = tmp_path / "audit.jsonl"
    tunnels = 20
    workers: list[int] = []
    async with watching_origin(log, http=False) as origin:
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, its ports read in a thread
            [EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
             "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--audit-log", str(log),
             "--allow-private", ORIGIN_RANGE, "--allow", "origin.test:*"],
            env=_env(tmp_path), stderr=subprocess.PIPE,
        )  # fmt: skip
        writers: list[asyncio.StreamWriter] = []
        try:
            port = await asyncio.to_thread(wait_serve_ports, proc)
            port = port["proxy"]
            for _ in range(tunnels):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writers.append(writer)
                writer.write(f"CONNECT origin.test:{origin.port} HTTP/1.1\r\n\r\n".encode())
                status, _, _ = await read_response(reader)
                assert status == 200
                writer.write(b"payload")
                assert await reader.readexactly(7) == b"payload"
            assert len(origin.seen_at_accept) == tunnels
            workers = _children(proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            # A worker outlives its owner only to cut its tunnels (recording how they ended) and exit.
            await wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 15)
        finally:
            for writer in writers:
                writer.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stderr is not None
            proc.stderr.close()
    assert log.read_bytes().endswith(b"\n")  # whole lines only: each batch is one write
    records = file_records(log)
    assert len(allowed(records)) == tunnels
    ends = [r for r in records if r["event"] == "egress.end"]
    # The killed process never saw its tunnels end; a surviving worker ends its own as a shutdown.
    assert {r["end"] for r in ends} <= {"shutdown"}, ends
    assert bool(ends) == bool(workers)  # 20 tunnels spread over the processes (1 in 2**20 all on one)
    assert len({r["id"] for r in ends}) == len(ends) and {r["id"] for r in ends} <= {r["id"] for r in allowed(records)}
    shown = await asyncio.to_thread(
        subprocess.run,
        [EGRESSD, "audit", "--audit-log", str(log), "--json"], env=_env(tmp_path),
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    lines = [json.loads(line) for line in shown.stdout.splitlines()]
    shown_ends = sorted(r["end"] for r in lines if r["event"] == "egress")
    assert shown_ends == sorted(["open"] * (tunnels - len(ends)) + ["shutdown"] * len(ends))
    verified = await asyncio.to_thread(
        subprocess.run,
        [EGRESSD, "audit", "verify", str(log)], env=_env(tmp_path), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout + verified.stderr


# -- the sink: one write per loop iteration ------------------------------------------


def _record(n: int) -> dict[str, object]:
    return EgressDecided(
        id=f"q-{n:016x}", ts=1.0, run="r", kind=EgressKind.CONNECT, client="127.0.0.1:1", host="origin.test",
        port=443, address=ORIGIN, decision=Decision.ALLOW, reason=None, rule="origin.test", approval=None, command=None,
    ).record()  # fmt: skip


def _end(
    *,
    id: str,
    ts: float,
    run: str,
    address: str | None,
    bytes_up: int,
    bytes_down: int,
    duration_s: float,
    end: str,
    **extra: object,
) -> dict[str, object]:
    return EgressEnded(id, ts, run, address, bytes_up, bytes_down, duration_s, end, extra or None).record()  # fmt: skip


def _count_writes(monkeypatch: pytest.MonkeyPatch, fd: int) -> list[int]:
    sizes: list[int] = []
    real = os.write

    def counting(target: int, data: bytes) -> int:
        if target == fd:
            sizes.append(len(data))
        return real(target, data)

    monkeypatch.setattr(os, "write", counting)
    return sizes


async def test_final_records_of_one_loop_turn_go_out_in_one_write(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        writes = _count_writes(monkeypatch, sink._fd)
        for n in range(50):
            sink.write(_end(id=f"q-{n}", ts=1.0, run="r", address=None, bytes_up=0, bytes_down=0,
                            duration_s=0.0, end="closed"))  # fmt: skip
        assert writes == [] and not log.read_bytes()  # queued until the turn ends
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(writes) == 1 and len(file_records(log)) == 50
    assert verify_files([log]).problem is None


async def test_a_record_ahead_of_a_dial_goes_out_at_once_with_what_was_queued_before_it(
    tmp_path: Path, monkeypatch
) -> None:
    """The dial does not wait for the turn to end; the final records queued before it share its write."""
    log = tmp_path / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        writes = _count_writes(monkeypatch, sink._fd)
        for n in range(3):
            sink.write(_end(id=f"q-{n}", ts=1.0, run="r", address=None, bytes_up=0, bytes_down=0,
                            duration_s=0.0, end="closed"))  # fmt: skip
        sink.write_ahead(_record(7))
        assert len(writes) == 1 and [r["id"] for r in file_records(log)] == ["q-0", "q-1", "q-2", _record(7)["id"]]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(writes) == 1  # nothing was left for the turn's end
    assert verify_files([log]).problem is None


async def test_a_batch_that_crosses_the_rotation_size_is_split_between_records(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    line = len(json.dumps(_record(0), separators=(",", ":"))) + 80  # with prev
    with JsonlAuditSink(log, max_bytes=line * 10, keep=20) as sink:
        for n in range(45):
            sink.write(_record(n))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    rotated = tmp_path.glob("audit.jsonl.*")  # noqa: ASYNC240 - a test's look
    files = sorted(rotated, key=lambda p: -int(p.suffix[1:])) + [log]
    assert len(files) >= 4
    ids = [r["id"] for path in files for r in file_records(path)]
    assert ids == [f"q-{n:016x}" for n in range(45)]  # none lost, none split, in order
    assert verify_files(files).problem is None


async def test_a_failed_write_refuses_the_dial_and_every_one_after(tmp_path: Path) -> None:
    with JsonlAuditSink("/dev/full") as sink:
        sink.write(_record(1))  # queued: its failure comes at the turn's end, or with the next dial's write
        with pytest.raises(AuditError, match="No space left on device"):
            sink.write_ahead(_record(2))
        assert not sink.healthy
        for n in range(3):
            with pytest.raises(AuditError):
                sink.write_ahead(_record(3 + n))


def test_written_at_once_outside_an_event_loop(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        sink.write(_record(1))
        assert len(file_records(log)) == 1


# -- reading it back: one line per connection ---------------------------------------


def test_join_folds_the_end_into_its_connection_and_keeps_the_rest() -> None:
    ahead = _record(1)
    refused = {**_record(2), "decision": "deny", "reason": "not_allowlisted"}
    end = _end(id="q-0000000000000001", ts=2.0, run="r", address=ORIGIN, bytes_up=5, bytes_down=7,
               duration_s=1.5, end="closed", status=200)  # fmt: skip
    still_open = _record(3)
    cut = _record(4)
    cut_end = _end(id="q-0000000000000004", ts=2.0, run="r", address=ORIGIN, bytes_up=0,
                   bytes_down=0, duration_s=0.1, end="sni_mismatch")  # fmt: skip
    orphan = _end(id="q-00000000000000ff", ts=2.0, run="r", address=None, bytes_up=0, bytes_down=0,
                  duration_s=0.1, end="closed")  # fmt: skip
    joined = join_ends([orphan, ahead, refused, still_open, end, cut, cut_end])
    assert [r["event"] for r in joined] == ["egress.end", "egress", "egress", "egress", "egress"]
    one, two, three, four = joined[1:]
    assert (one["bytes_up"], one["bytes_down"], one["duration_s"]) == (5, 7, 1.5)
    assert (one["end"], one["status"]) == ("closed", 200)
    assert one["ts"] == ahead["ts"]  # the connection's own time, not its end's
    assert "end" not in two and two["reason"] == "not_allowlisted"
    assert three["end"] == "open" and three["bytes_up"] is None
    assert (four["decision"], four["reason"], four["end"]) == ("deny", "sni_mismatch", "sni_mismatch")


def test_the_table_shows_an_open_connection_as_open(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        sink.write(_record(1))
    shown = subprocess.run(
        [EGRESSD, "audit", "--audit-log", str(log)], env=_env(tmp_path), capture_output=True, text=True, timeout=30
    )
    [_, row] = shown.stdout.splitlines()
    assert "ALLOW" in row and " open " in row


def test_egressd_audit_filters_the_joined_line(tmp_path: Path) -> None:
    """An end record has no host or decision of its own: the filter sees the joined connection."""
    log = tmp_path / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        sink.write(_record(1))
        sink.write(_end(id="q-0000000000000001", ts=2.0, run="r", address=ORIGIN, bytes_up=0,
                        bytes_down=0, duration_s=0.1, end="sni_mismatch"))  # fmt: skip
    shown = subprocess.run(
        [EGRESSD, "audit", "--audit-log", str(log), "--json", "--decision", "deny", "--host", "origin.test"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    [line] = [json.loads(x) for x in shown.stdout.splitlines()]
    assert (line["event"], line["reason"]) == ("egress", "sni_mismatch")


def test_egressd_audit_reads_the_rotated_files_too_and_joins_across_them(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    line = len(json.dumps(_record(0), separators=(",", ":"))) + 80
    with JsonlAuditSink(log, max_bytes=line * 2, keep=5) as sink:
        sink.write(_record(1))
        sink.write(_record(2))
        sink.write(_record(3))  # rotates: 1 and 2 are now in audit.jsonl.1
        sink.write(_end(id="q-0000000000000001", ts=2.0, run="r", address=ORIGIN, bytes_up=3,
                        bytes_down=4, duration_s=0.1, end="closed"))  # fmt: skip
    assert (tmp_path / "audit.jsonl.1").exists()
    shown = subprocess.run(
        [EGRESSD, "audit", "--audit-log", str(log), "--json"], env=_env(tmp_path),
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    lines = [json.loads(x) for x in shown.stdout.splitlines()]
    assert [(r["id"][-1], r["end"]) for r in lines] == [("1", "closed"), ("2", "open"), ("3", "open")]
