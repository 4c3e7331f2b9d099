"""What the approvals page needs of the control server (``ControlView``), and that view narrowed to a session.

``egressd.control.api`` puts a ``ControlView`` on its application; the page
(``egressd.approvals.web``) reads it through ``Bound``, which shows a
session only the runs its scope covers, escaped as the page shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .control import Scope
from .webview import always_row, run_row, tail_row


class RevokeError(Exception):
    """A revoke the control server refused (nothing was taken back); the message says why, for people."""


@dataclass(frozen=True, slots=True)
class ControlView:
    """What the page needs of the control server, put on its application by ``egressd.control.api``.

    ``sign_in``: the scope a token grants (the global token, a live run's
    own), or None; ``runs``: every live run as ``GET /runs`` shows it;
    ``recent``: the last ``n`` egress records of every run, oldest first;
    ``observers``: the recorder's list of egress-record observers;
    ``always``: the allow file's standing *always* answers as ``GET /always``
    lists them; ``revoke(run, entries, by, auth)``: take back approvals given
    for ``run``, or (run None) *always* entries, as ``PATCH /runs/ID``'s
    ``revoke`` does, recorded with who did it; what was taken back, or
    RevokeError.
    """

    sign_in: Callable[[str], Scope | None]
    runs: Callable[[], list[dict[str, Any]]]
    recent: Callable[[int], list[dict[str, Any]]]
    observers: list[Callable[[dict[str, Any]], None]]
    always: Callable[[], list[dict[str, Any]]] = list
    revoke: Callable[[str | None, Sequence[str], str, str], list[str]] | None = None


CONTROL_VIEW = web.AppKey("web_control_view", ControlView)


@dataclass(frozen=True, slots=True)
class Bound:
    """The control view, narrowed to a session's scope."""

    view: ControlView

    def runs(self, scope: Scope) -> list[dict[str, Any]]:
        return [run_row(r) for r in self.view.runs() if scope.covers(str(r.get("id")))]

    def sign_in_alive(self, run_id: str) -> bool:
        return any(r.get("id") == run_id for r in self.view.runs())

    def recent(self, scope: Scope, n: int) -> list[dict[str, Any]]:
        rows = [r for r in self.view.recent(n * 4) if isinstance(r.get("run"), str) and scope.covers(r["run"])]
        return [tail_row(r) for r in rows[-n:]]

    def always(self, scope: Scope) -> list[dict[str, Any]] | None:
        """The standing *always* entries, for a session that may revoke them (the global token's); else None."""
        return [always_row(a) for a in self.view.always()] if scope.outlives_runs else None
