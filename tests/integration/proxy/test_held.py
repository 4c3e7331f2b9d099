"""What a client connection holds (``egressd.proxy.net.runner.Runner``) is released once, by its last owner.

Socket-free: peers on a fake transport, a real gate recording into memory.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from egressd.approvals.deny import DenyApprover
from egressd.audit.log import MemoryAuditSink
from egressd.proxy.core.attempt import Attempt, Seen
from egressd.proxy.core.commands import Splice
from egressd.proxy.core.decision import Screen
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.modes import EXPLICIT, ListenerLimits
from egressd.proxy.core.runs import Run, RunRegistry
from egressd.proxy.net.dialer import Dialer
from egressd.proxy.net.listener import Listener
from egressd.proxy.net.recorder import Recorder
from egressd.proxy.net.resolver import SystemResolver
from egressd.proxy.net.runner import EgressPath, Runner
from egressd.proxy.net.stream import Peer
from egressd.vocabulary.egress import EgressKind


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5555) if name == "peername" else default


def _peer() -> Peer:
    peer = Peer()
    peer.connection_made(FakeTransport())
    return peer


def _transport(peer: Peer) -> FakeTransport:
    assert isinstance(peer.transport, FakeTransport)
    return peer.transport


@pytest.fixture
def setup() -> tuple[Listener, MemoryAuditSink, Run]:
    audit = MemoryAuditSink()
    path = EgressPath(
        recorder=Recorder(audit=audit, metrics=Metrics()),
        dialer=Dialer(),
        approver=DenyApprover(),
        resolver=SystemResolver(),
        screen=Screen(),
    )
    run = Run(id="r-1", token="t", task=None, allow=(), deny=())
    listener = Listener(path=path, runs=RunRegistry(default=run), limits=ListenerLimits(), mode=EXPLICIT)
    return listener, audit, run


def _egress(audit: MemoryAuditSink) -> list[dict[str, object]]:
    return [r for r in audit.records if str(r["event"]).startswith("egress")]


def _attempt(listener: Listener, run: Run, kind: EgressKind, port: int) -> Attempt:
    seen: Seen = listener.path.recorder.begin(kind, "127.0.0.1:5555")
    return Attempt(seen, "a.test", port, run, kind)


def _hold(listener: Listener, client: Peer) -> Runner:
    runner = Runner(listener, client)
    runner.hold()
    return runner


async def test_a_connection_is_counted_open_until_released_and_released_once(setup) -> None:  # type: ignore[no-untyped-def]
    listener, audit, run = setup
    client = _peer()
    runner = _hold(listener, client)
    assert listener.path.recorder.metrics.connections_open == 1
    assert runner.talk is not None
    runner.talk.pending = _attempt(listener, run, EgressKind.HTTP, 80)
    runner.release()
    runner.release()
    assert listener.path.recorder.metrics.connections_open == 0
    assert _transport(client).closed
    assert len(_egress(audit)) == 1  # the attempt left with the connection is recorded, once


async def test_a_runs_slot_is_given_back_when_its_request_is_refused(setup) -> None:  # type: ignore[no-untyped-def]
    listener, _, run = setup
    client = _peer()
    task = asyncio.create_task(Runner(listener, client).run())
    client.data_received(b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n")
    await asyncio.wait_for(task, 5)  # not allowlisted: the DenyApprover refuses, the refusal ends the connection
    assert run.open_connections == 0 and listener.path.recorder.metrics.connections_open == 0


async def test_after_a_splice_the_task_releases_nothing_and_the_tunnels_end_releases_everything(setup) -> None:  # type: ignore[no-untyped-def]
    listener, audit, run = setup
    client, upstream = _peer(), _peer()
    runner = _hold(listener, client)
    talk = runner.talk
    assert talk is not None
    attempt = _attempt(listener, run, EgressKind.CONNECT, 443)
    talk.pending, talk.slot, talk.spliced = attempt, run, True
    run.open_connections += 1
    runner._splice(Splice(upstream, attempt, None, name_required=False))
    runner.release()
    # The tunnel has them all: still counted, nothing recorded, nothing closed.
    assert (listener.path.recorder.metrics.connections_open, run.open_connections) == (1, 1)
    assert _egress(audit) == [] and not _transport(client).closed
    upstream.data_received(b"hello")
    client.connection_lost(None)  # the client goes: the tunnel ends
    assert (listener.path.recorder.metrics.connections_open, run.open_connections) == (0, 0)
    assert _transport(client).closed and _transport(upstream).closed
    [record] = _egress(audit)
    assert record["bytes_down"] == 5


async def test_an_attempt_seen_and_never_refused_is_recorded_once_when_the_connection_ends(setup) -> None:  # type: ignore[no-untyped-def]
    listener, audit, run = setup
    runner = _hold(listener, _peer())
    seen = listener.path.recorder.begin(EgressKind.HTTP, "127.0.0.1:5555")
    assert runner.talk is not None
    runner.talk.pending = seen.attributed(run)
    runner.release()
    runner.release()
    [record] = _egress(audit)
    assert (record["decision"], record["reason"], record["run"], record["id"]) == ("deny", None, "r-1", seen.id)


async def test_the_kept_and_the_dialled_upstreams_are_closed_with_the_client(setup) -> None:  # type: ignore[no-untyped-def]
    listener, _, _ = setup
    runner = _hold(listener, _peer())
    kept, dialled = _peer(), _peer()
    assert runner.talk is not None
    runner.talk.kept = (("a.test", 80), "127.0.0.2", kept)
    runner.dialled = dialled
    runner.release()
    assert _transport(kept).closed and _transport(dialled).closed and runner.talk.kept is None
