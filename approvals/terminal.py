"""The terminal channel: a prompt on the controlling terminal, one approval at a time.

It opens ``/dev/tty`` itself (never stdin, which may be the sandboxed
command's); when there is no controlling terminal the channel is not
attached. Several approvals queue and are shown one after another.

While a prompt is shown the terminal is in non-canonical, no-echo mode
(signals still work) and the channel draws the input line itself, so the
countdown can be redrawn every second without garbling what is typed:

1. showing a prompt first discards input typed before it appeared
   (``tcflush``): a keystroke meant for something else never answers;
2. the message is drawn once, rendered again for the terminal's size
   (``fit``): the header, the message and the input line fit the screen,
   so nothing of it scrolls away; on a small screen the allowlist and the
   task get one row each, the domain's names are shortened in the middle
   (the registered domain whole) and the command is cut, and the
   "unrelated" warning is judged on what is shown;
3. the domain line and the unrelated warning are emphasised; all text from
   the message is already escaped (``egressd.names.shown.escape``), so nothing the
   agent controls can move the cursor or repaint the prompt; every drawing
   starts by putting the terminal's attributes, character set and scroll
   region back to normal (``SANE``), whatever was written to it before;
4. the input line fits the terminal's width (``prompt_line``), so it stays
   one line; the countdown is redrawn every second, alone, in place; an
   answer that is neither allow nor deny says so on the input line, and a
   notice (a run stopped asking) waits until the prompt is answered, so
   nothing adds a row under a shown prompt;
5. the answer is a word and Enter (``read_answer``), named on a line of
   its own above the input line (``choices``): ``once`` allows this
   connection only (the request(s) waiting on the approval), ``allow`` for
   the rest of the run, ``always`` also appends the exact ``host:port`` to
   the allowlist file (offered, and taken, only when there is one);
   ``deny``, ``d``, ``n``, ``no`` and a bare Enter deny; anything else asks
   again. Whole words, not single keys: a stray key (or Caps Lock turning
   ``a`` into ``A``) never allows, and never makes a lasting rule;
6. an approval settled elsewhere (or expired) is withdrawn with a line
   saying how it ended, and the next one is shown; one whose waiting
   clients all gave up says so on its input line ("client gave up"), still
   answerable;
7. when the queue is empty the terminal's modes are restored.

egressd's own log lines, when its stderr is this terminal (``egressd
serve`` run by a person), go above the input line while a prompt is shown:
the channel puts a filter on each logging handler that writes to this
terminal (``_LogLinesAbove``), which, while the input line is on screen,
clears it, writes the log line (escaped) and draws the input line again
below it, so a log line never lands after the ``> `` and the countdown,
redrawn in place, never writes over one.

What is drawn is worked out in ``prompt`` (pure: the message fitted, the
input line, the answer words); this module owns the terminal: its modes,
input, output buffer and timer.

A command's output relayed to the same terminal goes through a
``TerminalOutput`` (``commandoutput``): escaped (``egressd.names.shown.TerminalText``), and held back from
the moment a prompt is shown until the channel has finished drawing, so no
command can hide, move or paint over a prompt.

No task is started: input arrives through ``loop.add_reader``, output
leaves through a buffer drained by ``loop.add_writer`` (a stopped terminal
must never block the proxy), and the countdown is a ``call_later`` timer.
"""

from __future__ import annotations

import asyncio
import errno
import getpass
import logging
import os
import termios
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from egressd.names.shown import escape

from .commandoutput import TerminalOutput
from .interface import (
    Answerer,
    AnswerResult,
    ChannelError,
    ChannelUnavailable,
    Choice,
    Notice,
    PendingApproval,
    Route,
    Settlement,
    settled_text,
)
from .message import shorten
from .prompt import (
    BOLD,
    CLEAR_LINE,
    RESET,
    SANE,
    WARN,
    allowed_text,
    choices,
    columns_of,
    countdown,
    fit,
    header,
    keep_of,
    prompt_line,
    read_answer,
)

log = logging.getLogger("egressd.approvals.terminal")

# A terminal that does not say how wide it is (no window size) is taken to be this wide,
# the width terminals have had since the VT100, so the input line still never wraps.
DEFAULT_COLUMNS = 80
# The longest answer anyone types; input past it is ignored.
MAX_INPUT = 16
# Output waiting for a stopped terminal (Ctrl-S); past this the terminal is
# treated as gone rather than letting memory grow.
MAX_PENDING_OUTPUT = 256 * 1024


@dataclass(frozen=True, slots=True)
class _Drawn:
    """The input line on screen: its text, the width it was fitted to, where its countdown starts (-1: not on it)."""

    line: str
    columns: int
    at: int
    left: str


def same_terminal(fd: int, other: int) -> bool:
    """Whether two descriptors are one terminal: the same device, or both the controlling terminal.

    ``/dev/tty`` opened is a device of its own (5, 0), standing for the
    controlling terminal; ``tcgetpgrp`` answers only on the controlling
    terminal (ENOTTY on any other).
    """
    try:
        if not os.isatty(other):
            return False
        if os.fstat(fd).st_rdev == os.fstat(other).st_rdev:
            return True
        os.tcgetpgrp(fd)
        os.tcgetpgrp(other)
    except OSError:
        return False
    return True


class _LogLinesAbove(logging.Filter):
    """On a logging handler that writes to the channel's terminal: its lines go above a shown input line.

    A filter, so the handler itself is left as it is: while the channel's
    input line is on screen, the record is formatted by the handler, written
    by the channel (``TerminalChannel.log_line``) and not emitted again;
    otherwise the handler writes it as ever.
    """

    def __init__(self, channel: TerminalChannel, handler: logging.Handler) -> None:
        super().__init__()
        self.channel = channel
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.channel.prompting():
            return True
        try:
            text = self.handler.format(record)
        except Exception:  # the handler's own error path reports it
            return True
        self.channel.log_line(text)
        return False


class TerminalChannel:
    """The module docstring, as a ``Channel``."""

    name = "terminal"

    def __init__(
        self,
        *,
        tty_path: str = "/dev/tty",
        clock: Callable[[], float] = time.time,
        tick_s: float = 1.0,
        who: str | None = None,
        output: TerminalOutput | None = None,
    ) -> None:
        self.tty_path = tty_path
        # What else is relayed to this terminal; held back while a prompt is up.
        self.output = output if output is not None else TerminalOutput()
        self._clock = clock
        self._tick_s = tick_s
        self._who = who
        self._fd: int | None = None
        self._saved_modes: list[object] | None = None
        self._answerer: Answerer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: deque[PendingApproval] = deque()
        self._current: PendingApproval | None = None
        self._typed = ""
        self._hint = False
        self._escape_state = ""
        # The input line as last drawn, so a tick redraws only its countdown.
        self._drawn: _Drawn | None = None
        self._left_width = 0
        # Notices that came while a prompt was shown: written after it.
        self._notices: list[str] = []
        # Approvals (queued or shown) whose waiting clients all gave up.
        self._abandoned: set[str] = set()
        self._out = bytearray()
        self._writing = False
        self._reading = False
        self._timer: asyncio.TimerHandle | None = None
        self._broken = False
        # The filters put on the logging handlers that write to this terminal (start), taken off at close.
        self._log_filters: list[_LogLinesAbove] = []

    # -- lifetime -----------------------------------------------------------------

    async def start(self, answerer: Answerer) -> None:
        try:
            fd = os.open(self.tty_path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise ChannelUnavailable(f"no controlling terminal ({self.tty_path}: {exc.strerror})") from None
        if not os.isatty(fd):
            os.close(fd)
            raise ChannelUnavailable(f"{self.tty_path} is not a terminal")
        self._fd = fd
        self._answerer = answerer
        self._loop = asyncio.get_running_loop()
        self._route_log_lines()
        if self._who is None:
            try:
                self._who = getpass.getuser()
            except (KeyError, OSError):
                self._who = "terminal"

    async def close(self) -> None:
        if self._fd is None:
            return
        for log_filter in self._log_filters:
            log_filter.handler.removeFilter(log_filter)
        self._log_filters.clear()
        self._stop_timer()
        self._stop_reading()
        if self._current is not None or self._queue:
            self._write(f"{CLEAR_LINE}egressd stopped: {len(self._queue) + 1} request(s) denied\r\n")
        self._write_notices()
        self._current = None
        self._queue.clear()
        self._abandoned.clear()
        self._restore_modes()
        self._flush_now()
        if self._writing and self._loop is not None:
            self._loop.remove_writer(self._fd)
            self._writing = False
        os.close(self._fd)
        self._fd = None
        self._sync_output()

    def routes(self) -> Sequence[Route]:
        return []

    # -- the Channel --------------------------------------------------------------

    async def deliver(self, approval: PendingApproval) -> None:
        """Queue the approval; it is on screen at once when nothing else is."""
        if self._fd is None or self._broken:
            raise ChannelError("the terminal is gone")
        self._queue.append(approval)
        if self._current is None:
            self._show_next()
        else:
            self._draw_prompt()  # the "N more waiting" count changed

    async def settle(self, approval: PendingApproval, settlement: Settlement) -> None:
        """Withdraw the approval: from the screen (saying how it ended) or from the queue."""
        self._abandoned.discard(approval.id)
        if self._current is not None and self._current.id == approval.id:
            self._finish(f"{settled_text(settlement)}")
        elif any(a.id == approval.id for a in self._queue):
            self._queue = deque(a for a in self._queue if a.id != approval.id)
            self._draw_prompt()

    async def abandoned(self, approval: PendingApproval) -> None:
        """Say on the approval's input line that its client gave up (no row is added under a prompt)."""
        if self._fd is None or self._broken:
            raise ChannelError("the terminal is gone")
        if approval.id != getattr(self._current, "id", None) and all(a.id != approval.id for a in self._queue):
            return
        self._abandoned.add(approval.id)
        if self._current is not None and self._current.id == approval.id:
            self._draw_prompt()

    async def notify(self, notice: Notice) -> None:
        """One line; while a prompt is shown, after it (a row added under a prompt pushes its top away)."""
        if self._fd is None or self._broken:
            raise ChannelError("the terminal is gone")
        self._notices.append(notice.text)
        if self._current is None:
            self._write_notices()

    def _write_notices(self) -> None:
        notices, self._notices = self._notices, []
        for text in notices:
            self._write(f"{CLEAR_LINE}{WARN}{text}{RESET}\r\n")

    # -- egressd's own log lines ----------------------------------------------------

    def _route_log_lines(self) -> None:
        """Put ``_LogLinesAbove`` on every logging handler (the root logger's) that writes to this terminal."""
        assert self._fd is not None
        for handler in logging.getLogger().handlers:
            stream = getattr(handler, "stream", None)
            try:
                other = stream.fileno() if stream is not None else -1
            except (AttributeError, OSError, ValueError):
                continue
            if other >= 0 and same_terminal(self._fd, other):
                log_filter = _LogLinesAbove(self, handler)
                handler.addFilter(log_filter)
                self._log_filters.append(log_filter)

    def prompting(self) -> bool:
        """Whether the input line is on screen with the cursor at its end, on the event loop's thread.

        Only then is a log line written above it; while a prompt is being
        drawn or closed, or from another thread, the handler writes as ever.
        """
        if self._current is None or self._drawn is None or self._fd is None or self._broken:
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def log_line(self, text: str) -> None:
        """One of egressd's log lines, above the input line: clear it, write the line, draw the input line again."""
        shown = escape(text, keep_layout=True).replace("\n", "\r\n")
        self._write(f"{CLEAR_LINE}{shown}\r\n")
        self._draw_prompt()

    # -- screen -------------------------------------------------------------------

    def _show_next(self) -> None:
        if self._fd is None or self._broken:
            return
        self._write_notices()
        if not self._queue:
            self._current = None
            self._stop_reading()
            self._stop_timer()
            self._restore_modes()
            self._sync_output()
            return
        self._current = self._queue.popleft()
        self._sync_output()
        self._typed = ""
        self._hint = False
        self._escape_state = ""
        self._drawn = None
        self._left_width = len(countdown(self._current.expires_at - self._clock()))
        if self._foreground():
            self._take_input()
        columns, rows = self._size()
        message = fit(self._current, columns=columns, rows=rows)
        out = [f"{SANE}\r\n{BOLD}{header(self._current)}{RESET}\r\n"]
        for kind, text in message.lines:
            if kind == "domain":
                out.append(f"{BOLD}{text}{RESET}\r\n")
            elif kind == "unrelated":
                out.append(f"{WARN}{text}{RESET}\r\n")
            else:
                out.append(f"{text}\r\n")
        out.append(f"{choices(self._current.scopes)}\r\n")
        self._write("".join(out))
        self._draw_prompt()
        self._schedule_tick()

    def _take_input(self) -> None:
        """Prompt modes, typed-ahead input thrown away (step 1), then read key by key."""
        assert self._fd is not None
        self._prompt_modes()
        try:
            termios.tcflush(self._fd, termios.TCIFLUSH)
        except termios.error:
            pass
        self._start_reading()

    def _left(self, current: PendingApproval) -> str:
        """The countdown, as wide as when the prompt was first drawn (so it is redrawn in place)."""
        return countdown(current.expires_at - self._clock()).rjust(self._left_width)

    def _draw_prompt(self) -> None:
        """Draw the input line whole (shown first, typed into, or the count waiting changed)."""
        current = self._current
        if current is None:
            return
        more = f", {len(self._queue)} more waiting" if self._queue else ""
        if current.id in self._abandoned:
            more = f", client gave up{more}"
        left = self._left(current)
        columns = self._columns()
        line = prompt_line(domain=current.message.domain, keep=keep_of(current.message), left=left, more=more,
                           typed=self._typed, columns=columns, hint=self._hint)
        self._write(f"{CLEAR_LINE}{line}")
        at = line.rfind(f"[{left} left")
        self._drawn = _Drawn(line, columns, at + 1 if at >= 0 else -1, left)

    def _redraw_countdown(self) -> None:
        """Redraw the countdown alone, where it is; the whole input line when that cannot be done."""
        current, drawn = self._current, self._drawn
        if current is None:
            return
        left = self._left(current)
        if drawn is None or drawn.at < 0 or drawn.columns != self._columns() or len(left) != len(drawn.left):
            self._draw_prompt()
            return
        if left == drawn.left:
            return
        # The cursor is at the end of the input line; from the countdown on, the line is
        # ASCII, so its length is the columns to go back (the domain before it may not be).
        back = len(drawn.line) - drawn.at
        self._write(f"{SANE}\x1b[{back}D{left}\x1b[{back - len(left)}C")
        line = drawn.line[: drawn.at] + left + drawn.line[drawn.at + len(left):]
        self._drawn = _Drawn(line, drawn.columns, drawn.at, left)

    def _finish(self, outcome: str) -> None:
        """Close the current prompt with one line saying how it ended; show the next."""
        current = self._current
        if current is None:
            return
        # One row, like the input line it replaces: the domain's middle shortened if need be.
        room = self._columns() - 1 - columns_of(f": {outcome}")
        domain = shorten(current.message.domain, room, keep=keep_of(current.message), measure=columns_of)
        self._write(f"{CLEAR_LINE}{domain or current.message.domain}: {outcome}\r\n")
        self._current = None
        self._drawn = None
        self._show_next()

    def _schedule_tick(self) -> None:
        self._stop_timer()
        if self._loop is not None and self._current is not None:
            self._timer = self._loop.call_later(self._tick_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._current is not None:
            # Job control may have moved egressd to the background or back (fg).
            foreground = self._foreground()
            if foreground and not self._reading:
                self._take_input()
            elif not foreground and self._reading:
                self._stop_reading()
        self._redraw_countdown()
        self._schedule_tick()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- input --------------------------------------------------------------------

    def _start_reading(self) -> None:
        if not self._reading and self._loop is not None and self._fd is not None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
        self._reading = False

    def _on_readable(self) -> None:
        assert self._fd is not None
        if not self._foreground():
            self._stop_reading()  # reading now would stop egressd (SIGTTIN); the tick resumes it
            return
        try:
            data = os.read(self._fd, 1024)
        except BlockingIOError:
            return
        except OSError as exc:
            self._gone(exc)
            return
        if not data:
            self._gone(None)
            return
        shown = self._current
        for byte in data:
            self._key(byte)
            if self._current is not shown:
                break  # the rest was typed before the next prompt appeared: step 1 drops it

    def _key(self, byte: int) -> None:
        # Escape sequences (arrow keys, function keys) are skipped whole: ESC,
        # then '[' or 'O', then parameter bytes up to one final byte.
        if self._escape_state == "esc":
            self._escape_state = "csi" if byte in (0x5B, 0x4F) else ""
            return
        if self._escape_state == "csi":
            if 0x40 <= byte <= 0x7E:
                self._escape_state = ""
            return
        if byte == 0x1B:
            self._escape_state = "esc"
        elif byte in (0x0A, 0x0D):
            self._submit()
        elif byte in (0x7F, 0x08):
            self._typed = self._typed[:-1]
            self._draw_prompt()
        elif byte == 0x15:  # Ctrl-U: kill the line
            self._typed = ""
            self._draw_prompt()
        elif 0x20 <= byte <= 0x7E and len(self._typed) < MAX_INPUT:
            self._typed += chr(byte)
            self._draw_prompt()

    def _submit(self) -> None:
        current = self._current
        if current is None or self._answerer is None:
            return
        read = read_answer(self._typed, current.scopes)
        if read is None:
            self._typed = ""
            self._hint = True  # said on the input line: a line of its own would push the message up
            self._draw_prompt()
            return
        decision, scope = read
        # The answer stays on its line, and the line ends here: what the answer
        # makes others print (the ALLOWED log line) starts on a row of its own.
        self._write("\r\n")
        self._drawn = None
        answered = self._answerer.answer(current.id, decision, channel=self.name, by=self._who, scope=scope)
        if answered.result is AnswerResult.ACCEPTED:
            if decision is Choice.ALLOW and answered.settlement is not None:
                self._finish(allowed_text(answered.settlement))
            else:
                self._finish("allowed for this run" if decision is Choice.ALLOW else "denied for this run")
        elif answered.settlement is not None:
            self._finish(f"already settled: {settled_text(answered.settlement)}")
        else:
            self._finish("no longer pending")

    # -- terminal modes and output ------------------------------------------------------

    def _prompt_modes(self) -> None:
        if self._fd is None:
            return
        try:
            modes = termios.tcgetattr(self._fd)
            if self._saved_modes is None:
                self._saved_modes = [list(m) if isinstance(m, list) else m for m in modes]
            modes[3] &= ~(termios.ICANON | termios.ECHO)  # lflag: read key by key, we echo ourselves
            modes[6][termios.VMIN] = 1
            modes[6][termios.VTIME] = 0
            termios.tcsetattr(self._fd, termios.TCSANOW, modes)
        except termios.error as exc:
            log.warning("cannot set terminal modes: %s", exc)

    def _size(self) -> tuple[int, int]:
        """The terminal's columns and rows now (it may have been resized); 0 when it does not say."""
        if self._fd is None:
            return 0, 0
        try:
            size = os.get_terminal_size(self._fd)
        except OSError:
            return 0, 0
        return size.columns, size.lines

    def _columns(self) -> int:
        """The width the input line is fitted to: the terminal's, or the usual 80 when it does not say."""
        return self._size()[0] or DEFAULT_COLUMNS

    def _sync_output(self) -> None:
        """Relayed output waits from the moment a prompt is shown until our drawing has reached the terminal."""
        if self._current is not None or (self._out and self._fd is not None and not self._broken):
            self.output.hold()
        else:
            self.output.release()

    def _foreground(self) -> bool:
        """Whether egressd may read, flush or set modes on the terminal now.

        POSIX job control stops a background process that does (SIGTTIN,
        SIGTTOU), and with it the proxy. A terminal that is not egressd's
        controlling terminal (``tcgetpgrp``: ENOTTY) has no job control for it.
        """
        if self._fd is None:
            return False
        try:
            return os.tcgetpgrp(self._fd) == os.getpgrp()
        except OSError:
            return True

    def _restore_modes(self) -> None:
        if self._fd is None or self._saved_modes is None:
            return
        if not self._foreground():
            self._saved_modes = None  # the shell restores the modes of a job it stopped
            return
        try:
            termios.tcsetattr(self._fd, termios.TCSANOW, self._saved_modes)  # type: ignore[arg-type]  # tcgetattr's own list
        except termios.error:
            pass
        self._saved_modes = None

    def _write(self, text: str) -> None:
        if self._fd is None or self._broken:
            return
        self._out += text.encode("utf-8", "replace")
        if len(self._out) > MAX_PENDING_OUTPUT:
            self._gone(OSError(errno.ENOBUFS, "the terminal stopped reading"))
            return
        self._flush_now()

    def _flush_now(self) -> None:
        if self._fd is None:
            return
        while self._out:
            try:
                written = os.write(self._fd, self._out)
            except BlockingIOError:
                if not self._writing and self._loop is not None:
                    self._loop.add_writer(self._fd, self._on_writable)
                    self._writing = True
                return
            except OSError as exc:
                self._out.clear()
                self._gone(exc)
                return
            del self._out[:written]
        if self._writing and self._loop is not None:
            self._loop.remove_writer(self._fd)
            self._writing = False
        self._sync_output()

    def _on_writable(self) -> None:
        self._flush_now()

    def _gone(self, exc: OSError | None) -> None:
        """The terminal hung up: stop using it. Open approvals wait for other channels or expire."""
        if self._broken:
            return
        log.warning(
            "the terminal is gone (%s): it no longer answers approvals", exc.strerror if exc else "end of input"
        )
        self._broken = True
        self._stop_reading()
        self._stop_timer()
        self._queue.clear()
        self._abandoned.clear()
        self._current = None
        if self._writing and self._loop is not None and self._fd is not None:
            self._loop.remove_writer(self._fd)
            self._writing = False
        self._out.clear()
        self._sync_output()
