"""Egress records read back: typed views for the runners (``egressd run``, ``egressd agent``).

An ``egress`` record crosses from the proxy (or from a Docker run's egressd,
as JSON) into ``cli`` and ``agent`` as a dict; ``EgressSeen.of`` parses it
once into what they read of it, and ``Refusal`` is what they report of a
refused attempt. Pure: nothing here writes or reshapes a record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["EgressSeen", "Refusal", "refusals"]

# The DNS query types of an address lookup: a refusal of one explains a failure.
_ADDRESS_TYPES = ("A", "AAAA")


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refused attempt as runners report it (``message``: the phrase a person reads, when known)."""

    host: str | None
    port: int | None
    reason: str | None
    kind: str | None = None
    message: str | None = None

    @property
    def target(self) -> str:
        """``host:port``, or the host alone when there is no port (a DNS query)."""
        return f"{self.host}:{self.port}" if self.port else f"{self.host}"


@dataclass(frozen=True, slots=True)
class EgressSeen:
    """What a runner reads of one egress record (an ``egress`` record joined with its end, or alone).

    Fields a record lacks are None; ``event`` is ``egress`` when the record
    names none; ``approved`` says the record carries an approval;
    ``learned`` is the refusal learn mode let through (``--learn``), if any.
    """

    event: str
    kind: str | None
    host: str | None
    port: int | None
    decision: str | None
    reason: str | None
    approved: bool
    learned: str | None = None
    qtype: str | None = None
    answer: str | None = None  # a DNS record's: the address, or the response code
    address: str | None = None  # the address checked (a ``private_address`` refusal's, for its hint)

    @classmethod
    def of(cls, record: Mapping[str, object]) -> EgressSeen:
        get = record.get
        return cls(
            event=_text(get("event", "egress")) or "",
            kind=_text(get("kind")),
            host=_text(get("host")),
            port=_port(get("port")),
            decision=_text(get("decision")),
            reason=_text(get("reason")),
            approved=bool(get("approval")),
            learned=_text(get("learned")),
            address=_text(get("address")),
            qtype=_text(get("qtype")),
            answer=_text(get("answer")),
        )

    @property
    def denied(self) -> bool:
        return self.decision == "deny"

    @property
    def is_refusal(self) -> bool:
        """A refused egress attempt worth telling the user or the model about: one that could explain a failure.

        A DNS query refused only for its type (TXT, HTTPS, …: egressd answers
        A and AAAA) is not: the name's address lookup is answered on its own.
        Nor is a DNS "deny" without a reason, as logs before every refusal
        had a reason recorded an empty AAAA answer.
        """
        if not self.denied:
            return False
        if self.kind != "dns":
            return True
        if self.reason is None or self.answer == "NOERROR":
            # Answered as designed: an AAAA with no address (NODATA; the A query answers the
            # name), or a record from before every deny had a reason.
            return False
        return self.qtype in _ADDRESS_TYPES + (None,)

    @property
    def target(self) -> str:
        """``host:port``, or the host alone when there is no port (a DNS query)."""
        return f"{self.host}:{self.port}" if self.port else f"{self.host}"

    def refusal(self) -> Refusal:
        return Refusal(host=self.host, port=self.port, reason=self.reason, kind=self.kind)


def refusals(seen: Iterable[EgressSeen]) -> list[Refusal]:
    """The refusals among egress records (``EgressSeen.is_refusal``), as runners report them."""
    return [s.refusal() for s in seen if s.is_refusal]


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _port(value: object) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        return None
