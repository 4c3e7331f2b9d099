"""The operator's log line: ``TIME egressd MESSAGE``, its time stamp made once per second."""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Iterator

import pytest

from egressd.cli.logformat import LineFormatter as _LineFormatter


def _line(formatter: logging.Formatter, created: float, message: str) -> str:
    record = logging.LogRecord("egressd.test", logging.INFO, __file__, 1, message, (), None)
    record.created = created
    return formatter.format(record)


def test_each_line_carries_its_own_second() -> None:
    formatter = _LineFormatter()
    base = 1_764_633_600.0  # a whole second, so +0.9 stays within it
    first = _line(formatter, base, "ALLOW connect a.test:443")
    same = _line(formatter, base + 0.9, "DENY  connect b.test:443")
    later = _line(formatter, base + 61.2, "ALLOW connect c.test:443")
    earlier = _line(formatter, base - 3600, "ALLOW connect d.test:443")  # a clock stepped back
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(base))
    assert first == f"{stamp} egressd ALLOW connect a.test:443"
    assert same == f"{stamp} egressd DENY  connect b.test:443"
    assert later == f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(base + 61))} egressd ALLOW connect c.test:443"
    assert earlier.startswith(time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(base - 3600)))


def test_the_json_format_is_one_object_per_line_for_a_log_collector() -> None:
    import json

    from egressd.cli.logformat import JsonFormatter

    line = _line(JsonFormatter(), 1_764_633_600.25, "DENY  connect evil\x1b[2J.test:443 run=default")
    assert "\n" not in line and "\x1b" not in line  # a hostile name cannot repaint a terminal tailing it
    assert json.loads(line) == {"ts": "2025-12-02T00:00:00.250Z", "level": "info",
                                "message": "DENY  connect evil\x1b[2J.test:443 run=default"}  # fmt: skip



@contextlib.contextmanager
def _own_logging(log_format: str) -> Iterator[io.StringIO]:
    """egressd's own logging on a stream of the test's, the root logger's handlers put back after."""
    from egressd.cli import logformat

    saved, level, stream = logging.root.handlers[:], logging.root.level, io.StringIO()
    logging.root.handlers = []
    real, logformat.sys.stderr = logformat.sys.stderr, stream  # type: ignore[attr-defined]
    try:
        logformat.setup_logging("info", log_format)
        yield stream
    finally:
        logformat.sys.stderr = real  # type: ignore[attr-defined]
        logging.root.handlers, logging.root.level = saved, level
        logformat._own = None


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_direct_line_is_the_line_logging_writes_without_a_log_record(log_format: str) -> None:
    """Issue 30: a decision's line through logging cost a tenth of a tunnel; written directly it is the same."""
    from egressd.cli.logformat import direct_writer

    logger = logging.getLogger("egressd.decisions")
    with _own_logging(log_format) as stream:
        write = direct_writer(logger)
        assert write is not None
        logger.info("%s", "ALLOW connect a.test:443 run=default rule=a.test")
        write("ALLOW connect a.test:443 run=default rule=a.test")
        through_logging, direct = stream.getvalue().splitlines()
        if log_format == "json":  # the same object; the times may differ by a millisecond
            import json

            through_logging, direct = (json.loads(line) | {"ts": "-"} for line in (through_logging, direct))
        else:
            through_logging, direct = (line.split(" ", 1)[1] for line in (through_logging, direct))
        assert direct == through_logging


def test_no_direct_line_when_anything_else_would_see_or_filter_it() -> None:
    from egressd.cli import logformat
    from egressd.cli.logformat import direct_writer

    logger = logging.getLogger("egressd.decisions")
    own, logformat._own = logformat._own, None
    try:
        assert direct_writer(logger) is None  # logging not set up by egressd: logging's way
    finally:
        logformat._own = own
    with _own_logging("text"):
        assert direct_writer(logger) is not None
        capture = logging.Handler()
        logging.root.addHandler(capture)  # a test's log capture, a collector's handler
        assert direct_writer(logger) is None
        logging.root.removeHandler(capture)
        quiet = logging.Filter("nothing")
        logger.addFilter(quiet)  # a filter on the way must still apply
        try:
            assert direct_writer(logger) is None
        finally:
            logger.removeFilter(quiet)
