"""The operator's log line: ``TIME egressd MESSAGE``, its time stamp made once per second."""

from __future__ import annotations

import logging
import time

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
