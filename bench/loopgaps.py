"""Where the keep-alive tail comes from: egressd's loop turns, stalls, GC pauses and lost cores under load.

    .venv/bin/python bench/loopgaps.py [--workers 1,2] [--seconds 10] [--connections 50]

Starts bench/servers.py's origin on 127.0.0.2 and, for each process count
in ``--workers``, ``egressd serve --workers N`` as bench/run.py starts it
(everything on, serve's default log level), with bench/loopwatch.py loaded
into each of its processes; drives small keep-alive HTTP requests through
it with wrk (one thread, ``--connections``), stops it with SIGTERM and
prints, per process: loop turns and their length (p50, p99, max, how many
over 10 ms), involuntary context switches per second (the scheduler taking
the core: more runnable processes than cores), the longest GC pause, and
the stacks most often seen while a turn ran long; and wrk's p50 and p99.

Issue 30, step 6 ("the keep-alive p99 tail"): bench/RESULTS.md has what it
showed. Every process is started here and stopped by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ORIGIN, PY, free_port, run_wrk, start_egressd, wait_port, wait_serving  # noqa: E402

HERE = Path(__file__).resolve().parent


def percentile(histogram: dict[int, int], fraction: float) -> int:
    """The bucket (whole ms) at ``fraction`` of the turns counted in ``histogram``."""
    total = sum(histogram.values())
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= fraction * total:
            return bucket
    return 0


def describe(report: dict, seconds: float) -> list[str]:  # type: ignore[type-arg]
    """One process's lines: its turns, context switches, GC pauses and the stacks seen in long turns."""
    gaps = {int(k): v for k, v in report["gaps_ms"].items()}
    role = "worker" if any("worker" in part for part in report["argv"]) else "owner"
    longest_gc = max((max(v) for v in report["gc_ms"].values() if v), default=0.0)
    collections = sum(len(v) for v in report["gc_ms"].values())
    lines = [
        f"  {role}: {sum(gaps.values())} turns, length p50 {percentile(gaps, 0.5)} ms, "
        f"p99 {percentile(gaps, 0.99)} ms, max {max(gaps, default=0)} ms, "
        f"{sum(v for k, v in gaps.items() if k >= 10)} over 10 ms; "
        f"{report.get('nonvoluntary_ctxt_switches', 0) / seconds:.0f} involuntary context switches/s; "
        f"{collections} collections under load, longest {longest_gc:.1f} ms; CPU {report['cpu_s']:.1f} s"
    ]
    for stack, count in report["stalls"][:3]:
        lines.append(f"    {count:4d} samples in long turns: {stack}")
    return lines


def measure(workers: int, http_port: int, seconds: int, connections: int, hook: Path) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="bench-loopgaps-") as tmp:
        workdir, out = Path(tmp), Path(tmp) / "reports"
        out.mkdir()
        saved = {key: os.environ.get(key) for key in ("PYTHONPATH", "LOOPWATCH_OUT")}
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), str(HERE), saved["PYTHONPATH"]]))
        os.environ["LOOPWATCH_OUT"] = str(out)
        port = free_port()
        try:
            proc = start_egressd(port, workdir, ("--workers", str(workers)))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        try:
            wait_serving(proc)
            wait_port("127.0.0.1", port)
            wrk = run_wrk(f"http://{ORIGIN}:{http_port}/small", port, proc.pid, seconds, connections)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        lines = [f"--workers {workers}: {wrk['rps']:.0f} req/s, p50 {wrk['p50_ms']:.2f} ms, p99 {wrk['p99_ms']:.2f} ms"]
        for path in sorted(out.glob("*.json")):
            report = json.loads(path.read_text())
            if report["gaps_ms"]:  # a process with no event loop (none expected) says nothing
                lines += describe(report, seconds)
        return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="process counts to measure, comma-separated")
    parser.add_argument("--seconds", type=int, default=10, help="wrk's run for each (1-120)")
    parser.add_argument("--connections", type=int, default=50, help="wrk's keep-alive connections (1-1000)")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    if not 1 <= args.seconds <= 120 or not 1 <= args.connections <= 1000 or not all(1 <= n <= 8 for n in counts):
        parser.error("--seconds 1-120, --connections 1-1000, --workers 1-8 each")
    with tempfile.TemporaryDirectory(prefix="bench-loopwatch-hook-") as hook:
        (Path(hook) / "sitecustomize.py").write_text("import loopwatch  # bench/loopwatch.py\n")
        stream_port, http_port = free_port(ORIGIN), free_port(ORIGIN)
        servers = subprocess.Popen([PY, str(HERE / "servers.py"), ORIGIN, str(stream_port), str(http_port)],
                                   stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert servers.stdout is not None
            if servers.stdout.readline().strip() != "ready":
                raise RuntimeError("test servers did not start")
            for workers in counts:
                print("\n".join(measure(workers, http_port, args.seconds, args.connections, Path(hook))), flush=True)
        finally:
            servers.terminate()
            servers.wait(timeout=15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
