"""scripts/install.sh on a fresh clone prints its one line, no setuptools warning (issue 16); ``--link``
puts egressd where sudo's PATH finds it, and never over a file of someone else's (issue 29)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.harness import copy_checkout


def test_install_sh_in_a_fresh_copy_says_one_line(tmp_path: Path) -> None:
    copy = copy_checkout(tmp_path / "egressd")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EGRESSD_", "PYTHON", "VIRTUAL_ENV"))}
    env["PIP_NO_DEPS"] = "1"  # the project alone: its dependencies are not what is checked (nor the time)
    env["EGRESSD_NATIVE"] = "0"  # nor the compiled audit line's build (CI's own install builds it, and a test needs it)
    links = tmp_path / "bin"
    links.mkdir()
    env["EGRESSD_LINK_DIR"] = str(links)  # /usr/local/bin on a user's machine: not a test's to change
    done = subprocess.run(["bash", "scripts/install.sh", "--link"], cwd=copy, capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    said = (done.stdout + done.stderr).strip().splitlines()
    target = copy / ".venv" / "bin" / "egressd"
    assert said == ["install.sh: EGRESSD_NATIVE=0: the compiled audit line is not built; egressd writes its lines in "
                    "Python",
                    f"install.sh: {links}/egressd links to {target} (sudo egressd finds it)",
                    "install.sh: egressd is installed in .venv (run .venv/bin/egressd --help)"], said  # fmt: skip
    assert (links / "egressd").readlink() == target
    # A file of that name that is not our link is left alone, and said so.
    (links / "egressd").unlink()
    (links / "egressd").write_text("#!/bin/sh\necho someone else's\n")
    again = subprocess.run(["bash", "scripts/install.sh", "--link"], cwd=copy, capture_output=True, text=True,
                           env=env, timeout=300)  # fmt: skip
    assert again.returncode == 1 and "is not a link to" in again.stderr, again.stderr
    assert (links / "egressd").read_text() == "#!/bin/sh\necho someone else's\n"
    # An option it does not know is refused with the ones it does.
    wrong = subprocess.run(["bash", "scripts/install.sh", "--lnk"], cwd=copy, capture_output=True, text=True,
                           env=env, timeout=60)  # fmt: skip
    assert wrong.returncode == 2 and "--link" in wrong.stderr, wrong.stderr
