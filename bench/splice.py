"""Spliced tunnels beside copied ones: egressd's CPU per GiB relayed and the throughput, against direct.

    .venv/bin/python bench/splice.py [--gib 4] [--rounds 3]

One CONNECT tunnel at a time through ``egressd serve`` (fresh each round),
``--gib`` GiB down and then up (bench/load.py's client against bench/servers.py's
stream server on 127.0.0.2), with tunnels spliced (the default) and with
``--no-splice`` (the copying relay), the two alternating round by round so
that a change in the machine's load falls on both; the direct connection is
measured each round too. Prints each transfer, then the medians: MB/s, the
ratio to direct, and egressd's CPU seconds per GiB (user + system, from
/proc/PID/stat: the bytes moved in the kernel on egressd's behalf count).
Every transfer is bounded (120 s).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable
ORIGIN = "127.0.0.2"
GiB = 1 << 30


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _transfer(stream_port: int, proxy_port: int | None, direction: str, nbytes: int) -> float:
    proxy = ["--proxy", f"127.0.0.1:{proxy_port}"] if proxy_port else []
    out = subprocess.run([PY, str(HERE / "load.py"), "throughput", "--target", f"{ORIGIN}:{stream_port}", *proxy,
                          "--direction", direction, "--bytes", str(nbytes), "--max-s", "120"],
                         capture_output=True, text=True, timeout=150)  # fmt: skip
    rate = re.search(r'"mb_s": ([\d.]+)', out.stdout)
    if out.returncode != 0 or rate is None:
        raise RuntimeError(f"load.py failed: {out.stderr.strip()[-300:]}")
    return float(rate[1])


def _serve(extra: list[str], workdir: str) -> tuple[subprocess.Popen[str], int]:
    egressd = str(Path(PY).with_name("egressd"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": workdir}
    proc = subprocess.Popen(
        [egressd, "serve", "--listen", "127.0.0.1:0", "--control", f"unix:{workdir}/control.sock",
         "--allow", f"{ORIGIN}:*", "--allow-private", f"{ORIGIN}/32", "--audit-log", f"{workdir}/audit.jsonl",
         "--workers", "1", *extra],  # one process: its CPU per GiB is the relay's
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        serving = re.search(r"serving: proxy \S+:(\d+),", line)
        if serving:
            return proc, int(serving[1])
        if not line:
            break
    proc.kill()
    raise RuntimeError("egressd did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=int, default=4, help="GiB each way per transfer (default 4, at most 16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3, at most 10)")
    args = parser.parse_args()
    if not (1 <= args.gib <= 16 and 1 <= args.rounds <= 10):
        parser.error("--gib 1..16, --rounds 1..10")
    nbytes = args.gib * GiB
    stream_port, http_port = _free_port(ORIGIN), _free_port(ORIGIN)
    servers = subprocess.Popen([PY, str(HERE / "servers.py"), ORIGIN, str(stream_port), str(http_port)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        assert servers.stdout is not None
        if servers.stdout.readline().strip() != "ready":
            raise RuntimeError("test servers did not start")
        for n in range(args.rounds):
            for direction in ("down", "up"):
                rate = _transfer(stream_port, None, direction, nbytes)
                figures.setdefault(("direct", direction), []).append((rate, 0.0))
                print(f"round {n + 1}: direct   {direction:<4} {rate:8.0f} MB/s", flush=True)
            for name, extra in (("spliced", []), ("copied", ["--no-splice"])) if n % 2 == 0 else (
                    ("copied", ["--no-splice"]), ("spliced", [])):  # fmt: skip
                with tempfile.TemporaryDirectory(prefix="egressd-splice-") as workdir:
                    proc, port = _serve(extra, workdir)
                    try:
                        for direction in ("down", "up"):
                            before = _cpu_s(proc.pid)
                            rate = _transfer(stream_port, port, direction, nbytes)
                            per_gib = (_cpu_s(proc.pid) - before) / args.gib
                            figures.setdefault((name, direction), []).append((rate, per_gib))
                            print(f"round {n + 1}: {name:<8} {direction:<4} {rate:8.0f} MB/s  "
                                  f"egressd CPU {per_gib:.3f} s/GiB", flush=True)  # fmt: skip
                    finally:
                        proc.terminate()
                        proc.wait(timeout=30)
    finally:
        servers.terminate()
        servers.wait(timeout=30)
    print(f"\nmedians over {args.rounds} rounds, {args.gib} GiB each way:")
    print(f"{'':<10}{'way':<6}{'MB/s':>8}{'/direct':>9}{'CPU s/GiB':>11}")
    for name in ("direct", "spliced", "copied"):
        for direction in ("down", "up"):
            rates = [r for r, _ in figures[(name, direction)]]
            rate = statistics.median(rates)
            direct = statistics.median(r for r, _ in figures[("direct", direction)])
            cpu = "" if name == "direct" else f"{statistics.median(c for _, c in figures[(name, direction)]):.3f}"
            print(f"{name:<10}{direction:<6}{rate:8.0f}{rate / direct:8.2f}x{cpu:>11}")
    for direction in ("down", "up"):
        spliced = statistics.median(c for _, c in figures[("spliced", direction)])
        copied = statistics.median(c for _, c in figures[("copied", direction)])
        print(f"copied / spliced CPU per GiB, {direction}: {copied / spliced:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
