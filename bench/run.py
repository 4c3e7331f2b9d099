"""egressd benchmark: figures through egressd as ratios to a direct connection.

    .venv/bin/python bench/run.py [--rounds 3] [--quick] [--proxies egressd,squid] [--no-dns] [--instructions]

Builds a loopback test bed (test servers on 127.0.0.2 in their own uvloop
process), then for each round starts egressd fresh with its normal features
on (policy check, run attribution, audit log to a file) and measures, in
interleaved order, the direct connection and egressd:

1. tunnel throughput: one CONNECT tunnel, 1 GiB down and 1 GiB up (MB/s);
2. tunnel setup: 2,000 tunnels one after another (CONNECT, one 64-byte echo,
   close), and the same with 50 in flight (tunnels/s, p50/p99 ms), driven by
   a C client against a C echo server (bench/ctools.py: built with ``cc``;
   without one, bench/load.py's Python client);
3. plain HTTP: wrk with 50 keep-alive connections for 10 s, small responses
   (requests/s, p50/p99 ms) and 1 MiB responses (MB/s); small responses again
   with ``Connection: close``, a fresh connection for every request;
4. idle tunnels: the proxy's resident memory per tunnel with 2,000 open;
5. egressd only: tunnel setup (50 in flight) and small HTTP again, just
   before and then while 1,000 requests are held waiting for an approval
   (each round's two measurements are adjacent, in the same process, so
   their ratio is not blurred by drift across the round).

6. egressd only, under strace: its audit-log writes per event-loop turn
   (tunnels 50 in flight, then small plain HTTP);
7. each round, after the proxies: DNS queries/s of egressd's DNS server and
   dnsmasq (bench/bench_dns.py), unless ``--no-dns``; egressd with
   ``--workers 1`` and ``--workers 2`` (small plain HTTP), when it has
   ``--workers``;
8. with ``--instructions``, once at the end: instructions per tunnel and per
   request (bench/instructions.py, cachegrind: minutes).

Along the way it counts the proxy's CPU seconds per tunnel, per request and
per GiB relayed (the table's first rows: on 2 cores a rate is shared with
the load generator, CPU per operation is not) and its write system calls
(``syscw`` of /proc/PID/io) per tunnel and per request. egressd runs at
``serve``'s default log level (a line per decision).

Prints a table of medians with min–max spread and the ratio to direct, and
the CPU seconds used by egressd and by the load generator, so a reader can
see which was saturated; then issue 30's targets (bench/targets.py), one row
each: egressd's median, the comparison's, the ratio, the ratio needed after
its steps 1–6 and the goal of its step 7, and met, not met or not measured
(with why). Every load is bounded in count and
time.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ctools  # noqa: E402
from peers import PEERS, ensure_installed  # noqa: E402
from targets import audit_writes, evaluate, parse_dns  # noqa: E402
from targets import render as render_targets  # noqa: E402

HERE = Path(__file__).resolve().parent
PY = sys.executable
ORIGIN = "127.0.0.2"
GiB = 1 << 30


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {host}:{port}")


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (squid and proxy.py work in child processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process tree, from /proc (clock ticks → seconds)."""
    total = 0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def write_calls(pid: int) -> int:
    """Write system calls made so far by a process tree (``syscw`` of /proc/PID/io: write, writev, pwrite...)."""
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/io").read_text().splitlines():
                if line.startswith("syscw:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def rss_kib(pid: int) -> int:
    """Resident memory of a process tree, KiB."""
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


@dataclass
class Proxy:
    """A proxy under test, started fresh for each round."""

    name: str
    start: Callable[[int, Path], subprocess.Popen]  # type: ignore[type-arg]
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]
    port: int = 0

    def __enter__(self) -> Proxy:
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix=f"bench-{self.name}-")
        self.workdir = Path(self._dir.name)
        self.proc = self.start(self.port, self.workdir)
        if self.proc.stderr is not None:
            wait_serving(self.proc)
        wait_port("127.0.0.1", self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._dir.cleanup()


# Where egressd's webhook channel posts approvals: the bench HTTP server's /hook,
# which answers "later" (202) and never does, so requests for unknown names stay held.
HOOK_URL: list[str] = []
CONTROL_TOKEN = "bench-control-token"
# The C client and echo server for tunnel setup (bench/ctools.py), when they could be built.
C_TOOLS: list[ctools.CTools] = []


def wait_serving(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:  # type: ignore[type-arg]
    """Until egressd says "serving:" (its worker processes serve by then: its port alone accepts before they
    do, and a load started then lands on the first process only), then its stderr is drained unread."""
    assert proc.stderr is not None
    ready = threading.Event()

    def drain() -> None:  # in large reads: the decision lines that follow cost the machine next to nothing
        assert proc.stderr is not None
        fd, seen = proc.stderr.fileno(), b""
        while chunk := os.read(fd, 1 << 20):
            if not ready.is_set():
                seen += chunk
                if b"serving:" in seen:
                    ready.set()
        ready.set()  # it exited: the port check says why

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(timeout_s):
        raise RuntimeError(f"egressd did not say it was serving within {timeout_s:g}s")


def start_egressd(port: int, workdir: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:  # type: ignore[type-arg]
    egressd = str(Path(PY).with_name("egressd"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(workdir)}
    control = free_port()
    (workdir / "control.port").write_text(str(control))
    argv = [egressd, "serve", "--listen", f"127.0.0.1:{port}", "--control", f"127.0.0.1:{control}",
            "--control-token", CONTROL_TOKEN,
            "--allow", f"{ORIGIN}:*", "--allow-private", f"{ORIGIN}/32",
            "--audit-log", str(workdir / "audit.jsonl"),  # at serve's default log level: a line per decision
            "--max-connections-per-run", "100000"]
    if HOOK_URL:
        argv += ["--approver", "webhook", "--webhook-url", HOOK_URL[0],
                 "--webhook-secret", "whsec_" + base64.b64encode(b"bench-webhook-secret-32-bytes!!!").decode(),
                 "--max-pending-approvals", "5000", "--max-approvals-per-run", "5000",
                 "--max-connections", "100000"]
    argv += [*EGRESSD_ARGS, *extra]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def held_requests(workdir: Path) -> int:
    """egressd's held-requests gauge, from its control API."""
    import urllib.request

    port = (workdir / "control.port").read_text().strip()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {CONTROL_TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("egressd_held_requests "):
                return int(float(line.split()[1]))
    return 0


def measure_held(
    figures: dict[str, Figure], proxy: Proxy, pid: int, stream_port: int, http_port: int, quick: bool
) -> None:
    """Figures 2 and 3 just before, then while 1,000 requests are held waiting for an approval."""
    count = 1000
    target = ["--target", f"{ORIGIN}:{stream_port}", "--proxy", f"127.0.0.1:{proxy.port}"]
    setup_args = ["setup", *target, "--count", "500" if quick else "2000", "--concurrency", "50", "--max-s", "60"]
    wrk_s = 3 if quick else 10
    before_setup = run_load(setup_args, pid, 120)["rate"]
    before_http = run_wrk(f"http://{ORIGIN}:{http_port}/small", proxy.port, pid, wrk_s, 50)["rps"]
    load = subprocess.Popen([PY, str(HERE / "load.py"), "hold", "--target", f"{ORIGIN}:{stream_port}",
                             "--proxy", f"127.0.0.1:{proxy.port}", "--count", str(count), "--max-s", "60"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert load.stdin is not None and load.stdout is not None
    try:
        load.stdout.readline()
        deadline = time.monotonic() + 60
        while held_requests(proxy.workdir) < count and time.monotonic() < deadline:
            time.sleep(0.2)
        held = held_requests(proxy.workdir)
        if held < count:
            print(f"bench: only {held} of {count} requests were held", file=sys.stderr)
        r = run_load(setup_args, pid, 120)
        figures["held_setup_50"].add("egressd", r["rate"], r["cpu_s"], r["proxy_cpu_s"])
        figures["held_setup_50_ratio"].add("egressd", r["rate"] / before_setup if before_setup else float("nan"))
        r = run_wrk(f"http://{ORIGIN}:{http_port}/small", proxy.port, pid, wrk_s, 50)
        figures["held_http_small"].add("egressd", r["rps"], r["cpu_s"], r["proxy_cpu_s"])
        figures["held_http_small_ratio"].add("egressd", r["rps"] / before_http if before_http else float("nan"))
    finally:
        load.stdin.write("\n")
        load.stdin.flush()
        load.communicate(timeout=60)


PROXIES = {"egressd": start_egressd, **PEERS}
# More arguments for every egressd started (--egressd-args): e.g. --no-splice, the copying relay.
EGRESSD_ARGS: list[str] = []


def run_load(args: list[str], proxy_pid: int | None, timeout_s: float) -> dict[str, float]:
    before = cpu_seconds(proxy_pid) if proxy_pid else 0.0
    writes_before = write_calls(proxy_pid) if proxy_pid else 0
    out = subprocess.run([PY, str(HERE / "load.py"), *args], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"load.py {' '.join(args)} failed: {out.stderr.strip()[-400:]}")
    result: dict[str, float] = json.loads(out.stdout)
    result["proxy_cpu_s"] = cpu_seconds(proxy_pid) - before if proxy_pid else 0.0
    result["proxy_writes"] = write_calls(proxy_pid) - writes_before if proxy_pid else float("nan")
    return result


def run_c_setup(tools: ctools.CTools, count: int, concurrency: int, proxy_port: int | None,
                proxy_pid: int | None) -> dict[str, float]:
    """Tunnel setup from the C client to the C echo server (bench/ctools.py), as ``run_load`` counts it."""
    before = cpu_seconds(proxy_pid) if proxy_pid else 0.0
    writes_before = write_calls(proxy_pid) if proxy_pid else 0
    result = tools.setup(ORIGIN, count, concurrency, 60, proxy_port)
    result["proxy_cpu_s"] = cpu_seconds(proxy_pid) - before if proxy_pid else 0.0
    result["proxy_writes"] = write_calls(proxy_pid) - writes_before if proxy_pid else float("nan")
    return result


_WRK_LUA = """
wrk.method = "GET"
wrk.path = "{url}"
"""


def run_wrk(
    url: str, proxy_port: int | None, proxy_pid: int | None, seconds: int, connections: int, close: bool = False
) -> dict[str, float]:
    """wrk for ``seconds``; ``close`` sends ``Connection: close``, so every request opens a fresh connection."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as lua:
        lua.write(_WRK_LUA.format(url=url))
    target = f"http://127.0.0.1:{proxy_port}/" if proxy_port else url
    before = cpu_seconds(proxy_pid) if proxy_pid else 0.0
    writes_before = write_calls(proxy_pid) if proxy_pid else 0
    t0 = os.times()
    args = ["wrk", "-t", "1", "-c", str(connections), "-d", f"{seconds}s", "--latency", "--timeout", "5s", target]
    if close:
        args[1:1] = ["-H", "Connection: close"]
    if proxy_port:
        args[1:1] = ["-s", lua.name]
    out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 30)
    t1 = os.times()
    writes = write_calls(proxy_pid) - writes_before if proxy_pid else float("nan")
    os.unlink(lua.name)
    text = out.stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    done = re.search(r"(\d+) requests in", text)
    requests = int(done.group(1)) if done else 0

    def latency_ms(pct: str) -> float:
        m = re.search(rf"\s{pct}%\s+([\d.]+)(us|ms|s)", text)
        if not m:
            return 0.0
        value, unit = float(m.group(1)), m.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    transfer = re.search(r"Transfer/sec:\s+([\d.]+)(\w+)", text)
    scale = {"B": 1e-6, "KB": 1.024e-3, "MB": 1.048576, "GB": 1073.741824}
    mb_s = float(transfer.group(1)) * scale.get(transfer.group(2), 0) if transfer else 0.0
    socket_errors = re.search(r"Socket errors:.*", text)
    if socket_errors:
        print(f"bench: wrk through {target}{' (Connection: close)' if close else ''}: {socket_errors.group(0)}",
              file=sys.stderr)
    errors = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    if errors and int(errors.group(1)) > 0:
        raise RuntimeError(f"wrk saw {errors.group(1)} non-2xx responses through {target}")
    return {
        "rps": rps,
        "p50_ms": latency_ms("50"),
        "p99_ms": latency_ms("99"),
        "mb_s": mb_s,
        "cpu_s": (t1.children_user + t1.children_system) - (t0.children_user + t0.children_system),
        "proxy_cpu_s": cpu_seconds(proxy_pid) - before if proxy_pid else 0.0,
        "requests": requests,
        "proxy_writes_per_request": writes / requests if requests else float("nan"),
    }


@dataclass
class Figure:
    name: str
    unit: str
    values: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, who: str, value: float, load_cpu: float = 0.0, proxy_cpu: float = 0.0) -> None:
        self.values.setdefault(who, []).append(value)
        self.cpu.setdefault(who, []).append((proxy_cpu, load_cpu))


def measure_round(
    figures: dict[str, Figure], who: str, proxy: Proxy | None, stream_port: int, http_port: int, quick: bool
) -> None:
    proxy_args = ["--proxy", f"127.0.0.1:{proxy.port}"] if proxy else []
    pid = proxy.proc.pid if proxy and proxy.proc else None
    target = ["--target", f"{ORIGIN}:{stream_port}"]
    nbytes = str(GiB // 8 if quick else GiB)
    for direction in ("down", "up"):
        r = run_load(
            ["throughput", *target, *proxy_args, "--direction", direction, "--bytes", nbytes, "--max-s", "120"],
            pid,
            200,
        )
        figures[f"tput_{direction}"].add(who, r["mb_s"], r["cpu_s"], r["proxy_cpu_s"])
        if pid is not None:
            figures["cpu_per_gib_s"].add(who, r["proxy_cpu_s"] / (int(nbytes) / GiB))
    count = 500 if quick else 2000
    for conc, key in ((1, "setup_serial"), (50, "setup_50")):
        if C_TOOLS:
            r = run_c_setup(C_TOOLS[0], count, conc, proxy.port if proxy else None, pid)
        else:
            r = run_load(["setup", *target, *proxy_args, "--count", str(count), "--concurrency", str(conc),
                          "--max-s", "60"], pid, 120)  # fmt: skip
        figures[key].add(who, r["rate"], r["cpu_s"], r["proxy_cpu_s"])
        figures[key + "_p50"].add(who, r["p50_ms"])
        figures[key + "_p99"].add(who, r["p99_ms"])
        if pid is not None and r["tunnels"]:
            per_tunnel = "cpu_per_tunnel_us" if key == "setup_serial" else "cpu_per_tunnel_50_us"
            figures[per_tunnel].add(who, r["proxy_cpu_s"] / r["tunnels"] * 1e6)
            figures[key + "_writes"].add(who, r["proxy_writes"] / r["tunnels"])
    if proxy is not None and pid is not None:
        figures["idle_kib"].add(who, measure_idle(proxy, pid, stream_port, 500 if quick else 2000))
    seconds = 3 if quick else 10
    r = run_wrk(f"http://{ORIGIN}:{http_port}/small", proxy.port if proxy else None, pid, seconds, 50)
    figures["http_small"].add(who, r["rps"], r["cpu_s"], r["proxy_cpu_s"])
    figures["http_small_p50"].add(who, r["p50_ms"])
    figures["http_small_p99"].add(who, r["p99_ms"])
    figures["http_small_writes"].add(who, r["proxy_writes_per_request"])
    if pid is not None and r["requests"]:
        figures["cpu_per_request_us"].add(who, r["proxy_cpu_s"] / r["requests"] * 1e6)
    r = run_wrk(f"http://{ORIGIN}:{http_port}/small", proxy.port if proxy else None, pid, seconds, 50, close=True)
    figures["http_close"].add(who, r["rps"], r["cpu_s"], r["proxy_cpu_s"])
    figures["http_close_p99"].add(who, r["p99_ms"])
    r = run_wrk(f"http://{ORIGIN}:{http_port}/big", proxy.port if proxy else None, pid, seconds, 50)
    figures["http_big"].add(who, r["mb_s"], r["cpu_s"], r["proxy_cpu_s"])
    if who == "egressd" and proxy is not None and pid is not None:
        measure_held(figures, proxy, pid, stream_port, http_port, quick)
        measure_audit(figures, proxy, pid, stream_port, http_port, quick)


def measure_audit(
    figures: dict[str, Figure], proxy: Proxy, pid: int, stream_port: int, http_port: int, quick: bool
) -> None:
    """egressd's audit-log writes per event-loop turn, under strace (a figure of its own: strace slows it).

    Two windows with strace attached: tunnels (50 in flight), then small
    plain-HTTP requests (wrk, 50 connections). In each, every write to the
    audit log is counted, and every epoll wait (one per loop turn); the target
    is at most one audit write in any turn of either.
    """
    if shutil.which("strace") is None:
        NOT_MEASURED["audit_writes_per_turn_max"] = "strace is not installed"
        return
    audit = proxy.workdir / "audit.jsonl"

    def records() -> int:
        try:
            with audit.open("rb") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def tunnels() -> None:
        run_load(["setup", "--target", f"{ORIGIN}:{stream_port}", "--proxy", f"127.0.0.1:{proxy.port}",
                  "--count", "200" if quick else "1000", "--concurrency", "50", "--max-s", "60"], pid, 120)

    def requests() -> None:
        run_wrk(f"http://{ORIGIN}:{http_port}/small", proxy.port, pid, 1 if quick else 3, 50)

    most = 0
    for name, load in (("tunnels", tunnels), ("http", requests)):
        trace = proxy.workdir / f"strace-{name}.txt"
        before = records()
        strace = subprocess.Popen(
            ["strace", "-f", "-qq", "-y", "-s", "0", "-o", str(trace), "-p", str(pid),
             "-e", "trace=/^(write|writev|pwrite64|pwritev2?|epoll_p?wait2?)$"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            time.sleep(1.0)  # attached by then (an idle loop writes nothing to show it)
            if strace.poll() is not None:
                said = (strace.stderr.read() if strace.stderr else "").strip()[-200:]
                NOT_MEASURED["audit_writes_per_turn_max"] = f"strace failed: {said}"
                return
            load()
            time.sleep(0.2)  # the last turn's flush
        finally:
            strace.send_signal(signal.SIGINT)  # detaches; egressd runs on
            try:
                strace.wait(timeout=15)
            except subprocess.TimeoutExpired:
                strace.kill()
                strace.wait()
        counted = audit_writes(trace.read_text(errors="replace"), str(audit))
        written = records() - before
        most = max(most, counted.max_per_turn)
        figures[f"audit_{name}_records"].add("egressd", written)
        figures[f"audit_{name}_writes"].add("egressd", counted.writes)
        figures[f"audit_{name}_turns_with_writes"].add("egressd", counted.turns_with_writes)
        figures[f"audit_{name}_max_per_turn"].add("egressd", counted.max_per_turn)
    figures["audit_writes_per_turn_max"].add("egressd", most)


def measure_idle(proxy: Proxy, pid: int, stream_port: int, count: int) -> float:
    """KiB of proxy memory per idle tunnel: RSS with ``count`` tunnels open minus before."""
    time.sleep(0.5)
    before = rss_kib(pid)
    load = subprocess.Popen([PY, str(HERE / "load.py"), "idle", "--target", f"{ORIGIN}:{stream_port}",
                             "--proxy", f"127.0.0.1:{proxy.port}", "--count", str(count), "--max-s", "60"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert load.stdin is not None and load.stdout is not None
    first = load.stdout.readline().split()
    opened = int(first[1]) if len(first) == 2 and first[0] == "open" else 0
    time.sleep(1.0)
    during = rss_kib(pid)
    load.stdin.write("\n")
    load.stdin.flush()
    out, _ = load.communicate(timeout=120)
    result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"alive": 0}
    if not opened or result.get("alive") != opened:
        print(
            f"bench: idle tunnels through {proxy.name}: {result.get('alive')} of {opened} still echoed", file=sys.stderr
        )
    return (during - before) / opened if opened else float("nan")


FIGURES = [
    # The proxy's CPU per operation first: on 2 cores the rates below are shared with the load generator.
    ("cpu_per_tunnel_us", "proxy CPU per tunnel, one after another", "µs"),
    ("cpu_per_tunnel_50_us", "proxy CPU per tunnel, 50 in flight", "µs"),
    ("cpu_per_request_us", "proxy CPU per small HTTP request", "µs"),
    ("cpu_per_gib_s", "proxy CPU per GiB relayed", "s"),
    ("tput_down", "tunnel throughput, 1 GiB down", "MB/s"),
    ("tput_up", "tunnel throughput, 1 GiB up", "MB/s"),
    ("setup_serial", "tunnel setup, one after another", "tunnels/s"),
    ("setup_serial_p50", "  p50 CONNECT-to-first-echo", "ms"),
    ("setup_serial_p99", "  p99 CONNECT-to-first-echo", "ms"),
    ("setup_serial_writes", "  proxy write system calls per tunnel", "calls"),
    ("setup_50", "tunnel setup, 50 in flight", "tunnels/s"),
    ("setup_50_p50", "  p50 CONNECT-to-first-echo", "ms"),
    ("setup_50_p99", "  p99 CONNECT-to-first-echo", "ms"),
    ("setup_50_writes", "  proxy write system calls per tunnel", "calls"),
    ("idle_kib", "idle tunnels: proxy memory per tunnel", "KiB"),
    ("http_small", "plain HTTP, small responses, 50 conns", "req/s"),
    ("http_small_p50", "  p50 latency", "ms"),
    ("http_small_p99", "  p99 latency", "ms"),
    ("http_small_writes", "  proxy write system calls per request", "calls"),
    ("http_close", "plain HTTP, small, a fresh connection each", "req/s"),
    ("http_close_p99", "  p99 latency", "ms"),
    ("http_big", "plain HTTP, 1 MiB responses, 50 conns", "MB/s"),
    ("held_setup_50", "with 1,000 held: tunnel setup, 50 in flight", "tunnels/s"),
    ("held_http_small", "with 1,000 held: plain HTTP, small", "req/s"),
]
# Per round: the figure with 1,000 held / the same figure just before (not in the table).
HELD_RATIOS = (("held_setup_50_ratio", "tunnel setup, 50 in flight"), ("held_http_small_ratio", "plain HTTP, small"))


LOWER_IS_BETTER = {"ms", "KiB", "µs", "calls", "s"}

# Figures measured for the targets (bench/targets.py) but not rows of the main table.
TARGET_FIGURES = (
    "audit_writes_per_turn_max", "dns_qps", "http_small_w1", "http_small_w2",
    *(f"audit_{name}_{what}" for name in ("tunnels", "http")
      for what in ("records", "writes", "turns_with_writes", "max_per_turn")),
)  # fmt: skip
# Why a figure (or a whole peer) was not measured, by figure name or peer: the targets table says so.
NOT_MEASURED: dict[str, str] = {}


# Wide enough for "15213 (10190–16551)" and "23.19 (22.93–24.31)".
_CELL = 22


def render(figures: dict[str, Figure], order: list[str]) -> str:
    lines = []
    header = (f"| {'figure':42} | {'unit':9} |" + "".join(f" {who:>{_CELL}} |" for who in order)
              + " egressd/direct | egressd/best peer |")
    lines.append(header)
    lines.append(
        "|" + "-" * 44 + "|" + "-" * 11 + "|"
        + "".join("-" * (_CELL + 2) + "|" for _ in order)
        + "-" * 16 + "|" + "-" * 19 + "|"
    )
    for key, title, unit in FIGURES:
        fig = figures[key]
        cells = []
        medians = {}
        for who in order:
            vals = [v for v in fig.values.get(who, []) if v == v]  # drop NaN
            if not vals:
                cells.append(f" {'-':>{_CELL}} |")
                continue
            med = statistics.median(vals)
            medians[who] = med
            precision = 2 if unit in LOWER_IS_BETTER else 0
            cell = f"{med:.{precision}f} ({min(vals):.{precision}f}–{max(vals):.{precision}f})"
            cells.append(f" {cell:>{_CELL}} |")  # never cut: a wide value widens its row
        ratio_direct = ratio_peer = ""
        ours = medians.get("egressd")
        if ours is not None and medians.get("direct"):
            ratio_direct = f"{ours / medians['direct']:.2f}×"
        peers = [v for who, v in medians.items() if who not in ("direct", "egressd")]
        if ours is not None and peers:
            best = min(peers) if unit in LOWER_IS_BETTER else max(peers)
            if best:
                ratio_peer = f"{ours / best:.2f}×"
        lines.append(f"| {title:42} | {unit:9} |" + "".join(cells) + f" {ratio_direct:>14} | {ratio_peer:>17} |")
    for key, title in HELD_RATIOS:
        ratios = [v for v in figures[key].values.get("egressd", []) if v == v]
        if ratios:
            lines.append(f"held approvals: egressd {title} with 1,000 held / just before = "
                         f"{statistics.median(ratios):.2f}× (per round {min(ratios):.2f}–{max(ratios):.2f})")
    lines.append("")
    lines.append("CPU seconds per measurement (median; proxy / load generator):")
    for key in ("tput_down", "tput_up", "setup_serial", "setup_50", "http_small", "http_big"):  # idle has no load
        fig = figures[key]
        parts = []
        for who in order:
            samples = fig.cpu.get(who, [])
            if samples:
                parts.append(
                    f"{who} {statistics.median(p for p, _ in samples):.2f} / "
                    f"{statistics.median(c for _, c in samples):.2f}"
                )
        lines.append(f"  {key:14} " + ";  ".join(parts))
    return "\n".join(lines)


def measure_dns(figures: dict[str, Figure], quick: bool) -> None:
    """bench/bench_dns.py as it is (dnsmasq, then egressd's DNS server), once per round."""
    args = [PY, str(HERE / "bench_dns.py"), "--seconds", "2" if quick else "10"]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        NOT_MEASURED["dns_qps"] = "bench_dns.py overran 300 s"
        return
    found = parse_dns(out.stdout)
    for who, qps in found.items():
        figures["dns_qps"].add(who, qps)
    notes = [line.removeprefix("note: ") for line in out.stdout.splitlines() if line.startswith("note: ")]
    if "dnsmasq" not in found:
        NOT_MEASURED["dnsmasq"] = notes[0] if notes else f"bench_dns.py printed no dnsmasq row {out.stderr[-200:]!r}"
    if "egressd" not in found:
        said = out.stderr.strip()[-200:]
        NOT_MEASURED["dns_qps"] = f"bench_dns.py printed no egressd row (status {out.returncode}): {said!r}"


def egressd_has_workers() -> bool:
    out = subprocess.run([str(Path(PY).with_name("egressd")), "serve", "--help"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    return "--workers" in out.stdout


def measure_workers(figures: dict[str, Figure], http_port: int, quick: bool, rnd: int = 0) -> None:
    """Small plain-HTTP requests through egressd with --workers 1 and 2, each started fresh.

    The order alternates from round to round, so the first of the two is not always the same.
    """
    for n in (1, 2) if rnd % 2 == 0 else (2, 1):
        def start(port: int, workdir: Path, n: int = n) -> subprocess.Popen:  # type: ignore[type-arg]
            return start_egressd(port, workdir, ("--workers", str(n)))

        with Proxy("egressd", start) as proxy:
            assert proxy.proc is not None
            r = run_wrk(f"http://{ORIGIN}:{http_port}/small", proxy.port, proxy.proc.pid, 3 if quick else 10, 50)
            figures[f"http_small_w{n}"].add("egressd", r["rps"], r["cpu_s"], r["proxy_cpu_s"])


def measure_instructions(quick: bool) -> list[str]:
    """bench/instructions.py's per-tunnel and per-request lines (cachegrind: minutes)."""
    n = "200" if quick else "1000"
    try:
        out = subprocess.run([PY, str(HERE / "instructions.py"), "--tunnels", n, "--requests", n],
                             capture_output=True, text=True, timeout=4 * 900 + 60)  # fmt: skip
    except subprocess.TimeoutExpired:
        return ["instructions: not measured: bench/instructions.py overran"]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("per tunnel", "per small"))]
    if out.returncode != 0 or not lines:
        return [f"instructions: not measured: {(out.stderr or out.stdout).strip()[-300:]}"]
    return [f"instructions {line}" for line in lines]


def medians_of(figures: dict[str, Figure]) -> dict[str, dict[str, float]]:
    """``{who: {figure: median over rounds}}``, NaN left out."""
    out: dict[str, dict[str, float]] = {}
    for key, fig in figures.items():
        for who, values in fig.values.items():
            kept = [v for v in values if v == v]
            if kept:
                out.setdefault(who, {})[key] = statistics.median(kept)
    return out


def beside(medians: dict[str, dict[str, float]], order: list[str]) -> list[str]:
    """The figures printed beside the targets table: the audit writes and the write calls behind them."""
    ours = medians.get("egressd", {})
    lines = []
    for name, what in (("tunnels", "tunnels 50 in flight"), ("http", "small plain HTTP, 50 connections")):
        if f"audit_{name}_writes" in ours:
            records, writes = ours[f"audit_{name}_records"], ours[f"audit_{name}_writes"]
            lines.append(
                f"audit log under strace, {what}: {records:.0f} records in {writes:.0f} writes "
                f"({records / writes if writes else float('nan'):.2f} records per write), "
                f"{ours[f'audit_{name}_turns_with_writes']:.0f} loop turns wrote, "
                f"at most {ours[f'audit_{name}_max_per_turn']:.0f} in one turn (medians)"
            )
    for key, what in (("setup_serial_writes", "per tunnel"), ("http_small_writes", "per keep-alive request")):
        parts = [f"{who} {medians[who][key]:.2f}" for who in order if key in medians.get(who, {})]
        if parts:
            lines.append(f"write system calls (/proc/PID/io syscw) {what}: " + ", ".join(parts))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, help="rounds to take medians over (default: 3; with --quick, 1)")
    parser.add_argument("--quick", action="store_true", help="one round, short runs (a smoke test)")
    parser.add_argument("--proxies", default=",".join(PROXIES), help=f"which to measure (default: {','.join(PROXIES)})")
    parser.add_argument("--no-dns", action="store_true", help="leave out the DNS measurement (bench/bench_dns.py)")
    parser.add_argument("--egressd-args", default="", metavar="ARGS",
                        help="more arguments for egressd serve, split on spaces (e.g. --no-splice: the copying relay)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per tunnel and per request (bench/instructions.py; minutes)")
    args = parser.parse_args()
    EGRESSD_ARGS[:] = args.egressd_args.split()
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    chosen = [p.strip() for p in args.proxies.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PROXIES]
    if unknown:
        parser.error(f"unknown proxies {unknown}; known: {', '.join(PROXIES)}")
    unavailable = ensure_installed(["wrk", *chosen])
    if shutil.which("wrk") is None:
        print("bench: wrk is needed (apt-get install wrk)", file=sys.stderr)
        return 1
    for name in unavailable:
        print(f"bench: {name} could not be installed; leaving it out", file=sys.stderr)
        chosen.remove(name)
        NOT_MEASURED[name] = f"{name} could not be installed"
    for name in PROXIES:
        NOT_MEASURED.setdefault(name, f"{name} not in --proxies")
    if args.no_dns:
        NOT_MEASURED["dns_qps"] = "--no-dns"
    workers = "egressd" in chosen and egressd_has_workers()
    if not workers:
        NOT_MEASURED["http_small_w2"] = "no --workers" if "egressd" in chosen else "egressd not in --proxies"
    elif (os.cpu_count() or 1) < 2:
        workers = False
        NOT_MEASURED["http_small_w2"] = "fewer than 2 cores"

    built = ctools.build()
    if built is not None:
        built.start_echo(ORIGIN)
        C_TOOLS.append(built)
    stream_port, http_port = free_port(ORIGIN), free_port(ORIGIN)
    HOOK_URL.append(f"http://{ORIGIN}:{http_port}/hook")
    servers = subprocess.Popen(
        [PY, str(HERE / "servers.py"), ORIGIN, str(stream_port), str(http_port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert servers.stdout is not None
        if servers.stdout.readline().strip() != "ready":
            raise RuntimeError("test servers did not start")
        figures = {key: Figure(key, unit) for key, _, unit in FIGURES}
        figures.update({key: Figure(key, "×") for key, _ in HELD_RATIOS})
        figures.update({key: Figure(key, "") for key in TARGET_FIGURES})
        order = ["direct", *chosen]
        for rnd in range(args.rounds):
            for who in order:
                print(f"round {rnd + 1}/{args.rounds}: {who}", file=sys.stderr, flush=True)
                if who == "direct":
                    measure_round(figures, who, None, stream_port, http_port, args.quick)
                else:
                    with Proxy(who, PROXIES[who]) as proxy:
                        measure_round(figures, who, proxy, stream_port, http_port, args.quick)
            if workers:
                print(f"round {rnd + 1}/{args.rounds}: egressd --workers 1, 2", file=sys.stderr, flush=True)
                measure_workers(figures, http_port, args.quick, rnd)
            if not args.no_dns:
                print(f"round {rnd + 1}/{args.rounds}: DNS (bench_dns.py)", file=sys.stderr, flush=True)
                measure_dns(figures, args.quick)
    finally:
        servers.terminate()
        servers.wait()
        for tools in C_TOOLS:
            tools.close()
    instructions = []
    if args.instructions:
        print("instructions (bench/instructions.py under cachegrind)", file=sys.stderr, flush=True)
        instructions = measure_instructions(args.quick)
    print(f"egressd benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()}: {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, {args.rounds} rounds{' (quick)' if args.quick else ''}; "
          "medians (min–max)")
    print(render(figures, order))
    for name in PROXIES:  # a peer measured is a peer with figures, whatever was said before
        if name in chosen:
            NOT_MEASURED.pop(name, None)
    medians = medians_of(figures)
    print()
    driver = "the C client (bench/c/tunnels.c)" if C_TOOLS else "bench/load.py (no C compiler)"
    print(f"issue 30's targets: egressd's median against the comparison's, {args.rounds} rounds"
          f"{' (quick)' if args.quick else ''}; tunnel setup driven by {driver}")
    print(render_targets(evaluate(medians, NOT_MEASURED)))
    for line in beside(medians, order) + instructions:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
