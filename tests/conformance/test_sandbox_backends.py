"""The ``egressd.sandbox.backend.Sandbox`` contract, held against both backends: bubblewrap and Docker.

Each test runs once per backend, on a real sandbox made the way ``egressd run``
makes it (``SandboxSession`` / ``DockerSession``). What one backend does and the
other does not is a failure here, whatever either's own tests say.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from egressd.config.settings import load_settings
from egressd.sandbox.backend import EXIT_MEMORY, EXIT_TIMEOUT, Sandbox
from egressd.sandbox.limits import Limits
from tests.harness import have, require


def _bwrap_session(settings: Any, work: Path) -> Any:
    require(os.geteuid() == 0, "the bubblewrap backend needs root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter"):
        require(have(tool), f"{tool} is not installed")
    from egressd.cli.wiring.session import SandboxSession

    return SandboxSession(settings, workdir=work, task="conformance")


async def _docker_session(settings: Any, work: Path) -> Any:
    from egressd.cli.wiring.docker_session import DockerSession
    from egressd.sandbox.docker.engine import DockerEngine
    from tests.fakes import dockerbed

    ok, why = dockerbed.engine_answers()
    require(ok, why)
    async with DockerEngine.connect() as engine:
        block = await dockerbed.free_test_range(engine)
    return DockerSession(settings, workdir=work, task="conformance", net_range=str(block),
                         labels=dockerbed.TEST_LABELS, egressd_image=dockerbed.EGRESSD_IMAGE)  # fmt: skip


@pytest.fixture(params=["bwrap", "docker"])
async def session(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    # A working directory as a real project's: an ordinary user's, reachable by that user.
    work = Path(tempfile.mkdtemp(prefix="egressd-conformance-"))
    os.chown(work, 1000, 1000)
    settings = load_settings({"allow": [], "audit_log": str(tmp_path / "audit.jsonl")})
    try:
        made = _bwrap_session(settings, work) if request.param == "bwrap" else await _docker_session(settings, work)
        async with made as entered:
            yield entered
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def test_the_box_is_a_sandbox(session: Any) -> None:
    assert isinstance(session.box, Sandbox)


async def test_a_commands_status_and_output_come_back(session: Any) -> None:
    obs = await session.box.run(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (obs.exit_code, obs.stdout, obs.stderr, obs.timed_out) == (7, "out\n", "err\n", False)


async def test_the_command_runs_as_the_working_directorys_owner(session: Any) -> None:
    obs = await session.box.run(["sh", "-c", "id -u; id -g; pwd"])
    assert obs.stdout.split() == ["1000", "1000", "/work"], obs.stderr


# Issue 27: the two backends' run() had diverged on why a command ended. The
# reason is the limit that ended it, one of them: exit 124 and timed_out alone,
# exit 137 and memory_exceeded alone, or the command's own status and neither.
_ALLOCATE = "x = bytearray(1 << 29); print(len(x))"  # 512 MiB, past the 64 MiB below
_BOUNDS = Limits(timeout_s=2, memory_mb=64)


def _reason(obs: Any) -> tuple[int, bool, bool]:
    return obs.exit_code, obs.timed_out, obs.memory_exceeded


async def test_past_its_time_limit_a_command_is_killed_with_124(session: Any) -> None:
    obs = await session.box.run(["sleep", "30"], limits=_BOUNDS)
    assert _reason(obs) == (EXIT_TIMEOUT, True, False), obs
    assert obs.duration_s < 15, obs  # killed at its limit, not left to finish


async def test_past_its_time_limit_after_a_child_ran_out_of_memory_the_reason_is_the_time(session: Any) -> None:
    # The memory limit killed a child, the command lived on: the time limit is what ended it.
    obs = await session.box.run(["sh", "-c", f"python3 -c '{_ALLOCATE}'; echo $?; sleep 30"], limits=_BOUNDS)
    assert _reason(obs) == (EXIT_TIMEOUT, True, False), obs
    assert obs.stdout == "137\n", obs  # the child was killed for memory: the test did what it says


async def test_past_its_memory_limit_a_command_is_killed_with_137(session: Any) -> None:
    obs = await session.box.run(["python3", "-c", _ALLOCATE], limits=_BOUNDS)
    assert _reason(obs) == (EXIT_MEMORY, False, True), obs


async def test_a_command_that_kills_itself_with_sigkill_is_its_own_137(session: Any) -> None:
    obs = await session.box.run(["sh", "-c", "kill -9 $$"], limits=_BOUNDS)
    assert _reason(obs) == (128 + signal.SIGKILL, False, False), obs


async def test_output_past_max_output_is_cut_and_counted(session: Any) -> None:
    obs = await session.box.run(["sh", "-c", "head -c 100000 /dev/zero | tr '\\000' a"], max_output=1000)
    assert obs.stdout.startswith("a" * 1000) and obs.stdout_truncated == 99000


async def test_the_working_directory_persists_between_commands_and_tmp_does_not(session: Any) -> None:
    first = await session.box.run(["sh", "-c", "echo kept > kept && echo gone > /tmp/gone"])
    assert first.exit_code == 0, first.stderr
    second = await session.box.run(["sh", "-c", "cat kept; cat /tmp/gone"])
    assert second.stdout == "kept\n" and second.exit_code != 0


async def test_work_is_the_users_directory_itself(session: Any) -> None:
    # Issue 26: an engine that did not see egressd's stage mounted an empty root-owned directory at /work.
    given = session.box.workdir / "given.txt"
    given.write_text("from the host\n")
    os.chown(given, 1000, 1000)
    obs = await session.box.run(["sh", "-c", "cat given.txt && echo from the sandbox > made.txt"])
    assert (obs.exit_code, obs.stdout) == (0, "from the host\n"), obs.stderr
    assert (session.box.workdir / "made.txt").read_text() == "from the sandbox\n"


async def test_stdin_is_the_descriptor_given_else_empty(session: Any, tmp_path: Path) -> None:
    given = tmp_path / "stdin"
    given.write_text("hello\n")
    fd = os.open(given, os.O_RDONLY)
    try:
        obs = await session.box.run(["cat"], stdin=fd)
    finally:
        os.close(fd)
    assert obs.stdout == "hello\n"
    assert (await session.box.run(["cat"])).stdout == ""


async def test_copy_out_takes_regular_files_and_never_a_link(session: Any, tmp_path: Path) -> None:
    obs = await session.box.run(["sh", "-c", "mkdir dist && echo wheel > dist/a.whl && ln -s /etc/passwd dist/b.whl"])
    assert obs.exit_code == 0, obs.stderr
    out = tmp_path / "out"
    out.mkdir()
    report = await session.box.copy_out(["dist/*.whl", "nothing/*"], out)
    assert (out / "dist" / "a.whl").read_text() == "wheel\n" and not (out / "dist" / "b.whl").exists()
    assert report.copied == ["dist/a.whl"] and report.unmatched == ["nothing/*"]
    assert [name for name, _ in report.skipped] == ["dist/b.whl"]
