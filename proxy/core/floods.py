"""Floods from inside a run: how many refusals go to the audit log one by one.

A sandboxed process can make refusals as fast as it can open sockets or send
DNS queries (random labels, unknown hosts, garbage heads). Each is refused
at once, and each would be one audit line of a few hundred bytes: left
alone, one run could fill the disk the log lives on, and an unwritable log
stops every run's egress (``audit_unavailable``). So each run has a budget
of refusal records per interval (``RefusalBudget``):

1. a refusal whose run has had fewer than ``max_records`` refusals recorded
   in its current interval is recorded one by one, as always;
2. past that, it is refused exactly the same (the client sees nothing
   different: fail closed), but only counted, by kind and reason, with a few
   sample hosts;
3. when the interval ends, its counts become one ``egress.suppressed``
   summary (``egressd.audit.records.suppressed_record``), also when the run ends and
   when egressd stops.

Allowed egress is never counted instead of recorded, nor is a summary of
other limits (the DNS server's). An interval starts with a run's first
refusal after the previous one ended, so a quiet run has no interval open.

Pure: time is passed in (``now``, monotonic seconds); the recorder writes the
records and owns the timer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# A real workload is refused a handful of times a minute (a package manager
# probing a mirror, a tool phoning home); 50 refusals in 10 s is already a
# loop or a scan, and 5 lines a second per run is a rate no disk notices.
DEFAULT_MAX_RECORDS = 50
DEFAULT_INTERVAL_S = 10.0
# Enough to see what a flood was after, few enough to keep the summary one short line.
MAX_SAMPLES = 5
# A sample is a host as the client sent it; a hostile one can be long.
MAX_SAMPLE_CHARS = 255


@dataclass(slots=True)
class Suppressed:
    """One run's interval in which refusals were counted instead of recorded."""

    run: str | None
    start: float  # monotonic seconds, as passed to ``RefusalBudget``
    end: float
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, reason) → refusals
    samples: list[str] = field(default_factory=list)  # distinct hosts, first seen first

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(slots=True)
class _Window:
    start: float
    end: float
    recorded: int = 0
    suppressed: Suppressed | None = None


class RefusalBudget:
    """Per run: the first ``max_records`` refusals of each interval are recorded, the rest counted.

    ``admit`` says whether one refusal gets its own record; ``due`` hands over
    the summaries of intervals that have ended; ``drain`` hands over a run's
    (or every run's) summary at once, ended or not. Each summary is handed
    over exactly once, so the counts of the summaries plus the refusals
    recorded add up to every refusal ``admit`` saw.
    """

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if max_records < 0:
            raise ValueError("max_records must be at least 0")
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        self.max_records = max_records
        self.interval_s = interval_s
        self._windows: dict[str | None, _Window] = {}
        self._ended: list[Suppressed] = []  # summaries of intervals that ended, not handed over yet
        # The earliest time ``due`` may have something to hand over; None: nothing is counted.
        self.next_due: float | None = None

    def admit(self, run: str | None, now: float, kind: str, reason: str, host: str | None) -> bool:
        """Whether this refusal gets a record of its own (True) or is counted into its run's summary."""
        window = self._windows.get(run)
        if window is None or now >= window.end:
            if window is not None and window.suppressed is not None:
                self._ended.append(window.suppressed)
                self.next_due = now if self.next_due is None else min(self.next_due, now)
            window = self._windows[run] = _Window(now, now + self.interval_s)
        if window.recorded < self.max_records:
            window.recorded += 1
            return True
        summary = window.suppressed
        if summary is None:
            summary = window.suppressed = Suppressed(run, window.start, window.end)
            if self.next_due is None or window.end < self.next_due:
                self.next_due = window.end
        summary.counts[(kind, reason)] += 1
        if host is not None and len(summary.samples) < MAX_SAMPLES:
            sample = host[:MAX_SAMPLE_CHARS]
            if sample not in summary.samples:
                summary.samples.append(sample)
        return False

    def due(self, now: float) -> list[Suppressed]:
        """The summaries of every interval that ended by ``now``; ended windows are forgotten."""
        ended, self._ended = self._ended, []
        if self.next_due is None or now < self.next_due:
            return ended
        self.next_due = None
        for run, window in list(self._windows.items()):
            if now >= window.end:
                del self._windows[run]
                if window.suppressed is not None:
                    ended.append(window.suppressed)
            elif window.suppressed is not None and (self.next_due is None or window.end < self.next_due):
                self.next_due = window.end
        return ended

    def drain(self, run: str | None = None, *, every: bool = False) -> list[Suppressed]:
        """The summaries of ``run`` (or of every run), ended or not; their windows are forgotten.

        For a run that ends (nothing of it may be left uncounted after its
        ``run.end``) and for egressd stopping (``every``).
        """
        runs = list(self._windows) if every else [run]
        drained = [s for s in self._ended if every or s.run == run]
        self._ended = [s for s in self._ended if not (every or s.run == run)]
        for key in runs:
            window = self._windows.pop(key, None)
            if window is not None and window.suppressed is not None:
                drained.append(window.suppressed)
        return drained
