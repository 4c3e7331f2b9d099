"""Issue 30's targets, and the pure evaluation of measured figures against them.

No I/O: ``evaluate`` takes the medians the benchmark measured (``{who: {figure:
median}}``) and the reasons some figures could not be measured, and returns one
row per target: egressd's figure, the figure it is compared with, their ratio,
the ratio the target needs, and "met", "not met" or "not measured: why".
``render`` prints the rows as a table. bench/run.py measures; this decides.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# ``Target.versus`` for a fixed figure (``Target.limit``) rather than a peer's.
LIMIT = "limit"


@dataclass(frozen=True)
class Target:
    """egressd's ``figure`` against ``versus``'s ``versus_figure`` (the same figure unless named).

    The target is met when ratio = egressd / comparison is at least ``bound``
    (``higher``) or at most ``bound`` (not ``higher``: a cost, a latency).
    ``versus`` is a proxy ("squid"), "direct", "dnsmasq", "egressd" itself
    (another of its figures, e.g. one worker against two) or ``LIMIT`` (the
    comparison is the fixed figure ``limit``).
    """

    title: str
    unit: str
    figure: str
    versus: str
    bound: float
    higher: bool = True
    versus_figure: str | None = None
    limit: float | None = None
    versus_label: str | None = None  # how the table names the comparison (default: ``versus``)
    goal: float | None = None  # the ratio of the step after (a compiled data path); None: ``bound`` is the goal


# Issue 30: ``bound`` is what its steps 1–6 (bench, log line, Rust audit line, workers, splice, the p99
# tail) must reach; ``goal`` what step 7 (a compiled data path) aims for.
TARGETS: tuple[Target, ...] = (
    Target("proxy CPU per tunnel (one after another)", "µs", "cpu_per_tunnel_us", "squid", 1.3, higher=False,
           goal=1.0),  # fmt: skip
    Target("tunnel setup, 50 in flight", "tunnels/s", "setup_50", "squid", 1.0, goal=1.5),
    Target("tunnel setup, one after another", "tunnels/s", "setup_serial", "squid", 0.8, goal=1.2),
    Target("small plain HTTP, keep-alive", "req/s", "http_small", "squid", 0.8, goal=1.5),
    Target("small plain HTTP, keep-alive: p99 latency", "ms", "http_small_p99", "squid", 1.5, higher=False,
           goal=1.0),  # fmt: skip
    Target("relay CPU per GiB", "s", "cpu_per_gib_s", LIMIT, 1.0, higher=False, limit=0.35),
    Target("tunnel throughput, down", "MB/s", "tput_down", "direct", 0.45),
    Target("tunnel throughput, up", "MB/s", "tput_up", "direct", 0.45),
    Target("DNS queries", "q/s", "dns_qps", "dnsmasq", 0.33, goal=0.5),
    Target("--workers 2 / --workers 1, small plain HTTP", "req/s", "http_small_w2", "egressd", 1.4,
           versus_figure="http_small_w1", versus_label="--workers 1"),  # fmt: skip
    Target("idle memory per tunnel", "KiB", "idle_kib", LIMIT, 1.0, higher=False, limit=5.0),
    Target("plain HTTP, 1 MiB responses", "MB/s", "http_big", "pproxy", 1.0),
    Target("small plain HTTP, fresh connection each", "req/s", "http_close", "pproxy", 1.0),
    Target("audit: one write per loop turn (max writes in a turn)", "writes", "audit_writes_per_turn_max", LIMIT, 1.0,
           higher=False, limit=1.0),  # fmt: skip
)


@dataclass(frozen=True)
class Row:
    target: Target
    ours: float | None
    theirs: float | None
    ratio: float | None
    verdict: str  # "met", "not met" or "not measured: why"

    @property
    def met(self) -> bool:
        return self.verdict == "met"


def _usable(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def evaluate(
    medians: dict[str, dict[str, float]],
    reasons: dict[str, str] | None = None,
    targets: tuple[Target, ...] = TARGETS,
) -> list[Row]:
    """One row per target. ``reasons`` says, per figure name or per peer, why it was not measured."""
    reasons = reasons or {}
    rows = []
    for target in targets:
        ours = medians.get("egressd", {}).get(target.figure)
        versus_figure = target.versus_figure or target.figure
        if target.versus == LIMIT:
            theirs = target.limit
        else:
            theirs = medians.get(target.versus, {}).get(versus_figure)
        if not _usable(ours):
            why = reasons.get(target.figure) or reasons.get("egressd") or "no egressd figure"
            rows.append(Row(target, None, theirs if _usable(theirs) else None, None, f"not measured: {why}"))
            continue
        if not _usable(theirs):
            why = reasons.get(versus_figure) or reasons.get(target.versus) or f"no {target.versus} figure"
            rows.append(Row(target, ours, None, None, f"not measured: {why}"))
            continue
        assert ours is not None and theirs is not None
        if theirs == 0:
            rows.append(Row(target, ours, theirs, None, f"not measured: {target.versus}'s figure is 0"))
            continue
        ratio = ours / theirs
        met = ratio >= target.bound if target.higher else ratio <= target.bound
        rows.append(Row(target, ours, theirs, ratio, "met" if met else "not met"))
    return rows


def number(value: float | None) -> str:
    """A figure as a person reads it: whole above 100, two decimals above 1, three significant below."""
    if value is None or math.isnan(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def render(rows: list[Row]) -> str:
    header = ("target", "unit", "egressd", "compared with", "ratio", "needs", "goal", "verdict")
    table = [header]
    for row in rows:
        t = row.target
        if t.versus == LIMIT:
            versus = f"{number(row.theirs)} (limit)"
        else:
            versus = f"{t.versus_label or t.versus} {number(row.theirs)}"
        sign = "≥" if t.higher else "≤"
        needs = f"{sign} {t.bound:.2f}×"
        goal = f"{sign} {(t.goal if t.goal is not None else t.bound):.2f}×"
        ratio = f"{row.ratio:.2f}×" if row.ratio is not None else "-"
        table.append((t.title, t.unit, number(row.ours), versus, ratio, needs, goal, row.verdict))
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = []
    for n, line in enumerate(table):
        cells = [
            cell.ljust(w) if i in (0, 1, 3, 7) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    met = sum(row.met for row in rows)
    measured = sum(not row.verdict.startswith("not measured") for row in rows)
    lines.append(f"targets met: {met} of {len(rows)} ({measured} measured)")
    return "\n".join(lines)


@dataclass(frozen=True)
class AuditWrites:
    """What an strace of egressd says about its audit-log writes."""

    writes: int  # write system calls to the audit log
    turns: int  # event-loop turns seen (epoll waits)
    turns_with_writes: int
    max_per_turn: int  # the most audit writes between two epoll waits


def audit_writes(trace: str, audit_name: str) -> AuditWrites:
    """Count the audit log's writes per event-loop turn in ``strace -f -y`` output.

    A turn ends at each epoll wait (the loop's one poll per iteration); a write
    is to the audit log when strace's ``-y`` names the file ``audit_name``
    (``write(7</tmp/x/audit.jsonl>, ...``). A call strace split in two
    (``<unfinished ...>`` then ``<... resumed>``) is counted at its start.
    """
    writes = turns = with_writes = most = 0
    in_turn = 0
    for line in trace.splitlines():
        body = line.split(" ", 1)[1] if line.startswith("[pid") or line[:1].isdigit() else line
        body = body.lstrip()
        if body.startswith("<..."):
            continue  # the end of a call counted at its start
        call = body.split("(", 1)[0]
        if call.startswith("epoll_") and "wait" in call:
            turns += 1
            with_writes += in_turn > 0
            most = max(most, in_turn)
            in_turn = 0
        elif call in ("write", "writev", "pwrite64", "pwritev", "pwritev2"):
            fd = body[len(call) + 1 :].split(",", 1)[0]
            if fd.endswith(">") and fd[:-1].endswith(audit_name):
                writes += 1
                in_turn += 1
    with_writes += in_turn > 0
    most = max(most, in_turn)
    return AuditWrites(writes, turns, with_writes, most)


# The first four numbers after the name (which may hold a number of its own); columns may follow.
_DNS_ROW = re.compile(r"^(dnsmasq|egressd)\b.*?\s(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)(?:\s.*)?$")


def parse_dns(text: str) -> dict[str, float]:
    """queries/s of each server in bench/bench_dns.py's table: ``{"dnsmasq": q/s, "egressd": q/s}``.

    A row is the server's name and then answered, lost, seconds, queries/s, and
    perhaps more columns (CPU µs and writes per query).
    """
    found = {}
    for line in text.splitlines():
        row = _DNS_ROW.match(line.strip())
        if row:
            found[row.group(1)] = float(row.group(5))
    return found
