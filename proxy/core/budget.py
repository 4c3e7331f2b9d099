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

With ``--workers`` the owner process keeps each run's budgets; a worker's
budget starts at nothing and is *lent* bytes by the owner as it needs them
(``lend``), a share at a time, so that the processes together never send
more than the run's budget before a person is asked. A share lent and not
yet used makes the question come early, never late.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Budget", "lend"]


class Budget:
    """What one run has sent to one registered domain, against what it may send before asking."""

    __slots__ = ("site", "sent", "limit", "grant", "asking")

    def __init__(self, site: str, grant: int, limit: int | None = None) -> None:
        self.site = site
        self.sent = 0
        self.limit = grant if limit is None else limit  # what may be sent before the next question (or loan)
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

    def short(self, more: int) -> int:
        """How far ``more`` bytes would take the run past what it may send (0: they fit)."""
        return max(0, self.sent + more - self.limit)

    def granted(self, more: int = 0) -> None:
        """A person let the run go on: another budget's worth, from what it has sent and the ``more`` it is about
        to send (a request's declared body)."""
        self.limit = self.sent + more + self.grant


def lend(budget: Budget, need: int, share: int) -> int | None:
    """Lend a worker ``need`` bytes of ``budget`` (the owner's), and up to ``share`` while the budget has them;
    None when it has not ``need`` left (a person is asked first)."""
    left = budget.limit - budget.sent
    if need > left:
        return None
    lent = min(max(need, share), left)
    budget.sent += lent
    return lent
