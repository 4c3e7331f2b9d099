"""Runs one client connection's conversation: executes each command the core yields.

The conversation (``egressd.proxy.core.conversation``) decides everything
a connection does, in every mode; this is the one place that does it: reads
and writes on the client (``stream.Peer``), asks the approver and the
resolver, writes the ``egress`` record ahead and the rest (``recorder``),
dials (``dialer``), relays an HTTP request and its response (as
``exchange`` frames them), and splices a tunnel (``tunnel``, checked by
``tunnelcheck``).

What a connection holds while it lasts, released once by whoever has it
last (this runner's task, or the tunnel it was spliced to):

1. the listener's count of open connections (``Metrics.connections_open``);
2. a slot under its run's cap (the conversation's ``slot``);
3. the attempt to record when the connection ends (its ``pending``);
4. an upstream connection: just dialled, or kept for the client's next
   request to the same host (the HTTP modes: ``Conversation.kept``), closed
   with the client.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, replace
from typing import Any, Protocol

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest, Approver
from egressd.names.suffixes import registrable_domain
from egressd.proxy.core.attempt import Attempt, DialError
from egressd.proxy.core.budget import Budget
from egressd.proxy.core.commands import (
    STALE,
    Ask,
    Close,
    Dial,
    Extend,
    Fill,
    Finish,
    Intercept,
    InterceptFailed,
    PeerClosed,
    ReadHead,
    RecordRefusal,
    Relay,
    Resolve,
    Send,
    Splice,
    Steps,
    WriteAhead,
)
from egressd.proxy.core.conversation import Conversation, Listening
from egressd.proxy.core.decision import Screen, budget_approval, cap_approval
from egressd.proxy.core.dns import ResolveError
from egressd.proxy.core.exchange import Exchange
from egressd.proxy.core.http1.heads import ResponseHead
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.modes import ListenerLimits
from egressd.proxy.core.runs import RunRegistry, source_address
from egressd.proxy.core.secrets import Secrets
from egressd.proxy.net.dialer import Dialer
from egressd.proxy.net.inspector import CannotInspect, Inspector
from egressd.proxy.net.recorder import Recorder
from egressd.proxy.net.resolver import Resolver
from egressd.proxy.net.stream import Framing, GoneCancels, IdleTimeout, OverAllowance, Peer
from egressd.proxy.net.tlslayer import ServerTls
from egressd.proxy.net.tunnel import Tunnel
from egressd.proxy.net.tunnelcheck import SniCheck
from egressd.vocabulary.egress import End
from egressd.vocabulary.reasons import ANSWER_REASONS, Answer, Reason

log = logging.getLogger("egressd.proxy")

# What executing a command may fail with: thrown into the conversation, which decides what it means.
_FAILURES = (PeerClosed, TimeoutError, DialError, HttpError, ResolveError, InterceptFailed)


@dataclass(frozen=True, slots=True)
class EgressPath:
    """What every connection of every listener goes through: one of each, shared."""

    recorder: Recorder
    dialer: Dialer
    approver: Approver
    resolver: Resolver
    screen: Screen
    inspector: Inspector | None = None  # the TLS ends of inspected connections (None: nothing is inspected)
    secrets: Secrets | None = None  # declared secrets (None: none)
    # A worker's (``--workers``): the owner keeps the runs' upload budgets and lends this process bytes of them.
    lender: Lender | None = None


class Lender(Protocol):
    """Where a worker's upload budgets come from: the owner process (``owner.OwnerApprover``)."""

    async def lend(self, run_id: str, site: str, port: int, need: int) -> tuple[ApprovalOutcome, int]:
        """``need`` bytes or more of the run's budget to ``site`` → (the outcome, the bytes lent when allowed)."""
        ...


class Shared(Protocol):
    """What the runners of one listener share with it (``listener.Listener``)."""

    path: EgressPath
    runs: RunRegistry
    limits: ListenerLimits
    listening: Listening  # what every conversation of the listener is given (its way in, its limits, ...)

    tasks: dict[Peer, asyncio.Task[None]]  # each client's task while it runs
    tunnels: set[Tunnel]  # the spliced tunnels, which have no task
    cutting: bool  # the listener is ending what its grace period left open

    def tunnel_ended(self, tunnel: Tunnel) -> None:
        """A tunnel of this listener ended."""
        ...


class Runner:
    """One client connection: its conversation, executed (``run``), and what it holds."""

    __slots__ = ("shared", "path", "recorder", "client", "talk", "dialled", "gone", "tunnel", "released")

    def __init__(self, shared: Shared, client: Peer) -> None:
        self.shared = shared
        self.path = shared.path
        self.recorder = shared.path.recorder
        self.client = client
        self.talk: Conversation | None = None
        self.dialled: Peer | None = None  # an upstream not yet spliced, kept or closed
        self.gone: GoneCancels | None = None  # entered around each decision: one per connection
        self.tunnel: Tunnel | None = None
        self.released = False

    def hold(self) -> Conversation:
        """Count the connection open and start its conversation: called first by its task.

        Counted when the task runs, not at the accept, so the cap compares the tasks under way.
        """
        shared, recorder, client = self.shared, self.recorder, self.client
        recorder.metrics.connections_open += 1
        peer = client.peername or ("", 0)
        talk = self.talk = Conversation(
            shared.listening, client.loop.time, f"{peer[0]}:{peer[1]}", source_address(str(peer[0])), client.buf
        )
        return talk

    async def run(self) -> None:
        """Serve the client until its conversation ends, then release what it holds (unless spliced)."""
        shared, recorder, client = self.shared, self.recorder, self.client
        talk = self.hold()
        steps: Steps = talk.steps()
        over = False  # the steps returned: nothing to close
        result: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    command = steps.send(result) if error is None else steps.throw(error)
                except StopIteration:
                    over = True
                    break
                result = error = None
                kind = type(command)
                try:
                    # The commands by how often they come: the first ones on every request.
                    if kind is ReadHead:
                        result = await client.read_head(command.parse, command.deadline)
                    elif kind is Resolve:
                        with self._gone(command.on_eof):
                            result = await self.path.resolver.resolve(command.host)
                    elif kind is WriteAhead:
                        recorder.open(command.attempt, command.address)
                    elif kind is Dial:
                        result = self.dialled = await self.path.dialer.dial(
                            command.attempt, command.admission, client.new_peer, client.loop, command.deadline,
                            command.tls_name,
                        )
                        if command.tls_name is not None:
                            result.half_open = False  # TLS cannot half-close
                    elif kind is Relay:
                        result = await self._relay(command)
                    elif kind is Finish:
                        if shared.cutting:
                            self.finish(command.attempt)
                        else:
                            recorder.finish(command.attempt)
                    elif kind is Send:
                        if client.write(command.data):
                            await client.drain()
                    elif kind is Splice:
                        if command.answer and client.write(command.answer):
                            await client.drain()
                        self._splice(command)
                    elif kind is Ask:
                        with self._gone(command.on_eof):
                            result = await self._ask(command.request)
                    elif kind is Extend:
                        with self._gone(False):
                            result = await self._extend(command.attempt, command.budget, command.more)
                    elif kind is Fill:
                        result = await client.fill(command.deadline)
                    elif kind is Close:
                        command.upstream.close()
                    elif kind is Intercept:
                        await self._intercept(command)
                    elif kind is RecordRefusal:
                        recorder.record_refusal(command.seen, command.reason, command.detail)
                    else:
                        raise TypeError(f"not a command: {command!r}")
                except _FAILURES as exc:
                    error = exc
        except PeerClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("connection %s failed", talk.client)
            seen = talk.failed()
            if seen is not None:
                recorder.record_refusal(seen, Reason.BAD_REQUEST)
        finally:
            if not over:
                steps.close()  # its cleanups run (the run's slot), whatever stopped it
            shared.tasks.pop(client, None)
            self.release()

    def release(self) -> None:
        """The task is over: release what the connection holds, unless a tunnel has it now."""
        if self.tunnel is None:
            self._release()

    def finish(self, attempt: Attempt) -> None:
        """``Recorder.finish``, saying ``shutdown`` for a connection cut when the grace period ran out."""
        if self.shared.cutting and attempt.ahead is not None:  # opened
            attempt.ends(End.SHUTDOWN)
        self.recorder.finish(attempt)

    def _gone(self, on_eof: bool) -> GoneCancels:
        """``with`` it, the client going away cancels the wait (``Peer.gone_cancels``): one per connection."""
        gone = self.gone
        if gone is None:
            gone = self.gone = self.client.gone_cancels(on_eof=on_eof)
        else:
            gone.on_eof = on_eof
        return gone

    async def _ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        metrics = self.recorder.metrics
        metrics.held_requests += 1
        try:
            return await self.path.approver.ask(replace(request, client=self.talk.client if self.talk else None))
        except asyncio.CancelledError:
            raise
        except Exception:
            # Fail closed: an approver that broke has not allowed anything.
            log.exception("approver failed for %s:%d in run %s; denying", request.host, request.port, request.run_id)
            return ApprovalOutcome(Answer.NO_APPROVER)
        finally:
            metrics.held_requests -= 1

    # -- an inspected connection ------------------------------------------------------------

    async def _intercept(self, command: Intercept) -> None:
        """Answer the CONNECT (if the way in does), then take over the client's TLS with the run's
        certificate for the name.

        The transparent TLS listener has read the ClientHello already: its
        handshake goes on from those bytes, in memory (``tlslayer``); the
        others' starts with the client's next byte (``loop.start_tls``: on
        uvloop its handshakes are done in C, 0.43-0.46x direct in
        bench/inspection.py against 0.30-0.32x through ``tlslayer``).
        """
        client = self.client
        inspector = self.path.inspector
        run = command.attempt.run
        if inspector is None or run is None:
            raise InterceptFailed("nothing is set up to inspect TLS")
        if client.buf and command.answer:
            # Bytes sent before the answer would be taken for the handshake's: refuse rather than guess.
            raise InterceptFailed("the client sent bytes before its CONNECT was answered")
        try:
            context = inspector.server_context(run, command.name)
        except CannotInspect as exc:
            raise InterceptFailed(str(exc)) from None
        if command.answer and client.write(command.answer):
            await client.drain()
        transport = client.transport
        if transport is None or client.closed:
            raise PeerClosed("the client went away")
        loop = client.loop
        tls: Any
        try:
            if client.buf:
                tls = ServerTls(transport, client, context)
                await tls.handshake(client.take(), command.deadline)
            else:
                timeout_s = max(0.001, command.deadline - loop.time())
                tls = await loop.start_tls(
                    transport, client, context, server_side=True, ssl_handshake_timeout=timeout_s
                )
        except (ssl.SSLError, OSError, TimeoutError) as exc:
            raise InterceptFailed(f"TLS handshake with the client failed: {exc}") from None
        if tls is None:
            raise PeerClosed("the client went away during the TLS handshake")
        client.transport = tls  # the client's bytes are read in clear from here
        client.half_open = False

    # -- a tunnel ----------------------------------------------------------------------------

    def _splice(self, command: Splice) -> None:
        """Hand the connection to a tunnel, which relays both ways from now on and releases it at its end."""
        limits = self.shared.limits
        upstream = command.upstream
        assert isinstance(upstream, Peer)
        self.dialled = None
        check = SniCheck(self.recorder, command.attempt, limits.max_head_bytes, name_required=command.name_required)
        tunnel = self.tunnel = Tunnel(
            self.client,
            upstream,
            idle_timeout_s=limits.idle_timeout_s,
            on_end=self._tunnel_ended,
            check=check,
            check_timeout_s=limits.head_timeout_s,
            loop=self.client.loop,
            splice=limits.splice,
        )
        self._budgeted(tunnel, command.attempt)
        self.shared.tunnels.add(tunnel)
        tunnel.start()

    # -- an upload budget ----------------------------------------------------------------------

    def _budgeted(self, tunnel: Tunnel, attempt: Attempt) -> None:
        """Hold ``tunnel`` to the run's upload budget for the attempt's registered domain (when budgets are on)."""
        limits, run, host = self.shared.limits, attempt.run, attempt.host
        if limits.upload_budget_bytes and run is not None and host is not None:
            tunnel.budget = run.budget(registrable_domain(host) or host, limits.upload_budget_bytes)
            tunnel.on_over_budget = self._over_budget

    def _over_budget(self, tunnel: Tunnel) -> None:
        """The tunnel's run went past its upload budget: ask once for every connection waiting on it."""
        budget = tunnel.budget
        talk = self.talk
        assert budget is not None and talk is not None
        attempt = talk.pending
        assert isinstance(attempt, Attempt)
        if budget.asking is None:
            budget.asking = self.client.loop.create_task(self._ask_budget(attempt, budget))
        budget.asking.add_done_callback(lambda asked: self._budget_answered(tunnel, attempt, asked))

    async def _ask_budget(self, attempt: Attempt, budget: Budget) -> ApprovalOutcome:
        """The question every connection over ``budget`` waits on (``asking``)."""
        try:
            return await self._extend(attempt, budget, 0)
        finally:
            budget.asking = None

    async def _extend(self, attempt: Attempt, budget: Budget, more: int) -> ApprovalOutcome:
        """Make room in ``budget`` for ``more`` bytes past what was sent: a person's allow, or the owner's loan."""
        run = attempt.run
        assert run is not None and attempt.port is not None
        lender = self.path.lender
        if lender is None:
            outcome = await self._ask(budget_approval(run, budget.site, attempt.port, budget.sent))
            if outcome.allowed:
                budget.granted(more)
            return outcome
        try:
            # What ``more`` needs past the loan (0 for a tunnel at its limit: the owner lends at least a byte).
            outcome, lent = await lender.lend(run.id, budget.site, attempt.port, budget.short(more))
        except asyncio.CancelledError:
            raise
        except Exception:  # fail closed: nothing was lent
            log.exception("the owner's loan of %s's budget for %s failed; denying", run.id, budget.site)
            return ApprovalOutcome(Answer.NO_APPROVER)
        if outcome.allowed:
            budget.limit += lent
        return outcome

    def _budget_answered(self, tunnel: Tunnel, attempt: Attempt, asked: asyncio.Task[ApprovalOutcome]) -> None:
        if tunnel.ended:
            return
        outcome = None if asked.cancelled() or asked.exception() is not None else asked.result()
        if outcome is not None and outcome.allowed:
            tunnel.release_budget()
            return
        budget = tunnel.budget
        sent = f"{budget.sent} bytes sent to {budget.site}" if budget is not None else "over budget"
        attempt.deny(ANSWER_REASONS[outcome.answer] if outcome is not None else Reason.NO_APPROVER,
                     f"past the run's upload budget ({sent})")
        tunnel.close()

    def _tunnel_ended(self, tunnel: Tunnel) -> None:
        """Everything the connection's task would have done when it finished."""
        self.shared.tunnel_ended(tunnel)
        talk = self.talk
        assert talk is not None
        attempt = talk.pending
        assert isinstance(attempt, Attempt)
        attempt.bytes_up += tunnel.bytes_up
        attempt.bytes_down += tunnel.bytes_down
        if tunnel.spliced:
            self.recorder.metrics.tunnels_spliced += 1
        if tunnel.idle_expired:
            attempt.ends(End.IDLE_TIMEOUT)
        tunnel.upstream.close()
        self._release()

    def _release(self) -> None:
        """The connection is over: record what is left, count it closed, close the client and upstreams."""
        if self.released:
            return
        self.released = True
        talk = self.talk
        if talk is not None:
            run, talk.slot = talk.slot, None
            if run is not None:
                run.open_connections -= 1
            pending, talk.pending = talk.pending, None
            if isinstance(pending, Attempt):
                self.finish(pending)
            elif pending is not None:
                self.recorder.record_refusal(pending, None)
            outer, talk.outer = talk.outer, None
            if outer is not None:  # an inspected tunnel: its egress.end, with what its requests moved
                self.finish(outer[0])
            kept, talk.kept = talk.kept, None
            if kept is not None:
                kept[2].close()
        self.recorder.metrics.connections_open -= 1
        dialled, self.dialled = self.dialled, None
        if dialled is not None:
            dialled.close()
        self.client.close()

    # -- HTTP/1 requests ----------------------------------------------------------------------

    async def _relay(self, command: Relay) -> Any:
        """One request out and its response back (``commands.Relay`` says what comes of it)."""
        attempt, exchange, out = command.attempt, command.exchange, command.out
        upstream = command.upstream
        assert isinstance(upstream, Peer)
        idle_s = self.shared.limits.idle_timeout_s
        body = exchange.request_body
        keep_upstream = False
        response: ResponseHead | None = None
        try:
            try:
                if upstream.write(out):
                    await upstream.drain()
                if body is None:
                    # The final response head (``exchange`` drops interim 1xx); None: the upstream closed first.
                    response = await upstream.read_head(exchange.read_response, upstream.loop.time() + idle_s)
            except PeerClosed:
                pass
            if response is None and command.reused and not command.last_try and body is None:
                return STALE  # a stale kept connection: dial a fresh one
            _count_up(attempt, command.budget, len(out))
            if body is not None:
                refused = await self._send_body(attempt, body, upstream, command)
                if refused is not None:
                    return refused
            if response is None:
                response = await upstream.read_head(exchange.read_response, upstream.loop.time() + idle_s)
            if response is None:
                raise HttpError(502, "upstream closed without a response")
            keep_client = await self._relay_response(attempt, exchange, upstream, response)
            keep_upstream = exchange.keep_upstream
            return keep_client
        except HttpError as exc:
            # The origin sent something we cannot frame safely; stop here.
            attempt.detail = f"bad response from upstream: {exc.detail}"
            return Reason.UPSTREAM_UNREACHABLE if attempt.bytes_down == 0 else False
        except TimeoutError as exc:
            if response is None and not isinstance(exc, IdleTimeout):
                # The origin took the whole request and began no answer: 504, the client hears why.
                if body is None:
                    _count_up(attempt, command.budget, len(out))  # sent, and not counted yet
                return Reason.UPSTREAM_TIMEOUT
            # A body moved no byte for the idle timeout: both connections close, as an idle tunnel's do.
            attempt.ends(End.IDLE_TIMEOUT)
            return False
        finally:
            self.dialled = None  # kept by the conversation (``Conversation.kept``), or closed
            if not keep_upstream:
                upstream.close()

    async def _send_body(self, attempt: Attempt, body: Framing, upstream: Peer, command: Relay) -> Reason | None:
        """The request's body to the origin, counted in ``attempt.bytes_up`` and the run's upload budget.

        Past the budget, or past the per-request cap (``command.cap``), the client is no longer read
        while a person is asked: what it goes on writing waits in its own socket. An allow lets the
        body go on (another budget's or cap's worth); anything else is the Reason the request is
        refused with (the origin has had part of the body; the connection closes).
        """
        budget, cap = command.budget, command.cap
        idle_s = self.shared.limits.idle_timeout_s
        moved, cap_at = 0, cap
        while True:
            allowance = None if budget is None else max(0, budget.limit - budget.sent)
            if cap:
                allowance = cap_at - moved if allowance is None else min(allowance, cap_at - moved)
            over = False
            try:
                n = await self.client.relay_body(body, upstream, idle_s=idle_s, allowance=allowance)
            except OverAllowance as exc:
                n, over = exc.moved, True
            except (IdleTimeout, PeerClosed) as exc:
                _count_up(attempt, budget, exc.moved)
                raise
            _count_up(attempt, budget, n)
            moved += n
            if not over:
                return None
            if budget is not None and budget.over_or_at:
                outcome = await self._budget_answer(attempt, budget)
                why = f"past the run's upload budget ({budget.sent} bytes sent to {budget.site})"
            else:
                outcome = await self._ask(_cap_question(attempt, moved))
                why = f"past the per-request body cap ({moved} bytes of its body sent)"
                cap_at = moved + cap
            if not outcome.allowed:
                attempt.deny(ANSWER_REASONS[outcome.answer], why)
                return ANSWER_REASONS[outcome.answer]

    async def _budget_answer(self, attempt: Attempt, budget: Budget) -> ApprovalOutcome:
        """The answer to the run's open budget question (asked now when none is open)."""
        if budget.asking is None:
            budget.asking = self.client.loop.create_task(self._ask_budget(attempt, budget))
        try:
            return await asyncio.shield(budget.asking)
        except asyncio.CancelledError:
            raise
        except Exception:  # the question broke: nothing was allowed
            return ApprovalOutcome(Answer.NO_APPROVER)

    async def _relay_response(
        self, attempt: Attempt, exchange: Exchange, upstream: Peer, response: ResponseHead
    ) -> bool:
        """Send the response on, as ``exchange`` framed it; True when the client may send another request."""
        client = self.client
        attempt.status = response.status
        out = exchange.response_out
        attempt.bytes_down += len(out)
        body = exchange.response_body
        idle_s = self.shared.limits.idle_timeout_s
        try:
            if body is None:
                if client.write(out):
                    await client.drain(client.loop.time() + idle_s)
            else:
                # The head and the body bytes already here go out in one write.
                attempt.bytes_down += await upstream.relay_body(body, client, head=out, idle_s=idle_s)
        except (IdleTimeout, PeerClosed) as exc:
            attempt.bytes_down += exc.moved  # what reached the client counts, cut short or not
            raise
        if exchange.upgraded:
            await self._both_ways(attempt, upstream)
        return exchange.finish()

    async def _both_ways(self, attempt: Attempt, upstream: Peer) -> None:
        """After a 101 to WebSocket (decided on its upgrade request, like any request): the bytes go both
        ways, unread, as a tunnel's do, until either side closes or nothing moves for the idle timeout."""
        client = self.client
        ended: asyncio.Future[None] = client.loop.create_future()
        tunnel = Tunnel(client, upstream, idle_timeout_s=self.shared.limits.idle_timeout_s,
                        on_end=lambda _: _settle(ended), loop=client.loop, splice=self.shared.limits.splice)
        self._budgeted(tunnel, attempt)
        tunnel.start()
        try:
            await ended
        finally:
            tunnel.close()
            attempt.bytes_up += tunnel.bytes_up
            attempt.bytes_down += tunnel.bytes_down
            if tunnel.idle_expired:
                attempt.ends(End.IDLE_TIMEOUT)


def _settle(ended: asyncio.Future[None]) -> None:
    if not ended.done():
        ended.set_result(None)


def _count_up(attempt: Attempt, budget: Budget | None, n: int) -> None:
    """``n`` bytes of the request sent upstream: the record's count and the run's upload budget."""
    attempt.bytes_up += n
    if budget is not None:
        budget.spend(n)


def _cap_question(attempt: Attempt, sent: int) -> ApprovalRequest:
    """What the approver is asked when a request's body passes the per-request cap: the request, what it sent."""
    run, host, port, shown = attempt.run, attempt.host, attempt.port, attempt.shown
    assert run is not None and host is not None and port is not None and shown is not None
    # What it sent is said; what it declared is not the question any more.
    return cap_approval(run, host, port, replace(shown, length=None), sent)
