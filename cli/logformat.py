"""egressd's own log on stderr: one line per event, as text for a person (``TIME egressd MESSAGE``) or as
JSON for a log collector (``--log-format json``: one object per line, ``ts``, ``level``, ``message``)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import time

__all__ = ["JsonFormatter", "LineFormatter", "setup_logging"]


class LineFormatter(logging.Formatter):
    """``TIME egressd MESSAGE``, the time made once per second: serve logs a line per decision."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s egressd %(message)s", "%Y-%m-%dT%H:%M:%S")
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        second = int(record.created)
        if second != self._second:  # under the handler's lock: one thread at a time
            self._stamp = time.strftime(datefmt or "%Y-%m-%dT%H:%M:%S", self.converter(second))
            self._second = second
        return self._stamp


def setup_logging(level: str, log_format: str = "text") -> None:
    # What no line of ours shows is not gathered for every record (the logging HOWTO's
    # "Optimization"): the caller's frame, thread and process (docs/performance.md).
    logging._srcfile = None  # noqa: SLF001 (the documented switch)
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else LineFormatter())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``{"ts": RFC 3339 UTC, "level": "info", "message": ...}`` (the message as the
    text format has it, never a terminal's control character: JSON escapes them)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")
        line = {"ts": ts.replace("+00:00", "Z"), "level": record.levelname.lower(), "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=True)
