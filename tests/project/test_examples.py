"""The walkthroughs in examples/ run, and show what they say they show.

``examples/learn-then-lock.sh`` is run as a reader would run it (loopback
only, ports from the kernel); its transcript is read back: the learned
``egress`` record, the suggested entry, the approval with scope *always* and
the ``[[approved]]`` table it appended, the ``policy.reloaded`` record and
the policy after it. The script's own checks are not trusted alone.
(examples/agent-demo.sh needs root: tests/integration/sandbox/test_agent_sandbox.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from egressd.config.allowfile import read_allow_file
from egressd.proxy.core.policy import parse_entry
from tests import REPO
from tests.harness import require
from tests.project.test_readme import _command_lines, _fenced_blocks, _flags_given, _help, _links

EGRESSD = Path(sys.executable).with_name("egressd")
SCRIPT = REPO / "examples" / "learn-then-lock.sh"


def _records(out: str, event: str) -> list[dict[str, Any]]:
    """The audit records (JSON objects, one a line) the transcript shows for ``event``."""
    found = []
    for line in out.splitlines():
        line = line.strip()
        if line.startswith('{"event": '):
            record = json.loads(line)
            if record["event"] == event:
                found.append(record)
    return found


def _section(out: str, heading: str) -> str:
    """The transcript from the step whose heading starts with ``heading`` up to the next step."""
    start = out.index(f"\n== {heading}")
    end = out.find("\n== ", start + 1)
    return out[start : end if end != -1 else len(out)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_learn_then_lock_walkthrough(tmp_path: Path) -> None:
    require(EGRESSD.exists(), f"the walkthrough runs {EGRESSD}")
    require(shutil.which("curl") is not None, "the walkthrough's job is curl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env |= {"EGRESSD": str(EGRESSD), "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(SCRIPT)], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr + out
    assert out.rstrip().endswith("learn-then-lock.sh: walkthrough complete")
    one = re.search(r"origins: http://(pkgs\.test):(\d+)/ .* and http://(docs\.test):(\d+)/", out)
    assert one is not None, out
    p1, p2 = int(one.group(2)), int(one.group(4))
    assert p1 != p2

    # 1. learn: let through, and recorded as learned; the terminal says so.
    learn = _section(out, "1. learn")
    assert "egressd: LEARN MODE: egress is NOT restricted by the allowlist" in learn
    assert "-> HTTP 200: hello from pkgs" in learn
    (learned,) = _records(learn, "egress")
    assert learned["host"] == "pkgs.test" and learned["port"] == p1
    assert learned["decision"] == "allow" and learned["rule"] is None
    assert learned["learned"] == "not_allowlisted"

    # 2. suggest: exactly that host and port.
    suggest = _section(out, "2. suggest")
    assert re.search(rf'allow = \[\n\s+"pkgs\.test:{p1}",\n\s+\]', suggest), suggest
    assert "docs.test" not in suggest

    # 3. lock: the file's entry allowed, the new host held, asked, answered with scope always.
    lock = _section(out, "3. lock")
    assert f"default run allows pkgs.test:{p1}" in lock
    assert "(X-Egress-Reason:" not in lock.split("the job now also wants")[0]
    (requested,) = [json.loads(x.strip()) for x in lock.splitlines() if '"approval.requested"' in x]
    assert (requested["host"], requested["port"]) == ("docs.test", p2)
    approval = requested["id"]
    assert re.search(rf"{re.escape(approval)}\s+default\s+docs\.test:{p2}", lock), "not in egressd pending"
    assert f"{approval}: allowed (always): docs.test:{p2} appended to the allow file" in lock
    assert "the held curl finished: HTTP 200: hello from docs" in lock
    (decided,) = _records(lock, "approval.decided")
    assert decided["id"] == approval and decided["decision"] == "allow"
    assert decided["scope"] == "always" and decided["entry"] == f"docs.test:{p2}" and decided["scope_error"] is None
    assert decided["channel"] == "control" and decided["by"] == "walkthrough"
    approved = lock[lock.index("the allow file now:") :]
    assert re.search(
        rf'\[\[approved\]\]\n\s+entry = "docs\.test:{p2}"\n\s+at = "[^"]+"\n\s+approval = "{re.escape(approval)}"\n'
        r'\s+by = "walkthrough"\n\s+channel = "control"\n\s+run = "default"',
        approved,
    ), approved

    # 4. reload: one policy.reloaded record, ok, naming what changed; the new policy applies at once.
    reload = _section(out, "4. reload")
    (reloaded,) = _records(reload, "policy.reloaded")
    assert reloaded["ok"] is True and reloaded["error"] is None
    assert reloaded["added"] == {"allow": [f"docs.test:{p2}"], "deny": ["pkgs.test"]}
    assert reloaded["removed"] == {"allow": [f"pkgs.test:{p1}"], "deny": []}
    after = reload[reload.index("kill -HUP") :]
    assert "-> HTTP 403 (X-Egress-Reason: denylisted)" in after
    assert "-> HTTP 200: hello from docs" in after

    # 5. a fresh start has the approved entry from the file, without asking anyone.
    fresh = _section(out, "5. a fresh start")
    assert f"default run allows docs.test:{p2}" in fresh
    assert "-> HTTP 200: hello from docs" in fresh and "-> HTTP 403 (X-Egress-Reason: denylisted)" in fresh

    # Everything it started is stopped, and its directory is gone.
    pids = [int(pid) for pid in re.findall(r"egressd \(pid (\d+)\) says:", out)]
    assert len(pids) == 3 and all(_gone(pid) for pid in pids)
    assert list(tmp_path.iterdir()) == []


def test_learn_then_lock_fails_loudly_when_egressd_is_missing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env |= {"EGRESSD": str(tmp_path / "no-egressd"), "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(SCRIPT)], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=30
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("learn-then-lock.sh: FAILED: no egressd at ")


PROSE = REPO / "examples" / "learn-then-lock.md"


def test_the_prose_walkthrough_gives_real_flags_links_and_allow_files(tmp_path: Path) -> None:
    text = PROSE.read_text()
    given = [flag for line in _command_lines(text) for flag in _flags_given(line)]
    assert len(given) >= 6, given  # the parsing found the commands at all
    unknown = [f"egressd {c} {f}" for c, f in given if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", _help(c))]
    assert not unknown, unknown
    links = _links(PROSE)
    assert "learn-then-lock.sh" in links
    assert [t for t in links if not t.startswith("https://") and not (PROSE.parent / t.split("#")[0]).exists()] == []
    blocks = _fenced_blocks(text, ("toml",))
    assert len(blocks) == 3
    for i, block in enumerate(blocks):
        path = tmp_path / f"allow{i}.toml"
        path.write_text(block)
        allow_file = read_allow_file(path)
        for entry in (*allow_file.allowed, *allow_file.deny):
            parse_entry(entry)
    # The records each step writes are named, with the fields the audit log documents.
    for words in ('"learned": "not_allowlisted"', "`approval.decided`", '`"scope": "always"`', "`policy.reloaded`"):
        assert words in text, words
