"""What the terminal channel draws, as text: the message fitted to the screen, the input line, the answers (pure).

The steps the numbers refer to are ``egressd.approvals.terminal``'s: ``fit``
renders the message again for the terminal's size (step 2), ``prompt_line``
fits the input line to its width (step 4), ``choices`` names the answers and
``read_answer`` reads the one typed (step 5), ``allowed_text`` says how a
settled approval ended (step 6). ``SANE`` and ``CLEAR_LINE`` start every
drawing (step 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from egressd.names.shown import escape

from .interface import ApprovalScope, Choice, PendingApproval, Settlement
from .message import UNRELATED, ApprovalMessage, Room, bounded, render, shorten

BOLD = "\x1b[1m"
WARN = "\x1b[1;33m"
RESET = "\x1b[0m"
# Before each drawing, whatever was written to the terminal before: the scroll
# region back to the whole screen (DECSTBM homes the cursor, so it is saved and
# restored around it: DECSC, DECRC), then normal attributes (SGR 0), the ASCII
# character set in G0, shifted in (a DEC graphics set turns letters into line
# drawing), insert mode off and line wrap on (off, a long line loses its end).
SANE = "\x1b7\x1b[r\x1b8\x1b[0m\x0f\x1b(B\x1b[4l\x1b[?7h"
CLEAR_LINE = SANE + "\r\x1b[K"

_DENY_WORDS = frozenset({"", "deny", "d", "n", "no"})
# The word that allows with each scope (step 5); "allow" is the run, the answer it always was.
_SCOPE_WORDS = {ApprovalScope.ONCE: "once", ApprovalScope.RUN: "allow", ApprovalScope.ALWAYS: "always"}
# What each of them does, as the choices line says it.
_SCOPE_MEANINGS = {
    ApprovalScope.ONCE: "this connection only",
    ApprovalScope.RUN: "this run",
    ApprovalScope.ALWAYS: "added to the allow file",
}


def choices(scopes: Sequence[ApprovalScope]) -> str:
    """The line above the input line naming every answer (step 5); the message's own lines stay the design's."""
    offered = [f"{_SCOPE_WORDS[scope]} ({_SCOPE_MEANINGS[scope]})" for scope in _SCOPE_WORDS if scope in scopes]
    return "Answer " + ", ".join(offered) + " or deny."


def read_answer(typed: str, scopes: Sequence[ApprovalScope]) -> tuple[Choice, ApprovalScope] | None:
    """A typed answer (step 5) → (allow, its scope) or (deny, RUN); None: not an answer, ask again.

    A scope word that is not offered (``always`` with no allowlist file) is not an answer.
    """
    word = typed.strip().lower()
    if word in _DENY_WORDS:
        return Choice.DENY, ApprovalScope.RUN
    for scope, allow_word in _SCOPE_WORDS.items():
        if word == allow_word and scope in scopes:
            return Choice.ALLOW, scope
    return None


def allowed_text(settlement: Settlement) -> str:
    """How an accepted allow ended, for the line that closes the prompt (what it quotes escaped)."""
    scope = settlement.scope
    if scope is ApprovalScope.ONCE:
        return "allowed for this connection only (the next one asks again)"
    if scope is ApprovalScope.ALWAYS:
        return f"allowed always: {escape(settlement.entry or '?')} added to the allow file"
    if settlement.scope_error:
        return f"allowed for this run only, not always: {bounded(settlement.scope_error, 200)}"
    return "allowed for this run"


def countdown(seconds: float) -> str:
    """``9:58`` (or ``1:02:03`` past an hour) for the time left, never negative."""
    left = max(0, int(seconds + 0.999))
    hours, rest = divmod(left, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# -- pure: what fits the screen ---------------------------------------------------------------


def columns_of(text: str) -> int:
    """The columns ``text`` may take on a terminal, at most: one an ASCII character, two any other.

    No character takes more than two; a terminal's own width tables (wide
    East Asian characters, ambiguous ones like "…") decide below that.
    """
    if text.isascii():
        return len(text)
    return len(text) + sum(1 for ch in text if not ch.isascii())


def rows_of(text: str, columns: int) -> int:
    """The rows a line of ``text`` may take on a terminal ``columns`` wide, at most.

    A wide character that does not fit at the end of a row moves to the next,
    leaving a column unused, so a row holds ``columns - 1`` of ``columns_of``
    at the least.
    """
    if text.isascii():
        return max(1, -(-len(text) // columns))
    return max(1, -(-columns_of(text) // max(columns - 1, 1)))


def header(approval: PendingApproval) -> str:
    """The line above the message: which approval, for which run."""
    return f"egressd: approval {bounded(approval.id, 64)} for run {bounded(approval.request.run_id, 64)}"


def keep_of(message: ApprovalMessage) -> str:
    """The end of ``message.domain`` never shortened: its registered domain and port (all of it for an IP)."""
    site = message.registered_domain
    if site is not None:
        keep = f"{site}:{message.port}"
        if message.domain == keep or message.domain.endswith("." + keep):
            return keep
    return message.domain


@dataclass(frozen=True, slots=True)
class _Rows:
    """Rows given to the lines ``fit`` may shorten."""

    domain: int
    command: int
    task: int
    allowed: int


def fit(approval: PendingApproval, *, columns: int, rows: int) -> ApprovalMessage:
    """The approval's message as a terminal of ``columns`` × ``rows`` shows it (0: size not known).

    Drawn below a line break and the ``header``, with the ``choices`` line
    and the input line under it, the whole fits the screen, so no part of it
    scrolls away while the prompt is up. In order:

    1. the message as every channel shows it, when it fits;
    2. else rendered again (``message.render``, the same template and rule)
       with a ``Room`` that fits: the intro, the warning, the closing lines
       and the scope line whole; each of the domain, command, task and
       allowlist lines one row at the least (the domain's names shortened in
       the middle, its registered domain whole); the rows left go to the
       domain line, then the command, then the task, then the allowlist,
       each up to its whole length. The "unrelated" warning is judged on the
       command and task as cut here, and its rows are kept whether or not it
       is shown;
    3. on a screen too small even for that, the smallest rendering (its top
       scrolls away).
    """
    message = approval.message
    if columns <= 0 or rows <= 0:
        return message
    # The line break, the header, the choices line and the input line.
    budget = rows - 2 - rows_of(header(approval), columns) - rows_of(choices(approval.scopes), columns)
    if _rows(message, columns, warning=False) <= budget:
        return message
    lines = dict(message.lines)
    fixed = sum(rows_of(text, columns) for kind, text in message.lines if kind in ("intro", "closing", "scope"))
    fixed += rows_of(UNRELATED, columns)
    whole = _Rows(*(rows_of(lines[kind], columns) for kind in ("domain", "command", "task", "allowed")))
    smallest_domain = dict(_render(approval, columns, _Rows(1, 1, 1, 1), name=0).lines)["domain"]
    smallest = _Rows(rows_of(smallest_domain, columns), 1, 1, 1)
    left = budget - fixed - sum((smallest.domain, smallest.command, smallest.task, smallest.allowed))
    given = []
    for kind in ("domain", "command", "task", "allowed"):
        extra = min(max(left, 0), max(getattr(whole, kind) - getattr(smallest, kind), 0))
        given.append(getattr(smallest, kind) + extra)
        left -= extra
    share = _Rows(*given)
    name = _name_room(approval, columns, share)
    fitted = _render(approval, columns, share, name=name)
    while _rows(fitted, columns, warning=True) > budget and share.command > 1:
        # The bounds above are estimates; a command that still does not fit gives a row back.
        share = _Rows(share.domain, share.command - 1, share.task, share.allowed)
        fitted = _render(approval, columns, share, name=name)
    return fitted


def _rows(message: ApprovalMessage, columns: int, *, warning: bool) -> int:
    """Rows the message takes; with ``warning``, counting the warning's rows also when it is not shown."""
    used = sum(rows_of(text, columns) for _, text in message.lines)
    if warning and not message.unrelated:
        used += rows_of(UNRELATED, columns)
    return used


def _render(approval: PendingApproval, columns: int, share: _Rows, *, name: int | None) -> ApprovalMessage:
    """The message again, each shortened line given room for its ``share`` of rows."""
    request = approval.request
    width = max(columns - 1, 1)

    def room(prefix: str, count: int, text: str | None) -> int:
        note = columns_of(f"… ({len(text or '')} more characters)")
        return max(count * width - columns_of(prefix) - note, 1)

    return render(
        host=request.host,
        port=request.port,
        command=request.command,
        task=request.task,
        allowed=request.allowed,
        request=request.request,
        uploaded=request.uploaded,
        room=Room(
            command=room("Command: ", share.command, request.command),
            task=room("Task: ", share.task, request.task),
            allowed=max(share.allowed * width - columns_of("Allowed domains: "), 1),
            name=name,
            measure=columns_of,
        ),
    )


def _name_room(approval: PendingApproval, columns: int, share: _Rows) -> int | None:
    """The most columns a name on the Domain line may take so that the line fits its rows (None: whole)."""
    message = approval.message
    if rows_of(dict(message.lines)["domain"], columns) <= share.domain:
        return None
    low, high = 0, columns_of(message.domain) + columns_of(message.unicode_host or "")
    while low < high:
        middle = (low + high + 1) // 2
        line = dict(_render(approval, columns, _Rows(share.domain, 1, 1, 1), name=middle).lines)["domain"]
        if rows_of(line, columns) <= share.domain:
            low = middle
        else:
            high = middle - 1
    return low


def prompt_line(
    *, domain: str, left: str, more: str, typed: str, columns: int, keep: str | None = None, hint: bool = False
) -> str:
    """The input line, fitted to ``columns`` (0: not known) so that a redraw never wraps.

    A line wider than the terminal would wrap, and each redraw (which clears
    only the line the cursor is on) would leave a copy behind. ``keep`` is
    the end of ``domain`` never cut (its registered domain and port; None:
    all of it); ``hint`` says that the last answer was neither allow nor deny.
    In order:

    1. the whole line, when it fits in all but the last column (a full line
       leaves the cursor waiting to wrap);
    2. else the domain's middle shortened (``message.shorten``), ``keep``
       whole; then the same without the count of approvals waiting;
    3. else without the domain, which the Domain line above shows whole;
    4. else the end of that, where the answer being typed is.

    A domain that is not ASCII is never shown here: its width is a guess.
    """
    ask = "type allow or deny" if hint else "allow or deny"

    def line(name: str | None, waiting: str) -> str:
        named = f" {name}" if name is not None else ""
        return f"{ask}{named}? [{left} left{waiting}; Enter = deny] > {typed}"

    if columns <= 0:
        return line(domain, more)
    room = columns - 1
    if domain.isascii():
        whole = line(domain, more)
        if columns_of(whole) <= room:
            return whole
        for waiting in (more, ""):
            short = shorten(domain, room - columns_of(line("", waiting)), keep=keep or domain, measure=columns_of)
            if short is not None and columns_of(line(short, waiting)) <= room:
                return line(short, waiting)
    bare = line(None, "")
    if columns_of(bare) <= room:
        return bare
    return bare[len(bare) - room:] if room > 0 else ""
