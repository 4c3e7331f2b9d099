"""How long egressd's commands take to start: the median of repeated runs, each a fresh process.

    .venv/bin/python bench/startup.py [--runs 15] [--egressd PATH]

A person types these all day (`egressd pending`, `egressd allow ID`), so their start-up is the
tool's latency: issue 29 sets 0.3 s for --version and --help and 0.6 s for `pending`. Each command
runs --runs times one after another (bounded: 20 s per run at most); `pending` finds no egressd
running (XDG_STATE_HOME is a fresh directory), so it measures start-up and the registry, nothing
on the network. Printed: the median and the slowest, in seconds, and `python -c pass` beside them
for the interpreter's own start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = [["--version"], ["--help"], ["pending"], ["serve", "--help"], ["run", "--help"], ["agent", "--help"]]


def _times(args: list[str], runs: int, env: dict[str, str]) -> list[float]:
    spent = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20)
        spent.append(time.perf_counter() - start)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--egressd", default=str(Path(sys.executable).parent / "egressd"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": state}
        _times([args.egressd, "--version"], 2, env)  # the bytecode cache, written once
        print(f"{'command':<28} {'median s':>9} {'slowest s':>10}")
        for name, argv in [("python -c pass", [sys.executable, "-c", "pass"])] + [
            ("egressd " + " ".join(c), [args.egressd, *c]) for c in COMMANDS
        ]:
            spent = _times(argv, args.runs, env)
            print(f"{name:<28} {statistics.median(spent):>9.3f} {max(spent):>10.3f}")


if __name__ == "__main__":
    main()
