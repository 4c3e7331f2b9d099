"""The event loop egressd runs on: uvloop where it is installed, else asyncio's own, said in one line.

Each case runs in a child process: ``run_async`` tunes the garbage collector
for the whole process, which this test process must not inherit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import asyncio, sys
if sys.argv[1] == "without":
    sys.modules["uvloop"] = None  # as if it were not installed: its import raises ImportError
from egressd.cli.wiring.loop import run_async

async def main() -> int:
    print(type(asyncio.get_running_loop()).__module__)
    return 7

sys.exit(run_async(main))
"""


def _probe(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)


def test_without_uvloop_it_runs_on_asyncio_and_says_so_in_one_line() -> None:
    done = _probe("without")
    assert done.returncode == 7
    assert done.stdout.strip().startswith("asyncio")
    assert done.stderr.count("\n") == 1 and "uvloop is not installed" in done.stderr


def test_with_uvloop_it_runs_on_uvloop_quietly() -> None:
    pytest.importorskip("uvloop", reason="uvloop is a dependency on Linux; this platform has no wheel")
    done = _probe("with")
    assert done.returncode == 7
    assert done.stdout.strip().startswith("uvloop") and done.stderr == ""
