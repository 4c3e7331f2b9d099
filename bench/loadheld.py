"""Load held: egressd carrying idle tunnels and held approvals, against itself unloaded.

    .venv/bin/python bench/loadheld.py [--idle 10000] [--held 1000] [--seconds 10] [--concurrency 50]

Starts a loopback origin (bench/servers.py's stream and HTTP servers on
127.0.0.2, in a process of its own) and ``egressd serve`` of this checkout on
port-0 listeners, with the webhook approver pointed at a hook receiver there
that answers 202 ("later") and never decides, then:

1. steady allowed traffic, unloaded: half the workers send plain HTTP requests
   on keep-alive connections, half open a CONNECT tunnel, echo 64 bytes and
   close; throughput and p50/p99 latency of each;
2. opens ``--idle`` CONNECT tunnels to the origin's echo server and leaves
   them idle (egressd's RSS growth / tunnels = memory per idle tunnel);
3. sends ``--held`` CONNECTs for distinct unknown names, each held for an
   approval (egressd's ``egressd_held_requests`` gauge must reach the count);
4. the same traffic again, under that load;
5. checks no held request was answered while held, denies every one through
   the control API (``POST /approvals/ID/deny``), checks each got its answer
   (403) and each idle tunnel still echoes, closes everything;
6. checks egressd's open descriptors (``/proc/PID/fd``) and asyncio tasks
   (``egressd_tasks`` on ``/metrics``) come back to the baseline taken before
   step 1, within the tolerances printed, and notes its RSS.

Steps 2-6 run ``--cycles`` times (default 2) in the same egressd, then step 1
once more. Throughput and latency are printed as the mean of the loaded runs
over the mean of the two unloaded ones. RSS does not come back to the
baseline (the allocator keeps its high-water mark), so the check on it is
that a second identical cycle does not grow it by more than the tolerance
printed: a leak per tunnel or per approval would.

egressd runs with its defaults otherwise (log level info: a line per
decision on stderr, to a file here; an audit record per connection).
Every process is started here and stopped by its pid; every loop is bounded in
count and time. Descriptors: egressd needs two per tunnel, so the bench raises
its own RLIMIT_NOFILE (the hard limit too, when it may) and ``egressd serve``
raises its soft limit to the hard one; when the hard limit is too low for the
counts asked, it says so and uses fewer idle tunnels. ``--json`` prints the
figures as one JSON object (the last line), for tests/integration/proxy/test_load_held.py.
Exit status 1 when a hard property failed.

The child roles (``origin``, ``hold``, ``traffic``) are this file run again
with that first argument.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
ORIGIN = "127.0.0.2"
CONTROL_TOKEN = "bench-loadheld-control-token"
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"bench-webhook-secret-32-bytes!!!").decode()
IP_BIND_ADDRESS_NO_PORT = 24  # linux/in.h: pick the port at connect(), per destination
# Descriptors egressd holds besides its tunnels: listeners, audit log, control API, epoll, a margin.
FD_MARGIN = 400
# What "back to baseline" allows, after everything is closed.
FD_TOLERANCE = 2
TASK_TOLERANCE = 2


# -- shared --------------------------------------------------------------------------------------


def raise_own_nofile(need: int) -> tuple[int, int]:
    """Raise this process's open-file limit: soft to ``need`` or the hard limit; the hard one too when allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        try:  # root (CAP_SYS_RESOURCE) may raise the hard limit, up to fs.nr_open
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            return need, need
        except (ValueError, OSError):
            pass
    target = hard if hard != resource.RLIM_INFINITY else max(soft, need)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft, hard


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- child: origin -------------------------------------------------------------------------------


class Hook(asyncio.Protocol):
    """A webhook receiver that will answer later (and never does): 202, then it closes the connection.

    Closing keeps egressd's webhook client from pooling idle keep-alive connections (aiohttp drops
    them only 15-30 s later), which would blur whether egressd's descriptors came back.
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", self.buf[:end])
        if len(self.buf) >= end + 4 + (int(length[1]) if length else 0):
            self.transport.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.transport.close()


async def origin_main() -> None:
    """bench/servers.py's servers and a hook on port 0 of 127.0.0.2; prints "ready STREAM HTTP HOOK"; ends on EOF."""
    sys.path.insert(0, str(HERE))
    from servers import Http, Stream

    loop = asyncio.get_running_loop()
    stream = await loop.create_server(Stream, ORIGIN, 0, backlog=4096)
    http = await loop.create_server(Http, ORIGIN, 0, backlog=4096)
    hook = await loop.create_server(Hook, ORIGIN, 0, backlog=4096)
    ports = [s.sockets[0].getsockname()[1] for s in (stream, http, hook)]
    print("ready", *ports, flush=True)
    async with stream, http, hook:
        await loop.run_in_executor(None, sys.stdin.read)


# -- child: hold (idle tunnels and held requests) ------------------------------------------------


def _client_socket(source: str | None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if source is not None:
        sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((source, 0))
    return sock


async def _read_head(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    head = b""
    while b"\r\n\r\n" not in head:
        data = await loop.sock_recv(sock, 4096)
        if not data:
            break
        head += data
    return head


async def _tunnel(proxy: tuple[str, int], target: str, source: str | None) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = _client_socket(source)
    try:
        await loop.sock_connect(sock, proxy)
        await loop.sock_sendall(sock, f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = await _read_head(sock)
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"CONNECT refused: {head[:80]!r}")
    except BaseException:
        sock.close()
        raise
    return sock


async def hold_main(args: argparse.Namespace) -> None:
    """Commands on stdin, one JSON line of answer each: open, hold, peek, collect, close."""
    loop = asyncio.get_running_loop()
    proxy = _hostport(args.proxy)
    sources = [None] if args.sources <= 1 else [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(args.sources)]
    idle: list[socket.socket] = []
    held: list[socket.socket] = []

    def say(obj: dict[str, Any]) -> None:
        print(json.dumps(obj), flush=True)

    async def open_idle() -> dict[str, Any]:
        errors: list[str] = []
        sem = asyncio.Semaphore(100)
        deadline = time.monotonic() + args.max_s

        async def one(i: int) -> None:
            async with sem:
                if time.monotonic() > deadline:
                    errors.append("deadline")
                    return
                try:
                    sock = await _tunnel(proxy, args.target, sources[i % len(sources)])
                    await loop.sock_sendall(sock, b"echo\n")
                    idle.append(sock)
                except OSError as exc:
                    errors.append(repr(exc))

        await asyncio.gather(*(one(i) for i in range(args.idle)))
        return {"idle": len(idle), "errors": len(errors), "first_error": errors[0] if errors else None}

    async def send_held() -> dict[str, Any]:
        deadline = time.monotonic() + args.max_s
        for i in range(args.held):
            if time.monotonic() > deadline:
                break
            name = f"h{i}.cycle{args.cycle}.test:443"  # a denial sticks to cycleN.test
            sock = _client_socket(sources[i % len(sources)])
            try:
                await loop.sock_connect(sock, proxy)
                await loop.sock_sendall(
                    sock,
                    f"CONNECT {name} HTTP/1.1\r\nHost: {name}\r\n\r\n".encode(),
                )
            except OSError:
                sock.close()
                continue
            held.append(sock)
        return {"held": len(held)}

    def peek() -> dict[str, Any]:
        answered = 0
        for sock in held:
            try:
                sock.recv(1, socket.MSG_PEEK)  # data or EOF (b""): either way no longer held
                answered += 1
            except BlockingIOError:
                continue
            except OSError:
                answered += 1
        return {"answered_while_held": answered}

    async def collect() -> dict[str, Any]:
        statuses: dict[str, int] = {}

        async def answer(sock: socket.socket) -> None:
            try:
                async with asyncio.timeout(args.answer_s):
                    head = await _read_head(sock)
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                key = line.split(" ")[1] if line.count(" ") >= 1 else "closed"
            except TimeoutError:
                key = "no answer"
            except OSError:
                key = "reset"
            statuses[key] = statuses.get(key, 0) + 1

        await asyncio.gather(*(answer(s) for s in held))
        alive = 0

        async def ping(sock: socket.socket) -> None:
            nonlocal alive
            try:
                await loop.sock_sendall(sock, b"ping")
                got = b""
                async with asyncio.timeout(args.answer_s):
                    while len(got) < 4:
                        data = await loop.sock_recv(sock, 16)
                        if not data:
                            break
                        got += data
                alive += got == b"ping"
            except (OSError, TimeoutError):
                pass

        sem = asyncio.Semaphore(200)

        async def bounded(sock: socket.socket) -> None:
            async with sem:
                await ping(sock)

        await asyncio.gather(*(bounded(s) for s in idle))
        return {"held_statuses": statuses, "idle_alive": alive}

    try:
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line == "open":
                say(await open_idle())
            elif line == "hold":
                say(await send_held())
            elif line == "peek":
                say(peek())
            elif line == "collect":
                say(await collect())
            else:  # "close" or EOF
                break
    finally:
        for sock in idle + held:
            sock.close()
        say({"closed": len(idle) + len(held)})


# -- child: traffic ------------------------------------------------------------------------------


async def traffic_main(args: argparse.Namespace) -> dict[str, Any]:
    """Steady allowed traffic for --seconds: half the workers HTTP on keep-alive, half tunnel setup + echo."""
    loop = asyncio.get_running_loop()
    proxy = _hostport(args.proxy)
    http_latency: list[float] = []
    tunnel_latency: list[float] = []
    errors: list[str] = []
    budget = args.max_requests
    deadline = time.perf_counter() + args.seconds
    request = f"GET http://{args.http}/small HTTP/1.1\r\nHost: {args.http}\r\n\r\n".encode()
    message = b"x" * 64

    def take() -> bool:
        nonlocal budget
        if budget <= 0 or time.perf_counter() > deadline:
            return False
        budget -= 1
        return True

    async def http_worker() -> None:
        sock: socket.socket | None = None
        buf = b""
        while take():
            t0 = time.perf_counter()
            try:
                if sock is None:
                    sock = _client_socket(None)
                    await loop.sock_connect(sock, proxy)
                    buf = b""
                await loop.sock_sendall(sock, request)
                while b"\r\n\r\n" not in buf:
                    data = await loop.sock_recv(sock, 65536)
                    if not data:
                        raise ConnectionError("proxy closed the connection")
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                if b" 200 " not in head.split(b"\r\n", 1)[0]:
                    raise ConnectionError(f"status {head[:40]!r}")
                length = int(re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)[1])  # type: ignore[index]
                while len(buf) < length:
                    data = await loop.sock_recv(sock, 65536)
                    if not data:
                        raise ConnectionError("closed in the body")
                    buf += data
                buf = buf[length:]
            except (OSError, TypeError) as exc:
                errors.append(f"http: {exc!r}")
                if sock is not None:
                    sock.close()
                sock = None
                continue
            http_latency.append(time.perf_counter() - t0)
        if sock is not None:
            sock.close()

    async def tunnel_worker() -> None:
        while take():
            t0 = time.perf_counter()
            try:
                sock = await _tunnel(proxy, args.stream, None)
                try:
                    await loop.sock_sendall(sock, b"echo\n" + message)
                    got = b""
                    while len(got) < len(message):
                        data = await loop.sock_recv(sock, 256)
                        if not data:
                            raise ConnectionError("closed before the echo")
                        got += data
                finally:
                    sock.close()
            except OSError as exc:
                errors.append(f"tunnel: {exc!r}")
                continue
            tunnel_latency.append(time.perf_counter() - t0)

    http_workers = max(1, args.concurrency // 2)
    start = time.perf_counter()
    async with asyncio.timeout(args.seconds + 30):
        await asyncio.gather(
            *(http_worker() for _ in range(http_workers)),
            *(tunnel_worker() for _ in range(max(1, args.concurrency - http_workers))),
        )
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"seconds": seconds, "errors": len(errors), "first_errors": errors[:3]}
    for kind, values in (("http", http_latency), ("tunnel", tunnel_latency)):
        values.sort()
        out[kind] = {
            "count": len(values),
            "rate": len(values) / seconds if seconds else 0.0,
            "p50_ms": percentile(values, 0.5) * 1000,
            "p99_ms": percentile(values, 0.99) * 1000,
        }
    return out


# -- the orchestrator ----------------------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Egressd:
    """``egressd serve`` of this checkout, on port-0 listeners, stderr to a file."""

    def __init__(self, workdir: Path, hook_url: str, held: int, approvals: int, connections: int) -> None:
        self.workdir = workdir
        self.log = workdir / "egressd.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
        env |= {
            "XDG_STATE_HOME": str(workdir),
            "PYTHONPATH": str(ROOT),
            "EGRESSD_CONTROL_TOKEN": CONTROL_TOKEN,
            "EGRESSD_WEBHOOK_SECRET": WEBHOOK_SECRET,
        }
        argv = [
            PY,
            "-c",
            "import sys; from egressd.cli.main import main; sys.argv[0] = 'egressd'; sys.exit(main())",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
            "--allow",
            f"{ORIGIN}:*",
            "--allow-private",
            f"{ORIGIN}/32",
            "--audit-log",
            str(workdir / "audit.jsonl"),
            "--log-level",
            "info",
            "--workers",  # one process: its memory and held requests are read from its /proc
            "1",
            "--approver",
            "webhook",
            "--webhook-url",
            hook_url,
            "--approval-timeout",
            "3600",
            "--max-pending-approvals",
            str(max(5, min(held, 10000))),
            "--max-approvals-per-run",
            str(max(20, min(approvals + 10, 100_000))),
            "--max-connections",
            str(connections),
            "--max-connections-per-run",
            str(connections),
        ]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log
            )
        self.pid = self.proc.pid
        deadline = time.monotonic() + 30
        while True:
            text = self.log.read_text(errors="replace")
            serving = re.search(r"serving: proxy (\S+):(\d+), control http://(\S+?):(\d+)", text)
            if serving:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"egressd did not start: {text[-2000:]}")
            time.sleep(0.05)
        self.proxy = f"{serving[1]}:{serving[2]}"
        self.control = f"http://{serving[3]}:{serving[4]}"
        limit = re.search(r"open files: up to (\d+) \(hard limit (\d+)\)", text)
        self.nofile = int(limit[1]) if limit else None

    def api(self, method: str, path: str) -> bytes:
        request = urllib.request.Request(
            self.control + path,
            method=method,
            data=b"" if method == "POST" else None,
            headers={"Authorization": f"Bearer {CONTROL_TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.read()

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.api("GET", "/metrics").decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                out[name] = float(value)
        return out

    def snapshot(self) -> dict[str, float]:
        m = self.metrics()  # first: the request's own descriptor is closed again when fds are counted
        return {
            "fds": fd_count(self.pid),
            "tasks": m.get("egressd_tasks", float("nan")),
            "rss_kib": rss_kib(self.pid),
            "open": m["egressd_connections_open"],
            "held": m["egressd_held_requests"],
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Child:
    """This file run again in a role; commands on stdin, JSON lines on stdout."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(
            [PY, str(Path(__file__).resolve()), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{command}: the child ended")
        return json.loads(line)  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.communicate(input="close\n", timeout=60)
            except (subprocess.TimeoutExpired, OSError, ValueError):
                self.proc.kill()
                self.proc.wait()


def traffic(args: argparse.Namespace, egressd: Egressd, stream: int, http: int, seconds: float) -> dict[str, Any]:
    argv = [
        PY,
        str(Path(__file__).resolve()),
        "traffic",
        "--proxy",
        egressd.proxy,
        "--stream",
        f"{ORIGIN}:{stream}",
        "--http",
        f"{ORIGIN}:{http}",
        "--seconds",
        str(seconds),
        "--concurrency",
        str(args.concurrency),
        "--max-requests",
        str(args.max_requests),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 90)
    if out.returncode != 0:
        raise RuntimeError(f"traffic failed: {out.stderr[-1000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def deny_all(egressd: Egressd, expected: int, timeout_s: float) -> int:
    """Deny every pending approval through the control API; returns how many were denied."""
    denied = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending = json.loads(egressd.api("GET", "/approvals"))["approvals"]
        if not pending:
            break
        for approval in pending:
            try:
                egressd.api("POST", f"/approvals/{approval['id']}/deny")
                denied += 1
            except urllib.error.HTTPError as exc:
                if exc.code != 409:  # settled meanwhile (e.g. timed out) is not ours to count
                    raise
            if time.monotonic() > deadline:
                break
        if denied >= expected:
            break
    return denied


def settle(egressd: Egressd, baseline: dict[str, float], timeout_s: float) -> dict[str, float]:
    """Poll until nothing is open or held and fds/tasks are back to the baseline, or the time is up.

    Keep-alive connections egressd's webhook client made to the hook receiver close
    after aiohttp's 15 s keep-alive, so exactly back takes that long after the last post.
    """
    start = time.monotonic()
    while True:
        now = egressd.snapshot()
        back = (
            now["open"] == 0
            and now["held"] == 0
            and now["fds"] <= baseline["fds"]
            and now["tasks"] <= baseline["tasks"]
        )
        if back or time.monotonic() - start > timeout_s:
            now["settle_s"] = time.monotonic() - start
            return now
        time.sleep(0.2)


def plan_counts(args: argparse.Namespace) -> tuple[int, list[str]]:
    """The idle-tunnel count the open-file limits allow, and what to print about it."""
    notes = []
    egressd_need = 2 * (args.idle + args.concurrency) + args.held + FD_MARGIN
    soft, hard = raise_own_nofile(egressd_need)
    notes.append(
        f"open files: soft limit {soft}, hard limit {hard} (egressd needs about {egressd_need} "
        f"for {args.idle} idle tunnels, {args.held} held requests, {args.concurrency} traffic workers)"
    )
    idle = args.idle
    if soft < egressd_need:
        idle = max(0, (soft - args.held - 2 * args.concurrency - FD_MARGIN) // 2)
        notes.append(
            f"open files: the hard limit {hard} is too low for {args.idle} idle tunnels; "
            f"using {idle} instead (raise it with ulimit -Hn or LimitNOFILE=)"
        )
    return idle, notes


def ratio(loaded: float, unloaded: float) -> float:
    return loaded / unloaded if unloaded else float("nan")


def load_cycle(args: argparse.Namespace, egressd: Egressd, stream: int, http: int, n: int) -> dict[str, Any]:
    """Steps 2-5 of the module docstring once: idle tunnels, held requests, traffic under them, release."""
    holder = Child(
        "hold",
        "--proxy",
        egressd.proxy,
        "--target",
        f"{ORIGIN}:{stream}",
        "--idle",
        str(args.idle),
        "--held",
        str(args.held),
        "--sources",
        str(args.sources),
        "--max-s",
        str(args.max_s),
        "--cycle",
        str(n),
    )
    try:
        before_idle = egressd.snapshot()
        t0 = time.monotonic()
        opened = holder.ask("open")
        open_s = time.monotonic() - t0
        time.sleep(1.0)
        with_idle = egressd.snapshot()
        sent = holder.ask("hold")
        deadline = time.monotonic() + args.max_s
        while (loaded_state := egressd.snapshot())["held"] < sent["held"] and time.monotonic() < deadline:
            time.sleep(0.2)
        loaded = traffic(args, egressd, stream, http, args.seconds)
        early = holder.ask("peek")["answered_while_held"]
        denied = deny_all(egressd, sent["held"], args.max_s)
        collected = holder.ask("collect")
    finally:
        holder.stop()
    return {
        "idle_opened": opened["idle"],
        "idle_errors": opened["errors"],
        "idle_first_error": opened["first_error"],
        "idle_open_s": open_s,
        "idle_alive_at_end": collected["idle_alive"],
        "held_sent": sent["held"],
        "held_seen": loaded_state["held"],
        "answered_while_held": early,
        "denied": denied,
        "held_statuses": collected["held_statuses"],
        "held_answered": sum(v for k, v in collected["held_statuses"].items() if k.isdigit()),
        "loaded": loaded,
        "kib_per_idle_tunnel": (with_idle["rss_kib"] - before_idle["rss_kib"]) / opened["idle"]
        if opened["idle"]
        else float("nan"),
        "before_idle": before_idle,
        "with_idle": with_idle,
        "loaded_state": loaded_state,
    }


def cycle_failures(args: argparse.Namespace, c: dict[str, Any], n: int) -> list[str]:
    failures = []
    if c["idle_opened"] < args.idle:
        failures.append(
            f"cycle {n}: only {c['idle_opened']} of {args.idle} idle tunnels opened ({c['idle_first_error']})"
        )
    if c["idle_alive_at_end"] != c["idle_opened"]:
        failures.append(f"cycle {n}: {c['idle_alive_at_end']} of {c['idle_opened']} idle tunnels still echoed")
    if c["loaded"]["errors"]:
        failures.append(f"cycle {n}: {c['loaded']['errors']} allowed requests failed: {c['loaded']['first_errors']}")
    if c["held_sent"] < args.held or c["held_seen"] < c["held_sent"]:
        failures.append(f"cycle {n}: {c['held_seen']:.0f} held of {c['held_sent']} sent ({args.held} asked)")
    if c["answered_while_held"]:
        failures.append(f"cycle {n}: {c['answered_while_held']} held requests were answered while held")
    if c["held_answered"] != c["held_sent"]:
        failures.append(f"cycle {n}: held requests' answers after the denial: {c['held_statuses']}")
    after, base = c["after"], c["baseline"]
    if after["fds"] > base["fds"] + FD_TOLERANCE:
        failures.append(f"cycle {n}: descriptors {after['fds']:.0f} after, baseline {base['fds']:.0f}")
    if not after["tasks"] <= base["tasks"] + TASK_TOLERANCE:
        failures.append(f"cycle {n}: tasks {after['tasks']:.0f} after, baseline {base['tasks']:.0f}")
    return failures


def main_bench(args: argparse.Namespace) -> int:
    idle_asked = args.idle
    args.idle, notes = plan_counts(args)
    for note in notes:
        print(note, flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-loadheld-"))
    origin = subprocess.Popen(
        [PY, str(Path(__file__).resolve()), "origin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    egressd: Egressd | None = None
    failures: list[str] = []
    result: dict[str, Any] = {"idle_asked": idle_asked, "idle_requested": args.idle, "held_requested": args.held}
    try:
        assert origin.stdout is not None
        ready = origin.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError("the origin did not start")
        stream, http, hook = int(ready[1]), int(ready[2]), int(ready[3])
        connections = args.idle + args.held + 2 * args.concurrency + 1000
        egressd = Egressd(workdir, f"http://{ORIGIN}:{hook}/hook", args.held, args.held * args.cycles, connections)
        print(
            f"egressd pid {egressd.pid}: proxy {egressd.proxy}, control {egressd.control}; "
            f"egressd's open-file limit {egressd.nofile}",
            flush=True,
        )
        traffic(args, egressd, stream, http, min(2.0, args.seconds))  # warm-up, not measured
        time.sleep(0.5)
        baseline = egressd.snapshot()
        baseline_fds = fd_targets(egressd.pid)
        unloaded = traffic(args, egressd, stream, http, args.seconds)
        cycles = []
        for n in range(1, args.cycles + 1):
            cycle = load_cycle(args, egressd, stream, http, n)
            cycle["baseline"] = baseline
            cycle["after"] = settle(egressd, baseline, args.settle_s)
            cycle["new_fds"] = sorted(set(fd_targets(egressd.pid)) - set(baseline_fds))
            failures += cycle_failures(args, cycle, n)
            cycles.append(cycle)
        # The same traffic unloaded again, once everything is closed: drift on a shared machine shows here.
        unloaded_after = traffic(args, egressd, stream, http, args.seconds)
        for run in (unloaded, unloaded_after):
            if run["errors"]:
                failures.append(f"{run['errors']} allowed requests failed unloaded: {run['first_errors']}")
        first, last = cycles[0], cycles[-1]
        peak_growth = max(first["loaded_state"]["rss_kib"], first["with_idle"]["rss_kib"]) - baseline["rss_kib"]
        rss_tolerance = max(8 * 1024, 0.10 * peak_growth)
        if len(cycles) > 1 and last["after"]["rss_kib"] > first["after"]["rss_kib"] + rss_tolerance:
            failures.append(
                f"RSS grew from cycle to cycle: {first['after']['rss_kib']} KiB after the first, "
                f"{last['after']['rss_kib']} KiB after the last"
            )
        result |= first
        result |= {
            "unloaded": unloaded,
            "unloaded_after": unloaded_after,
            "after": last["after"],
            "cycles": cycles,
            "rss_after_cycles_kib": [c["after"]["rss_kib"] for c in cycles],
            "tolerance": {"fds": FD_TOLERANCE, "tasks": TASK_TOLERANCE, "rss_kib_between_cycles": rss_tolerance},
            "failures": failures,
        }
        print_report(result)
    finally:
        if egressd is not None:
            egressd.stop()
        if origin.poll() is None:
            try:
                origin.communicate(input="", timeout=15)
            except subprocess.TimeoutExpired:
                origin.kill()
                origin.wait()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 1 if failures else 0


def print_report(r: dict[str, Any]) -> None:
    u = r["unloaded"]
    runs = [("unloaded", u), *((f"loaded {n}", c["loaded"]) for n, c in enumerate(r["cycles"], 1))]
    runs.append(("unloaded", r["unloaded_after"]))
    print(
        f"load: {r['idle_opened']} idle tunnels (opened in {r['idle_open_s']:.1f} s) and {r['held_seen']:.0f} "
        f"requests held for approval; traffic {u['seconds']:.0f} s per run, {len(r['cycles'])} load cycle(s); "
        "ratio: mean of the loaded runs / mean of the unloaded runs (before and after)"
    )
    print(f"{'allowed traffic':28}" + "".join(f"{name:>12}" for name, _ in runs) + f"{'ratio':>9}")
    for kind, title in (("http", "plain HTTP keep-alive"), ("tunnel", "CONNECT + 64-byte echo")):
        for key, label in (
            ("rate", title + ", req/s"),
            ("p50_ms", "  p50 latency, ms"),
            ("p99_ms", "  p99 latency, ms"),
        ):
            values = [run[kind][key] for _, run in runs]
            loaded = [run[kind][key] for name, run in runs if name.startswith("loaded")]
            unloaded = [run[kind][key] for name, run in runs if name == "unloaded"]
            fmt = "12.0f" if key == "rate" else "12.2f"
            figure = ratio(sum(loaded) / len(loaded), sum(unloaded) / len(unloaded))
            print(f"{label:28}" + "".join(f"{v:{fmt}}" for v in values) + f"{figure:8.2f}×")
    print("allowed requests that failed: " + ", ".join(f"{run['errors']} {name}" for name, run in runs))
    print(
        f"memory per idle tunnel: {r['kib_per_idle_tunnel']:.1f} KiB (egressd's RSS "
        f"{r['with_idle']['rss_kib'] / 1024:.1f} MiB with them − {r['before_idle']['rss_kib'] / 1024:.1f} MiB before, "
        f"/ {r['idle_opened']})"
    )
    for n, c in enumerate(r["cycles"], 1):
        print(
            f"cycle {n}: {c['held_seen']:.0f} of {c['held_sent']} held, {c['answered_while_held']} answered while "
            f"held; denied {c['denied']} via the control API; answers after: {c['held_statuses']}; "
            f"idle tunnels still echoing: {c['idle_alive_at_end']} of {c['idle_opened']}; back to the fd/task "
            f"baseline {c['after']['settle_s']:.1f} s after closing"
        )
    t = r["tolerance"]
    header = "".join(
        f"{'cycle ' + str(n) + ' ' + s:>16}" for n in range(1, len(r["cycles"]) + 1) for s in ("loaded", "after")
    )
    print(f"{'egressd':10} {'baseline':>10}{header}   tolerance (after vs baseline)")
    for key, scale, tol in (("fds", 1, f"+{t['fds']}"), ("tasks", 1, f"+{t['tasks']}"), ("rss_kib", 1024, "-")):
        values = [v for c in r["cycles"] for v in (c["loaded_state"][key], c["after"][key])]
        name = "RSS MiB" if key == "rss_kib" else key
        print(
            f"{name:10} {r['baseline'][key] / scale:10.0f}"
            + "".join(f"{v / scale:16.0f}" for v in values)
            + f"   {tol}"
        )
    rss = r["rss_after_cycles_kib"]
    print(
        f"RSS after each cycle: {', '.join(f'{v / 1024:.1f}' for v in rss)} MiB (baseline "
        f"{r['baseline']['rss_kib'] / 1024:.1f}): the allocator keeps its high-water mark; a leak would show as "
        f"growth from cycle to cycle (allowed: {t['rss_kib_between_cycles'] / 1024:.0f} MiB)"
    )
    print("result: " + ("all hard properties held" if not r["failures"] else "FAILED: " + "; ".join(r["failures"])))


def main() -> int:
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role == "origin":
        raise_own_nofile(1 << 16)
        run_loop(origin_main())
        return 0
    if role == "hold":
        p = argparse.ArgumentParser()
        p.add_argument("role")
        p.add_argument("--proxy", required=True)
        p.add_argument("--target", required=True)
        p.add_argument("--idle", type=int, required=True)
        p.add_argument("--held", type=int, required=True)
        p.add_argument("--sources", type=int, default=1)
        p.add_argument("--cycle", type=int, default=1, help="in the held names: a denied name stays denied")
        p.add_argument("--max-s", type=float, default=120)
        p.add_argument("--answer-s", type=float, default=30)
        a = p.parse_args()
        raise_own_nofile(a.idle + a.held + 200)
        run_loop(hold_main(a))
        return 0
    if role == "traffic":
        p = argparse.ArgumentParser()
        p.add_argument("role")
        p.add_argument("--proxy", required=True)
        p.add_argument("--stream", required=True)
        p.add_argument("--http", required=True)
        p.add_argument("--seconds", type=float, required=True)
        p.add_argument("--concurrency", type=int, default=50)
        p.add_argument("--max-requests", type=int, default=1_000_000)
        a = p.parse_args()
        print(json.dumps(run_loop(traffic_main(a))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", type=int, default=10_000, help="idle CONNECT tunnels to hold open (default 10000)")
    parser.add_argument("--held", type=int, default=1000, help="requests held for approval (default 1000; max 10000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each traffic run (default 10)")
    parser.add_argument("--concurrency", type=int, default=50, help="traffic workers (half HTTP, half tunnels)")
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="bound on requests per traffic run")
    parser.add_argument(
        "--sources",
        type=int,
        default=4,
        help="client source addresses in 127.0.1.0/24 for the held connections (ephemeral ports)",
    )
    parser.add_argument("--max-s", type=float, default=120.0, help="bound on opening tunnels / waiting for holds")
    parser.add_argument("--settle-s", type=float, default=40.0, help="how long to wait for fds and tasks to return")
    parser.add_argument("--cycles", type=int, default=2, help="load cycles in one egressd (RSS growth across them)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line, last")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (egressd's log, audit log)")
    args = parser.parse_args()
    if not 0 < args.held <= 10000:
        parser.error("--held must be 1..10000 (max_pending_approvals caps it)")
    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())
