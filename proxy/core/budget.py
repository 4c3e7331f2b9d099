"""Upload budgets: how much a run may send to one registered domain before a person is asked again.

Per run and registered domain (``github.com`` for ``api.github.com`` and
``uploads.github.com`` alike), off unless ``upload_budget_mb`` is set. Every
byte a client sends upstream counts, on every kind of connection (opaque
tunnels included). Past the budget the connection is paused (egressd stops
reading from the client: what it has not sent waits in the client's socket,
never in egressd) and a person is asked whether the run may go on; an allow
grants another budget's worth, anything else cuts the connection. Every
connection of the run to the domain that goes over while the question is
open waits for the same answer (``asking``). Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Budget"]


class Budget:
    """What one run has sent to one registered domain, against what it may send before asking."""

    __slots__ = ("site", "sent", "limit", "grant", "asking")

    def __init__(self, site: str, grant: int) -> None:
        self.site = site
        self.sent = 0
        self.limit = grant  # what may be sent before the next question
        self.grant = grant  # what each allow adds
        self.asking: Any = None  # the open question's future (the shell's), shared by every waiting connection

    def __repr__(self) -> str:
        return f"Budget({self.site!r}, sent={self.sent}, limit={self.limit})"

    def spend(self, n: int) -> bool:
        """Count ``n`` bytes sent; False once the run is past what it may send."""
        self.sent += n
        return self.sent <= self.limit

    @property
    def over(self) -> bool:
        return self.sent > self.limit

    @property
    def over_or_at(self) -> bool:
        """Nothing more may be sent before a person is asked."""
        return self.sent >= self.limit

    def granted(self) -> None:
        """A person let the run go on: another budget's worth, from what it has sent."""
        self.limit = self.sent + self.grant
