"""The audit log's hash chain, its rotation and its reopen on SIGUSR1 (DESIGN.md, "Audit log").

The attacks are on the file after the fact: a record edited, removed,
inserted, or the tail cut off; ``egressd audit verify`` must name where.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from egressd.audit.chain import ChainLine, ChainReport, verify_chain, verify_files
from egressd.audit.fields import RecordError
from egressd.audit.log import JsonlAuditSink
from egressd.audit.records import EgressDecided, EgressEnded, run_record
from egressd.vocabulary.egress import Decision, EgressKind
from tests.harness import free_port, require, wait_serve_ports_in

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def _record(n: int) -> dict[str, object]:
    return run_record("run.start", ts=1_764_000_000.0 + n, run=f"r-{n}", task=f"task {n}")


def _write(path: Path, count: int, **kwargs: object) -> None:
    with JsonlAuditSink(path, **kwargs) as sink:  # type: ignore[arg-type]
        for n in range(count):
            sink.write(_record(n))


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _verify(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EGRESSD, "audit", "verify", *map(str, files)], capture_output=True, text=True, timeout=30)


def _rewrite(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(lines))


def test_every_record_carries_the_sha256_of_the_previous_line_as_written(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 5)
    _write(log, 3)  # a second writer continues the chain from the file's last line
    lines = _lines(log)
    assert len(lines) == 8
    assert json.loads(lines[0])["prev"] is None  # the first record of a fresh log
    for before, line in zip(lines, lines[1:], strict=False):
        assert json.loads(line)["prev"] == hashlib.sha256(before).hexdigest()


def test_verify_passes_an_untouched_log_and_counts_its_records(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 7)
    result = _verify(log)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 records" in result.stdout


def test_verify_names_a_record_whose_field_was_edited(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 6)
    lines = _lines(log)
    record = json.loads(lines[2])
    lines[2] = lines[2].replace(b'"task 2"', b'"task X"')
    _rewrite(log, lines)
    result = _verify(log)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "line 3" in result.stdout and record["run"] in result.stdout
    assert "edited" in result.stdout


def test_verify_names_the_first_record_after_a_removed_one(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 6)
    lines = _lines(log)
    after_gap = json.loads(lines[4])
    del lines[3]
    _rewrite(log, lines)
    result = _verify(log)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "line 4" in result.stdout and after_gap["run"] in result.stdout
    assert "removed" in result.stdout


def test_verify_names_an_inserted_record_even_one_with_a_correct_prev(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 6)
    lines = _lines(log)
    # A forger who knows the scheme: the inserted record's prev is right.
    forged = dict(_record(99), run="r-forged", prev=hashlib.sha256(lines[2]).hexdigest())
    lines.insert(3, json.dumps(forged, separators=(",", ":")).encode() + b"\n")
    _rewrite(log, lines)
    result = _verify(log)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "line 4" in result.stdout and "r-forged" in result.stdout and "inserted" in result.stdout


def test_verify_names_a_naively_inserted_record(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 6)
    lines = _lines(log)
    lines.insert(3, json.dumps(dict(_record(99), run="r-forged", prev=None)).encode() + b"\n")
    _rewrite(log, lines)
    result = _verify(log)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "line 4" in result.stdout and "r-forged" in result.stdout and "inserted" in result.stdout


def test_verify_reports_a_truncated_tail(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 4)
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - 20])
    result = _verify(log)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "truncated" in result.stdout and "line 4" in result.stdout


def test_rotation_loses_and_splits_nothing_and_the_chain_runs_across_files(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    written = 200
    _write(log, written, max_bytes=2000, keep=100)
    rotated = sorted(tmp_path.glob("audit.jsonl.*"), key=lambda p: int(p.suffix[1:]), reverse=True)
    assert len(rotated) >= 5
    files = [*rotated, log]  # oldest first
    seen: list[str] = []
    for path in files:
        assert path.stat().st_size <= 2000
        for line in _lines(path):
            assert line.endswith(b"\n")
            seen.append(str(json.loads(line)["run"]))
    assert seen == [f"r-{n}" for n in range(written)]
    assert (os.stat(rotated[0]).st_mode & 0o777) == 0o600 and (os.stat(log).st_mode & 0o777) == 0o600
    result = _verify(*files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{written} records" in result.stdout
    # With no FILE, verify reads the log the settings name and its rotated files, oldest first.
    default = subprocess.run(
        [EGRESSD, "audit", "--audit-log", str(log), "verify"], capture_output=True, text=True, timeout=30
    )
    assert default.returncode == 0 and f"{written} records" in default.stdout, default.stdout + default.stderr


def test_rotation_keeps_only_the_configured_number_of_old_files(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 200, max_bytes=2000, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    # The oldest file kept starts mid-chain; verify says so but passes.
    result = _verify(tmp_path / "audit.jsonl.2", tmp_path / "audit.jsonl.1", log)
    assert result.returncode == 0, result.stdout + result.stderr


def _deny_one(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"CONNECT blocked.test:443 HTTP/1.1\r\nHost: blocked.test:443\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 403")


def _wait(predicate, timeout_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigusr1_reopens_the_log_after_logrotate_moved_it_and_the_chain_continues(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    stderr = tmp_path / "serve.stderr"
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [
                EGRESSD,
                "serve",
                # One process: what it queued before the signal goes to the moved file. A worker follows the
                # reopen at its next batch, so a record it still held lands in the new file (nothing is lost;
                # tests/integration/audit/test_audit_shared.py); this test counts the old file's records exactly.
                "--workers",
                "1",
                "--listen",
                "127.0.0.1:0",
                "--control",
                "127.0.0.1:0",
                # Only names outside the allowlist are asked for, denied before any lookup: nothing dials this port.
                "--upstream-dns",
                f"127.0.0.1:{free_port()}",
                "--audit-log",
                str(log),
            ],
            env=env,
            stderr=err,
        )
    try:
        port = wait_serve_ports_in(stderr, proc)["proxy"]  # the port it bound, read from its report
        _deny_one(port)
        _deny_one(port)
        moved = tmp_path / "audit.jsonl.1"
        os.rename(log, moved)  # what logrotate does
        _deny_one(port)  # still goes to the moved file: nothing lost before the signal
        proc.send_signal(signal.SIGUSR1)
        _wait(log.exists)
        _deny_one(port)
        _deny_one(port)
        _wait(lambda: len(_lines(log)) == 2)
        old, new = _lines(moved), _lines(log)
        assert sum(json.loads(x).get("event") == "egress" for x in old) == 3
        assert json.loads(new[0])["prev"] == hashlib.sha256(old[-1]).hexdigest()
        result = _verify(moved, log)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{len(old) + len(new)} records" in result.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _chain(*bodies: str) -> list[ChainLine]:
    """Lines chained the way the writer chains them (pure: no file)."""
    out: list[ChainLine] = []
    prev: str | None = None
    for n, body in enumerate(bodies, 1):
        raw = json.dumps({"id": body, "prev": prev}).encode() + b"\n"
        out.append(ChainLine("log", n, raw))
        prev = hashlib.sha256(raw).hexdigest()
    return out


def test_verify_chain_is_pure_and_names_the_break() -> None:
    lines = _chain("a", "b", "c", "d")
    assert verify_chain(lines) == ChainReport(4, None)
    edited = [*lines[:1], ChainLine("log", 2, lines[1].raw.replace(b'"b"', b'"B"')), *lines[2:]]
    report = verify_chain(edited)
    assert not report.ok and report.records == 2 and "line 2 of log (id B) was edited" in str(report.problem)
    assert "line 1 of log" in str(verify_chain([ChainLine("log", 1, b"not json\n")]).problem)
    # A record without prev is not a chained record, whatever else it holds.
    assert not verify_chain([ChainLine("log", 1, b'{"id":"x"}\n')]).ok


def test_verify_notes_a_log_that_starts_mid_chain_and_still_passes() -> None:
    report = verify_chain(_chain("a", "b", "c")[1:])
    assert report.ok and report.records == 2 and "continues a chain" in report.notes[0]


def test_the_writer_sets_prev_itself_whatever_the_caller_put_there(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        sink.write({"event": "x", "prev": "f" * 64})
        sink.write({"event": "y", "prev": None})
    assert verify_files([log]).ok


def test_a_torn_record_left_by_a_crash_is_named_and_the_writer_chains_past_it(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 3)
    with log.open("ab") as f:
        f.write(b'{"event":"run.st')  # a crash mid-write
    _write(log, 2)
    lines = _lines(log)
    assert json.loads(lines[4])["prev"] == hashlib.sha256(lines[3]).hexdigest()
    report = verify_files([log])
    assert not report.ok and "line 4 of" in str(report.problem) and report.records == 3


def test_a_new_writer_on_an_empty_log_continues_the_chain_of_the_rotated_file(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write(log, 3)
    os.rename(log, tmp_path / "audit.jsonl.1")  # moved away while egressd was stopped
    _write(log, 2)
    assert verify_files([tmp_path / "audit.jsonl.1", log]) == ChainReport(5, None)


def test_reopen_without_a_move_keeps_writing_the_same_file(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        sink.write(_record(0))
        sink.reopen()  # a SIGUSR1 with nothing moved: our own lock must not lock us out
        sink.write(_record(1))
        assert sink.healthy
    assert verify_files([log]) == ChainReport(2, None)


def test_reopen_that_cannot_open_the_path_loses_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "logs"
    directory.mkdir()
    log = directory / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        sink.write(_record(0))
        os.rename(directory, tmp_path / "moved")
        sink.reopen()  # the directory is gone: records keep going to the open file
        sink.write(_record(1))
        assert sink.healthy
    assert verify_files([tmp_path / "moved" / "audit.jsonl"]) == ChainReport(2, None)


def test_a_last_line_longer_than_a_read_chunk_is_still_chained_onto(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonlAuditSink(log) as sink:
        sink.write(_record(0))
        sink.write({"event": "x", "command": "y" * 1_200_000})
    _write(log, 1)
    assert verify_files([log]) == ChainReport(3, None)


def test_rotation_never_renames_a_file_that_is_not_a_regular_one(tmp_path: Path) -> None:
    # A device node of the test's own, /dev/null's twin, stands for /dev/null (never the real one: we are root).
    require(os.geteuid() == 0, "making a device node needs root")
    null = tmp_path / "audit.null"
    os.mknod(null, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    with JsonlAuditSink(null, max_bytes=10, keep=2) as sink:
        for n in range(5):
            sink.write(_record(n))
        assert sink.healthy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.null"]


def test_no_record_builder_lets_a_caller_set_prev() -> None:
    # prev is the writer's: a builder that passed one through would let a caller pick its place in the chain.
    with pytest.raises(RecordError, match="prev"):
        run_record("run.start", ts=0.0, run="r", prev="0" * 64)
    with pytest.raises(RecordError, match="prev"):
        EgressDecided(
            id="q",
            ts=0.0,
            run="r",
            kind=EgressKind.CONNECT,
            client=None,
            host="h",
            port=1,
            address=None,
            decision=Decision.DENY,
            reason="denied",
            rule=None,
            approval=None,
            command=None,
            extra={"prev": "0" * 64},
        ).record()
    with pytest.raises(RecordError, match="prev"):
        EgressEnded(
            id="q",
            ts=0.0,
            run="r",
            address=None,
            bytes_up=0,
            bytes_down=0,
            duration_s=0.0,
            end="closed",
            extra={"prev": "0" * 64},
        ).record()


def test_whole_records_cut_from_the_tail_pass_the_chain_but_not_the_head_egressd_said_at_stop(tmp_path: Path) -> None:
    """Issue 29: deleting the last records left a valid chain, and the docs said otherwise. The attack: the
    tail cut at a line boundary. egressd's own log carries the head; `verify --head` finds the cut."""
    log = tmp_path / "audit.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(tmp_path)}
    said = tmp_path / "serve.stderr"
    with said.open("wb") as err:
        proc = subprocess.Popen(
            [EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0", "--upstream-dns",
             f"127.0.0.1:{free_port()}", "--audit-log", str(log)],
            env=env, stderr=err,
        )  # fmt: skip
    try:
        port = wait_serve_ports_in(said, proc)["proxy"]
        for _ in range(3):
            _deny_one(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    stderr = said.read_text()
    heads = [line.split("audit head ")[1].split()[0] for line in stderr.splitlines() if "audit head " in line]
    assert heads, stderr
    head = heads[-1]
    assert hashlib.sha256(_lines(log)[-1]).hexdigest() == head  # the head is the last line as written
    ok = subprocess.run([EGRESSD, "audit", "verify", "--head", head, str(log)], capture_output=True, text=True,
                        timeout=30)  # fmt: skip
    assert ok.returncode == 0 and "the head given among them" in ok.stdout, ok.stdout
    _rewrite(log, _lines(log)[:-2])  # the last two records gone, whole lines: the chain still holds
    assert _verify(log).returncode == 0
    cut = subprocess.run([EGRESSD, "audit", "verify", "--head", head, str(log)], capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    assert cut.returncode == 1 and "cut from the log's tail" in cut.stdout, cut.stdout


def test_verify_chain_with_a_head_finds_it_anywhere_in_the_log() -> None:
    lines = _chain("a", "b", "c")
    middle = hashlib.sha256(lines[1].raw).hexdigest()
    assert verify_chain(lines, head=middle).ok  # records written after the head was said are fine
    assert not verify_chain(lines[:1], head=middle).ok
    assert "cut from the log's tail" in (verify_chain(lines[:1], head=middle).problem or "")
