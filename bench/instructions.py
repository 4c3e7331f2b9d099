"""Instructions per tunnel and per request: a figure that does not move with the machine's load.

    .venv/bin/python bench/instructions.py [--tunnels 2000] [--requests 2000] [--egressd PATH]

Wall-clock rates on a shared 2-core machine wander by tens of percent from
one round to the next; the number of instructions egressd executes for the
same work does not. This runs ``egressd serve`` under valgrind's cachegrind
(instruction counting only, at its default log level) three times after
a warm-up run (which fills the runs' own bytecode cache), each started fresh
with ``PYTHONHASHSEED=0``: idle (start-up and shutdown alone), then N CONNECT
tunnels one after another (CONNECT, one 64-byte echo, close), then N small
plain-HTTP requests on one keep-alive connection. Each figure is the run's
total less the idle run's, divided by N. ``--egressd`` names another build
(e.g. a worktree's ``.venv/bin/egressd``) for an A/B comparison; ``EGRESSD_NATIVE=0``
in its environment runs egressd with the Python audit line instead of the compiled one. Origins are
on 127.0.0.2 (loopback) in this process; every load is bounded in count and
time. Needs valgrind (Debian: ``apt install valgrind``).

``--profile PREFIX`` runs the same loads under cProfile instead (no valgrind;
wall times there are the profiler's, calls are what to read): it writes
``PREFIX.idle.prof``, ``PREFIX.tunnels.prof`` and ``PREFIX.requests.prof``
and prints, per tunnel and per request, the functions called, by calls per
operation (the idle run's calls taken off).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ORIGIN = "127.0.0.2"
SERVING = re.compile(r"serving: proxy (\S+):(\d+),")
PAYLOAD = b"x" * 64
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
RUN_LIMIT_S = 900.0  # one valgrind run, start-up included


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _wait_port(stderr: Path, proc: asyncio.subprocess.Process) -> int:
    deadline = time.monotonic() + RUN_LIMIT_S
    while time.monotonic() < deadline:
        found = SERVING.search(stderr.read_text(errors="replace"))  # noqa: ASYNC240 - a small local file
        if found:
            return int(found[2])
        if proc.returncode is not None:
            raise SystemExit(f"egressd exited before serving: {stderr.read_text(errors='replace')}")  # noqa: ASYNC240
        await asyncio.sleep(0.2)
    raise SystemExit("egressd did not start in time under valgrind")


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)


async def _tunnels(port: int, origin: int, n: int) -> None:
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"CONNECT {ORIGIN}:{origin} HTTP/1.1\r\nHost: {ORIGIN}:{origin}\r\n\r\n".encode())
        head = await _read_head(reader)
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"tunnel refused: {head!r}")
        writer.write(PAYLOAD)
        await asyncio.wait_for(reader.readexactly(len(PAYLOAD)), 60)
        writer.close()
        await writer.wait_closed()


async def _requests(port: int, origin: int, n: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET http://{ORIGIN}:{origin}/small HTTP/1.1\r\nHost: {ORIGIN}:{origin}\r\n\r\n".encode()
    for _ in range(n):
        writer.write(request)
        head = await _read_head(reader)
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"request refused: {head!r}")
        await asyncio.wait_for(reader.readexactly(2), 60)
    writer.close()


async def measure(
    egressd: str, *, tunnels: int, requests: int, echo_port: int, http_port: int, pycache: str,
    profile: str | None = None,
) -> int:
    """Total instructions of one egressd run doing this work, start-up and shutdown included.

    ``pycache``: the runs' own bytecode cache (``PYTHONPYCACHEPREFIX``), filled by the warm-up
    run: a ``.pyc`` another process wrote between two runs once moved one by 350 M instructions.
    ``profile``: run under cProfile instead, its stats written there (0 is returned).
    """
    with tempfile.TemporaryDirectory(prefix="egressd-instr-") as tmp:
        out, err = Path(tmp) / "cachegrind.out", Path(tmp) / "stderr"
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and k != "PYTHONDONTWRITEBYTECODE"}
        if "EGRESSD_NATIVE" in os.environ:  # EGRESSD_NATIVE=0: the Python audit line, for an A/B comparison
            env["EGRESSD_NATIVE"] = os.environ["EGRESSD_NATIVE"]
        env |= {"PYTHONHASHSEED": "0", "XDG_STATE_HOME": tmp, "PYTHONPYCACHEPREFIX": pycache}
        if profile is None:
            runner = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}", egressd]
        else:  # the build's own interpreter, with cProfile around its egressd script
            runner = [str(Path(egressd).with_name("python")), "-m", "cProfile", "-o", profile, egressd]
        with open(err, "wb") as stderr:  # noqa: ASYNC230 - opened once, handed to the child
            proc = await asyncio.create_subprocess_exec(
                *runner, "serve", "--listen", "127.0.0.1:0", "--control", "unix:" + str(Path(tmp) / "control.sock"),
                "--allow", f"{ORIGIN}:*", "--allow-private", f"{ORIGIN}/32", "--audit-log", str(Path(tmp) / "a.jsonl"),
                "--log-level", "info",  # serve's default, and how its "serving:" line (the bound port) is seen
                "--workers", "1",  # cachegrind counts one process: every tunnel in it
                stdout=asyncio.subprocess.DEVNULL, stderr=stderr, env=env,
            )  # fmt: skip
        try:
            port = await _wait_port(err, proc)
            async with asyncio.timeout(RUN_LIMIT_S):
                await _tunnels(port, echo_port, tunnels)
                await _requests(port, http_port, requests)
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), RUN_LIMIT_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if profile is not None:
            return 0
        summary = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M)
        if summary is None:
            raise SystemExit(f"no cachegrind summary: {err.read_text(errors='replace')[-2000:]}")
        return int(summary[1])


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tunnels", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--egressd", default=str(Path(sys.executable).with_name("egressd")))
    parser.add_argument("--profile", metavar="PREFIX", help="cProfile the loads instead; stats to PREFIX.*.prof")
    args = parser.parse_args(argv)
    if args.profile is not None:
        return await _profile(args.egressd, args.profile, tunnels=args.tunnels, requests=args.requests)
    if shutil.which("valgrind") is None:
        print("bench/instructions.py needs valgrind (apt install valgrind)", file=sys.stderr)
        return 2
    echo = await asyncio.start_server(_echo, ORIGIN, 0)
    http = await asyncio.start_server(_http, ORIGIN, 0)
    pycache = tempfile.TemporaryDirectory(prefix="egressd-instr-pycache-")
    ports = {"echo_port": echo.sockets[0].getsockname()[1], "http_port": http.sockets[0].getsockname()[1]}
    runs = {**ports, "pycache": pycache.name}
    try:
        # A first run compiles whatever has no bytecode cache yet; counted, it would inflate "idle".
        await measure(args.egressd, tunnels=0, requests=0, **runs)
        idle = await measure(args.egressd, tunnels=0, requests=0, **runs)
        with_tunnels = await measure(args.egressd, tunnels=args.tunnels, requests=0, **runs)
        with_requests = await measure(args.egressd, tunnels=0, requests=args.requests, **runs)
    finally:
        echo.close()
        http.close()
        pycache.cleanup()
    print(f"egressd: {args.egressd}")
    print(f"idle run (start-up and shutdown): {idle:,} instructions")
    if args.tunnels:
        print(f"per tunnel (CONNECT, 64-byte echo, close; {args.tunnels} one after another): "
              f"{(with_tunnels - idle) / args.tunnels:,.0f} instructions")  # fmt: skip
    if args.requests:
        print(f"per small plain-HTTP request (keep-alive; {args.requests}): "
              f"{(with_requests - idle) / args.requests:,.0f} instructions")  # fmt: skip
    return 0


async def _profile(egressd: str, prefix: str, *, tunnels: int, requests: int) -> int:
    """``--profile``: each load under cProfile, and the calls per operation beyond the idle run's."""
    echo = await asyncio.start_server(_echo, ORIGIN, 0)
    http = await asyncio.start_server(_http, ORIGIN, 0)
    pycache = tempfile.TemporaryDirectory(prefix="egressd-instr-pycache-")
    ports = {"echo_port": echo.sockets[0].getsockname()[1], "http_port": http.sockets[0].getsockname()[1]}
    runs = {**ports, "pycache": pycache.name}
    loads = {"idle": (0, 0), "tunnels": (tunnels, 0), "requests": (0, requests)}
    try:
        for name, (n_tunnels, n_requests) in loads.items():
            await measure(egressd, tunnels=n_tunnels, requests=n_requests, profile=f"{prefix}.{name}.prof", **runs)
    finally:
        echo.close()
        http.close()
        pycache.cleanup()
    idle = pstats.Stats(f"{prefix}.idle.prof").stats  # type: ignore[attr-defined]
    for name, n in (("tunnels", tunnels), ("requests", requests)):
        if not n:
            continue
        stats = pstats.Stats(f"{prefix}.{name}.prof").stats  # type: ignore[attr-defined]
        rows = sorted(
            ((calls - idle.get(where, (0, 0))[1]) / n, where) for where, (_, calls, *_rest) in stats.items()
        )
        print(f"per {name[:-1]}: {sum(max(0.0, per) for per, _ in rows):.1f} calls")
        for per, (file, line, function) in reversed(rows):
            if per >= 0.5:
                print(f"  {per:6.2f}  {function}  {file}:{line}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
