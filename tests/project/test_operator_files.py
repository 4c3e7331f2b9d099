"""What an operator installs beside egressd (issue 29): the systemd unit, the example config, the man page
and the shell completions; the last two made from the parser itself (scripts/manpage.py), so a flag added
without them fails here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from egressd.config.settings import load_settings
from tests import REPO
from tests.harness import require

EGRESSD = Path(sys.executable).with_name("egressd")


def test_the_man_page_and_the_completions_are_what_the_parser_gives() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "manpage.py"), "--check"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = (REPO / "docs" / "egressd.1").read_text()
    assert page.startswith('.TH EGRESSD "1"') and "\\-\\-request\\-body\\-cap\\-mb" in page


def test_bash_completes_subcommands_and_a_subcommands_flags() -> None:
    require(shutil.which("bash") is not None, "bash is not installed")
    script = (
        f"source {REPO / 'deploy' / 'completions' / 'egressd.bash'}\n"
        'COMP_WORDS=(egressd ser); COMP_CWORD=1; _shtab_egressd; echo "${COMPREPLY[@]}"\n'
        'COMP_WORDS=(egressd run --allow-pr); COMP_CWORD=2; _shtab_egressd; echo "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.stdout.splitlines() == ["serve", "--allow-private"], done.stdout + done.stderr


def test_the_systemd_unit_is_one_systemd_accepts(tmp_path: Path) -> None:
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze is not installed (Debian: systemd)")
    unit = (REPO / "deploy" / "systemd" / "egressd.service").read_text()
    assert "ExecStart=/usr/local/bin/egressd serve --config /etc/egressd/egressd.toml" in unit
    assert "NoNewPrivileges=yes" in unit and "CapabilityBoundingSet=\n" in unit
    # Where this test's egressd is: systemd checks that the command exists.
    (tmp_path / "egressd.service").write_text(unit.replace("/usr/local/bin/egressd", str(EGRESSD)))
    env = {k: v for k, v in os.environ.items() if k != "SYSTEMD_LOG_LEVEL"} | {"SYSTEMD_LOG_LEVEL": "warning"}
    done = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "egressd.service")],
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_the_example_config_is_one_egressd_takes(tmp_path: Path) -> None:
    config = tmp_path / "egressd.toml"
    config.write_bytes((REPO / "examples" / "egressd.toml").read_bytes())
    config.chmod(0o600)
    settings = load_settings({}, config)
    assert settings.allow == ["pypi.org", "files.pythonhosted.org"] and settings.log_format == "text"
