"""Queries per second of egressd's sandbox-facing DNS server, beside dnsmasq on loopback.

    .venv/bin/python bench/bench_dns.py [--seconds 10] [--queries 300000] [--inflight 64] [--audit-cost]
    .venv/bin/python bench/bench_dns.py --instructions 5000 [--inflight 16] [--python OTHER/.venv/bin/python]

Both servers answer every A query with one address from no upstream at all:
dnsmasq with ``--address=/#/127.0.0.1`` (Debian's ``dnsmasq-base``, installed
with apt when missing and we are root), egressd with its ``DnsServer`` in a
process of its own, on uvloop when installed, exactly as ``egressd serve``
builds it: the default run, the policy, one JSON Lines audit record per query
written to a file, the reply. Only the per-client rate limit is raised, so
that one load client can saturate the server instead of the limiter.

One load generator (this process, a UDP socket) keeps ``--inflight`` queries
outstanding against each server in turn, cycling through 1000 names, after a
warm-up; each run stops at ``--queries`` answers or ``--seconds``, whichever
comes first. A query unanswered for 0.2 s counts as lost. On a small machine
the client shares the CPU with the server, and with dnsmasq the Python client
may be the bottleneck, so the dnsmasq figure is a floor. Beside each rate, the
server process's CPU time per answered query (``/proc/PID/stat``), which a
loaded machine moves less than the rate, and its write system calls per query
(``/proc/PID/io``: egressd's audit records, one write per loop turn). ``--audit-cost`` then prints what one
audit record costs and the writes per record (``bench/audit_cost.py``).

``--instructions N`` measures instead what does not move with the machine's
load (as ``bench/instructions.py`` does for tunnels and requests): the
egressd server process above under valgrind's cachegrind, started fresh
with ``PYTHONHASHSEED=0`` after a warm-up run (which fills the runs' own
bytecode cache), once idle and once answering N queries (``--inflight`` at a
time, default here 16: each loop turn answers several, as under load, and
writes their records at once); prints the second run's instructions less the
idle run's, per query. ``--python`` serves another build's egressd (its
venv's interpreter runs this file's server) for an A/B comparison, and
``EGRESSD_NATIVE=0`` in the environment the Python audit line. Needs
valgrind; user-space instructions only (the system calls' kernel work is not
counted). Run one count at a time: the figure depends on how many queries a
loop turn finds waiting (each turn costs an epoll wait and an audit write),
and two counts at once on a 2-CPU machine moved it by 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMES = 1000
WARMUP_S = 1.0
LOST_AFTER_S = 0.2
# Safety bounds whatever the flags say: the load loop never runs longer or
# sends more than this.
MAX_SECONDS = 120.0
MAX_QUERIES = 5_000_000


@dataclass
class Result:
    server: str
    answered: int
    lost: int
    seconds: float
    # The server process's CPU time (user + system) while it answered them: less moved by a loaded
    # machine than the rate (None where /proc is missing).
    cpu_s: float | None = None
    # The server process's write system calls meanwhile (/proc/PID/io syscw: write and writev,
    # not sendto): egressd's audit log writes.
    writes: int | None = None

    @property
    def qps(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    @property
    def writes_per_query(self) -> float | None:
        return self.writes / self.answered if self.writes is not None and self.answered else None

    @property
    def cpu_us(self) -> float | None:
        """The server's CPU microseconds per answered query."""
        return self.cpu_s / self.answered * 1e6 if self.cpu_s is not None and self.answered else None


def build_queries() -> list[bytes]:
    from dnslib import DNSRecord

    return [DNSRecord.question(f"host{i}.bench.test", "A").pack() for i in range(NAMES)]


def load(address: tuple[str, int], queries: list[bytes], *, seconds: float, limit: int, inflight: int) -> Result:
    """Keep ``inflight`` queries outstanding until ``limit`` answers or ``seconds``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.connect(address)
    sock.settimeout(LOST_AFTER_S)
    answered = lost = 0
    outstanding = 0
    i = 0
    started = time.perf_counter()
    deadline = started + min(seconds, MAX_SECONDS)
    limit = min(limit, MAX_QUERIES)
    try:
        while answered < limit:
            while outstanding < inflight:
                sock.send(queries[i % len(queries)])
                i += 1
                outstanding += 1
            try:
                sock.recv(4096)
            except TimeoutError:
                lost += outstanding  # on loopback: the server's receive buffer overflowed
                outstanding = 0
            else:
                answered += 1
                outstanding -= 1
            if (answered & 0x3FF) == 0 and time.perf_counter() > deadline:
                break
    finally:
        elapsed = time.perf_counter() - started
        sock.close()
    return Result("", answered, lost, elapsed)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` so far (``/proc/PID/stat``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # After the command's ")": state is field 3, utime and stime are fields 14 and 15 (proc(5)).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_calls(pid: int) -> int | None:
    """Write system calls of process ``pid`` so far (``/proc/PID/io`` ``syscw``), or None."""
    try:
        with open(f"/proc/{pid}/io", "rb") as io:
            for line in io:
                if line.startswith(b"syscw:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def measure(name: str, address: tuple[str, int], queries: list[bytes], args: argparse.Namespace, pid: int) -> Result:
    load(address, queries, seconds=WARMUP_S, limit=args.queries, inflight=args.inflight)
    before, writes_before = cpu_seconds(pid), write_calls(pid)
    result = load(address, queries, seconds=args.seconds, limit=args.queries, inflight=args.inflight)
    after, writes_after = cpu_seconds(pid), write_calls(pid)
    result.server = name
    if before is not None and after is not None:
        result.cpu_s = after - before
    if writes_before is not None and writes_after is not None:
        result.writes = writes_after - writes_before
    return result


def free_port() -> int:
    """A port free on 127.0.0.1 for both UDP and TCP (a DNS server takes both)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            try:
                tcp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free for both UDP and TCP")


def wait_for_dns(address: tuple[str, int], proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    from dnslib import DNSRecord

    probe = DNSRecord.question("probe.bench.test", "A").pack()
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.2)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                said = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                raise RuntimeError(f"the server exited with status {proc.returncode}: {said}")
            sock.sendto(probe, address)
            with contextlib.suppress(TimeoutError, ConnectionRefusedError):
                sock.recv(4096)
                return
    raise RuntimeError(f"no DNS answer from {address} in {timeout_s}s")


def ensure_dnsmasq() -> str | None:
    path = shutil.which("dnsmasq")
    if path:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing dnsmasq-base with apt-get ...", file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "dnsmasq-base"], check=False, env=env, stdout=subprocess.DEVNULL
        )
    return shutil.which("dnsmasq")


def dnsmasq_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    return out.split("\n", 1)[0].replace("Dnsmasq version ", "").split()[0] if out else "?"


@contextlib.contextmanager
def running(cmd: list[str], **kwargs: object):  # type: ignore[no-untyped-def]
    proc = subprocess.Popen(cmd, **kwargs)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench_dnsmasq(queries: list[bytes], args: argparse.Namespace) -> Result | str:
    binary = ensure_dnsmasq()
    if binary is None:
        return "dnsmasq is not installed and could not be (needs root and apt-get)"
    port = free_port()
    cmd = [
        binary,
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--pid-file=",
        "--no-resolv",
        "--no-hosts",
        f"--port={port}",
        "--listen-address=127.0.0.1",
        "--bind-interfaces",
        "--address=/#/127.0.0.1",
        "--user=root" if os.geteuid() == 0 else "--user=",
    ]
    with running(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        wait_for_dns(("127.0.0.1", port), proc)
        return measure(f"dnsmasq {dnsmasq_version(binary)}", ("127.0.0.1", port), queries, args, proc.pid)


def bench_egressd(queries: list[bytes], args: argparse.Namespace) -> Result:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="egressd-bench-") as tmp:
        audit = Path(tmp) / "audit.jsonl"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-egressd", str(port), str(audit)]
        with running(cmd, cwd=ROOT) as proc:
            wait_for_dns(("127.0.0.1", port), proc)
            result = measure("egressd", ("127.0.0.1", port), queries, args, proc.pid)
        records = sum(1 for _ in audit.open("rb"))
    result.server = f"egressd ({_loop_name()}, {records} audit records)"
    return result


# Under cachegrind a query takes a millisecond or more, and start-up half a minute.
INSTRUCTIONS_TIMEOUT_S = 900.0


def count_instructions(queries: list[bytes], python: str, n: int, inflight: int, pycache: str) -> int:
    """Instructions of one cachegrind run of the egressd server answering ``n`` queries (start-up and shutdown too)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="egressd-bench-dns-instr-") as tmp:
        out = Path(tmp) / "cachegrind.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and k != "PYTHONDONTWRITEBYTECODE"}
        if "EGRESSD_NATIVE" in os.environ:  # EGRESSD_NATIVE=0: the Python audit line, for an A/B comparison
            env["EGRESSD_NATIVE"] = os.environ["EGRESSD_NATIVE"]
        env |= {"PYTHONHASHSEED": "0", "PYTHONPYCACHEPREFIX": pycache}
        cmd = [
            "valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
            python, str(Path(__file__).resolve()), "--serve-egressd", str(port), str(Path(tmp) / "audit.jsonl"),
        ]  # fmt: skip
        with running(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
            wait_for_dns(("127.0.0.1", port), proc, timeout_s=INSTRUCTIONS_TIMEOUT_S)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect(("127.0.0.1", port))
                sock.settimeout(INSTRUCTIONS_TIMEOUT_S)
                sent = answered = 0
                while answered < n:  # every query answered: none lost on loopback at this pace
                    while sent < n and sent - answered < inflight:
                        sock.send(queries[sent % len(queries)])
                        sent += 1
                    sock.recv(4096)
                    answered += 1
            proc.send_signal(signal.SIGTERM)
            proc.wait(INSTRUCTIONS_TIMEOUT_S)
        summary = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M)
        if summary is None:
            raise SystemExit("no cachegrind summary (is valgrind installed?)")
        return int(summary[1])


def instructions(queries: list[bytes], args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (apt install valgrind)", file=sys.stderr)
        return 2
    n, inflight = min(args.instructions, MAX_QUERIES), args.inflight or 16
    with tempfile.TemporaryDirectory(prefix="egressd-bench-dns-pycache-") as pycache:
        count_instructions(queries, args.python, 0, inflight, pycache)  # warm-up: compiles what has no .pyc yet
        idle = count_instructions(queries, args.python, 0, inflight, pycache)
        busy = count_instructions(queries, args.python, n, inflight, pycache)
    print(f"egressd DNS server under cachegrind ({args.python}, {_loop_name()})")
    print(f"idle run (start-up and shutdown): {idle:,} instructions")
    per_query = (busy - idle) / n
    print(f"per query ({n} A queries, {inflight} in flight, one audit record each): {per_query:,.0f} instructions")
    return 0


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def serve_egressd(port: int, audit_path: str) -> None:
    """The child process: egressd's DNS server wired as ``egressd serve`` wires it."""
    sys.path.insert(0, str(ROOT))
    from ipaddress import IPv4Address

    from egressd.audit.log import JsonlAuditSink
    from egressd.proxy.core.metrics import Metrics
    from egressd.proxy.core.policy import parse_entry
    from egressd.proxy.core.runs import DEFAULT_RUN_ID, Run, RunRegistry
    from egressd.proxy.net.dnsserver import DnsServer
    from egressd.proxy.net.recorder import Recorder

    async def main() -> None:
        sink = JsonlAuditSink(Path(audit_path))
        recorder = Recorder(audit=sink, metrics=Metrics())
        run = Run(id=DEFAULT_RUN_ID, token="-", task=None, allow=(parse_entry("pypi.org"),), deny=())
        server = DnsServer(
            recorder=recorder,
            runs=RunRegistry(default=run),
            answer4=IPv4Address("127.0.0.1"),
            rate_qps=1e9,
            burst=10**9,
        )
        await server.start("127.0.0.1", port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.close()
        sink.close()

    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring time per server (max 120)")
    parser.add_argument("--queries", type=int, default=300_000, help="stop after this many answers")
    parser.add_argument(
        "--inflight", type=int, default=None, help="queries kept outstanding (64; 16 for --instructions)"
    )
    parser.add_argument(
        "--instructions", type=int, metavar="N", help="count instructions per query over N queries instead (cachegrind)"
    )
    parser.add_argument(
        "--python", default=sys.executable, help="with --instructions: the interpreter whose egressd is served"
    )
    parser.add_argument(
        "--audit-cost", action="store_true", help="also print an audit record's cost (bench/audit_cost.py)"
    )
    parser.add_argument("--serve-egressd", nargs=2, metavar=("PORT", "AUDIT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_egressd:
        serve_egressd(int(args.serve_egressd[0]), args.serve_egressd[1])
        return 0
    sys.path.insert(0, str(ROOT))
    queries = build_queries()
    if args.instructions:
        return instructions(queries, args)
    if args.inflight is None:
        args.inflight = 64
    results: list[Result] = []
    notes: list[str] = []
    dnsmasq = bench_dnsmasq(queries, args)
    if isinstance(dnsmasq, str):
        notes.append(dnsmasq)
    else:
        results.append(dnsmasq)
    results.append(bench_egressd(queries, args))

    print(
        f"DNS on loopback, UDP, A queries, {args.inflight} in flight, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, {platform.machine()}"
    )
    print(
        f"{'server':<44} {'answered':>10} {'lost':>6} {'seconds':>8} {'queries/s':>10} {'CPU µs/q':>9} {'writes/q':>9}"
    )
    for r in results:
        cpu = f"{r.cpu_us:>9.1f}" if r.cpu_us is not None else f"{'?':>9}"
        writes = f"{r.writes_per_query:>9.3f}" if r.writes_per_query is not None else f"{'?':>9}"
        print(f"{r.server:<44} {r.answered:>10} {r.lost:>6} {r.seconds:>8.2f} {r.qps:>10.0f} {cpu} {writes}")
    if len(results) == 2 and results[0].qps:
        print(f"egressd / dnsmasq: {results[1].qps / results[0].qps:.2f}")
    if args.audit_cost:
        # What the records cost the DNS server and the proxy (bench/audit_cost.py), in this process.
        from audit_cost import measure as audit_measure
        from audit_cost import report as audit_report

        print(audit_report(audit_measure()))
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
