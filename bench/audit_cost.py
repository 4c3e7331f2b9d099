"""What one audit record costs, and how many writes carry the records of one loop turn.

    .venv/bin/python bench/audit_cost.py [--records 20000] [--per-turn 32]

In this process, on the event loop egressd runs on (uvloop when installed),
with a ``JsonlAuditSink`` appending to a file in a temporary directory, as
``egressd serve`` writes its audit log:

- ``egress`` written ahead: an allowed CONNECT's record, built from its fact
  (``EgressDecided.record()``), encoded, chained and written with
  ``write_ahead`` (it must be in the file before the dial: one write each);
- ``egress`` queued: the same record written with ``write``, ``--per-turn``
  in each loop turn (the difference from the line above is what writing
  ahead, one write per record, costs);
- ``egress.end`` queued: an allowed CONNECT's second record, written when it
  ends (``EgressEnded.record()``), ``--per-turn`` in each loop turn: a tunnel
  writes this one and the ``egress`` record above;
- ``dns`` queued: a DNS query's record (the ``extra`` fields the DNS server
  adds) written with ``write``, ``--per-turn`` records in each loop turn, as
  the DNS server does when a burst of datagrams arrives;
- a turn of a busy proxy: ``--per-turn`` final records and one record
  written ahead in the same turn, the write-ahead one last.

For each: microseconds of CPU per record (``time.process_time``, so a loaded
machine stretches it less than wall-clock time; the figures are the best of
``--rounds``) and writes per record, counted by the kernel
(``/proc/self/io`` ``syscw``, which counts every write system call of the
process: the figure includes any other write, and there is none here but
the sink's). A write-ahead record costs one write by contract; records
queued in one turn share one write with each other and with a write-ahead
record that follows them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_RECORDS = 1_000_000


@dataclass
class Cost:
    name: str
    records: int
    cpu_us: float  # per record
    writes: float  # per record, or None when /proc/self/io is missing

    def line(self) -> str:
        writes = f"{self.writes:.3f}" if self.writes >= 0 else "?"
        return f"{self.name:<44} {self.records:>8} {self.cpu_us:>8.2f} {writes:>8}"


def _syscw() -> int:
    try:
        with open("/proc/self/io", "rb") as io:
            for line in io:
                if line.startswith(b"syscw:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _facts() -> tuple[Callable[[], object], Callable[[], object], Callable[[], object]]:
    from egressd.audit.records import EgressDecided, EgressEnded, new_request_id
    from egressd.vocabulary.egress import Decision, EgressKind

    def egress() -> EgressDecided:
        return EgressDecided(
            id=new_request_id(),
            ts=time.time(),
            run="default",
            kind=EgressKind.CONNECT,
            client="127.0.0.1:40000",
            host="pypi.org",
            port=443,
            address=None,
            decision=Decision.ALLOW,
            reason=None,
            rule="pypi.org",
            approval=None,
            command=None,
        )

    def dns() -> EgressDecided:
        return EgressDecided(
            id=new_request_id(),
            ts=time.time(),
            run="default",
            kind=EgressKind.DNS,
            client="127.0.0.1:40000",
            host="host1.bench.test",
            port=None,
            address=None,
            decision=Decision.ALLOW,
            reason=None,
            rule=None,
            approval=None,
            command=None,
            bytes_up=0,
            bytes_down=0,
            duration_s=1.2e-05,
            extra={"qtype": "A", "answer": "127.0.0.1", "transport": "udp"},
        )

    def end() -> EgressEnded:
        return EgressEnded(
            id=new_request_id(),
            ts=time.time(),
            run="default",
            address="127.0.0.1",
            bytes_up=64,
            bytes_down=64,
            duration_s=0.000734,
            end="closed",
        )

    return egress, dns, end


async def _measure(records: int, per_turn: int, rounds: int) -> list[Cost]:
    from egressd.audit.log import JsonlAuditSink

    egress, dns, end = _facts()
    turns = max(1, records // per_turn)
    results: list[Cost] = []
    with tempfile.TemporaryDirectory(prefix="egressd-audit-cost-") as tmp:
        sink = JsonlAuditSink(Path(tmp) / "audit.jsonl")

        async def ahead() -> int:
            for _ in range(turns * per_turn):
                sink.write_ahead(egress().record())  # type: ignore[attr-defined]
            return turns * per_turn

        async def egress_queued() -> int:
            for _ in range(turns):
                for _ in range(per_turn):
                    sink.write(egress().record())  # type: ignore[attr-defined]
                await asyncio.sleep(0)
            return turns * per_turn

        async def end_queued() -> int:
            for _ in range(turns):
                for _ in range(per_turn):
                    sink.write(end().record())  # type: ignore[attr-defined]
                await asyncio.sleep(0)
            return turns * per_turn

        async def queued() -> int:
            for _ in range(turns):
                for _ in range(per_turn):
                    sink.write(dns().record())  # type: ignore[attr-defined]
                await asyncio.sleep(0)  # the turn ends: its flush runs
            return turns * per_turn

        async def mixed() -> int:
            for _ in range(turns):
                for _ in range(per_turn):
                    sink.write(dns().record())  # type: ignore[attr-defined]
                sink.write_ahead(egress().record())  # type: ignore[attr-defined]
                await asyncio.sleep(0)
            return turns * (per_turn + 1)

        cases: list[tuple[str, Callable[[], object]]] = [
            ("egress, write_ahead", ahead),
            (f"egress, write, {per_turn} a turn", egress_queued),
            (f"egress.end, write, {per_turn} a turn", end_queued),
            (f"dns, write, {per_turn} a turn", queued),
            (f"{per_turn} write + 1 write_ahead a turn", mixed),
        ]
        for name, case in cases:
            best_cpu, best_writes, count = float("inf"), -1.0, 0
            for _ in range(rounds):
                await asyncio.sleep(0)
                writes_before, cpu_before = _syscw(), time.process_time()
                count = await case()  # type: ignore[misc]
                cpu = (time.process_time() - cpu_before) / count * 1e6
                writes_after = _syscw()
                best_cpu = min(best_cpu, cpu)
                if writes_before >= 0 and writes_after >= 0:
                    best_writes = (writes_after - writes_before) / count
            results.append(Cost(name, count, best_cpu, best_writes))
        sink.close()
    return results


def measure(records: int = 20_000, per_turn: int = 32, rounds: int = 3) -> list[Cost]:
    """The figures of the module docstring, on uvloop when installed."""
    records = max(1, min(records, MAX_RECORDS))
    per_turn = max(1, per_turn)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_measure(records, per_turn, rounds))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_measure(records, per_turn, rounds))


def report(costs: list[Cost]) -> str:
    lines = [f"{'audit record':<44} {'records':>8} {'CPU µs':>8} {'writes':>8}  (per record)"]
    lines.extend(cost.line() for cost in costs)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000, help="records per figure and round")
    parser.add_argument("--per-turn", type=int, default=32, help="records queued in one loop turn")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best is shown")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    print(report(measure(args.records, args.per_turn, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
