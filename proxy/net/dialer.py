"""The dialer: connects to exactly the addresses the decision admitted, within the connect timeout.

Only after the attempt's ``egress`` record is written (``recorder.Recorder.open``):
the conversation asks for the record, then the dial. The address is passed
as a literal, so nothing is looked up again.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
from collections.abc import Callable
from typing import TypeVar

from egressd.names.addresses import IPAddress
from egressd.proxy.core.attempt import Admission, Attempt, DialError
from egressd.vocabulary.reasons import Reason

P = TypeVar("P", bound=asyncio.Protocol)


def bound_locally(address: IPAddress) -> bool:
    """Whether an address is one of this host's own: the kernel lets a socket bind to it.

    Asked only for a port where egressd has a listener on 0.0.0.0 or ::
    (``addresses.is_own``), and never remembered: interfaces come and go.
    bind() sends nothing. When in doubt (an error other than "not here"),
    the answer is True: refusing a dial is the safe side.
    """
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True


class _Expiry:
    """``Dialer.dial``'s connect timeout: cancels the task when due, and takes that cancellation back once."""

    __slots__ = ("task", "cancelling", "fired")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.cancelling = task.cancelling()  # cancellations requested before ours are not ours
        self.fired = False

    def fire(self) -> None:
        self.fired = True
        self.task.cancel()

    def taken_back(self, *, cancelled: bool) -> bool:
        """Take our cancellation back (once); True when the CancelledError under way was ours alone."""
        if not self.fired:
            return False
        self.fired = False
        return self.task.uncancel() <= self.cancelling and cancelled


class Dialer:
    """Connects an admitted attempt upstream.

    ``origin_tls``: gives the client side of TLS toward origins (an inspected
    connection's upstream: the system's trust store, hostname checked), made
    when first asked for; None when nothing is inspected.
    """

    def __init__(self, origin_tls: Callable[[], ssl.SSLContext] | None = None) -> None:
        self.origin_tls = origin_tls

    async def dial(
        self,
        attempt: Attempt,
        admission: Admission,
        protocol: Callable[[], P],
        loop: asyncio.AbstractEventLoop,
        deadline: float,
        tls_name: str | None = None,
    ) -> P:
        """Connect to the first admitted address that answers (after ``open`` wrote the record ahead).

        Returns the connection's ``protocol()`` instance (the event loop
        connects in its own code: on uvloop no Python socket is involved).
        The address is passed as a literal, so nothing is looked up again.
        Raises DialError (``upstream_unreachable`` or ``upstream_timeout``).
        ``deadline``: when to give up, on ``loop``'s clock (the connection's: ``Conversation.now``).
        ``tls_name``: TLS to that name, the origin's certificate verified for it (``origin_tls``);
        a certificate that does not verify is ``upstream_unreachable``, as a refused connection is.
        """
        assert attempt.opened, "the egress record is written before the dial"
        # The connect timeout as ``asyncio.timeout`` would do it (the task cancelled, the
        # cancellation taken back as TimeoutError), with one timer and no context object.
        task = asyncio.current_task(loop)
        assert task is not None
        expiry = _Expiry(task)
        timer = loop.call_at(deadline, expiry.fire)
        last: OSError | None = None
        try:
            for text in admission.texts:
                try:
                    # Both asyncio and uvloop set TCP_NODELAY on every TCP transport.
                    if tls_name is None:
                        _transport, peer = await loop.create_connection(protocol, text, admission.port)
                    else:
                        if self.origin_tls is None:
                            raise DialError(Reason.TLS_INTERCEPT_FAILED, "no TLS settings for inspected origins")
                        _transport, peer = await loop.create_connection(
                            protocol, text, admission.port, ssl=self.origin_tls(), server_hostname=tls_name
                        )
                except OSError as exc:
                    last = exc
                    continue
                attempt.address = text
                return peer
        except asyncio.CancelledError:
            if expiry.taken_back(cancelled=True):
                attempt.address = admission.texts[0]
                raise DialError(Reason.UPSTREAM_TIMEOUT, "connect timed out") from None
            raise
        finally:
            timer.cancel()
            expiry.taken_back(cancelled=False)
        attempt.address = admission.texts[-1]
        raise DialError(Reason.UPSTREAM_UNREACHABLE, str(last) if last else "no address")
