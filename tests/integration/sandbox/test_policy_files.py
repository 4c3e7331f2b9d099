"""The sandbox cannot rewrite the policy of a later run (issue 26, item 1).

DESIGN.md, "Policy": files that shape policy or hold secrets (config, allow
file, audit log, transcript, token files) are never inside a run's working
directory. The attacker is the sandboxed command: it owns the working
directory, so an allow file or config there is its to rewrite (it replaces the
file by a rename, whoever owned it), and the next run, same command line,
would start under its policy (``*.evil.test`` allowed, ``learn = true``).
Each such run is refused before anything starts: exit 125, one line naming
the setting, and the command never ran (its marker file is not there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import have, require

EGRESSD = str(Path(sys.executable).with_name("egressd"))
EXIT_CANNOT_START = 125
ALLOW = 'allow = ["origin.test"]\n'
CONFIG = 'deny = ["leak.test"]\n'
# What run 1 would do to the files it can reach: replace them (the directory is its own).
REWRITE = (
    "printf 'allow = [\"*.evil.test\"]\\n' > .new && mv -f .new allow.toml; "
    "printf 'learn = true\\nallow_private = [\"0.0.0.0/0\"]\\n' > .new && mv -f .new egressd.toml; "
    "touch ran"
)


@pytest.fixture(autouse=True)
def _needs_root_and_tools() -> None:
    require(os.geteuid() == 0, "egressd run needs root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter"):
        require(have(tool), f"{tool} is not installed")


def _egressd(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and "proxy" not in k.lower()}
    return subprocess.run(
        [EGRESSD, "run", "--audit-log", str(tmp_path / "audit.jsonl"), *args, "--", "sh", "-c", REWRITE],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env=base | {"XDG_STATE_HOME": str(tmp_path / "state")} | env,
    )


def _project(workdir: Path) -> tuple[Path, Path]:
    allow, config = workdir / "allow.toml", workdir / "egressd.toml"
    allow.write_text(ALLOW)
    config.write_text(CONFIG)
    return allow, config


def _assert_refused_before_start(result: subprocess.CompletedProcess[str], workdir: Path, setting: str) -> None:
    assert result.returncode == EXIT_CANNOT_START, result.stderr
    assert f"bad setting {setting}" in result.stderr and "inside the working directory" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (workdir / "ran").exists(), "the command ran"
    assert (workdir / "allow.toml").read_text() == ALLOW
    assert (workdir / "egressd.toml").read_text() == CONFIG


@pytest.mark.parametrize("backend", ["bwrap", "docker"])
def test_an_allow_file_inside_the_working_directory_is_refused_before_the_run(
    tmp_path: Path, workdir: Path, backend: str
) -> None:
    # `egressd audit suggest > allow.toml` in the project, then `egressd run --workdir "$PWD" --allow-file allow.toml`.
    allow, _ = _project(workdir)
    result = _egressd(tmp_path, "--backend", backend, "--workdir", str(workdir), "--allow-file", str(allow))
    _assert_refused_before_start(result, workdir, "allow_file")


def test_an_allow_file_reached_through_a_link_to_the_working_directory_is_refused(
    tmp_path: Path, workdir: Path
) -> None:
    _project(workdir)
    elsewhere = tmp_path / "project"
    elsewhere.symlink_to(workdir)
    result = _egressd(tmp_path, "--workdir", str(workdir), "--allow-file", str(elsewhere / "allow.toml"))
    _assert_refused_before_start(result, workdir, "allow_file")


def test_an_allow_file_not_made_yet_inside_the_working_directory_is_refused(tmp_path: Path, workdir: Path) -> None:
    # The first *always* answer would make it there, for the command to rewrite.
    _project(workdir)
    result = _egressd(tmp_path, "--workdir", str(workdir), "--allow-file", str(workdir / "later" / "allow.toml"))
    _assert_refused_before_start(result, workdir, "allow_file")


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_a_config_file_inside_the_working_directory_is_refused_before_the_run(
    tmp_path: Path, workdir: Path, how: str
) -> None:
    _, config = _project(workdir)
    if how == "flag":
        result = _egressd(tmp_path, "--workdir", str(workdir), "--config", str(config))
    else:
        result = _egressd(tmp_path, "--workdir", str(workdir), EGRESSD_CONFIG=str(config))
    _assert_refused_before_start(result, workdir, "config")


def test_a_secret_file_inside_the_working_directory_is_refused_before_the_run(tmp_path: Path, workdir: Path) -> None:
    # The command would read the secret (it is egressd's, never the sandbox's) and could replace it.
    _project(workdir)
    secret = workdir / "webhook.secret"
    secret.write_text("whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0\n")
    secret.chmod(0o600)
    result = _egressd(tmp_path, "--workdir", str(workdir), EGRESSD_WEBHOOK_SECRET_FILE=str(secret))
    _assert_refused_before_start(result, workdir, "webhook_secret_file")


def test_policy_files_outside_the_working_directory_still_run(tmp_path: Path, workdir: Path) -> None:
    # The placement the docs now show: the project's policy beside it, not in it.
    _project(workdir)
    allow, config = tmp_path / "allow.toml", tmp_path / "egressd.toml"
    allow.write_text(ALLOW)
    config.write_text(CONFIG)
    result = _egressd(tmp_path, "--workdir", str(workdir), "--allow-file", str(allow), "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert (workdir / "ran").exists()
    assert allow.read_text() == ALLOW and config.read_text() == CONFIG  # out of the command's reach


def test_egressd_agent_refuses_an_allow_file_inside_the_working_directory_before_the_run(
    tmp_path: Path, workdir: Path
) -> None:
    allow, _ = _project(workdir)
    script = tmp_path / "script.json"
    script.write_text(f'[{{"command": "{REWRITE.replace(chr(34), chr(92) + chr(34))}"}}, {{"final": "done"}}]')
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and "proxy" not in k.lower()}
    result = subprocess.run(
        [EGRESSD, "agent", "--task", "t", "--model", f"script:{script}", "--workdir", str(workdir),
         "--allow-file", str(allow), "--audit-log", str(tmp_path / "audit.jsonl")],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env=base | {"XDG_STATE_HOME": str(tmp_path / "state")},
    )
    _assert_refused_before_start(result, workdir, "allow_file")
    assert "sandbox ready" not in result.stderr
