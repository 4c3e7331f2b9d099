"""The way in inside an inspected connection: HTTP/1 requests read in clear from the client's TLS.

A CONNECT to a name the run has request rules for (DESIGN.md "Policy",
request rules) is answered and its TLS taken over with the run's own
certificate (the runner's ``Intercept``); from then on this way reads the
requests, one after another, on the same connection, and each is decided
on its own (``decision.decide_request``): its method, and its path
normalised (``requestrules.normalise_path``), the same path forwarded.

Inside the tunnel a request may only go where the tunnel goes: its Host (or
an absolute-form target) must name the tunnel's host and port, else it is
refused ``sni_mismatch`` with the name it asked for (as a tunnel's plain
HTTP is, ``tunnelcheck``); a CONNECT inside it is ``bad_request``. A
refusal is an HTTP answer inside the TLS, as the explicit proxy gives one.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

from egressd.proxy.core.attempt import Seen
from egressd.proxy.core.commands import ReadHead, Steps
from egressd.proxy.core.conversation import Conversation, Refused
from egressd.proxy.core.exchange import Exchange
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.insiderequest import Inside, NamedElsewhere, inside_request
from egressd.proxy.core.modes import Reads, Refusal, bad_head, head_too_slow
from egressd.proxy.core.runs import Run
from egressd.proxy.core.ways import HttpWay
from egressd.vocabulary.egress import EgressKind
from egressd.vocabulary.reasons import Reason

_HTTPS: Final = EgressKind.HTTPS


class InspectedWay(HttpWay):
    """Requests inside an intercepted TLS connection to one host and port, in one run.

    Made by the conversation once the client's TLS is taken over; the
    tunnel's ``Attempt`` stays open as the connection's record.
    """

    kind: EgressKind = EgressKind.HTTPS
    accepted: bytes | None = None

    def __init__(self, run: Run, host: str, port: int, max_head_bytes: int) -> None:
        self.run = run
        self.host = host
        self.port = port
        self.exchange = Exchange(max_head_bytes)  # the requests in clear: a framing of their own
        self.request: Inside | None = None  # the request being carried

    def arrive(self, talk: Conversation) -> Steps:
        run, host, port = self.run, self.host, self.port
        seen: Seen = talk.at.begin(_HTTPS, talk.client, port)._replace(
            host=host, run=run, command=run.command
        )
        talk.exchange = self.exchange
        try:
            head = yield ReadHead(self.exchange.read_request, talk.now() + talk.at.limits.head_timeout_s)
        except TimeoutError:
            if not talk.buf:
                return None  # an idle keep-alive connection, not an attempt
            raise Refused(seen, head_too_slow(Reads.HTTP)) from None
        except HttpError as exc:
            raise Refused(seen, bad_head(exc)) from None
        if head is None:
            return None
        try:
            inside = self.request = inside_request(head, host, port)
        except NamedElsewhere as exc:
            raise Refused(seen, Refusal(Reason.SNI_MISMATCH, f"the request names {exc.named}")) from None
        except HttpError as exc:
            raise Refused(seen, Refusal(Reason.BAD_REQUEST, exc.detail, status=exc.status)) from None
        talk.at.metrics.connections_total["https"] += 1
        return seen, run, host, port, _HTTPS, inside.destination
