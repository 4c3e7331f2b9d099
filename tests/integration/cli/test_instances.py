"""The registry of running instances (issue 16): entries ours alone, never a token, stale ones removed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from egressd.cli.wiring.instances import live_instances, register, register_quietly, registry_dir


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def test_an_entry_is_ours_alone_and_names_the_token_file_not_the_token(tmp_path: Path) -> None:
    token_file = tmp_path / "control.token"
    registration = register(kind="run", control="unix:/tmp/x/control.sock", token_file=token_file, task="build it")
    assert stat.S_IMODE(os.lstat(registry_dir()).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(registration.path).st_mode) == 0o600
    entry = json.loads(registration.path.read_text())
    assert entry["token_file"] == str(token_file) and entry["pid"] == os.getpid() and entry["kind"] == "run"
    [me] = live_instances()
    assert (me.control, me.task, me.shown) == (
        "unix:/tmp/x/control.sock",
        "build it",
        f"egressd run (pid {os.getpid()}): build it",
    )
    registration.remove()
    assert live_instances() == [] and not registration.path.exists()


def test_a_token_given_to_the_registry_goes_to_a_token_file_of_its_own() -> None:
    registration = register_quietly(kind="run", control="http://127.0.0.1:9", token="s3cret-token-value")
    assert registration is not None and registration.own_token_file is not None
    assert "s3cret" not in registration.path.read_text()
    assert registration.own_token_file.read_text().strip() == "s3cret-token-value"
    assert stat.S_IMODE(os.lstat(registration.own_token_file).st_mode) == 0o600
    registration.remove()
    assert not registration.own_token_file.exists()


def test_stale_entries_are_removed_and_foreign_shapes_ignored(tmp_path: Path) -> None:
    mine = register(kind="serve", control="127.0.0.1:3129", token_file=None)
    directory = registry_dir()
    stale = directory / "4194305.aa.json"  # above any pid_max: its process is gone
    stale.write_text(json.dumps({"pid": 4194305, "pid_started": "1", "control": "127.0.0.1:1"}))
    stale.chmod(0o600)
    reused = directory / "1.bb.json"  # pid 1 runs, but not since the time this entry says: not it
    reused.write_text(json.dumps({"pid": 1, "pid_started": "0", "control": "127.0.0.1:1"}))
    reused.chmod(0o600)
    loose = directory / f"{os.getpid()}.cc.json"  # readable by others: not trusted
    loose.write_text(mine.path.read_text())
    loose.chmod(0o644)
    elsewhere = tmp_path / "planted.json"
    elsewhere.write_text(mine.path.read_text())
    elsewhere.chmod(0o600)
    (directory / f"{os.getpid()}.dd.json").symlink_to(elsewhere)  # a link: never followed
    assert [i.control for i in live_instances()] == ["127.0.0.1:3129"]
    assert not stale.exists() and not reused.exists() and loose.exists()
    mine.remove()


def test_a_registry_that_is_a_link_is_not_used(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    registry_dir().parent.mkdir(parents=True)
    registry_dir().symlink_to(target)
    assert register_quietly(kind="serve", control="127.0.0.1:1", token_file=None) is None
    assert list(target.iterdir()) == [] and live_instances() == []
