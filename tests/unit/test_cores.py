"""``workers = 0`` resolves to the cores egressd may use: its affinity, lowered by a cgroup v2 quota."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from egressd.cli.wiring.errors import StartupError
from egressd.cli.wiring.workers import process_count
from egressd.config.cores import own_cgroup, quota_cores, usable_cores
from egressd.config.settings import Settings


@pytest.mark.parametrize(
    ("line", "cores"),
    [("max 100000", None), ("50000 100000", 1), ("200000 100000", 2), ("250000 100000", 3), ("garbage", None),
     ("0 100000", None), ("x 100000", None)],
)  # fmt: skip
def test_a_quota_allows_its_cores_rounded_up(line: str, cores: int | None) -> None:
    assert quota_cores(line) == cores


def test_the_v2_line_names_the_cgroup() -> None:
    assert own_cgroup("1:name=systemd:/old\n0::/system.slice/egressd.service\n") == "/system.slice/egressd.service"
    assert own_cgroup("1:cpu:/only-v1\n") is None


def _in_cgroup(tmp_path: Path, path: str) -> tuple[Path, Path, Path]:
    """A cgroup tree under tmp_path and a /proc/self/cgroup naming ``path`` in it: (root, membership, directory)."""
    root = tmp_path / "cgroup"
    directory = root / path.lstrip("/")
    directory.mkdir(parents=True)
    membership = tmp_path / "membership"
    membership.write_text(f"4:memory:/elsewhere\n0::{path}\n")
    return root, membership, directory


def test_without_a_quota_every_cpu_of_the_affinity_counts(tmp_path: Path) -> None:
    root, membership, _ = _in_cgroup(tmp_path, "/agents/one")
    assert usable_cores(root, membership) == len(os.sched_getaffinity(0))


def test_a_quota_of_half_a_core_gives_one(tmp_path: Path) -> None:
    root, membership, directory = _in_cgroup(tmp_path, "/agents/one")
    (directory / "cpu.max").write_text("50000 100000\n")
    assert usable_cores(root, membership) == 1


def test_an_ancestors_quota_holds_too(tmp_path: Path) -> None:
    root, membership, directory = _in_cgroup(tmp_path, "/agents/one")
    (directory.parent / "cpu.max").write_text("100000 100000\n")
    (directory / "cpu.max").write_text("max 100000\n")
    assert usable_cores(root, membership) == 1


def test_the_root_cgroup_and_no_cgroup_file_leave_the_affinity(tmp_path: Path) -> None:
    root, membership, _ = _in_cgroup(tmp_path, "/")
    assert usable_cores(root, membership) == len(os.sched_getaffinity(0))
    assert usable_cores(root, tmp_path / "absent") == len(os.sched_getaffinity(0))


def test_workers_0_is_one_per_core_and_a_number_is_kept() -> None:
    assert process_count(Settings(workers=0)) == min(64, usable_cores())
    assert process_count(Settings(workers=3)) == 3
    assert process_count(Settings()) == min(64, usable_cores())


def test_where_python_cannot_be_run_again_the_default_is_one_process_and_a_number_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "not-here" / "python3"))
    assert process_count(Settings(workers=1)) == 1
    if usable_cores() > 1:
        assert process_count(Settings()) == 1
        assert "serving from one process" in caplog.text and "cannot run" in caplog.text
    with pytest.raises(StartupError, match="bad setting workers: 2 processes asked for"):
        process_count(Settings(workers=2))
