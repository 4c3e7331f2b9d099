"""Playbooks for the connection core: every mode's conversation driven by hand, no socket anywhere.

Each test plays the network shell: it feeds the client's bytes, answers
each command the conversation yields (or throws the failure into it) and
reads the commands back in order. What they hold: the ``egress`` record is
written (``WriteAhead``) before any dial, every refusal of every mode is
recorded and answered the way its mode answers, and nothing is dialled for
a request that was refused.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from egressd.approvals.interface import ApprovalOutcome
from egressd.proxy.core.attempt import Admission, Attempt, DialError, Seen
from egressd.proxy.core.commands import (
    STALE,
    Ask,
    Close,
    Dial,
    Fill,
    Finish,
    Intercept,
    PeerClosed,
    ReadHead,
    RecordRefusal,
    Relay,
    Resolve,
    Send,
    Splice,
    WriteAhead,
)
from egressd.proxy.core.conversation import Conversation, Listening
from egressd.proxy.core.decision import Screen
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.modes import (
    EXPLICIT,
    GONE_DETAIL,
    SOCKS,
    ListenerLimits,
    Mode,
    Refusal,
    transparent_http,
    transparent_tls,
)
from egressd.proxy.core.policy import parse_entry
from egressd.proxy.core.responses import CONNECT_ESTABLISHED, tls_refusal
from egressd.proxy.core.runs import Run, RunRegistry
from egressd.proxy.core.socks5 import reply
from egressd.proxy.core.ways import WAYS
from egressd.vocabulary.egress import EgressKind
from egressd.vocabulary.reasons import Answer, Reason
from egressd.vocabulary.wire import SocksReply
from tests.fakes.hellos import client_hello, ech_extension

ORIGIN = "127.0.0.2"
ADDRESSES = [ipaddress.ip_address(ORIGIN)]  # what a.test resolves to, in the range the screen permits
FORBIDDEN = [ipaddress.ip_address("127.0.1.5")]  # loopback outside that range: never dialled
SOURCE = ipaddress.ip_address("127.0.0.1")


class Upstream:
    """What a dial gives back: a handle the conversation only reads and passes on."""

    def __init__(self) -> None:
        self.closed = False
        self.eof = False
        self.buf = bytearray()

    def close(self) -> None:
        raise AssertionError("the conversation asks the shell to close an upstream (``Close``)")


class AuditLog:
    """The audit sink as the decision sees it: writable or not."""

    def __init__(self, healthy: bool) -> None:
        self.healthy = healthy


class Playbook:
    """One conversation and the shell's side of it: the commands seen, the answers given."""

    def __init__(self, mode: Mode, *, limits: ListenerLimits | None = None, open_connections: int = 1,
                 anonymous: bool = True, run_cap_reached: bool = False, allowlisted: bool = True,
                 healthy: bool = True, bound: bool = False) -> None:
        allow = (parse_entry("a.test"),) if allowlisted else ()
        runs = RunRegistry()
        if bound:  # the run the client's source address is bound to (a sandbox's)
            self.run = runs.create(task=None, allow=allow, sources=[SOURCE], run_id="r-1")
        elif not anonymous:  # a run only its credentials find
            self.run = runs.create(task=None, allow=allow, run_id="r-1")
        else:
            self.run = Run(id="r-1", token="t", task=None, allow=allow, deny=())
            runs = RunRegistry(default=self.run)  # the source address finds the run
        if run_cap_reached:
            self.run.open_connections = (limits or ListenerLimits()).max_connections_per_run
        self.metrics = Metrics()
        self.metrics.connections_open = open_connections
        self.buf = bytearray()
        self.ids = iter(range(1, 1000))
        listening = Listening(
            way=WAYS[mode.reads],
            mode=mode,
            limits=limits or ListenerLimits(),
            runs=runs,
            metrics=self.metrics,
            screen=Screen(allow_private=[ipaddress.ip_network("127.0.0.0/24")]),
            audit=AuditLog(healthy),
            begin=self._begin,
        )
        self.talk = Conversation(listening, lambda: 100.0, "127.0.0.1:5555", SOURCE, self.buf)
        self.steps = self.talk.steps()
        self.seen: list[Any] = []
        self.over = False
        self._next(lambda: next(self.steps))

    def _begin(self, kind: EgressKind, client: str | None, port: int | None) -> Seen:
        return Seen(id=f"req-{next(self.ids)}", kind=kind, client=client, ts=1.0, started=0.0, port=port)

    def _next(self, step: Any) -> None:
        try:
            self.seen.append(step())
        except StopIteration:
            self.over = True

    @property
    def attempt(self) -> Attempt:
        """The attempt being decided or carried."""
        attempt = self.talk.pending
        assert isinstance(attempt, Attempt)
        return attempt

    @property
    def command(self) -> Any:
        assert not self.over, "the conversation is over"
        return self.seen[-1]

    def give(self, result: Any = None) -> Any:
        """Answer the current command with ``result``; the next command."""
        command = self.command
        if isinstance(command, WriteAhead):
            command.attempt.address = command.address  # what the recorder does as it writes the record
        self._next(lambda: self.steps.send(result))
        return None if self.over else self.command

    def fail(self, exc: BaseException) -> Any:
        """The current command failed with ``exc``; the next command."""
        self._next(lambda: self.steps.throw(exc))
        return None if self.over else self.command

    def client_sends(self, data: bytes) -> Any:
        """The client's bytes arrive for the ``ReadHead`` or ``Fill`` under way; the next command."""
        self.buf += data
        command = self.command
        if isinstance(command, ReadHead):
            head, used = command.parse(self.buf, False)
            del self.buf[:used]
            assert head is not None, "a whole head was sent"
            return self.give(head)
        assert isinstance(command, Fill)
        return self.give(True)

    def kinds(self) -> list[type]:
        return [type(command) for command in self.seen]

    def until(self, kind: type) -> Any:
        """Answer every command with None until one of ``kind`` comes."""
        while not isinstance(self.command, kind):
            self.give(None)
        return self.command


def admission(port: int) -> Admission:
    """What the screen admits for a.test on ``port``."""
    return Admission(None, "a.test", port, tuple(ADDRESSES), (ORIGIN,))


# -- the record before the dial, in every mode ---------------------------------------------------


def _connect_request(play: Playbook) -> Any:
    return play.client_sends(b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n")


def _socks_request(play: Playbook, name: bytes = b"a.test", command: int = 1) -> Any:
    assert play.client_sends(b"\x05\x01\x00") == Send(b"\x05\x00")  # no authentication: the source's run
    play.give(None)
    request = b"\x05" + bytes([command]) + b"\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", 443)
    return play.client_sends(request)


ARRIVALS = {
    "proxy": (EXPLICIT, _connect_request, CONNECT_ESTABLISHED),
    "tls": (transparent_tls(), lambda play: play.client_sends(client_hello("a.test")), None),
    "socks": (SOCKS, _socks_request, reply(SocksReply.SUCCEEDED)),
}


@pytest.mark.parametrize("mode", [EXPLICIT, transparent_http(), transparent_tls(), SOCKS], ids=str)
def test_the_first_wait_of_every_mode_ends_at_the_head_timeout_on_the_one_clock(mode: Any) -> None:
    first = Playbook(mode).command
    assert isinstance(first, ReadHead | Fill)
    assert first.deadline == 100.0 + ListenerLimits().head_timeout_s


@pytest.mark.parametrize("name", sorted(ARRIVALS))
def test_every_mode_writes_the_record_before_the_dial_and_splices_after_the_answer(name: str) -> None:
    mode, arrive, accepted = ARRIVALS[name]
    play = Playbook(mode)
    resolve = arrive(play)
    assert resolve == Resolve("a.test", on_eof=True)  # a tunnel's client going away stops the wait
    assert play.attempt.host == "a.test" and play.attempt.port == 443 and play.attempt.run is play.run
    assert play.run.open_connections == 1  # the request counts against its run's cap
    write = play.give(ADDRESSES)
    assert write == WriteAhead(play.attempt, ORIGIN)
    dial = play.give(None)
    assert isinstance(dial, Dial) and dial.attempt is play.attempt
    # Every wait's deadline is an instant on the conversation's one clock (here 100.0).
    assert dial.deadline == 100.0 + ListenerLimits().connect_timeout_s
    upstream = Upstream()
    # The answer (a CONNECT's 200, a SOCKS reply; nothing for TLS) goes out, then the splice.
    assert play.give(upstream) == Splice(upstream, play.attempt, accepted, name_required=name == "tls")
    assert play.give(None) is None and play.over
    kinds = play.kinds()
    assert kinds.index(WriteAhead) < kinds.index(Dial) < kinds.index(Splice)
    # The tunnel has the slot and the attempt now: the runner releases them at its end.
    assert play.talk.spliced and play.talk.slot is play.run and play.talk.pending is play.attempt
    assert play.run.open_connections == 1


@pytest.mark.parametrize("name", sorted(ARRIVALS))
def test_an_unwritable_record_means_no_dial_in_any_mode(name: str) -> None:
    mode, arrive, _ = ARRIVALS[name]
    play = Playbook(mode)
    arrive(play)
    play.give(ADDRESSES)
    after = play.fail(DialError(Reason.AUDIT_UNAVAILABLE, "disk full"))
    assert after == Finish(play.attempt)
    assert play.attempt.reason == "audit_unavailable"
    assert Dial not in play.kinds()
    play.until(Send)
    assert play.give(None) is None
    assert play.run.open_connections == 0


@pytest.mark.parametrize("name", sorted(ARRIVALS))
def test_a_client_gone_while_held_ends_the_conversation_with_nothing_dialled(name: str) -> None:
    mode, arrive, _ = ARRIVALS[name]
    play = Playbook(mode)
    arrive(play)
    with pytest.raises(PeerClosed):
        play.fail(PeerClosed("gone"))
    assert play.attempt.detail == GONE_DETAIL
    assert play.talk.pending is play.attempt  # recorded by the runner as the connection ends
    assert play.run.open_connections == 0 and WriteAhead not in play.kinds()


def test_the_policy_decides_before_anything_is_resolved_or_dialled() -> None:
    play = Playbook(EXPLICIT, allowlisted=False)
    ask = _connect_request(play)
    assert isinstance(ask, Ask)  # an unknown name: a person is asked first
    assert play.give(ApprovalOutcome(Answer.ALLOW)) == Resolve("a.test", True)
    assert play.give(ADDRESSES) == WriteAhead(play.attempt, ORIGIN)
    assert play.attempt.rule == "approved" and "a.test" in play.run.allowed_texts()


def test_an_unhealthy_audit_log_refuses_before_anything_is_asked_resolved_or_dialled() -> None:
    play = Playbook(EXPLICIT, healthy=False)
    assert _connect_request(play) == Finish(play.attempt)
    assert play.attempt.reason == "audit_unavailable"
    assert play.give(None).data.startswith(b"HTTP/1.1 503 ")
    assert not {Ask, Resolve, WriteAhead, Dial} & set(play.kinds())


@pytest.mark.parametrize("name", sorted(ARRIVALS))
def test_a_name_resolving_only_outside_the_permitted_range_is_never_dialled(name: str) -> None:
    mode, arrive, _ = ARRIVALS[name]
    play = Playbook(mode)
    arrive(play)
    assert play.give(FORBIDDEN) == Finish(play.attempt)
    assert play.attempt.reason == "private_address" and play.attempt.recorded_address == "127.0.1.5"
    assert not {WriteAhead, Dial} & set(play.kinds())


# -- refusals: recorded, then answered the way the mode answers ---------------------------------


def _refusal_bytes(play: Playbook) -> bytes | None:
    sends = [command.data for command in play.seen if isinstance(command, Send)]
    return sends[-1] if sends else None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("proxy", lambda data: data.startswith(b"HTTP/1.1 403 ") and b"X-Egress-Reason: denied" in data),
        ("tls", lambda data: data == tls_refusal(Reason.DENIED)),
        ("socks", lambda data: data == reply(SocksReply.NOT_ALLOWED)),
    ],
)
def test_a_denial_is_finished_then_answered_in_the_modes_own_terms(name: str, expected: Any) -> None:
    mode, arrive, _ = ARRIVALS[name]
    play = Playbook(mode, allowlisted=False)
    ask = arrive(play)
    assert isinstance(ask, Ask) and ask.request.host == "a.test" and ask.request.run_id == "r-1"
    assert play.give(ApprovalOutcome(Answer.DENY)) == Finish(play.attempt)
    assert play.attempt.reason == "denied"
    data = play.give(None).data
    assert expected(data)
    assert play.give(None) is None
    assert WriteAhead not in play.kinds() and Dial not in play.kinds()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("proxy", lambda data: data.startswith(b"HTTP/1.1 502 ")),
        ("tls", lambda data: data == tls_refusal(Reason.UPSTREAM_UNREACHABLE)),
        ("socks", lambda data: data == reply(SocksReply.CONNECTION_REFUSED)),
    ],
)
def test_a_failed_dial_is_recorded_with_its_detail_and_answered(name: str, expected: Any) -> None:
    mode, arrive, _ = ARRIVALS[name]
    play = Playbook(mode)
    arrive(play)
    play.give(ADDRESSES)
    play.give(None)  # the record ahead
    assert play.fail(DialError(Reason.UPSTREAM_UNREACHABLE, "refused")) == Finish(play.attempt)
    assert play.attempt.detail == "refused"
    assert expected(play.give(None).data)


def test_http_a_bad_head_is_recorded_before_the_policy_and_answered_400() -> None:
    play = Playbook(EXPLICIT)
    play.buf += b"GET / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
    command = play.command
    assert isinstance(command, ReadHead)
    with pytest.raises(Exception) as error:
        command.parse(play.buf, False)
    record = play.fail(error.value)
    assert isinstance(record, RecordRefusal) and record.reason is Reason.BAD_REQUEST
    assert play.give(None).data.startswith(b"HTTP/1.1 400 ")


def test_http_a_slow_head_is_408_but_an_idle_keep_alive_connection_just_ends() -> None:
    play = Playbook(EXPLICIT)
    record = play.fail(TimeoutError())
    assert isinstance(record, RecordRefusal) and record.reason is Reason.LIMIT_EXCEEDED
    assert play.give(None).data.startswith(b"HTTP/1.1 408 ")
    # The second request of a keep-alive connection that never comes is no attempt.
    play = Playbook(EXPLICIT)
    play.talk.first = False
    assert play.fail(TimeoutError()) is None and play.over
    assert RecordRefusal not in play.kinds()


def test_http_without_credentials_where_runs_need_them_is_407() -> None:
    play = Playbook(EXPLICIT, anonymous=False)  # every request needs its run's credentials
    record = _connect_request(play)
    assert isinstance(record, RecordRefusal) and record.reason is Reason.AUTH_REQUIRED
    assert record.seen.kind is EgressKind.CONNECT and record.seen.host == "a.test"
    assert play.give(None).data.startswith(b"HTTP/1.1 407 ")


def test_http_the_transparent_host_listener_refuses_plainly_403() -> None:
    play = Playbook(transparent_http(), anonymous=False)
    record = play.client_sends(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
    assert isinstance(record, RecordRefusal) and record.reason is Reason.AUTH_REQUIRED
    assert play.give(None).data.startswith(b"HTTP/1.1 403 ")  # 407 would ask for credentials it cannot send


@pytest.mark.parametrize("name", sorted(ARRIVALS))
def test_a_listener_over_its_connection_cap_sheds_before_reading(name: str) -> None:
    mode, _, _ = ARRIVALS[name]
    play = Playbook(mode, limits=ListenerLimits(max_connections=1), open_connections=2)
    record = play.command
    assert isinstance(record, RecordRefusal) and record.reason is Reason.LIMIT_EXCEEDED
    after = play.give(None)
    if name == "proxy":
        assert after.data.startswith(b"HTTP/1.1 429 ") and b"Retry-After: 1" in after.data
    else:
        assert after is None  # TLS and SOCKS: shed before the client spoke, so no answer
    assert ReadHead not in play.kinds() and Fill not in play.kinds()


@pytest.mark.parametrize("name", sorted(ARRIVALS))
def test_a_run_at_its_cap_is_refused_without_asking(name: str) -> None:
    mode, arrive, _ = ARRIVALS[name]
    play = Playbook(mode, limits=ListenerLimits(max_connections_per_run=1), run_cap_reached=True)
    record = arrive(play)
    assert isinstance(record, RecordRefusal) and record.reason is Reason.LIMIT_EXCEEDED
    assert Ask not in play.kinds() and Resolve not in play.kinds()


def test_tls_not_tls_is_closed_silently_and_ech_is_refused_as_a_mismatch() -> None:
    play = Playbook(transparent_tls())
    record = play.client_sends(b"GET / HTTP/1.1\r\n\r\n")
    assert isinstance(record, RecordRefusal) and record.reason is Reason.BAD_REQUEST
    assert play.give(None) is None  # no TLS was spoken: no alert
    play = Playbook(transparent_tls())
    record = play.client_sends(client_hello("cover.test", extra=[ech_extension()]))
    assert isinstance(record, RecordRefusal) and record.reason is Reason.SNI_MISMATCH
    assert record.seen.host == "cover.test" and record.seen.run is play.run
    assert play.give(None) == Send(tls_refusal(Reason.SNI_MISMATCH))
    assert Ask not in play.kinds() and Resolve not in play.kinds()


def test_tls_a_hello_without_a_name_is_refused_with_missing_extension() -> None:
    play = Playbook(transparent_tls())
    record = play.client_sends(client_hello(None))
    assert isinstance(record, RecordRefusal) and record.reason is Reason.BAD_REQUEST
    alert = play.give(None).data
    assert alert[0] == 21 and alert[-1] == 109  # a fatal alert: missing_extension


def test_socks_bind_is_refused_with_command_not_supported() -> None:
    play = Playbook(SOCKS)
    record = _socks_request(play, command=2)
    assert isinstance(record, RecordRefusal) and record.reason is Reason.BAD_REQUEST
    assert play.give(None) == Send(reply(SocksReply.COMMAND_NOT_SUPPORTED))


def test_socks_without_a_run_for_the_source_offers_no_acceptable_method() -> None:
    play = Playbook(SOCKS, anonymous=False)
    record = play.client_sends(b"\x05\x01\x00")
    assert isinstance(record, RecordRefusal) and record.reason is Reason.AUTH_REQUIRED
    assert play.give(None) == Send(b"\x05\xff")


def test_socks_wrong_credentials_get_status_1() -> None:
    play = Playbook(SOCKS, anonymous=False)
    assert play.client_sends(b"\x05\x01\x02") == Send(b"\x05\x02")
    play.give(None)
    record = play.client_sends(b"\x01\x03r-1\x05wrong")
    assert isinstance(record, RecordRefusal) and record.reason is Reason.AUTH_REQUIRED
    assert play.give(None) == Send(b"\x01\x01")


# -- HTTP/1 carried: requests forwarded one by one ------------------------------------------------


def _get(play: Playbook, path: bytes = b"/") -> Any:
    return play.client_sends(b"GET http://a.test" + path + b" HTTP/1.1\r\nHost: a.test\r\n\r\n")


def _respond(play: Playbook, relay: Relay) -> Any:
    """The runner's part of a relay: the origin answers 200 with no body, the client may go on."""
    response, used = relay.exchange.read_response(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", False)
    assert response is not None and used
    return play.give(relay.exchange.finish())


def _first_request_on_a_kept_connection(play: Playbook) -> Upstream:
    _get(play)
    play.give(ADDRESSES)
    play.give(None)  # the record
    upstream = Upstream()
    relay = play.give(upstream)
    assert _respond(play, relay) == Finish(play.attempt)
    assert isinstance(play.give(None), ReadHead)
    return upstream


def test_http_forwarding_records_before_dialling_then_relays_and_takes_the_next_request() -> None:
    play = Playbook(EXPLICIT)
    # A plain HTTP client may half-close after its request and still read the answer.
    assert _get(play) == Resolve("a.test", on_eof=False)
    assert play.give(ADDRESSES) == WriteAhead(play.attempt, ORIGIN)
    assert isinstance(play.give(None), Dial)
    upstream = Upstream()
    relay = play.give(upstream)
    assert isinstance(relay, Relay) and relay.upstream is upstream and not relay.reused
    assert relay.out.startswith(b"GET / HTTP/1.1\r\n")
    assert _respond(play, relay) == Finish(play.attempt)
    assert isinstance(play.give(None), ReadHead)  # keep-alive: the next request
    assert play.run.open_connections == 0 and play.talk.pending is None
    assert play.talk.kept == (("a.test", 80), ORIGIN, upstream)


def test_http_the_next_request_to_the_same_host_is_recorded_then_sent_on_the_kept_connection() -> None:
    play = Playbook(EXPLICIT)
    upstream = _first_request_on_a_kept_connection(play)
    first = len(play.seen)
    play.client_sends(b"GET http://a.test/two HTTP/1.1\r\nHost: a.test\r\n\r\n")
    assert play.give(ADDRESSES) == WriteAhead(play.attempt, ORIGIN)  # its own record, before its bytes go out
    relay = play.give(None)
    assert relay.upstream is upstream and relay.reused
    assert Dial not in [type(command) for command in play.seen[first:]]


def test_http_a_stale_kept_connection_is_replaced_once() -> None:
    play = Playbook(EXPLICIT)
    _first_request_on_a_kept_connection(play)
    play.client_sends(b"GET http://a.test/two HTTP/1.1\r\nHost: a.test\r\n\r\n")
    play.give(ADDRESSES)
    relay = play.give(None)
    assert relay.reused and not relay.last_try
    assert play.give(STALE) == WriteAhead(play.attempt, ORIGIN)  # idempotent: the record is written once
    assert isinstance(play.give(None), Dial)
    relay = play.give(Upstream())
    assert not relay.reused and relay.last_try


def test_http_a_kept_connection_that_went_away_is_closed_and_a_new_one_dialled() -> None:
    play = Playbook(EXPLICIT)
    upstream = _first_request_on_a_kept_connection(play)
    upstream.eof = True  # the origin closed it meanwhile
    play.client_sends(b"GET http://a.test/two HTTP/1.1\r\nHost: a.test\r\n\r\n")
    assert play.give(ADDRESSES) == Close(upstream)
    assert play.give(None) == WriteAhead(play.attempt, ORIGIN)
    assert isinstance(play.give(None), Dial)


def test_http_an_upstream_that_takes_the_request_and_never_answers_is_504() -> None:
    play = Playbook(EXPLICIT)
    _get(play)
    play.give(ADDRESSES)
    play.until(Relay)
    assert play.give(Reason.UPSTREAM_TIMEOUT) == Finish(play.attempt)
    assert play.give(None).data.startswith(b"HTTP/1.1 504 ")
    assert play.give(None) is None  # a refusal ends the connection


def test_a_bug_in_the_conversation_leaves_what_it_saw_to_record_as_a_bad_request() -> None:
    play = Playbook(transparent_tls())
    seen = play.talk.pending
    assert isinstance(seen, Seen)
    assert play.talk.failed() is seen and play.talk.pending is None


def _all_commands() -> Iterator[type]:
    yield from (Ask, Dial, Fill, Finish, ReadHead, RecordRefusal, Relay, Resolve, Send, Splice, WriteAhead, Close)


def test_every_command_is_a_value() -> None:
    for kind in _all_commands():
        assert hasattr(kind, "_fields"), kind  # a NamedTuple: compared and shown by value in these playbooks


# -- every other refusal before the decision, mode by mode -------------------------------------------


def _refusal_after(play: Playbook, *chunks: bytes) -> tuple[Any, bytes | None]:
    """Feed the client's ``chunks`` (each SOCKS reply taken as sent) until a refusal is recorded.

    Returns the recording command and what the client hears (None: the close alone).
    """
    for chunk in chunks:
        while isinstance(play.command, Send):
            play.give(None)
        if chunk == b"<eof>":
            play.give(False)  # the client closed
        elif chunk == b"<timeout>":
            play.fail(TimeoutError())
        else:
            play.client_sends(chunk)
        if isinstance(play.command, (RecordRefusal, Finish)):
            break
    record = play.command
    assert isinstance(record, (RecordRefusal, Finish)), record
    answer = play.give(None)
    if answer is None:
        return record, None
    assert isinstance(answer, Send) and play.give(None) is None
    return record, answer.data


GREETING = b"\x05\x01\x00"
CONNECT_A = b"\x05\x01\x00\x03\x06a.test\x01\xbb"
HELLO = client_hello("a.test")


@pytest.mark.parametrize(
    ("mode", "chunks", "reason", "answer"),
    [
        # HTTP: a head naming no destination this listener serves.
        (transparent_http(), [b"GET / HTTP/1.1\r\nHost: a.test:8080\r\n\r\n"], "bad_request", b"HTTP/1.1 400 "),
        (transparent_http(), [b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test\r\n\r\n"], "bad_request", b"HTTP/1.1 400 "),
        # TLS: malformed, cut short, too slow.
        (transparent_tls(), [b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00"], "bad_request", b"\x15"),
        (transparent_tls(), [HELLO[:20], b"<eof>"], "bad_request", None),
        (transparent_tls(), [HELLO[:20], b"<timeout>"], "limit_exceeded", None),
        # SOCKS: a bad greeting, bad credentials' syntax, a bad request, cut short, too slow.
        (SOCKS, [b"\x04\x01\x00"], "bad_request", None),
        (SOCKS, [GREETING, b"\x05\x01\x00\x09"], "bad_request", b"\x05\x08"),
        (SOCKS, [GREETING, CONNECT_A[:6], b"<eof>"], "bad_request", None),
        (SOCKS, [GREETING[:1], b"<timeout>"], "limit_exceeded", None),
    ],
    ids=["host-port", "host-connect", "tls-malformed", "tls-cut", "tls-slow", "socks-version", "socks-atyp",
         "socks-cut", "socks-slow"],
)
def test_a_bad_or_slow_head_is_recorded_and_answered_as_its_mode_does(
    mode: Mode, chunks: list[bytes], reason: str, answer: bytes | None
) -> None:
    play = Playbook(mode)
    record, heard = _refusal_after(play, *chunks)
    assert isinstance(record, RecordRefusal) and record.reason is not None and record.reason.value == reason
    if answer is None:
        assert heard is None
    else:
        assert heard is not None and heard.startswith(answer)
    assert not {Ask, Resolve, WriteAhead, Dial} & set(play.kinds())


@pytest.mark.parametrize("name", sorted(ARRIVALS))
def test_a_sandbox_at_its_run_cap_is_refused_before_its_head_is_read(name: str) -> None:
    mode, _, _ = ARRIVALS[name]
    play = Playbook(mode, bound=True, limits=ListenerLimits(max_connections_per_run=1), run_cap_reached=True)
    record = play.command
    assert isinstance(record, RecordRefusal) and record.reason is Reason.LIMIT_EXCEEDED
    assert record.seen.run is play.run
    after = play.give(None)
    if name == "proxy":
        assert after.data.startswith(b"HTTP/1.1 429 ")
    elif name == "tls":
        assert after == Send(tls_refusal(Reason.LIMIT_EXCEEDED))
    else:
        assert after is None  # SOCKS: before the greeting there is no reply to send
    assert ReadHead not in play.kinds() and Fill not in play.kinds()


def test_socks_credentials_of_a_run_are_accepted_and_decided_in_that_run() -> None:
    play = Playbook(SOCKS, anonymous=False)
    assert play.client_sends(b"\x05\x01\x02") == Send(b"\x05\x02")
    play.give(None)
    token = play.run.token.encode()
    assert play.client_sends(b"\x01\x03r-1" + bytes([len(token)]) + token) == Send(b"\x01\x00")
    play.give(None)
    assert play.client_sends(CONNECT_A) == Resolve("a.test", on_eof=True)
    assert play.attempt.run is play.run


# -- a fourth way in is one layer ------------------------------------------------------------------


class LineWay:
    """A made-up way in: the client names ``host port`` on one line; refusals are a line too.

    Nothing else is written for it: the conversation decides, records,
    dials and splices for it as for the three real ones.
    """

    kind = EgressKind.CONNECT
    counted: str | None = "line"
    name_required = False
    accepted: bytes | None = b"OK\n"

    def arrive(self, talk: Conversation) -> Any:
        if not talk.first:
            return None
        seen = talk.pending = talk.at.begin(self.kind, talk.client, None)
        while b"\n" not in talk.buf:
            if not (yield Fill(talk.now() + 1.0)):
                return None
        line, _, _ = bytes(talk.buf).partition(b"\n")
        del talk.buf[: len(line) + 1]
        host, port = line.decode().split()
        run = talk.at.runs.attribute(talk.source, None)
        assert run is not None
        return seen.attributed(run), run, host, int(port), None, None

    def answer(self, talk: Conversation, refused: Refusal, target: Seen | Attempt) -> bytes | None:
        return f"NO {refused.reason.value}\n".encode()


def _line_play(allowlisted: bool) -> Playbook:
    play = Playbook(EXPLICIT, allowlisted=allowlisted)
    listening = play.talk.at
    play.talk = Conversation(
        Listening(LineWay(), listening.mode, listening.limits, listening.runs, listening.metrics,
                  listening.screen, listening.audit, listening.begin),
        lambda: 100.0, "127.0.0.1:5555", SOURCE, play.buf,
    )
    play.steps, play.seen, play.over = play.talk.steps(), [], False
    play._next(lambda: next(play.steps))
    return play


def test_a_fourth_way_in_is_one_layer_and_meets_the_same_decision_record_and_dial() -> None:
    play = _line_play(allowlisted=True)
    assert play.client_sends(b"a.test 443\n") == Resolve("a.test", on_eof=True)
    assert play.give(ADDRESSES) == WriteAhead(play.attempt, ORIGIN)
    assert isinstance(play.give(None), Dial)
    upstream = Upstream()
    assert play.give(upstream) == Splice(upstream, play.attempt, b"OK\n", name_required=False)
    assert play.metrics.connections_total["line"] == 1
    play = _line_play(allowlisted=False)
    assert isinstance(play.client_sends(b"b.test 443\n"), Ask)
    assert play.give(ApprovalOutcome(Answer.DENY)) == Finish(play.attempt)
    assert play.give(None) == Send(b"NO denied\n")


# -- a name with request rules ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tls", "socks", "proxy"])
@pytest.mark.parametrize("can_inspect", [True, False])
def test_a_name_with_request_rules_is_never_spliced_unseen(name: str, can_inspect: bool) -> None:
    """Every way in whose tunnel carries TLS intercepts it; a listener given nothing to inspect with refuses it."""
    mode, arrive, _ = ARRIVALS[name]
    play = Playbook(mode)
    play.run.set_entries([parse_entry("GET a.test/**")], [])
    play.talk.at = dataclasses.replace(
        play.talk.at, inspecting=(lambda run, host, port, head: object()) if can_inspect else None
    )
    arrive(play)
    after = play.give(ADDRESSES)
    if can_inspect:
        assert after == WriteAhead(play.attempt, None)  # the tunnel's record: nothing dialled for it
        intercept = play.give(None)
        assert isinstance(intercept, Intercept) and intercept.name == "a.test"
        assert intercept.deadline == 100.0 + ListenerLimits().head_timeout_s
        assert intercept.answer == play.talk.at.way.accepted  # the transparent TLS listener's: none
        return
    assert after == Finish(play.attempt)
    assert play.attempt.reason == "tls_intercept_failed" and "cannot inspect" in (play.attempt.detail or "")
    assert not {WriteAhead, Dial, Splice} & set(play.kinds())
