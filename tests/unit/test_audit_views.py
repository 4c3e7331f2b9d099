"""egressd.audit.views: an egress record read once into what the runners show of it."""

from __future__ import annotations

from egressd.audit.records import EgressDecided, EgressEnded
from egressd.audit.views import EgressSeen, Refusal, refusals


def _record(**fields: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        id="q-1",
        ts=0.0,
        run="r-1",
        kind="connect",
        client="10.0.0.2:5000",
        host="evil.test",
        port=443,
        address=None,
        decision="deny",
        reason="not_allowlisted",
        rule=None,
        approval=None,
        command="curl",
        bytes_up=0,
        bytes_down=0,
        duration_s=0.0,
    )
    return EgressDecided(**(base | fields)).record()  # type: ignore[arg-type]


def test_a_written_refusal_reads_back_as_one() -> None:
    seen = EgressSeen.of(_record())
    assert seen == EgressSeen("egress", "connect", "evil.test", 443, "deny", "not_allowlisted", approved=False)
    assert seen.denied and seen.is_refusal and seen.target == "evil.test:443"
    assert seen.refusal() == Refusal("evil.test", 443, "not_allowlisted", kind="connect")


def test_an_empty_dns_answer_is_no_refusal_and_a_dns_target_has_no_port() -> None:
    empty = EgressSeen.of(_record(kind="dns", port=None, reason=None))
    assert empty.denied and not empty.is_refusal
    refused = EgressSeen.of(_record(kind="dns", port=None, reason="denylisted"))
    assert refused.is_refusal and refused.target == "evil.test"
    assert refusals([empty, refused]) == [Refusal("evil.test", None, "denylisted", kind="dns")]


def test_an_approval_is_seen_and_missing_fields_are_none() -> None:
    approved = _record(decision="allow", reason=None, approval={"id": "a-1", "by": "ann", "waited_s": 1.0})
    assert EgressSeen.of(approved).approved and not EgressSeen.of(approved).is_refusal
    bare = EgressSeen.of({})
    assert bare == EgressSeen("egress", None, None, None, None, None, approved=False)
    assert bare.target == "None"  # as the runners printed a record without a host before
    ended = EgressEnded(
        id="q-1", ts=0.0, run="r-1", address=None, bytes_up=0, bytes_down=0, duration_s=0.0, end="closed"
    ).record()
    end = EgressSeen.of(ended)
    assert end.event == "egress.end" and not end.denied
