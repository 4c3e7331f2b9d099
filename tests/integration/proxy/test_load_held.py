"""Load held, the short form: bench/loadheld.py with 1,000 idle tunnels and 50 held approvals.

Only the hard properties are asserted, never a timing: every allowed request
succeeded under the load, the held requests were held and then each answered,
the idle tunnels still carried data, and egressd's descriptors and asyncio
tasks came back to their baseline once everything was closed. The long form
(10,000 + 1,000, with figures) is ``python bench/loadheld.py``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from tests import REPO
from tests.harness import wait_serve_ports

ROOT = REPO
BENCH = ROOT / "bench" / "loadheld.py"
IDLE, HELD = 1000, 50


def test_idle_tunnels_and_held_approvals_leave_allowed_traffic_working_and_egressd_as_it_was() -> None:
    # Its own session, so a bench that overruns is stopped whole: it and the processes it started.
    proc = subprocess.Popen(
        [
            sys.executable,
            str(BENCH),
            "--idle",
            str(IDLE),
            "--held",
            str(HELD),
            "--seconds",
            "1",
            "--concurrency",
            "10",
            "--max-s",
            "20",
            "--settle-s",
            "15",
            "--cycles",
            "2",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=55)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the bench overran 55 s: {stdout[-3000:]} {stderr[-2000:]}") from None
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.stdout.strip(), out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    printed = out.stdout[-4000:]
    # The CI machine's open-file limit must hold the short form whole; the bench says so if it did not.
    assert r["idle_requested"] == IDLE, printed
    assert r["unloaded"]["errors"] == 0, printed
    assert len(r["cycles"]) == 2, printed
    for c in r["cycles"]:
        assert c["idle_opened"] == IDLE and c["idle_errors"] == 0, printed
        assert c["loaded"]["errors"] == 0, printed
        assert c["loaded"]["http"]["count"] > 0 and c["loaded"]["tunnel"]["count"] > 0, printed
        assert c["held_sent"] == HELD and c["held_seen"] == HELD, printed
        assert c["answered_while_held"] == 0, printed
        assert c["denied"] == HELD, printed
        assert c["held_statuses"] == {"403": HELD}, printed
        assert c["idle_alive_at_end"] == IDLE, printed
        base, after = c["baseline"], c["after"]
        assert base["tasks"] == base["tasks"], "egressd_tasks is missing from /metrics"  # NaN when absent
        assert after["open"] == 0 and after["held"] == 0, printed
        assert after["fds"] <= base["fds"] + r["tolerance"]["fds"], printed
        assert after["tasks"] <= base["tasks"] + r["tolerance"]["tasks"], printed
    assert r["failures"] == [], printed
    assert out.returncode == 0, printed


def _lower_soft_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))


def test_serve_raises_its_open_file_soft_limit_to_the_hard_limit(tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env |= {"XDG_STATE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "EGRESSD_CONTROL_TOKEN": "t" * 32}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from egressd.cli.main import main; sys.exit(main())",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
            "--audit-log",
            str(tmp_path / "audit.jsonl"),
            "--allow",
            "127.0.0.2:*",
        ],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_lower_soft_nofile,
    )
    try:
        wait_serve_ports(proc)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        soft = line.split()[3]
        assert soft == (str(hard) if hard != resource.RLIM_INFINITY else str(1 << 20)), line
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
