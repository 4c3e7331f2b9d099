"""Allowlist files (``--allow-file``) appended by several processes at once: no answer is lost.

The pure reading and appending is tested in tests/unit/test_allowfile.py; this
one starts processes, so it lives here.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from egressd.config.allowfile import Approved, append_approved, read_allow_file


def _append_many(path: str, worker: int, count: int) -> None:
    for n in range(count):
        append_approved(Path(path), Approved(f"h{worker}-{n}.example", "2026-12-01T00:00:00Z"))


def test_concurrent_appends_from_processes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_append_many, args=(str(path), w, 40)) for w in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    held = read_allow_file(path)
    assert sorted(held.allowed) == sorted(f"h{w}-{n}.example" for w in range(3) for n in range(40))
