"""The audit log: records, the JSON Lines sink, and reading it back."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import stat
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.audit.approvalrecords import approval_decided_record, approval_requested_record
from egressd.audit.display import format_json, format_table
from egressd.audit.fields import RecordError
from egressd.audit.log import AuditError, AuditSink, JsonlAuditSink, MemoryAuditSink
from egressd.audit.query import (
    AuditFilter,
    follow_records,
    parse_since,
    read_records,
    read_records_from,
)
from egressd.audit.records import EGRESS_FIELDS, EgressDecided, new_request_id, rfc3339, run_record
from egressd.vocabulary.egress import Decision, EgressKind

# 2026-11-29T10:54:52.123456Z
T0 = 1795949692.123456


def egress(**overrides: object) -> dict[str, object]:
    """An egress record with plausible values; keyword arguments replace them."""
    values: dict[str, object] = {
        "id": "q-0000000000000001",
        "ts": T0,
        "run": "r-7f3a",
        "kind": "connect",
        "client": "10.200.0.2:40112",
        "host": "pypi.org",
        "port": 443,
        "address": "151.101.0.223",
        "decision": "allow",
        "reason": None,
        "rule": "pypi.org",
        "approval": None,
        "command": "pip install requests",
        "bytes_up": 1234,
        "bytes_down": 56789,
        "duration_s": 0.25,
    }
    values.update(overrides)
    fields = {name: values.pop(name) for name in EgressDecided._fields if name in values}
    return EgressDecided(**fields, extra=values or None).record()  # type: ignore[arg-type]


def line(record: Mapping[str, object]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as file:
        file.write(data)


# --- records -------------------------------------------------------------


def test_egress_record_has_every_field_in_order_even_when_not_applicable() -> None:
    record = EgressDecided(
        id="q-1",
        ts=T0,
        run=None,
        kind=EgressKind.DNS,
        client=None,
        host="example.com",
        port=None,
        address=None,
        decision=Decision.DENY,
        reason="not_allowlisted",
        rule=None,
        approval=None,
        command=None,
    ).record()
    assert tuple(record) == EGRESS_FIELDS
    assert record["event"] == "egress"
    assert record["port"] is None and record["approval"] is None


def test_egress_record_keeps_extra_fields_after_the_fixed_ones() -> None:
    record = egress(kind="dns", qtype="A", answer="10.200.0.1")
    assert tuple(record)[: len(EGRESS_FIELDS)] == EGRESS_FIELDS
    assert record["qtype"] == "A" and record["answer"] == "10.200.0.1"


def test_egress_record_timestamp_is_rfc3339_utc_with_microseconds() -> None:
    assert egress()["ts"] == "2026-11-29T10:54:52.123456Z"
    assert rfc3339(0.5) == "1970-01-01T00:00:00.500000Z"


def test_rfc3339_refuses_a_value_that_is_not_a_time() -> None:
    with pytest.raises(RecordError):
        rfc3339(float("nan"))


@pytest.mark.parametrize(
    ("kind", "decision"),
    [("udp", "allow"), ("connect", "maybe"), ("CONNECT", "allow"), ("connect", "")],
    ids=["unknown kind", "unknown decision", "kind in capitals", "empty decision"],
)
def test_egress_record_refuses_kinds_and_decisions_outside_the_closed_sets(kind: str, decision: str) -> None:
    with pytest.raises(RecordError):
        egress(kind=kind, decision=decision)


def test_egress_record_refuses_an_extra_field_that_would_shadow_a_fixed_one() -> None:
    with pytest.raises(RecordError, match="event"):
        egress(event="run.start")


@pytest.mark.parametrize(
    ("given_host", "logged"),
    [
        ("example.com?token=abc", "example.com"),
        ("example.com/path?q=1", "example.com"),
        ("user:secret@example.com", "example.com"),
        ("user:pa/ss@example.com/x?y#z", "example.com"),
        ("example.com#frag", "example.com"),
        ("example.com", "example.com"),
    ],
)
def test_egress_record_strips_query_path_and_userinfo_from_host(given_host: str, logged: str) -> None:
    assert egress(host=given_host)["host"] == logged


def test_egress_record_rounds_durations_to_microseconds() -> None:
    record = egress(
        duration_s=1.23456789,
        approval={"id": "a-1", "channel": "slack", "by": "U1", "waited_s": 2.0000004},
    )
    assert record["duration_s"] == 1.234568
    assert record["approval"] == {"id": "a-1", "channel": "slack", "by": "U1", "waited_s": 2.0}


def test_egress_record_refuses_a_duration_that_is_not_finite() -> None:
    with pytest.raises(RecordError):
        egress(duration_s=float("inf"))


def test_request_ids_are_url_safe_and_do_not_repeat() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    for request_id in ids:
        assert request_id.startswith("q-") and len(request_id) == 18
        assert all(c in "0123456789abcdef" for c in request_id[2:])


def test_run_record_drops_credentials_at_any_depth_and_in_any_case() -> None:
    record = run_record(
        "run.start",
        ts=T0,
        run="r-7f3a",
        task="fix the tests",
        allow=["pypi.org"],
        Token="t0ps3cret",
        proxy={"Password": "hunter2", "host": "10.200.0.1", "AUTHORIZATION": "Bearer x"},
        sources=[{"address": "10.200.0.2", "credentials": ["u", "p"]}],
        slack_bot_token="xoxb-1",
        secret="s",
    )
    text = json.dumps(record)
    for leaked in ("t0ps3cret", "hunter2", "Bearer", "xoxb-1", '"s"', '"p"'):
        assert leaked not in text
    assert record["proxy"] == {"host": "10.200.0.1"}
    assert record["sources"] == [{"address": "10.200.0.2"}]
    assert record["task"] == "fix the tests"


def test_run_record_removes_credentials_from_urls_in_values() -> None:
    record = run_record("run.start", ts=T0, run="r-1", proxy_url="http://r-1:TOKEN@10.0.0.1:3128")
    assert record["proxy_url"] == "http://10.0.0.1:3128"


def test_run_record_refuses_other_events() -> None:
    with pytest.raises(RecordError):
        run_record("egress", ts=T0, run="r-1")


def test_approval_records_carry_the_designed_fields() -> None:
    asked = approval_requested_record(
        id="a-1",
        ts=T0,
        run="r-1",
        host="evil.example?x=1",
        port=443,
        command="curl https://evil.example",
        channels=("terminal", "slack"),
    )
    assert asked == {
        "event": "approval.requested",
        "id": "a-1",
        "ts": "2026-11-29T10:54:52.123456Z",
        "run": "r-1",
        "host": "evil.example",
        "port": 443,
        "command": "curl https://evil.example",
        "channels": ["terminal", "slack"],
    }
    decided = approval_decided_record(
        id="a-1",
        ts=T0 + 12,
        decision="deny",
        reason="denied",
        channel="slack",
        by="U123",
        waited_s=12.0000001,
        run="r-1",
    )
    assert {k: decided[k] for k in ("event", "decision", "reason", "channel", "by")} == {
        "event": "approval.decided",
        "decision": "deny",
        "reason": "denied",
        "channel": "slack",
        "by": "U123",
    }
    assert decided["waited_s"] == 12.0 and decided["run"] == "r-1"


# --- sinks ----------------------------------------------------------------


def test_jsonl_sink_writes_one_parseable_line_per_record_over_2000_writes(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    hostile = "line\nbreak \x1b[2J \u2028 \udcff caf\u00e9"
    with JsonlAuditSink(path) as sink:
        for n in range(2000):
            sink.write(egress(id=f"q-{n}", command=hostile if n % 2 else "ls"))
        assert sink.healthy
    data = path.read_bytes()
    assert data.isascii()
    lines = data.split(b"\n")
    assert lines.pop() == b""
    assert len(lines) == 2000
    records = [json.loads(raw) for raw in lines]
    assert [r["id"] for r in records] == [f"q-{n}" for n in range(2000)]
    assert records[1]["command"] == hostile


def test_jsonl_sink_creates_the_file_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with JsonlAuditSink(path):
        pass
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_jsonl_sink_appends_to_an_existing_log(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(line({"event": "run.end", "run": "r-0"}))
    with JsonlAuditSink(path) as sink:
        sink.write(egress())
    assert [r["event"] for r in read_records(path, AuditFilter())] == ["run.end", "egress"]


def test_jsonl_sink_on_a_full_disk_turns_unhealthy_raises_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # /dev/full fails every write with ENOSPC: a real full disk, for free.
    with caplog.at_level(logging.ERROR, logger="egressd.audit"):
        with JsonlAuditSink("/dev/full") as sink:
            assert sink.healthy
            with pytest.raises(AuditError, match="/dev/full"):
                sink.write(egress())
            assert not sink.healthy
            with pytest.raises(AuditError, match="failed earlier"):
                sink.write(egress())
    failures = [r for r in caplog.records if r.name == "egressd.audit"]
    assert len(failures) == 1
    assert "/dev/full" in failures[0].getMessage()


def test_a_second_sink_on_the_same_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with JsonlAuditSink(path):
        with pytest.raises(AuditError, match="another egressd is writing"):
            JsonlAuditSink(path)


def test_closing_a_sink_releases_the_log_for_the_next_one(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    JsonlAuditSink(path).close()
    with JsonlAuditSink(path) as sink:
        sink.write(egress())
    assert path.read_bytes().count(b"\n") == 1


def test_a_missing_directory_is_an_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "no-such-dir" / "audit.jsonl"
    with pytest.raises(AuditError, match="does not exist") as raised:
        JsonlAuditSink(path)
    assert str(path) in str(raised.value)


def test_a_new_sink_ends_a_torn_last_line_so_its_records_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(line(egress(id="q-old")) + b'{"event":"egress","id":"q-to')
    with JsonlAuditSink(path) as sink:
        sink.write(egress(id="q-new"))
    bad: list[int] = []
    ids = [r["id"] for r in read_records(path, AuditFilter(), on_bad_line=lambda o, _: bad.append(o))]
    assert ids == ["q-old", "q-new"]
    assert len(bad) == 1


def test_an_unserialisable_record_raises_but_leaves_the_sink_healthy(tmp_path: Path) -> None:
    with JsonlAuditSink(tmp_path / "audit.jsonl") as sink:
        with pytest.raises(AuditError, match="serialise"):
            sink.write({"event": "egress", "duration_s": float("nan")})
        with pytest.raises(AuditError, match="serialise"):
            sink.write({"event": "egress", "payload": object()})
        assert sink.healthy
        sink.write(egress())


def test_each_line_is_json_dumps_of_the_record_with_prev_last_even_after_a_failed_encoding(tmp_path: Path) -> None:
    # The sink keeps one C encoder for every line: its bytes must stay those of json.dumps with the
    # design's options, and a record that failed halfway (inside a nested object, whose id the
    # circular-reference check had noted) must not make a later record "circular".
    approval: dict[str, object] = {"by": "alice", "x": [1, 2.5, None], "bad": object()}
    path = tmp_path / "audit.jsonl"
    with JsonlAuditSink(path) as sink:
        sink.write(egress())
        with pytest.raises(AuditError, match="serialise"):
            sink.write({**egress(id="q-2"), "approval": approval})
        del approval["bad"]
        records: list[dict[str, object]] = [
            egress(),
            {**egress(id="q-2"), "approval": approval, "detail": "caf\u00e9 \u2028 \ud800 \x00", "big": 10**30},
        ]
        sink.write(records[1])
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    prev = None
    for record, written in zip(records, lines, strict=True):
        expected = json.dumps({**record, "prev": prev}, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        assert written == expected.encode("ascii") + b"\n"
        prev = hashlib.sha256(written).hexdigest()


def test_writing_to_a_closed_sink_raises(tmp_path: Path) -> None:
    sink = JsonlAuditSink(tmp_path / "audit.jsonl")
    sink.close()
    sink.close()
    assert not sink.healthy
    with pytest.raises(AuditError, match="closed"):
        sink.write(egress())


def test_memory_sink_fails_like_a_full_disk_after_n_records() -> None:
    sink = MemoryAuditSink(fail_after=2)
    sink.write(egress(id="q-1"))
    sink.write(egress(id="q-2"))
    with pytest.raises(AuditError):
        sink.write(egress(id="q-3"))
    assert not sink.healthy
    with pytest.raises(AuditError):
        sink.write(egress(id="q-4"))
    assert [r["id"] for r in sink.records] == ["q-1", "q-2"]


def test_both_sinks_satisfy_the_audit_sink_protocol(tmp_path: Path) -> None:
    with JsonlAuditSink(tmp_path / "audit.jsonl") as sink:
        assert isinstance(sink, AuditSink)
    assert isinstance(MemoryAuditSink(), AuditSink)


# --- filters --------------------------------------------------------------


@pytest.mark.parametrize(
    ("flt", "record", "expected"),
    [
        (AuditFilter(), egress(), True),
        (AuditFilter(run="r-7f3a"), egress(), True),
        (AuditFilter(run="r-other"), egress(), False),
        (AuditFilter(decision="deny"), egress(decision="deny", reason="denied"), True),
        (AuditFilter(decision="deny"), egress(), False),
        (AuditFilter(decision="deny"), run_record("run.start", ts=T0, run="r-1"), False),
        (AuditFilter(host="PyPI.org."), egress(), True),
        (AuditFilter(host="*.example.com"), egress(host="a.b.example.com"), True),
        (AuditFilter(host="*.example.com"), egress(host="example.com"), False),
        (AuditFilter(host="*.example.com"), egress(host="badexample.com"), False),
        (AuditFilter(host="example.com"), egress(host="www.example.com"), False),
        (AuditFilter(since=T0), egress(), True),
        (AuditFilter(since=T0 + 1), egress(), False),
        (AuditFilter(since=T0), {"event": "egress", "ts": "yesterday"}, False),
        (AuditFilter(events=frozenset({"run.start"})), egress(), False),
        (
            AuditFilter(events=frozenset({"run.start"})),
            run_record("run.start", ts=T0, run="r-1"),
            True,
        ),
    ],
    ids=[
        "an empty filter matches everything",
        "the same run matches",
        "another run does not match",
        "a denial matches decision deny",
        "an allow does not match decision deny",
        "a record without a decision does not match a decision filter",
        "host matching ignores case and one trailing dot",
        "a wildcard matches a deep subdomain",
        "a wildcard does not match the apex",
        "a wildcard does not match a name that merely ends the same",
        "an exact host does not match its subdomains",
        "a record at the since time matches",
        "a record before the since time does not match",
        "a record with an unreadable time does not match a since filter",
        "an event not listed does not match",
        "an event listed matches",
    ],
)
def test_filter(flt: AuditFilter, record: dict[str, object], expected: bool) -> None:
    assert flt.matches(record) is expected


@pytest.mark.parametrize("kwargs", [{"decision": "DENIED"}, {"host": "ex*.com"}, {"host": "*."}])
def test_filter_refuses_unknown_decisions_and_odd_wildcards(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        AuditFilter(**kwargs)  # type: ignore[arg-type]


# --- parse_since ------------------------------------------------------------


NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", NOW - 90),
        ("15m", NOW - 900),
        ("2h", NOW - 7200),
        ("1d", NOW - 86400),
        ("1.5h", NOW - 5400),
        ("2026-11-29T10:54:52Z", 1795949692.0),
        ("2026-11-29t10:54:52.5z", 1795949692.5),
        ("2026-11-29T11:54:52+01:00", 1795949692.0),
        ("2026-11-29T10:54:52", 1795949692.0),
        ("2026-11-29", 1795910400.0),
        (" 15m ", NOW - 900),
        # Issue 16: the forms a user tries first. NOW is 2027-01-15T08:00:00Z.
        ("1w", NOW - 7 * 86400),
        ("today", 1799971200.0),
        ("Yesterday", 1799884800.0),
        ("2027-01-15", 1799971200.0),
        ("2027-01-15T08:00:00Z", NOW),
        ("2027-01-15T10:00:00+02:00", NOW),
        ("2027-01-15T03:00:00-05:00", NOW),
        ("2027-01-15 08:00:00Z", NOW),
    ],
)
def test_parse_since_reads_times_dates_and_durations(text: str, expected: float) -> None:
    assert parse_since(text, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "tomorrow", "15", "15 m", "-5m", "2026-13-01", "1y"])
def test_parse_since_refuses_anything_else_with_a_clear_message(text: str) -> None:
    with pytest.raises(ValueError, match="RFC 3339"):
        parse_since(text, NOW)


# --- reading ----------------------------------------------------------------


def test_read_records_skips_garbage_and_a_torn_last_line_and_reports_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    parts = [
        line(egress(id="q-1")),
        b"garbage\n",
        b"[1,2]\n",
        b"\xff\xfe\n",
        line(egress(id="q-2")),
        b'{"event":"egress","id":"q-3"',
    ]
    path.write_bytes(b"".join(parts))
    bad: list[tuple[int, str]] = []
    ids = [r["id"] for r in read_records(path, AuditFilter(), on_bad_line=lambda o, w: bad.append((o, w)))]
    assert ids == ["q-1", "q-2"]
    starts = [sum(len(p) for p in parts[:n]) for n in (1, 2, 3, 5)]
    assert [offset for offset, _ in bad] == starts
    assert "unterminated" in bad[-1][1]


def test_read_records_applies_the_filter(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(line(egress(id="q-1")) + line(egress(id="q-2", decision="deny", reason="denied")))
    assert [r["id"] for r in read_records(path, AuditFilter(decision="deny"))] == ["q-2"]


def test_read_records_from_stops_before_an_unfinished_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    first = line(egress(id="q-1"))
    path.write_bytes(first + b'{"event":"egress"')
    records, offset = read_records_from(path, AuditFilter(), 0)
    assert [r["id"] for r in records] == ["q-1"]
    assert offset == len(first)


def test_read_records_from_restarts_at_zero_after_truncation(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(line(egress(id="q-1")))
    records, offset = read_records_from(path, AuditFilter(), 10_000)
    assert [r["id"] for r in records] == ["q-1"]
    assert offset == path.stat().st_size


def test_read_records_from_a_missing_file_reads_nothing(tmp_path: Path) -> None:
    assert read_records_from(tmp_path / "absent.jsonl", AuditFilter(), 0) == ([], 0)


# --- following ----------------------------------------------------------------


async def take(records: AsyncIterator[dict[str, object]], count: int) -> list[dict[str, object]]:
    taken: list[dict[str, object]] = []
    async with asyncio.timeout(5):
        while len(taken) < count:
            taken.append(await anext(records))
    return taken


async def test_follow_yields_only_records_appended_after_it_started(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(line(egress(id="q-before")))
    async with aclosing(follow_records(path, AuditFilter(), poll_s=0.01)) as follow:
        async with asyncio.TaskGroup() as tg:
            taking = tg.create_task(take(follow, 1))
            await asyncio.sleep(0)  # the follower opens the file at its end
            append(path, line(egress(id="q-after")))
    assert [r["id"] for r in taking.result()] == ["q-after"]


async def test_follow_waits_for_the_newline_of_a_line_written_in_two_parts(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b"")
    whole = line(egress(id="q-split"))
    bad: list[int] = []
    follow = follow_records(path, AuditFilter(), offset=0, poll_s=0.01, on_bad_line=lambda o, _: bad.append(o))
    async with aclosing(follow):
        async with asyncio.TaskGroup() as tg:
            taking = tg.create_task(take(follow, 1))
            append(path, whole[:20])
            await asyncio.sleep(0.05)  # several polls see only the first part
            assert not taking.done()
            append(path, whole[20:])
    assert [r["id"] for r in taking.result()] == ["q-split"]
    assert bad == []


async def test_follow_reads_a_truncated_log_again_from_the_start(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(line(egress(id="q-1")) + line(egress(id="q-2")))
    _, offset = read_records_from(path, AuditFilter(), 0)
    async with aclosing(follow_records(path, AuditFilter(), offset=offset, poll_s=0.01)) as follow:
        async with asyncio.TaskGroup() as tg:
            taking = tg.create_task(take(follow, 1))
            await asyncio.sleep(0)
            path.write_bytes(line(egress(id="q-3")))  # truncates, then writes less than before
    assert [r["id"] for r in taking.result()] == ["q-3"]


async def test_follow_finishes_a_rotated_log_then_reads_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(line(egress(id="q-1")))
    async with aclosing(follow_records(path, AuditFilter(), poll_s=0.01)) as follow:
        async with asyncio.TaskGroup() as tg:
            taking = tg.create_task(take(follow, 2))
            await asyncio.sleep(0)
            append(path, line(egress(id="q-2")))
            path.rename(tmp_path / "audit.jsonl.1")
            path.write_bytes(line(egress(id="q-3")))
    assert [r["id"] for r in taking.result()] == ["q-2", "q-3"]


async def test_follow_waits_for_a_log_that_does_not_exist_yet(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with aclosing(follow_records(path, AuditFilter(), poll_s=0.01)) as follow:
        async with asyncio.TaskGroup() as tg:
            taking = tg.create_task(take(follow, 1))
            await asyncio.sleep(0.03)
            path.write_bytes(line(egress(id="q-first")))
    assert [r["id"] for r in taking.result()] == ["q-first"]


async def test_read_then_follow_loses_and_repeats_nothing(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    second = line(egress(id="q-2"))
    path.write_bytes(line(egress(id="q-1")) + second[:15])
    shown, offset = read_records_from(path, AuditFilter(), 0)
    append(path, second[15:] + line(egress(id="q-3", decision="deny", reason="denied")))
    stop = asyncio.Event()
    stop.set()  # read once more, then return
    follow = follow_records(path, AuditFilter(), offset=offset, stop=stop)
    async with aclosing(follow):
        shown += [record async for record in follow]
    assert [r["id"] for r in shown] == ["q-1", "q-2", "q-3"]


async def test_follow_applies_the_filter_and_reports_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    allowed = line(egress(id="q-1"))
    path.write_bytes(allowed + b"not json\n" + line(egress(id="q-2", decision="deny")))
    bad: list[int] = []
    stop = asyncio.Event()
    stop.set()
    follow = follow_records(
        path,
        AuditFilter(decision="deny"),
        offset=0,
        stop=stop,
        on_bad_line=lambda o, _: bad.append(o),
    )
    async with aclosing(follow):
        ids = [record["id"] async for record in follow]
    assert ids == ["q-2"]
    assert bad == [len(allowed)]


async def test_follow_returns_soon_after_stop_is_set(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    stop = asyncio.Event()

    async def drain() -> list[dict[str, object]]:
        async with aclosing(follow_records(path, AuditFilter(), poll_s=10, stop=stop)) as follow:
            return [record async for record in follow]

    async with asyncio.timeout(1):  # far less than one 10 s poll
        async with asyncio.TaskGroup() as tg:
            draining = tg.create_task(drain())
            await asyncio.sleep(0)
            stop.set()
    assert draining.result() == []


# --- printing -------------------------------------------------------------------


def test_format_table_prints_a_header_then_one_line_per_record() -> None:
    denial = egress(
        decision="deny",
        reason="denied",
        host="evil.example",
        address=None,
        bytes_up=None,
        bytes_down=None,
        approval={"id": "a-1", "channel": "slack", "by": "U123", "waited_s": 3.0},
    )
    lines = list(format_table([egress(), denial]))
    assert len(lines) == 3
    assert lines[0].startswith("TIME")
    assert "2026-11-29 10:54:52" in lines[1]
    assert "ALLOW" in lines[1] and "pypi.org:443" in lines[1] and "1.2 KiB" in lines[1]
    assert "55.5 KiB" in lines[1] and "250ms" in lines[1]
    assert "DENY" in lines[2] and "denied" in lines[2] and lines[2].endswith("U123")


def test_format_table_never_cuts_a_long_host_name() -> None:
    host = "paypal.com.account-verify.login." + "x" * 60 + ".example"
    (_, row) = format_table([egress(host=host)])
    assert f"{host}:443" in row


def test_format_table_summarises_run_and_approval_events() -> None:
    rows = list(
        format_table(
            [
                run_record("run.start", ts=T0, run="r-1", task="fix tests", allow=["pypi.org"]),
                approval_requested_record(
                    id="a-1",
                    ts=T0,
                    run="r-1",
                    host="evil.example",
                    port=443,
                    command="curl evil.example",
                    channels=["slack"],
                ),
                approval_decided_record(
                    id="a-1",
                    ts=T0,
                    decision="deny",
                    reason="approval_timeout",
                    channel=None,
                    by=None,
                    waited_s=600,
                    run="r-1",
                ),
                run_record("run.end", ts=T0, run="r-1", exit_status=0),
            ]
        )
    )[1:]
    assert "RUN START" in rows[0] and "fix tests" in rows[0] and "pypi.org" in rows[0]
    assert "APPROVAL ASKED" in rows[1] and "evil.example:443" in rows[1] and "slack" in rows[1]
    assert "APPROVAL DENY" in rows[2] and "approval_timeout" in rows[2] and "10m00s" in rows[2]
    assert "RUN END" in rows[3] and "exit_status: 0" in rows[3]


def test_format_table_escapes_control_characters_from_hostile_records() -> None:
    rows = list(
        format_table(
            [
                egress(host="evil\x1b[2J.example", reason="x\r\n"),
                approval_requested_record(
                    id="a-1",
                    ts=T0,
                    run="r\x07",
                    host="\u0430pple.com",
                    port=443,
                    command="echo \x1b]0;pwned\x07 \x9b31m",
                    channels=["slack"],
                ),
            ]
        )
    )
    assert all(row.isascii() and row.isprintable() for row in rows)
    assert "evil\\x1b[2J.example:443" in rows[1]
    assert "x\\x0d\\x0a" in rows[1]
    assert "\\u0430pple.com" in rows[2] and "\\x9b31m" in rows[2]


def test_format_table_doubles_backslashes_so_escapes_cannot_be_forged() -> None:
    (_, row) = format_table([egress(host="a\\x1b.example")])
    assert "a\\\\x1b.example" in row


def test_format_table_survives_records_with_unexpected_types() -> None:
    odd: dict[str, object] = {
        "event": "egress",
        "ts": 5,
        "run": ["r"],
        "decision": 1,
        "host": {"h": 1},
        "port": "x",
        "bytes_up": "lots",
        "duration_s": "slow",
        "approval": "yes",
    }
    rows = list(format_table([odd, {}, {"event": "approval.requested", "channels": "x"}]))
    assert len(rows) == 4


@given(
    st.text(),
    st.text(),
    st.text(),
    st.text(),
    st.dictionaries(st.text(), st.text(), max_size=3),
)
def test_format_table_output_is_always_printable_ascii(
    host: str, run: str, command: str, event: str, extra: dict[str, str]
) -> None:
    records: list[dict[str, object]] = [
        {"event": "egress", "host": host, "run": run, "reason": command, "approval": {"by": run}},
        {"event": "approval.requested", "host": host, "run": run, "command": command},
        {"event": "approval.decided", "by": host, "channel": run, "reason": command},
        {"event": event, "run": run, **extra},
    ]
    for row in format_table(records):
        assert row.isascii() and row.isprintable()


def test_format_json_is_one_compact_ascii_line_that_reads_back() -> None:
    record = egress(command="echo \x1b[2J caf\u00e9 \u009b")
    text = format_json(record)
    assert "\n" not in text and text.isascii() and ", " not in text
    assert json.loads(text) == record


def test_the_table_shows_a_run_event_as_words_with_no_chain_hash() -> None:
    """Issue 29: a 64-hex prev and raw JSON blobs on every run line."""
    record = run_record("run.end", ts=T0, run="r-1", exit_status=0, duration_s=3.2, allowed=4, refused=1, answered=1)
    record["prev"] = "ab" * 32
    changed = {"event": "policy.reloaded", "ts": "2026-12-01T00:00:00Z", "run": None, "prev": "cd" * 32,
               "added": {"allow": ["a.example", "b.example"], "deny": []}}  # fmt: skip
    rows = list(format_table([record, changed]))[1:]
    assert "RUN END" in rows[0] and "exit_status: 0" in rows[0] and "allowed: 4" in rows[0], rows[0]
    assert "ab" * 32 not in "".join(rows) and "cd" * 32 not in "".join(rows) and "prev" not in "".join(rows)
    assert "added: allow=a.example,b.example deny=-" in rows[1] and "{" not in rows[1], rows[1]
