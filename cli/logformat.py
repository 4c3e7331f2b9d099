"""egressd's own log on stderr: one line per event, as text for a person (``TIME egressd MESSAGE``) or as
JSON for a log collector (``--log-format json``: one object per line, ``ts``, ``level``, ``message``).

``serve`` logs a line per decision at its default level. Through logging
that line is a ``LogRecord``, a trip through the logger tree and the
handler: about 56k instructions per tunnel, a tenth of all. When nothing but
egressd's own handler would see the line, ``direct_writer`` writes it to
the same stream in the same format, under the handler's lock, without one.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["JsonFormatter", "LineFormatter", "direct_writer", "setup_logging"]

# The handler ``setup_logging`` installed: the only one a direct line may stand in for.
_own: logging.StreamHandler[TextIO] | None = None


class LineFormatter(logging.Formatter):
    """``TIME egressd MESSAGE``, the time made once per second: serve logs a line per decision."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s egressd %(message)s", "%Y-%m-%dT%H:%M:%S")
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        return self.stamp(record.created)

    def stamp(self, created: float) -> str:
        """The line's time for ``created`` (epoch seconds); called under the handler's lock."""
        second = int(created)
        if second != self._second:
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(second))
            self._second = second
        return self._stamp


def setup_logging(level: str, log_format: str = "text") -> None:
    # What no line of ours shows is not gathered for every record (the logging HOWTO's
    # "Optimization"): the caller's frame, thread and process (docs/performance.md).
    logging._srcfile = None  # noqa: SLF001 (the documented switch)
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    global _own
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else LineFormatter())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
    _own = handler


def direct_writer(logger: logging.Logger) -> Callable[[str], None] | None:
    """A writer of ``logger``'s INFO lines that skips logging's ``LogRecord``, or None when it would not be
    the same: logging is not set up by ``setup_logging``, or something else would see or filter the line
    (a filter or handler on the way to the root, another handler there: a test's log capture).

    Checked once, when a service starts; a line is written only while ``logger`` is on at INFO (the
    caller asks ``isEnabledFor``, which logging caches).
    """
    handler = _own
    if handler is None or logging.root.handlers != [handler] or handler.filters or handler.level > logging.INFO:
        return None
    node: logging.Logger | None = logger
    while node is not None and node is not logging.root:
        if node.filters or node.handlers or not node.propagate:
            return None
        node = node.parent
    if logging.root.filters:
        return None
    formatter, stream, lock = handler.formatter, handler.stream, handler.lock
    if isinstance(formatter, LineFormatter):

        def render(message: str) -> str:
            return f"{formatter.stamp(time.time())} egressd {message}\n"

    elif isinstance(formatter, JsonFormatter):

        def render(message: str) -> str:
            return formatter.line(time.time(), "INFO", message) + "\n"

    else:
        return None

    flushes = getattr(stream, "line_buffering", False)  # stderr is (Python 3.9+): a line's write flushes it

    def write(message: str) -> None:
        if lock is None:
            return
        with lock:
            try:
                stream.write(render(message))
                if not flushes:
                    stream.flush()
            except (OSError, ValueError):
                pass  # stderr gone (a closed pipe): the audit log, not this line, is the record

    return write


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``{"ts": RFC 3339 UTC, "level": "info", "message": ...}`` (the message as the
    text format has it, never a terminal's control character: JSON escapes them)."""

    def format(self, record: logging.LogRecord) -> str:
        exception = self.formatException(record.exc_info) if record.exc_info else None
        return self.line(record.created, record.levelname, record.getMessage(), exception)

    @staticmethod
    def line(created: float, level: str, message: str, exception: str | None = None) -> str:
        ts = dt.datetime.fromtimestamp(created, dt.UTC).isoformat(timespec="milliseconds")
        line = {"ts": ts.replace("+00:00", "Z"), "level": level.lower(), "message": message}
        if exception is not None:
            line["exception"] = exception
        return json.dumps(line, ensure_ascii=True)
