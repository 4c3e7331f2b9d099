"""A command loads what it needs and no more (issue 29): `egressd --version` and `egressd pending` used to
import the sandbox, Docker and agent modules, a second at every start. What a fresh process imported is
checked, not how long it took (that is bench/startup.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from egressd.cli.flags import subcommand as _subcommand
from egressd.cli.main import ALL, build_parser

# What a command that starts no proxy, sandbox or agent must not load.
HEAVY = ("egressd.cli.wiring.service", "egressd.cli.wiring.docker_session", "egressd.agent.loop",
         "egressd.sandbox.bwrap", "aiodocker", "slack_sdk")  # fmt: skip


def _imported_by(argv: list[str], tmp_path: Path) -> tuple[int, str, set[str]]:
    """Run egressd's main with ``argv`` in a fresh interpreter; its exit, its output and every module it imported."""
    probe = (
        "import json, sys\n"
        "from egressd.cli.main import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
        "sys.exit(code or 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, timeout=60)
    return done.returncode, done.stdout, set(json.loads(done.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["pending"], ["serve", "--help"], ["audit", "--help"]])
def test_a_command_that_starts_nothing_heavy_imports_nothing_heavy(tmp_path: Path, argv: list[str]) -> None:
    code, out, modules = _imported_by(argv, tmp_path)
    assert code == (2 if argv == ["pending"] else 0), out  # pending: no egressd runs here, it says so
    assert not [name for name in HEAVY if name in modules], sorted(name for name in HEAVY if name in modules)


def test_run_still_gets_every_argument_of_its_own(tmp_path: Path) -> None:
    code, out, modules = _imported_by(["run", "--help"], tmp_path)
    assert code == 0 and "--copy-out" in out and "--backend" in out and "--allow" in out, out
    assert "egressd.cli.wiring.docker_session" in modules  # loaded because run was asked for


def test_the_subcommand_is_the_first_word_that_is_no_option() -> None:
    assert _subcommand(["--version"]) is None and _subcommand([]) is None
    assert _subcommand(["run", "--allow", "x", "--", "sh"]) == "run"
    assert _subcommand(["-h", "agent"]) == "agent"
    # The whole parser (the reference, the README's checks) still has every subcommand's arguments.
    assert "--copy-out" in build_parser(ALL).format_help() or build_parser(ALL).parse_args(
        ["run", "--copy-out", "a", "--", "true"]).copy_out == ["a"]  # fmt: skip


@pytest.mark.parametrize("argv", [["pending"], ["allow", "a-1"], ["deny", "a-1"]])
def test_with_no_egressd_running_the_approval_commands_say_so(tmp_path: Path, argv: list[str]) -> None:
    egressd = Path(sys.executable).parent / "egressd"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(tmp_path)}
    done = subprocess.run([egressd, *argv], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("egressd: no egressd is running"), done.stderr
    assert "Traceback" not in done.stderr and "aiohttp" not in done.stderr
