"""One audit chain written by several processes (``--workers``): ``SharedChain`` (egressd.audit.shared).

Real processes, each with a sink of its own on one file: the records of all
of them end up in one chain in write order, rotation and reopen are
followed by every process, and the deaths the issue names are attacks:
``kill -9`` of a writer holding the lock (the others go on), of one that
tore a line (the next writer ends it and chains past it), of one killed
while writing as fast as it can (nothing it wrote is lost). A second
egressd is still kept off the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressd.audit.chain import ChainLine, verify_chain, verify_files
from egressd.audit.log import AuditError, JsonlAuditSink
from egressd.audit.shared import SharedChain

# A writer of the same egressd, in a process of its own: attaches to the chain passed down as a descriptor.
# Modes: "write N" writes N records then exits; "stream" writes until killed (10 s at most);
# "hold" takes the lock and sleeps; "tear" takes the lock, writes half a line and sleeps; "efbig" fails a
# write. The writing modes say "ready" and wait for a line on standard input before they write.
_MEMBER = r"""
import os, sys, time
from egressd.audit.log import JsonlAuditSink
from egressd.audit.shared import SharedChain
fd, path, tag, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
count, max_bytes = int(sys.argv[5]), int(sys.argv[6])
chain = SharedChain.attach(fd)
sink = JsonlAuditSink(path, shared=chain, max_bytes=max_bytes, keep=50)
if mode == "hold":
    with chain:
        print("holding", flush=True)
        time.sleep(30)
elif mode == "tear":
    with chain:
        log = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.write(log, b'{"event":"torn","who":"' + tag.encode())
        print("torn", flush=True)
        time.sleep(30)
elif mode == "efbig":  # this process may not grow the file: its next write fails (EFBIG), as a full disk would
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    size = os.stat(path).st_size
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        sink.write_ahead({"event": "w", "who": tag, "n": 0})
    except Exception as exc:
        print("failed", exc, flush=True)
    time.sleep(30)
print("ready", flush=True)
sys.stdin.readline()  # the go: every writer starts at once
deadline = time.monotonic() + 10
n = 0
while (mode == "stream" or n < count) and time.monotonic() < deadline:
    sink.write_ahead({"event": "w", "who": tag, "n": n})
    n += 1
sink.close()
print("done", n, flush=True)
"""


class Members:
    """The member processes a test started; each killed at the end if it still runs."""

    def __init__(self, chain: SharedChain, log: Path, max_bytes: int = 0) -> None:
        self.chain, self.log, self.max_bytes = chain, log, max_bytes
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, tag: str, mode: str, count: int = 0) -> subprocess.Popen[str]:
        args = [str(self.chain.fd), str(self.log), tag, mode, str(count), str(self.max_bytes)]
        proc = subprocess.Popen(
            [sys.executable, "-c", _MEMBER, *args],
            pass_fds=(self.chain.fd,),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def run(self, tag: str, count: int) -> None:
        """A member that writes ``count`` records, to its end."""
        self.go([self.start(tag, "write", count)])

    def go(self, procs: list[subprocess.Popen[str]], wait: bool = True) -> None:
        """Tell members that said "ready" to write; ``wait``: until they are done."""
        for proc in procs:
            _said(proc, "ready")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs if wait else ():
            assert proc.wait(timeout=30) == 0

    def alongside(self, sink: JsonlAuditSink, count: int) -> None:
        """Members "a" and "b" and the founder's ``sink`` each write ``count`` records at once, to their end."""
        procs = [self.start(tag, "write", count) for tag in ("a", "b")]
        self.go(procs, wait=False)
        for n in range(count):
            sink.write_ahead({"event": "w", "who": "founder", "n": n})
            if n == count // 2:  # half-way, until both members write too (a loaded machine may start them late)
                self._until_written(("a", "b"))
        for proc in procs:
            assert proc.wait(timeout=30) == 0

    def _until_written(self, whos: tuple[str, ...], timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = set()
            lines: list[str] = []
            for path in self.log.parent.glob(self.log.name + "*"):  # the log, and the files it rotated to
                with contextlib.suppress(FileNotFoundError):  # renamed as it is read: found again next time
                    lines += path.read_text().splitlines()
            for line in lines:
                try:
                    seen.add(json.loads(line).get("who"))
                except ValueError:
                    pass  # a line being written
            if set(whos) <= seen:
                return
            time.sleep(0.01)
        raise AssertionError(f"{whos} wrote nothing within {timeout_s}s")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


@pytest.fixture
def founded(tmp_path: Path) -> Iterator[tuple[JsonlAuditSink, Members]]:
    chain = SharedChain.create()
    log = tmp_path / "audit.jsonl"
    sink = JsonlAuditSink(log, shared=chain)
    members = Members(chain, log)
    yield sink, members
    members.stop()
    sink.close()
    chain.close()


def _said(proc: subprocess.Popen[str], word: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(word), f"member said {line!r}, not {word!r}"
    return line


def _records(*files: Path) -> list[dict[str, object]]:
    return [json.loads(raw) for path in files for raw in path.read_bytes().splitlines()]


def test_three_processes_writing_at_once_make_one_chain_with_every_record(
    founded: tuple[JsonlAuditSink, Members],
) -> None:
    sink, members = founded
    members.alongside(sink, 400)
    report = verify_files([members.log])
    assert report.ok, report.problem
    records = _records(members.log)
    assert report.records == len(records) == 1200
    for who in ("founder", "a", "b"):  # each writer's records all there, in its own order
        assert [r["n"] for r in records if r["who"] == who] == list(range(400))
    # They really interleaved: the founder's records are not one block before or after the others'.
    whos = [r["who"] for r in records]
    assert sum(1 for x, y in zip(whos, whos[1:], strict=False) if x != y) > 2


def test_rotation_by_any_process_is_followed_by_the_others_and_the_chain_crosses_files(tmp_path: Path) -> None:
    chain = SharedChain.create()
    log = tmp_path / "audit.jsonl"
    members = Members(chain, log, max_bytes=4096)
    try:
        with JsonlAuditSink(log, shared=chain, max_bytes=4096, keep=50) as sink:
            members.alongside(sink, 300)
    finally:
        members.stop()
        chain.close()
    rotated = sorted(tmp_path.glob("audit.jsonl.*"), key=lambda p: -int(p.suffix[1:]))
    assert len(rotated) > 5
    files = [*rotated, log]
    report = verify_files(files)
    assert report.ok, report.problem
    assert report.records == len(_records(*files)) == 900
    assert all(path.stat().st_size <= 4096 for path in files)


def test_reopen_after_logrotate_moves_the_file_sends_every_process_to_the_new_one(
    founded: tuple[JsonlAuditSink, Members],
) -> None:
    sink, members = founded
    log = members.log
    members.run("a", 5)
    os.rename(log, log.with_name("audit.jsonl.1"))  # logrotate's move, then SIGUSR1 to the founder
    sink.reopen()
    sink.write_ahead({"event": "w", "who": "founder", "n": 0})
    members.run("b", 5)
    moved = log.with_name("audit.jsonl.1")
    assert [r["who"] for r in _records(moved)] == ["a"] * 5
    assert [r["who"] for r in _records(log)] == ["founder"] + ["b"] * 5
    report = verify_files([moved, log])
    assert report.ok and report.records == 11, report.problem


def test_a_writer_killed_while_holding_the_lock_does_not_stop_the_others(
    founded: tuple[JsonlAuditSink, Members],
) -> None:
    sink, members = founded
    holder = members.start("h", "hold")
    _said(holder, "holding")
    done = threading.Event()

    def write() -> None:
        sink.write_ahead({"event": "w", "who": "founder", "n": 0})
        done.set()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert not done.wait(0.5)  # the lock is real: the founder waits for the holder
    os.kill(holder.pid, signal.SIGKILL)
    assert done.wait(10), "the lock outlived its holder"
    writer.join()
    assert verify_files([members.log]).ok


def test_a_line_torn_by_a_writer_killed_mid_write_is_ended_and_chained_past(
    founded: tuple[JsonlAuditSink, Members],
) -> None:
    sink, members = founded
    sink.write_ahead({"event": "w", "who": "founder", "n": 0})
    tearer = members.start("t", "tear")
    _said(tearer, "torn")
    os.kill(tearer.pid, signal.SIGKILL)
    tearer.wait(timeout=10)
    sink.write_ahead({"event": "w", "who": "founder", "n": 1})
    members.run("b", 2)
    lines = members.log.read_bytes().splitlines(keepends=True)
    assert len(lines) == 5 and lines[1] == b'{"event":"torn","who":"t\n'  # ended, never glued to a record
    assert json.loads(lines[2])["prev"] == hashlib.sha256(lines[1]).hexdigest()
    after = [ChainLine("log", n, raw) for n, raw in enumerate(lines[2:], 3)]
    assert verify_chain(after).ok  # past the torn line the chain is whole
    report = verify_files([members.log])
    assert not report.ok and "line 2 of" in str(report.problem)  # and verify names the torn line


def test_kill_9_of_a_writer_streaming_records_loses_nothing_it_wrote(
    founded: tuple[JsonlAuditSink, Members],
) -> None:
    sink, members = founded
    streamer = members.start("s", "stream")
    members.go([streamer], wait=False)
    deadline = time.monotonic() + 10
    while members.log.stat().st_size < 20_000 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(streamer.pid, signal.SIGKILL)
    streamer.wait(timeout=10)
    for n in range(3):
        sink.write_ahead({"event": "w", "who": "founder", "n": n})
    lines = members.log.read_bytes().splitlines(keepends=True)
    whole = [json.loads(raw) for raw in lines if raw.endswith(b"}\n")]
    numbers = [r["n"] for r in whole if r["who"] == "s"]
    assert len(numbers) > 100 and numbers == list(range(len(numbers)))  # every record it wrote, none skipped
    assert [r["who"] for r in whole[-3:]] == ["founder"] * 3
    torn = [raw for raw in lines if not raw.endswith(b"}\n")]
    assert len(torn) <= 1  # killed mid-write at most once
    start = lines.index(torn[0]) + 1 if torn else 0
    report = verify_chain(ChainLine("log", n, raw) for n, raw in enumerate(lines[start:], start + 1))
    assert report.ok, report.problem


def test_another_egressd_is_still_kept_off_a_shared_log(founded: tuple[JsonlAuditSink, Members]) -> None:
    sink, members = founded
    members.run("a", 1)
    with pytest.raises(AuditError, match="another egressd"):
        JsonlAuditSink(members.log)  # a single-process egressd
    other = SharedChain.create()
    try:
        with pytest.raises(AuditError, match="another egressd"):
            JsonlAuditSink(members.log, shared=other)  # the founder of another group
    finally:
        other.close()
    sink.write_ahead({"event": "w", "who": "founder", "n": 0})
    assert verify_files([members.log]).ok


def test_a_descriptor_that_is_not_a_chain_is_refused(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    with pytest.raises(ValueError, match="not an audit chain"):
        SharedChain.attach(fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # taken, and closed, either way


def test_a_write_that_fails_in_one_process_fails_the_log_for_every_process(
    founded: tuple[JsonlAuditSink, Members],
) -> None:
    sink, members = founded
    sink.write_ahead({"event": "w", "who": "founder", "n": 0})
    failing = members.start("f", "efbig")
    assert "File too large" in _said(failing, "failed")
    assert not sink.healthy  # a hole made by another process is a hole: egress is refused here too
    with pytest.raises(AuditError, match="another process of this egressd"):
        sink.write_ahead({"event": "w", "who": "founder", "n": 1})
    # Nothing after the failure: the founder's first line, and what the failed write got in (10 bytes, torn).
    assert members.log.read_bytes() == b'{"event":"w","who":"founder","n":0,"prev":null}\n{"event":"'
