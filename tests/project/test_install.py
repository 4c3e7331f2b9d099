"""scripts/install.sh on a fresh clone prints its one line, no setuptools warning (issue 16)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests import REPO


def test_install_sh_in_a_fresh_copy_says_one_line(tmp_path: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    copy = tmp_path / "egressd"
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EGRESSD_", "PYTHON", "VIRTUAL_ENV"))}
    env["PIP_NO_DEPS"] = "1"  # the project alone: its dependencies are not what is checked (nor the time)
    done = subprocess.run(["bash", "scripts/install.sh"], cwd=copy, capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    said = (done.stdout + done.stderr).strip().splitlines()
    assert said == ["install.sh: egressd is installed in .venv (run .venv/bin/egressd --help)"], said
