"""What a connection's conversation asks the network shell to do, and what comes back.

The conversation (``conversation``) is a generator: it yields one command
at a time and is resumed with the command's result, or has the command's
failure thrown into it (the exceptions named below). The runner
(``egressd.proxy.net.runner``) executes each; a playbook test executes them
by hand. Deadlines are instants on the connection's one clock (the
``now`` the conversation was given: the event loop's).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, NamedTuple, Protocol

from egressd.approvals.interface import ApprovalRequest
from egressd.proxy.core.attempt import Admission, Attempt, Seen
from egressd.proxy.core.budget import Budget
from egressd.proxy.core.exchange import Exchange
from egressd.vocabulary.reasons import Reason

# A conversation's steps, or a layer of them (``yield from``): yields commands, is sent their results.
Steps = Generator[Any, Any, Any]


class PeerClosed(Exception):
    """The peer closed or broke the connection; nothing more to say to it.

    Raised from inside a body relay, ``moved`` body bytes had gone through.
    """

    moved = 0


class Upstream(Protocol):
    """An upstream connection, as the conversation sees it: a handle it passes back to the shell."""

    closed: bool
    eof: bool
    buf: bytearray  # bytes it sent that nobody asked for yet

    def close(self) -> None:
        """Close it (the shell does, executing a command)."""
        ...


# -- reading and writing the client ------------------------------------------------------------


class ReadHead(NamedTuple):
    """The client's next head as ``parse`` frames it (``Peer.read_head``) → the head, or None at its close.

    Fails with TimeoutError past ``deadline``, or with ``parse``'s HttpError.
    """

    parse: Callable[[bytearray, bool], tuple[Any, int]]
    deadline: float


class Fill(NamedTuple):
    """More of the client's bytes into the buffer → False when it closed instead (TimeoutError past ``deadline``)."""

    deadline: float


class Send(NamedTuple):
    """Send ``data`` to the client (and wait while its buffer is full) → None; PeerClosed if it went."""

    data: bytes


# -- deciding, recording, dialling ---------------------------------------------------------------


class Ask(NamedTuple):
    """Hold the request while the approver asks a person → the ``ApprovalOutcome``.

    An approver that fails has denied (``no_approver``). The client going
    away meanwhile (closed, or its FIN when ``on_eof``) stops the wait: PeerClosed.
    """

    request: ApprovalRequest
    on_eof: bool


class Extend(NamedTuple):
    """More of the run's upload budget, for ``more`` bytes about to be sent → the ``ApprovalOutcome``.

    A person is asked when the run has no more (an allow grants another
    budget's worth); in a worker, the owner lends it from the run's budget
    and asks the person only when that is spent (``budget.lend``). The
    client going away stops the wait as it stops ``Ask``.
    """

    attempt: Attempt
    budget: Budget
    more: int


class Resolve(NamedTuple):
    """The addresses ``host`` resolves to → a sequence of addresses; ResolveError. The client going
    away stops it as it stops ``Ask``."""

    host: str
    on_eof: bool


class WriteAhead(NamedTuple):
    """Write the allowed attempt's ``egress`` record before any of its bytes go out, naming ``address``.

    → None; DialError(``audit_unavailable``) when it could not be written. Idempotent.
    """

    attempt: Attempt
    address: str | None


class Dial(NamedTuple):
    """Connect to the admitted addresses, in order → the upstream; DialError. Only after ``WriteAhead``.

    Past ``deadline`` the dial gives up (``upstream_timeout``), whichever address it was trying.
    ``tls_name``: the connection is TLS to that name, the origin's certificate verified for it
    (an inspected connection's upstream); a handshake that fails is ``upstream_unreachable``.
    """

    attempt: Attempt
    admission: Admission
    deadline: float
    tls_name: str | None = None


class Finish(NamedTuple):
    """Write the attempt's final record (idempotent), its run event and metrics → None."""

    attempt: Attempt


class RecordRefusal(NamedTuple):
    """Record an attempt refused before the policy ran (``reason`` None: it ended undecided) → None."""

    seen: Seen
    reason: Reason | None
    detail: str | None


# -- what the connection carries -------------------------------------------------------------------


class Splice(NamedTuple):
    """Send ``answer`` (if any: the CONNECT's 200, the SOCKS reply), then relay both ways from now on,
    the client's bytes checked until the TLS handshake settles.

    The tunnel owns the client, the upstream, the run's slot and the attempt
    from here; the conversation ends. ``name_required``: a ClientHello must
    name the attempt's host (the transparent listener decided on it). A
    client gone before the answer is out: PeerClosed.
    """

    upstream: Upstream
    attempt: Attempt
    answer: bytes | None
    name_required: bool


class Intercept(NamedTuple):
    """Send ``answer`` (the CONNECT's 200), then take the client's TLS for ``name`` with the run's
    own certificate: from here its requests are read in clear → None.

    InterceptFailed when the client would not take the certificate or the
    handshake failed otherwise (``tls_intercept_failed``), TimeoutError past
    ``deadline``; a client gone before the answer is out: PeerClosed.
    """

    attempt: Attempt
    name: str
    answer: bytes | None
    deadline: float


class InterceptFailed(Exception):
    """The TLS handshake with the client failed: it did not trust the run's certificate, or broke off."""


class Close(NamedTuple):
    """Close a kept upstream connection that may not carry the next request → None."""

    upstream: Upstream


class Relay(NamedTuple):
    """Send one request upstream and its response back, as ``exchange`` frames them.

    → ``STALE`` (a reused connection the origin had closed: nothing was
    lost, dial again), a ``Reason`` to refuse with (nothing reached the
    client yet), ``True`` when the client may send another request, or
    ``False`` when the connection ends. Once the response is through, the
    upstream is left open when the exchange says it may serve the next
    request (``Exchange.keep_upstream``: the conversation keeps it), else closed.
    """

    attempt: Attempt
    exchange: Exchange
    upstream: Upstream
    out: bytes
    reused: bool
    last_try: bool
    # The run's upload budget for the host's registered domain (None: no budget), and the body bytes
    # one request may send before a person is asked (0: no cap); the runner counts the request in.
    budget: Budget | None = None
    cap: int = 0


STALE: Any = object()
