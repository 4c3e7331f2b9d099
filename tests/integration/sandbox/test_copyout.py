"""Copy-out never follows a link on either side (DESIGN.md, "Command line", ``egressd run``).

The attacker is the sandboxed command: it owns the working directory and can
plant links there, and a directory that was an earlier run's working
directory may hold links it planted then. Every "forbidden" place a planted
link points to is a directory this test made under its tmp_path; each test
checks that nothing arrived there, that nothing of the source was changed,
and that the report says what happened.

Three layers: the writer itself (plain files, no sandbox), ``egressd run``
with bubblewrap, and ``egressd run --backend docker`` (and the Docker
sandbox's ``copy_out``) against the local engine.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from egressd.sandbox.copyout import CopyDestination, CopyOutError, CopyReport, check_destination, copy_out
from tests.harness import have, require

EGRESSD = str(Path(sys.executable).with_name("egressd"))


@pytest.fixture
def bed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(working directory with dist/a.whl, destination outside it, a forbidden directory)."""
    work, dest, forbidden = tmp_path / "work", tmp_path / "dest", tmp_path / "forbidden"
    for path in (work / "dist", dest, forbidden):
        path.mkdir(parents=True)
    (work / "dist" / "a.whl").write_text("new wheel")
    return work, dest, forbidden


# -- the writer, on plain files ------------------------------------------------------------


def test_a_link_planted_in_the_destination_is_not_written_through(bed: tuple[Path, Path, Path]) -> None:
    work, dest, forbidden = bed
    (dest / "dist").symlink_to(forbidden)  # as an earlier run whose working directory this was could
    report = copy_out(work, ["dist/*"], dest)
    assert list(forbidden.iterdir()) == []
    assert report.copied == []
    assert dict(report.skipped) == {"dist/a.whl": "the destination has a link at dist (not followed)"}


def test_a_file_link_in_the_destination_is_left_alone(bed: tuple[Path, Path, Path]) -> None:
    work, dest, forbidden = bed
    (forbidden / "authorized_keys").write_text("the owner's keys")
    (dest / "dist").mkdir()
    (dest / "dist" / "a.whl").symlink_to(forbidden / "authorized_keys")
    report = copy_out(work, ["dist/*"], dest)
    assert (forbidden / "authorized_keys").read_text() == "the owner's keys"
    assert (dest / "dist" / "a.whl").is_symlink()
    assert dict(report.skipped) == {"dist/a.whl": "the destination has a link there (left alone)"}


def test_an_existing_file_is_replaced_whole_never_written_in_place(bed: tuple[Path, Path, Path]) -> None:
    work, dest, forbidden = bed
    (dest / "dist").mkdir()
    (dest / "dist" / "a.whl").write_text("old wheel")
    os.link(dest / "dist" / "a.whl", forbidden / "hardlink")  # someone else's name for the same file
    report = copy_out(work, ["dist/*"], dest)
    assert report.copied == ["dist/a.whl"] and (dest / "dist" / "a.whl").read_text() == "new wheel"
    assert (forbidden / "hardlink").read_text() == "old wheel"
    assert [p.name for p in (dest / "dist").iterdir()] == ["a.whl"]  # no temporary file left behind


def test_a_destination_that_is_a_link_is_refused(bed: tuple[Path, Path, Path]) -> None:
    work, dest, forbidden = bed
    (dest / "out").symlink_to(forbidden)
    with pytest.raises(CopyOutError, match="is a link"):
        copy_out(work, ["dist/*"], dest / "out")
    assert list(forbidden.iterdir()) == []


def test_the_working_directory_as_destination_is_refused_and_nothing_is_truncated(
    bed: tuple[Path, Path, Path],
) -> None:
    work, _, _ = bed
    with pytest.raises(CopyOutError, match="inside the working directory"):
        copy_out(work, ["dist/*"], work)
    assert (work / "dist" / "a.whl").read_text() == "new wheel"


def test_a_destination_inside_or_through_the_working_directory_is_refused(bed: tuple[Path, Path, Path]) -> None:
    work, dest, forbidden = bed
    (work / "hop").symlink_to(forbidden / "x", target_is_directory=True)  # the command could retarget it
    (forbidden / "x").mkdir()
    for target in (work / "out", work / "dist", work / "hop" / "..", Path(f"{work}/../work/deeper")):
        with pytest.raises(CopyOutError, match="inside the working directory"):
            copy_out(work, ["dist/*"], target)
    assert sorted(p.name for p in work.iterdir()) == ["dist", "hop"] and list((forbidden / "x").iterdir()) == []


def test_nothing_is_written_into_the_working_directory_below_the_destination(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    work = dest / "w"  # the working directory inside the destination: allowed, but never written to
    (work / "w").mkdir(parents=True)
    (work / "a").write_text("the workdir's own file")
    (work / "w" / "a").write_text("would overwrite it")
    report = copy_out(work, ["w/a"], dest)
    assert (work / "a").read_text() == "the workdir's own file"
    assert dict(report.skipped) == {"w/a": "the destination has the working directory at w (not written to)"}


def test_a_source_that_is_the_destination_file_itself_is_never_copied_onto_itself(
    bed: tuple[Path, Path, Path],
) -> None:
    work, dest, _ = bed
    (dest / "dist").mkdir()
    os.link(work / "dist" / "a.whl", dest / "dist" / "a.whl")  # one file under both names
    report = copy_out(work, ["dist/*"], dest)
    assert (work / "dist" / "a.whl").read_text() == "new wheel"
    assert dict(report.skipped) == {"dist/a.whl": "it is the source file itself"}


def test_a_pattern_matching_nothing_says_so(bed: tuple[Path, Path, Path]) -> None:
    work, dest, _ = bed
    (work / "dist" / "link.whl").symlink_to("/nowhere")
    report = copy_out(work, ["dist/a.whl", "nope/*", "dist/link.whl", "dist"], dest)
    assert report.copied == ["dist/a.whl"]
    assert report.unmatched == ["nope/*", "dist"]  # a skipped match is a match; a directory is not a file
    assert "nothing matched 'nope/*'" in report.lines() and "nothing matched 'dist'" in report.lines()


def test_the_destination_check_before_the_run_needs_no_working_directory_yet(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(CopyOutError, match="is a link"):
        check_destination(tmp_path / "link", None)  # a fresh working directory: the link is still refused
    check_destination(tmp_path / "not-yet", None)
    check_destination(tmp_path / "out", tmp_path / "work")  # beside the working directory: fine
    (tmp_path / "work").mkdir()
    check_destination(tmp_path, tmp_path / "work")  # the working directory inside the destination: fine


def test_the_writer_leaves_nothing_behind_when_a_file_is_over_the_limit(tmp_path: Path) -> None:
    work, dest = tmp_path / "work", tmp_path / "dest"
    work.mkdir()
    report = CopyReport(bytes=5)
    with CopyDestination.open(dest, workdir=work) as out:
        assert out.write("d/big", io.BytesIO(b"x" * 10), report=report, max_bytes=12) == "over the 0 MiB copy-out limit"
        assert out.write("d/small", io.BytesIO(b"x" * 7), report=report, max_bytes=12) is None
    assert [p.name for p in (dest / "d").iterdir()] == ["small"] and report.copied == ["d/small"] and report.bytes == 12


def test_the_writer_leaves_a_directory_in_the_way_alone(tmp_path: Path) -> None:
    work, dest = tmp_path / "work", tmp_path / "dest"
    work.mkdir()
    (dest / "a" / "keep").mkdir(parents=True)
    (dest / "f").write_text("a file, not a directory")
    report = CopyReport()
    with CopyDestination.open(dest, workdir=work) as out:
        assert out.write("a", io.BytesIO(b"x"), report=report, max_bytes=100) == (
            "the destination has something other than a file there (left alone)")
        assert out.write("f/x", io.BytesIO(b"x"), report=report, max_bytes=100) == (
            "the destination has a file at f, not a directory (left alone)")
    assert (dest / "a" / "keep").is_dir() and (dest / "f").read_text() == "a file, not a directory"

def _archive(*members: tuple[str, bytes | None]) -> io.BytesIO:
    """A tar of /work as the engine sends it: (name, data) for files, (name, None) for directories."""
    spool = io.BytesIO()
    with tarfile.open(fileobj=spool, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    spool.seek(0)
    return spool


def test_the_docker_archive_goes_through_the_same_writer(tmp_path: Path) -> None:
    from egressd.sandbox.docker.commands import _extract

    work, dest, forbidden = tmp_path / "work", tmp_path / "dest", tmp_path / "forbidden"
    for path in (work, dest / "sub", forbidden):
        path.mkdir(parents=True)
    (dest / "dist").symlink_to(forbidden)
    (dest / "sub" / "x.whl").symlink_to(forbidden / "x.whl")
    spool = _archive(("work", None), ("work/dist", None), ("work/dist/a.whl", b"wheel"), ("work/sub", None),
                     ("work/sub/x.whl", b"x"), ("work/ok", None), ("work/ok/y.whl", b"y"))
    report = CopyReport()
    with CopyDestination.open(dest, workdir=work) as out:
        _extract(spool, ["dist/*", "sub/*", "ok/*", "nope/*"], out, report, 10, 1 << 20)
    assert list(forbidden.iterdir()) == [] and (dest / "sub" / "x.whl").is_symlink()
    assert report.copied == ["ok/y.whl"] and (dest / "ok" / "y.whl").read_bytes() == b"y"
    assert dict(report.skipped) == {"dist/a.whl": "the destination has a link at dist (not followed)",
                                    "sub/x.whl": "the destination has a link there (left alone)"}
    assert report.unmatched == ["nope/*"]


# -- the Docker sandbox, against the local engine ---------------------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[Any]:
    from egressd.sandbox.docker.engine import DockerEngine
    from tests.fakes import dockerbed

    ok, why = dockerbed.engine_answers()
    require(ok, why)
    async with DockerEngine.connect() as engine:
        yield engine
        assert await dockerbed.leftovers(engine, "egressd.run", owner_pid=os.getpid()) == []


@pytest.fixture
async def docker_session(engine: Any, tmp_path: Path) -> AsyncIterator[Any]:
    """A Docker run's session (its sidecar egressd, no origins) on a working directory of uid 1000."""
    from egressd.cli.wiring.docker_session import DockerSession
    from egressd.config.settings import load_settings
    from tests.fakes.dockerbed import EGRESSD_IMAGE, TEST_LABELS, free_test_range

    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, 1000, 1000)
    settings = load_settings({"allow": [], "audit_log": str(tmp_path / "audit.jsonl")})
    block = await free_test_range(engine)
    async with DockerSession(settings, workdir=work, task="copy-out", net_range=str(block), labels=TEST_LABELS,
                             egressd_image=EGRESSD_IMAGE) as s:
        yield s


async def test_docker_copy_out_refuses_the_working_directory_and_links_and_says_what_matched_nothing(
    docker_session: Any, tmp_path: Path
) -> None:
    box, work = docker_session.box, docker_session.workdir
    forbidden, dest = tmp_path / "forbidden", tmp_path / "dest"
    forbidden.mkdir()
    dest.mkdir()
    obs = await box.run(["sh", "-c", f"mkdir dist && echo wheel > dist/a.whl && ln -s {forbidden} out"])
    assert obs.exit_code == 0, obs.stderr
    for target in (work, work / "dist", work / "out" / "dist"):
        with pytest.raises(CopyOutError):
            await box.copy_out(["dist/*"], target)
    assert (work / "dist" / "a.whl").read_text() == "wheel" + "\n" and list(forbidden.iterdir()) == []
    (dest / "dist").symlink_to(forbidden)  # as an earlier run could have left it
    report = await box.copy_out(["dist/*", "nope"], dest)
    assert list(forbidden.iterdir()) == [] and report.copied == []
    assert report.skipped == [("dist/a.whl", "the destination has a link at dist (not followed)")]
    assert report.unmatched == ["nope"]


# -- egressd run and egressd agent, as a user runs them, on both backends ------------------------


def _needs_bwrap() -> None:
    require(os.geteuid() == 0, "the sandbox tests need root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter"):
        require(have(tool), f"{tool} is not installed")


async def egressd_run(tmp_path: Path, *args: str, dns: Any = None, limit_s: float = 90) -> tuple[int, str, str]:
    """``egressd run ARGS`` as a user runs it; (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "s")
    extra = ["--upstream-dns", f"127.0.0.1:{dns.address[1]}"] if dns is not None else []
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", *extra, "--audit-log", str(tmp_path / "audit.jsonl"), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _plant(forbidden: Path) -> str:
    """A command that records it ran and plants links into every place copy-out might write."""
    return (f"touch /work/ran; mkdir -p /work/out; ln -s {forbidden} /work/out/dist; "
            f"echo planted > /work/dist/a.whl; exit 0")


def _backend(name: str) -> list[str]:
    from tests.fakes.dockerbed import EGRESSD_IMAGE

    return ["--backend", name, "--egressd-image", EGRESSD_IMAGE]


def _give(path: Path, backend: list[str]) -> None:
    """The command runs as the working directory's owner, never root: make it an ordinary user's."""
    os.chown(path, 1000, 1000)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory an ordinary user can reach (tmp_path's parents are root's alone), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="egressd-test-copyout-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _refused_before_the_run(tmp_path: Path, base: Path, backend: list[str], dns: Any = None) -> None:
    work, forbidden = base / "work", base / "forbidden"
    (work / "dist").mkdir(parents=True)
    forbidden.mkdir()
    (work / "dist" / "a.whl").write_text("keep me")
    for path in (work, work / "dist", work / "dist" / "a.whl"):
        _give(path, backend)
    for dest in (work / "out", work, work / "dist" / ".."):
        code, _, err = await egressd_run(
            tmp_path, *backend, "--workdir", str(work), "--copy-out", "dist/*", "--copy-out-dir", str(dest),
            "--", "sh", "-c", _plant(forbidden), dns=dns,
        )
        assert code == 2 and "inside the working directory" in err and "copy-out:" not in err, (dest, code, err)
        assert not (work / "ran").exists(), "the run started"
        assert (work / "dist" / "a.whl").read_text() == "keep me"
        assert list(forbidden.iterdir()) == []


async def _never_through_an_earlier_runs_link(tmp_path: Path, base: Path, backend: list[str], dns: Any = None) -> None:
    shared, work, forbidden = base / "shared", base / "work", base / "forbidden"
    for path in (shared, work, forbidden):
        path.mkdir()
        _give(path, backend)
    # The earlier run: its working directory is where the next run copies to.
    code, _, err = await egressd_run(
        tmp_path, *backend, "--workdir", str(shared), "--",
        "sh", "-c", f"ln -s {forbidden} /work/dist && ln -s {forbidden} /work/out", dns=dns,
    )
    assert code == 0, err
    code, _, err = await egressd_run(
        tmp_path, *backend, "--workdir", str(work), "--copy-out", "dist/*", "--copy-out", "nope/*",
        "--copy-out-dir", str(shared), "--", "sh", "-c", "mkdir dist && echo wheel > dist/a.whl", dns=dns,
    )
    assert code == 0, err
    assert list(forbidden.iterdir()) == []
    assert "copy-out: skipped dist/a.whl: the destination has a link at dist (not followed)" in err
    assert "copy-out: nothing matched 'nope/*'" in err
    # The destination itself a link the earlier run planted: refused before this run starts.
    code, _, err = await egressd_run(
        tmp_path, *backend, "--workdir", str(work), "--copy-out", "dist/*", "--copy-out-dir", str(shared / "out"),
        "--", "sh", "-c", "touch ran", dns=dns,
    )
    assert code == 2 and "is a link" in err and not (work / "ran").exists(), err
    assert list(forbidden.iterdir()) == []


async def test_run_refuses_a_destination_inside_the_working_directory_before_it_starts(
    tmp_path: Path, reachable: Path, dns: Any
) -> None:
    _needs_bwrap()
    await _refused_before_the_run(tmp_path, reachable, _backend("bwrap"), dns)


async def test_run_never_writes_through_a_link_an_earlier_run_planted(
    tmp_path: Path, reachable: Path, dns: Any
) -> None:
    _needs_bwrap()
    await _never_through_an_earlier_runs_link(tmp_path, reachable, _backend("bwrap"), dns)


async def test_agent_refuses_a_destination_inside_the_working_directory_before_a_sandbox_exists(
    tmp_path: Path,
) -> None:
    work, script = tmp_path / "work", tmp_path / "steps.json"
    work.mkdir()
    script.write_text('[{"command": "touch ran"}, {"final": "x"}]')
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "s")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "agent", "--audit-log", str(tmp_path / "audit.jsonl"), "--task", "t", "--model", f"script:{script}",
        "--workdir", str(work), "--copy-out", "*", "--copy-out-dir", str(work / "out"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"inside the working directory" in err and b"sandbox ready" not in err, err
    assert not (work / "ran").exists()


async def test_docker_run_refuses_a_destination_inside_the_working_directory_before_it_starts(
    engine: Any, tmp_path: Path, reachable: Path
) -> None:
    await _refused_before_the_run(tmp_path, reachable, _backend("docker"))


async def test_docker_run_never_writes_through_a_link_an_earlier_run_planted(
    engine: Any, tmp_path: Path, reachable: Path
) -> None:
    await _never_through_an_earlier_runs_link(tmp_path, reachable, _backend("docker"))
