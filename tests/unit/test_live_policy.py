"""Live policy changes, without I/O: a run's entries edited, the operator's deny entries, and their records."""

from __future__ import annotations

import pytest

from egressd.audit.fields import RecordError
from egressd.audit.records import policy_reloaded_record, run_changed_record
from egressd.proxy.core.entries import entry_diff
from egressd.proxy.core.policy import Verdict, parse_entry
from egressd.proxy.core.runs import Run, RunError, RunRegistry
from egressd.vocabulary.reasons import Reason


def entries(*texts: str) -> tuple:  # type: ignore[type-arg]
    return tuple(parse_entry(t) for t in texts)


def run(allow: tuple[str, ...] = (), deny: tuple[str, ...] = ()) -> Run:
    return Run(id="r-1", token="t", task=None, allow=entries(*allow), deny=entries(*deny), ask=False)


def test_an_added_allow_entry_applies_to_the_next_decision_even_after_a_refusal_was_remembered() -> None:
    r = run()
    assert r.decide("new.example", 443).reason is Reason.NOT_ALLOWLISTED  # remembered now
    change = r.change_entries(allow_add=entries("new.example"))
    assert change.allow_added == ("new.example",) and r.decide("new.example", 443).verdict is Verdict.ALLOW


def test_an_added_deny_entry_refuses_a_host_allowed_and_approved_before() -> None:
    r = run(allow=("ok.example",))
    r.approve("other.example", 443)
    assert r.decide("ok.example", 443).verdict is Verdict.ALLOW
    r.change_entries(deny_add=entries("ok.example", "other.example"))
    assert r.decide("ok.example", 443).reason is Reason.DENYLISTED
    assert r.decide("other.example", 443).reason is Reason.DENYLISTED
    assert "other.example" in r.approved  # the approval stays; the deny entry wins over it


def test_a_removal_of_an_entry_the_run_lacks_applies_nothing_at_all() -> None:
    r = run(allow=("a.example",), deny=("d.example",))
    with pytest.raises(RunError, match="'typo.example' is not an entry"):
        r.change_entries(allow_add=entries("b.example"), deny_remove=entries("d.example", "typo.example"))
    assert [e.text for e in r.allow] == ["a.example"] and [e.text for e in r.deny] == ["d.example"]
    assert r.decide("b.example", 443).reason is Reason.NOT_ALLOWLISTED


def test_entries_are_matched_by_what_they_cover_not_how_they_are_spelled() -> None:
    r = run(allow=("Api.Example.com.",))
    change = r.change_entries(allow_remove=entries("api.example.com"), allow_add=entries("API.example.com:8443"))
    assert change.allow_removed == ("Api.Example.com.",) and change.allow_added == ("API.example.com:8443",)
    assert r.change_entries(allow_add=entries("api.example.com:8443")).allow_added == ()  # already there
    assert not r.change_entries()


def test_a_run_cannot_remove_the_operators_deny_entries() -> None:
    registry = RunRegistry(global_deny=entries("evil.example"))
    r = registry.create(task=None, allow=entries("evil.example"))
    assert r.decide("evil.example", 443).reason is Reason.DENYLISTED
    with pytest.raises(RunError):
        r.change_entries(deny_remove=entries("evil.example"))
    assert r.describe()["global_deny"] == ["evil.example"] and r.describe()["deny"] == []


def test_new_global_deny_entries_reach_every_run_but_the_default_one() -> None:
    default = Run(id="default", token="t", task=None, allow=entries("x.example"), deny=())
    registry = RunRegistry(default=default)
    r = registry.create(task=None, allow=entries("x.example"))
    assert r.decide("x.example", 443).verdict is Verdict.ALLOW
    registry.set_global_deny(entries("x.example"))
    assert r.decide("x.example", 443).reason is Reason.DENYLISTED
    assert default.decide("x.example", 443).verdict is Verdict.ALLOW  # its own deny entries are the operator's
    assert registry.create(task=None, allow=entries("x.example")).decide("x.example", 443).reason is Reason.DENYLISTED


def test_entry_diff_names_what_was_added_and_removed() -> None:
    assert entry_diff(entries("a.example", "b.example"), entries("B.example", "c.example")) == (
        ("c.example",),
        ("a.example",),
    )


def test_policy_reloaded_records_have_fixed_fields_and_null_for_what_does_not_apply() -> None:
    ok = policy_reloaded_record(
        ts=0, ok=True, added={"allow": ["a.example"]}, removed={}, changed=["ask"], needs_restart=["listen"]
    )
    assert list(ok) == [
        "event", "ts", "ok", "added", "removed", "changed", "needs_restart", "live_kept", "live_in_files", "error"
    ]  # fmt: skip
    assert ok["live_kept"] == {"allow": {"added": [], "removed": []}, "deny": {"added": [], "removed": []}}
    assert ok["added"] == {"allow": ["a.example"], "deny": []} and ok["removed"] == {"allow": [], "deny": []}
    bad = policy_reloaded_record(ts=0, ok=False, error="bad setting allow_file: ...")
    assert bad["event"] == "policy.reloaded" and bad["added"] is None and bad["needs_restart"] is None
    assert bad["live_kept"] is None and bad["live_in_files"] is None
    with pytest.raises(RecordError):
        policy_reloaded_record(ts=0, ok=False)
    with pytest.raises(RecordError):
        policy_reloaded_record(ts=0, ok=True, added={"allowed": ["x"]})


def test_run_changed_records_name_the_run_and_both_lists() -> None:
    record = run_changed_record(ts=0, run="r-1", added={"deny": ["x.example"]})
    assert record == {
        "event": "run.changed",
        "ts": "1970-01-01T00:00:00.000000Z",
        "run": "r-1",
        "added": {"allow": [], "deny": ["x.example"]},
        "removed": {"allow": [], "deny": []},
    }


def test_the_allowlist_a_prompt_shows_keeps_an_approvals_port() -> None:
    # Issue 16: after approving host:8443, later prompts listed it as bare "host".
    r = run(allow=("ok.example", "api.example:8080"))
    r.approve("web.example", 443)
    r.approve("svc.example", 8443)
    r.approve("svc.example", 9000)
    assert r.allowed_texts() == (
        "ok.example", "api.example:8080", "svc.example:8443", "svc.example:9000", "web.example",
    )  # fmt: skip


def test_a_reload_keeps_the_live_edits_on_top_of_the_configured_entries() -> None:
    """An operator's live deny (and every other live edit) outlives a reload of unchanged files."""
    r = run(allow=("a.example", "b.example"), deny=("d.example",))
    r.change_entries(deny_add=entries("a.example"), allow_remove=entries("b.example"), deny_remove=entries("d.example"))
    r.change_entries(allow_add=entries("new.example"))
    merge = r.reconfigure(entries("a.example", "b.example", "c.example"), entries("d.example"))
    assert [e.text for e in r.allow] == ["a.example", "c.example", "new.example"]
    assert [e.text for e in r.deny] == ["a.example"]
    assert r.decide("a.example", 443).reason is Reason.DENYLISTED
    assert merge.kept.by_kind == {
        "allow": {"added": ["new.example"], "removed": ["b.example"]},
        "deny": {"added": ["a.example"], "removed": ["d.example"]},
    }
    assert not merge.in_files


def test_a_live_edit_the_files_now_say_becomes_theirs() -> None:
    r = run(allow=("a.example",))
    r.change_entries(deny_add=entries("a.example"), allow_remove=entries("a.example"))
    merge = r.reconfigure((), entries("A.example."))  # the files now say both, spelled their way
    assert merge.in_files.by_kind["deny"]["added"] == ["a.example"]
    assert merge.in_files.by_kind["allow"]["removed"] == ["a.example"]
    assert not merge.kept
    # No longer a live edit: the files' next word is the last.
    assert not r.reconfigure(entries("a.example"), ()).kept
    assert r.decide("a.example", 443).verdict is Verdict.ALLOW


def test_the_last_live_edit_of_an_entry_is_the_one_kept() -> None:
    r = run(allow=("a.example",))
    r.change_entries(allow_remove=entries("a.example"))
    r.change_entries(allow_add=entries("a.example"))  # back as it was: the files say it, nothing to keep
    merge = r.reconfigure(entries("a.example"), ())
    assert not merge.kept and [e.text for e in r.allow] == ["a.example"]
