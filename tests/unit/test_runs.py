"""Runs and their registry, without I/O: attribution by source address, and the event window."""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from egressd.names.addresses import IPAddress
from egressd.proxy.core.runs import DEFAULT_RUN_ID, Run, RunRegistry, source_address

# What a client's socket may say its address is: bound ones in several spellings, and others.
PEERS = (
    "10.1.0.2",
    "10.1.0.3",
    "::ffff:10.1.0.2",  # a dual-stack listener's view of 10.1.0.2
    "fd00::2",
    "FD00:0:0::2",
    "fd00::2%eth0",  # a zone id is dropped
    "fd00::3",
    "fe80::1%2",
    "127.0.0.1",
    "not an address",  # a Unix socket's peer
    "",
)


def _registry(default: Run | None) -> tuple[RunRegistry, Run, Run]:
    runs = RunRegistry(default=default)
    v4 = runs.create(task=None, allow=(), sources=[ip_address("10.1.0.2")])
    v6 = runs.create(task=None, allow=(), sources=[ip_address("fd00::2"), ip_address("10.1.0.9")])
    return runs, v4, v6


def _by_text(runs: RunRegistry, peer: str) -> Run | None:
    source = source_address(peer)
    return runs.attribute_text(str(source) if source is not None else None)


def _by_address(runs: RunRegistry, peer: str) -> Run | None:
    source: IPAddress | None = source_address(peer)
    return runs.attribute(source, None)


@pytest.mark.parametrize("with_default", [False, True])
def test_attribution_by_an_address_text_finds_what_attribution_by_the_address_finds(with_default: bool) -> None:
    default = Run(id=DEFAULT_RUN_ID, token="-", task=None, allow=(), deny=()) if with_default else None
    runs, v4, v6 = _registry(default)
    found = {peer: _by_text(runs, peer) for peer in PEERS}
    assert found == {peer: _by_address(runs, peer) for peer in PEERS}
    assert (found["10.1.0.2"], found["::ffff:10.1.0.2"], found["FD00:0:0::2"], found["fd00::2%eth0"]) == (
        v4,
        v4,
        v6,
        v6,
    )
    assert found["10.1.0.3"] is found["fe80::1%2"] is found["not an address"] is default
    runs.end(v6.id)
    assert _by_text(runs, "fd00::2") is _by_text(runs, "10.1.0.9") is default
    assert _by_text(runs, "10.1.0.2") is v4


def test_a_run_bound_to_a_scoped_address_is_found_by_that_address_alone() -> None:
    runs = RunRegistry()
    scoped = runs.create(task=None, allow=(), sources=[ip_address("fe80::1%eth0")])
    assert runs.attribute_text("fe80::1%eth0") is runs.attribute(ip_address("fe80::1%eth0"), None) is scoped
    assert runs.attribute_text("fe80::1") is runs.attribute(ip_address("fe80::1"), None) is None


def test_the_event_window_keeps_a_handed_over_record_itself_and_a_copy_of_any_other() -> None:
    run = Run(id="r-1", token="-", task=None, allow=(), deny=())
    copied, kept = {"id": "q-1"}, {"id": "q-2"}
    run.record_event(copied)
    run.keep_event(kept)
    copied["id"] = "changed"
    events, cursor = run.events_after(0)
    assert events == [{"id": "q-1"}, {"id": "q-2"}] and cursor == 2
    assert events[1] is kept


def test_the_runs_summary_counts_what_went_out_what_was_refused_and_what_a_person_decided() -> None:
    run = Run(id="r-1", token="-", task=None, allow=(), deny=())
    run.started = 100.0
    for record in (
        {"kind": "connect", "decision": "allow", "approval": None},
        {"kind": "https", "decision": "allow", "approval": {"id": "a-1", "by": "alice"}},
        {"kind": "http", "decision": "deny", "approval": {"id": "a-2", "by": "bob"}},
        {"kind": "http", "decision": "deny", "approval": {"id": "a-3", "by": None}},  # nobody answered
        {"kind": "dns", "decision": "allow", "approval": None},  # a lookup is no connection: not counted
        {"kind": "connect", "decision": "deny", "approval": None},
    ):
        run.keep_event(record)
    assert run.summary(112.5) == {"duration_s": 12.5, "allowed": 2, "refused": 3, "answered": 2}
