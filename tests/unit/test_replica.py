"""A worker's copy of the runs (``proxy.core.replica``): it follows the owner's, and reports back what it sees.

Pure: two registries in one process stand for the owner's and a worker's.
The copy must decide what the owner decides after every kind of change
(a run begun and ended, entries edited, an approval revoked, the
operator's deny entries), and what the copy's conversations apply (an
answer, an event) must reach the owner through the same methods.
"""

from __future__ import annotations

import pickle

from egressd.approvals.interface import ApprovalScope
from egressd.proxy.core.decision import settled_meanwhile
from egressd.proxy.core.policy import Verdict, parse_entry
from egressd.proxy.core.replica import Change, ReplicaRun, apply_change, follow, image_of
from egressd.proxy.core.runs import Run, RunRegistry
from egressd.vocabulary.reasons import Answer


def _entries(*texts: str) -> tuple:  # type: ignore[type-arg]
    return tuple(parse_entry(text) for text in texts)


def _owner() -> RunRegistry:
    default = Run(id="default", token="t0", task=None, allow=_entries("a.example"), deny=())
    return RunRegistry(default=default, global_deny=_entries("evil.example"))


def _copy(owner: RunRegistry, told: list[Change]) -> RunRegistry:
    copy = RunRegistry()
    follow(copy, pickle.loads(pickle.dumps(image_of(owner))), told.append)  # as sent: through pickle
    return copy


def _verdicts(registry: RunRegistry, run_id: str, *hosts: str) -> list[Verdict]:
    run = registry.get(run_id)
    assert run is not None
    return [run.decide(host, 443).verdict for host in hosts]


HOSTS = ("a.example", "b.example", "evil.example", "c.example")


def test_a_copy_decides_as_the_owner_for_every_run() -> None:
    owner = _owner()
    run = owner.create(task="t", allow=_entries("b.example"), run_id="r-1")
    copy = _copy(owner, [])
    assert copy.default is not None and copy.default.id == "default"
    for run_id in ("default", "r-1"):
        assert _verdicts(copy, run_id, *HOSTS) == _verdicts(owner, run_id, *HOSTS)
    # It recognises the run's credentials, and only those; the control token never travels.
    assert copy.credentials("r-1", run.token) is copy.get("r-1")
    assert copy.credentials("r-1", "wrong") is None
    assert copy.by_control_token(run.control_token) is None


def test_every_change_in_the_owner_is_followed_and_a_revocation_holds_at_once() -> None:
    owner = _owner()
    owner.create(task="t", allow=(), run_id="r-1")
    told: list[Change] = []
    copy = _copy(owner, told)
    changes = [
        lambda: owner.get("r-1").approve("c.example", 443),  # type: ignore[union-attr]
        lambda: owner.get("r-1").revoke(["c.example"]),  # type: ignore[union-attr]
        lambda: owner.get("default").change_entries(deny_add=_entries("a.example")),  # type: ignore[union-attr]
        lambda: owner.set_global_deny(_entries("b.example")),
        lambda: owner.end("r-1"),
        lambda: owner.create(task="u", allow=_entries("c.example"), run_id="r-2"),
    ]
    for change in changes:
        change()
        follow(copy, image_of(owner), told.append)
        assert sorted(run.id for run in copy) == sorted(run.id for run in owner)
        for run in owner:
            assert _verdicts(copy, run.id, *HOSTS) == _verdicts(owner, run.id, *HOSTS), change
    assert told == []  # following the owner reports nothing back
    ended = [run for run in copy if run.id == "r-1"]
    assert ended == []


def test_what_a_copy_applies_reaches_the_owner_through_the_same_methods() -> None:
    owner = _owner()
    owner.create(task="t", allow=(), run_id="r-1")
    told: list[Change] = []
    copy = _copy(owner, told)
    run = copy.get("r-1")
    assert isinstance(run, ReplicaRun)
    run.approve("c.example", 443)
    run.deny_host("x.bad.example")
    run.approve_request("POST", "c.example", 443, "/api/")
    run.deny_request("DELETE", "c.example", "/")
    run.keep_event({"event": "egress", "kind": "connect", "decision": "allow"})
    run.stop_asking()
    assert [change.what for change in told] == [
        "approve", "deny_host", "approve_request", "deny_request", "keep_event", "stop_asking",
    ]  # fmt: skip
    assert list(run.events) == []  # the owner keeps the events, not the copy
    for change in pickle.loads(pickle.dumps(told)):
        assert apply_change(owner, change)
    mine = owner.get("r-1")
    assert mine is not None
    assert mine.approved == {"c.example": run.approved["c.example"]}
    assert mine.denied == run.denied and not mine.ask
    assert mine.approved_requests == run.approved_requests and mine.denied_requests == run.denied_requests
    assert mine.allowed == 1 and len(mine.events) == 1
    assert _verdicts(owner, "r-1", *HOSTS) == _verdicts(copy, "r-1", *HOSTS)


def test_a_change_for_an_ended_run_or_an_unknown_method_is_dropped() -> None:
    owner = _owner()
    assert not apply_change(owner, Change("r-gone", "approve", ("c.example", 443)))
    assert not apply_change(owner, Change("default", "end", ()))  # only what a copy may report
    assert not apply_change(owner, Change("default", "__class__", ()))
    assert owner.get("default") is not None


def test_a_question_that_reaches_the_owner_after_the_runs_answer_is_answered_by_it() -> None:
    """A worker asks from its copy; the owner's run may have been answered while the question travelled
    (a client of another process asked the same): the question is not put to the person again."""
    owner = _owner()
    run = owner.get("default")
    assert run is not None
    assert settled_meanwhile(run, "b.example", 443) is None  # still to be asked
    run.approve("b.example", 443)
    allowed = settled_meanwhile(run, "b.example", 443)
    assert allowed is not None and allowed.answer is Answer.ALLOW and allowed.scope is ApprovalScope.ONCE
    run.deny_host("c.example")
    denied = settled_meanwhile(run, "c.example", 443)
    assert denied is not None and denied.answer is Answer.DENY
    assert settled_meanwhile(run, "d.example", 443) is None
