"""The refusal budget (``egressd.proxy.core.floods``): pure first (time passed in), then wired into egressd."""

from __future__ import annotations

import asyncio
import base64

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.audit.records import suppressed_record
from egressd.config.settings import SettingsError, load_settings
from egressd.proxy.core.floods import MAX_SAMPLE_CHARS, MAX_SAMPLES, RefusalBudget
from tests.fakes import hellos
from tests.harness import connect_via, egress, wait_until


def test_the_first_refusals_of_an_interval_are_recorded_and_the_rest_counted() -> None:
    budget = RefusalBudget(max_records=3, interval_s=10.0)
    verdicts = [budget.admit("r-1", 100.0 + i * 0.1, "dns", "not_allowlisted", f"{i}.evil.test") for i in range(7)]
    assert verdicts == [True, True, True, False, False, False, False]
    assert budget.due(109.9) == []  # the interval has not ended
    (summary,) = budget.due(110.0)
    assert (summary.run, summary.start, summary.end, summary.total) == ("r-1", 100.0, 110.0, 4)
    assert summary.counts == {("dns", "not_allowlisted"): 4}
    assert summary.samples == ["3.evil.test", "4.evil.test", "5.evil.test", "6.evil.test"]
    assert budget.due(200.0) == []  # handed over once


def test_one_run_past_its_budget_does_not_touch_another_runs() -> None:
    budget = RefusalBudget(max_records=2, interval_s=10.0)
    assert [budget.admit("flood", 0.0, "connect", "denied", "x") for _ in range(5)] == [True, True] + [False] * 3
    assert [budget.admit("quiet", 1.0, "connect", "denied", "y") for _ in range(2)] == [True, True]
    assert [s.run for s in budget.due(10.0)] == ["flood"]


def test_a_new_interval_starts_with_a_full_budget_and_the_old_one_is_summarised() -> None:
    budget = RefusalBudget(max_records=1, interval_s=5.0)
    assert [budget.admit(None, 0.0, "tls", "auth_required", None) for _ in range(3)] == [True, False, False]
    assert budget.admit(None, 5.0, "tls", "auth_required", None) is True  # a new interval
    (summary,) = budget.due(5.0)
    assert (summary.run, summary.total, summary.samples) == (None, 2, [])


def test_samples_are_few_distinct_and_short() -> None:
    budget = RefusalBudget(max_records=0, interval_s=5.0)
    for host in ["a.test", "a.test", "b" * 1000, "c", "d", "e", "f", "g"]:
        budget.admit("r", 0.0, "connect", "not_allowlisted", host)
    (summary,) = budget.drain("r")
    assert len(summary.samples) == MAX_SAMPLES and summary.samples[:2] == ["a.test", "b" * MAX_SAMPLE_CHARS]


def test_counts_are_kept_by_kind_and_reason() -> None:
    budget = RefusalBudget(max_records=0, interval_s=5.0)
    for kind, reason in [("dns", "bad_request"), ("connect", "denied"), ("dns", "bad_request")]:
        budget.admit("r", 1.0, kind, reason, "h")
    (summary,) = budget.drain("r")
    assert summary.counts == {("dns", "bad_request"): 2, ("connect", "denied"): 1}


def test_draining_a_run_hands_over_its_summaries_ended_or_not_and_leaves_others() -> None:
    budget = RefusalBudget(max_records=0, interval_s=5.0)
    budget.admit("r", 0.0, "connect", "denied", "h")
    budget.admit("r", 6.0, "connect", "denied", "h")  # the first interval ended, a second one counts
    budget.admit("other", 6.0, "connect", "denied", "h")
    assert [(s.start, s.total) for s in budget.drain("r")] == [(0.0, 1), (6.0, 1)]
    assert budget.drain("r") == []
    assert [s.run for s in budget.drain(every=True)] == ["other"]


def test_a_quiet_interval_leaves_nothing_to_summarise() -> None:
    budget = RefusalBudget(max_records=5, interval_s=1.0)
    budget.admit("r", 0.0, "connect", "denied", "h")
    assert budget.next_due is None and budget.due(100.0) == [] and budget.drain(every=True) == []


@pytest.mark.parametrize(("max_records", "interval_s"), [(-1, 1.0), (1, 0.0), (1, -1.0), (1, float("nan"))])
def test_a_budget_that_makes_no_sense_is_refused(max_records: int, interval_s: float) -> None:
    with pytest.raises(ValueError):
        RefusalBudget(max_records, interval_s)


events = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", None]),
        st.floats(min_value=0, max_value=5, allow_nan=False),
        st.sampled_from(["dns", "connect"]),
        st.sampled_from(["denied", "not_allowlisted"]),
    ),
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(events=events, max_records=st.integers(0, 5), interval_s=st.floats(0.5, 3.0), polls=st.integers(1, 7))
def test_records_written_plus_summaries_count_every_refusal_exactly_once(
    events: list[tuple[str | None, float, str, str]], max_records: int, interval_s: float, polls: int
) -> None:
    budget = RefusalBudget(max_records, interval_s)
    now = 0.0
    written = counted = 0
    for i, (run, step, kind, reason) in enumerate(events):
        now += step
        if budget.admit(run, now, kind, reason, "h"):
            written += 1
        if i % polls == 0 and budget.next_due is not None and now >= budget.next_due:
            counted += sum(s.total for s in budget.due(now))
    counted += sum(s.total for s in budget.drain(every=True))
    assert written + counted == len(events)
    assert budget.drain(every=True) == [] and budget.due(now + 1e9) == []


def test_the_summary_record_nests_counts_by_kind_and_adds_them_up() -> None:
    record = suppressed_record(
        ts=20.0,
        run="r-1",
        start=0.0,
        end=10.0,
        counts={("dns", "not_allowlisted"): 3, ("connect", "denied"): 2, ("dns", "bad_request"): 1},
        samples=["user:pw@evil.test/path?q=1"],
    )
    assert record == {
        "event": "egress.suppressed",
        "ts": "1970-01-01T00:00:20.000000Z",
        "run": "r-1",
        "decision": "deny",
        "start": "1970-01-01T00:00:00.000000Z",
        "end": "1970-01-01T00:00:10.000000Z",
        "suppressed": 6,
        "counts": {"connect": {"denied": 2}, "dns": {"bad_request": 1, "not_allowlisted": 3}},
        "samples": ["evil.test"],
    }


# --- wired into egressd: the gate counts, the timer, the run's end, the settings ------------------

AUTH = {"Authorization": "Bearer test-token"}


async def refuse(svc, n: int, extra: str = "", reason: str = "not_allowlisted") -> None:  # type: ignore[no-untyped-def]
    for i in range(n):
        status, headers, _, _, writer = await connect_via(svc, f"n{i}.unknown.test:443", extra)
        writer.close()
        assert (status, headers["x-egress-reason"]) == (403, reason)


def suppressed(svc) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    return [r for r in svc.audit_records if r["event"] == "egress.suppressed"]


async def test_a_summary_is_written_when_its_interval_ends_with_no_more_traffic(make_egressd) -> None:
    svc = await make_egressd(ask=False, max_refusal_records=2, refusal_interval_s=0.3)
    await refuse(svc, 5)
    assert [r["host"] for r in egress(svc)] == ["n0.unknown.test", "n1.unknown.test"]
    await wait_until(lambda: suppressed(svc) != [], timeout_s=3)
    (summary,) = suppressed(svc)
    assert (summary["run"], summary["suppressed"], summary["counts"]) == (
        "default",
        3,
        {"connect": {"not_allowlisted": 3}},
    )
    assert summary["samples"] == ["n2.unknown.test", "n3.unknown.test", "n4.unknown.test"]
    assert summary["start"] < summary["end"] <= summary["ts"]


async def test_allowed_egress_is_recorded_whatever_the_run_was_refused(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"], ask=False, max_refusal_records=1, refusal_interval_s=60)
    await refuse(svc, 3)
    for _ in range(4):
        status, _, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        assert status == 200
        writer.close()
    await wait_until(lambda: sum(r["decision"] == "allow" for r in egress(svc)) == 4)
    assert sum(r["decision"] == "deny" for r in egress(svc)) == 1


async def test_ending_a_run_writes_its_summary_before_its_end(make_egressd) -> None:
    svc = await make_egressd(require_auth=True, ask=False, max_refusal_records=1, refusal_interval_s=3600)
    async with aiohttp.ClientSession(svc.control_address, headers=AUTH) as http:
        async with http.post("/runs", json={"task": "t", "allow": []}) as resp:
            created = await resp.json()
        creds = base64.b64encode(f"{created['id']}:{created['token']}".encode()).decode()
        await refuse(svc, 4, f"Proxy-Authorization: Basic {creds}\r\n", "no_approver")
        assert suppressed(svc) == []
        async with http.delete(f"/runs/{created['id']}") as resp:
            assert resp.status == 200
    mine = [r["event"] for r in svc.audit_records if r.get("run") == created["id"]]
    assert mine == ["run.start", "egress", "egress.suppressed", "run.end"]
    assert suppressed(svc)[0]["suppressed"] == 3


async def test_stopping_egressd_writes_what_was_counted(make_egressd) -> None:
    svc = await make_egressd(ask=False, max_refusal_records=1, refusal_interval_s=3600)
    await refuse(svc, 3)
    await svc.close(grace_s=0)
    assert [r["event"] for r in svc.audit_records][-2:] == ["egress.suppressed", "run.end"]
    assert suppressed(svc)[0]["suppressed"] == 2


@pytest.mark.parametrize(
    ("values", "setting"),
    [
        ({"max_refusal_records": 0}, "max_refusal_records"),
        ({"max_refusal_records": "many"}, "max_refusal_records"),
        ({"refusal_interval_s": 0}, "refusal_interval_s"),
        ({"refusal_interval_s": 86400}, "refusal_interval_s"),
    ],
)
def test_a_refusal_budget_out_of_range_stops_start_up_naming_it(values: dict, setting: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(SettingsError, match=f"bad setting {setting}"):
        load_settings(values)


def test_the_refusal_budget_has_flags_and_sensible_defaults() -> None:
    settings = load_settings({})
    assert (settings.max_refusal_records, settings.refusal_interval_s) == (50, 10.0)
    from egressd.cli.main import _COMMON

    flags = {flag: dest for flag, dest, _ in _COMMON}
    assert flags["--max-refusal-records"] == "max_refusal_records"
    assert flags["--refusal-interval-s"] == "refusal_interval_s"


async def test_a_tunnel_cut_after_it_was_recorded_ahead_still_gets_its_end(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"], ask=False, max_refusal_records=1, refusal_interval_s=60)
    await refuse(svc, 3)  # the run's budget is spent
    status, headers, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200
    writer.write(hellos.client_hello("elsewhere.test"))  # another server than the one allowed: sni_mismatch
    await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await wait_until(lambda: any(r["event"] == "egress.end" for r in svc.audit_records))
    (end,) = [r for r in svc.audit_records if r["event"] == "egress.end"]
    assert end["end"] == "sni_mismatch"
    (ahead,) = [r for r in svc.audit_records if r["event"] == "egress" and r["id"] == end["id"]]
    assert ahead["decision"] == "allow"  # written ahead, before the dial
