"""Who the sandboxed command is on the host, on both backends alike (DESIGN.md, "The two boundaries", 1).

The command runs as the working directory's owner (uid and gid, no other
group), never as the host's root and with no capability over the host; a
fresh working directory belongs to an unprivileged uid; a root-owned
``--workdir`` is refused (exit 125) before anything is created. What the
command makes belongs to that user on the host, the working directory is
mounted nosuid and nodev, and a root-only file stays unreadable.

Every attack runs ``egressd run`` as a user does (as root, the way ``sudo
egressd run`` runs it) on bubblewrap and on Docker, and looks at the result
from the host: file owners and modes, the sandboxed process's credentials in
the host's /proc, and the mount table.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egressd.sandbox.backend import SandboxError
from egressd.sandbox.bwrap import SANDBOX_GID, SANDBOX_UID, generated_etc, host_layout
from egressd.sandbox.docker.config import LABEL_OWNER, LABEL_RUN
from egressd.sandbox.docker.engine import DockerEngine, clean_leftovers
from egressd.sandbox.identity import refusal, run_as
from egressd.sandbox.stage import STAGE_DIR, remount_flags
from tests.fakes import dockerbed
from tests.harness import have, require

EGRESSD = str(Path(sys.executable).with_name("egressd"))
# An ordinary user's ids, as a real project directory has them (no such user needs to exist).
OWNER_UID, OWNER_GID = 12345, 12346
BACKENDS = ["bwrap", "docker"]


# -- pure parts --------------------------------------------------------------------------


def test_the_command_runs_as_the_owner_and_never_as_root() -> None:
    assert run_as(OWNER_UID, OWNER_GID) == (OWNER_UID, OWNER_GID)
    assert run_as(0, 0) is None
    assert run_as(0, OWNER_GID) is None  # a world-writable root-owned directory is no exception
    assert run_as(OWNER_UID, 0) is None  # group root is root's too
    message = refusal("/srv/x")
    assert "\n" not in message and "/srv/x" in message and "belongs to root" in message
    assert "chown" in message and "--workdir" in message


def test_the_generated_passwd_names_the_owner() -> None:
    etc = generated_etc(nameserver="169.254.100.1", uid=OWNER_UID, gid=OWNER_GID)
    assert f"agent:x:{OWNER_UID}:{OWNER_GID}:" in etc["passwd"]
    assert f"agent:x:{OWNER_GID}:" in etc["group"]


def test_etc_binds_certificates_but_never_private_keys(tmp_path: Path) -> None:
    for name in ("ssl/certs", "ssl/private", "ca-certificates"):
        (tmp_path / "etc" / name).mkdir(parents=True)
    (tmp_path / "etc" / "ssl" / "openssl.cnf").write_text("")
    _, _, etc = host_layout(str(tmp_path))
    assert "ssl/certs" in etc and "ssl/openssl.cnf" in etc and "ca-certificates" in etc
    assert not [name for name in etc if name in ("ssl", "ssl/private") or name.startswith("ssl/private")]


def test_a_stage_is_nosuid_nodev_and_keeps_what_the_mount_beneath_had() -> None:
    flags = remount_flags(os.ST_RDONLY | os.ST_NOEXEC | os.ST_RELATIME)
    assert flags & 0x2 and flags & 0x4  # MS_NOSUID, MS_NODEV
    assert flags & 0x1 and flags & 0x8 and flags & 0x200000  # read-only, noexec, relatime kept
    assert remount_flags(0) & 0x1 == 0 and remount_flags(0) & 0x8 == 0  # nothing added that was not there


# -- for real, on both backends ---------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    require(os.geteuid() == 0, "the identity tests run egressd run as root, as sudo does")
    if name == "bwrap":
        for tool in ("bwrap", "nft", "ip", "nsenter"):
            require(have(tool), f"{tool} is not installed")
    else:
        ok, why = dockerbed.engine_answers()
        require(ok, why)
    return name


@pytest.fixture
def owned_workdir() -> Iterator[Path]:
    """A working directory of an ordinary user (OWNER_UID:OWNER_GID), where that user can reach it."""
    path = Path(tempfile.mkdtemp(prefix="egressd-identity-"))
    os.chown(path, OWNER_UID, OWNER_GID)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def egressd_run(tmp_path: Path, backend: str, *args: str, env: dict[str, str] | None = None,
                      limit_s: float = 120) -> tuple[int, str, str]:
    """``egressd run --backend BACKEND ARGS`` as a user runs it; (exit code, stdout, stderr)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--backend", backend, "--egressd-image", dockerbed.EGRESSD_IMAGE,
        "--audit-log", str(tmp_path / "audit.jsonl"), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        env=base | (env or {}),
    )
    out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def kept_workdir(err: str) -> Path:
    """The fresh working directory ``--keep-workdir`` kept (egressd names it on stderr)."""
    kept = [line for line in err.splitlines() if "working directory kept at " in line]
    assert kept, err
    return Path(kept[0].split("working directory kept at ", 1)[1].strip())


def assert_nothing_mounted_from(workdir: Path) -> None:
    """No mount of ``workdir`` is left on the host (the Docker backend stages one per run)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        assert not line.split()[3].endswith(f"/{workdir.name}"), line  # the mount's root, within its filesystem


async def test_the_command_runs_as_the_workdir_owner_and_its_files_are_theirs(
    backend: str, tmp_path: Path, owned_workdir: Path
) -> None:
    script = "id -u; id -g; id -G; mkdir -p made/sub && echo inside > made/sub/file && echo wrote=$?"
    code, out, err = await egressd_run(tmp_path, backend, "--workdir", str(owned_workdir), "--",
                                       "sh", "-c", script)
    assert code == 0, err
    assert out.split()[:3] == [str(OWNER_UID), str(OWNER_GID), str(OWNER_GID)]  # and no other group
    assert "wrote=0" in out
    for path in (owned_workdir / "made", owned_workdir / "made" / "sub", owned_workdir / "made" / "sub" / "file"):
        info = path.stat()
        assert (info.st_uid, info.st_gid) == (OWNER_UID, OWNER_GID), path
    assert_nothing_mounted_from(owned_workdir)


async def test_on_the_host_the_command_is_the_owner_with_no_capability(
    backend: str, tmp_path: Path, owned_workdir: Path
) -> None:
    # A sleep with a duration no other process has: found in the host's /proc while it runs.
    marker = f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(1000)}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--backend", backend, "--egressd-image", dockerbed.EGRESSD_IMAGE,
        "--audit-log", str(tmp_path / "audit.jsonl"), "--workdir", str(owned_workdir), "--", "sleep", marker,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        env=base,
    )
    status = ""
    try:
        for _ in range(600):
            status = _status_of(["sleep", marker])
            if status:
                break
            await asyncio.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert status, err.decode()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["Uid"].split() == [str(OWNER_UID)] * 4, fields["Uid"]
    assert fields["Gid"].split() == [str(OWNER_GID)] * 4, fields["Gid"]
    assert fields["Groups"].split() in ([], [str(OWNER_GID)])
    for name in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(fields[name], 16) == 0, name
    assert fields["NoNewPrivs"].strip() == "1"
    assert_nothing_mounted_from(owned_workdir)


def _status_of(argv: list[str]) -> str:
    """/proc/PID/status of the host's process running exactly ``argv`` ("" if none)."""
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            if (proc_dir / "cmdline").read_bytes().split(b"\0")[:-1] == [a.encode() for a in argv]:
                return (proc_dir / "status").read_text()
        except OSError:
            continue
    return ""


async def test_a_root_only_file_in_the_workdir_and_the_hosts_private_keys_stay_unreadable(
    backend: str, tmp_path: Path, owned_workdir: Path
) -> None:
    secret = owned_workdir / "root-only"
    marker = f"ROOT-ONLY-{secrets.token_hex(8)}"
    secret.write_text(marker)  # left by an earlier `sudo something` in the project
    os.chmod(secret, 0o600)
    script = "cat root-only; echo cat=$?; ls /etc/ssl/private; echo ls=$?; cat /etc/ssl/private/*.key; echo key=$?"
    code, out, err = await egressd_run(tmp_path, backend, "--workdir", str(owned_workdir), "--",
                                       "sh", "-c", script)
    assert code == 0, err
    assert marker not in out and "cat=1" in out and "Permission denied" in err
    assert "ls=0" not in out and "key=0" not in out and "PRIVATE KEY" not in out
    assert secret.stat().st_uid == 0 and secret.read_text() == marker


async def test_a_setuid_copy_gives_nothing_inside_or_on_the_host(backend: str, tmp_path: Path) -> None:
    script = ("cp /bin/sh x && chmod 4755 x && ls -ln x && ./x -c 'echo euid=$(id -u)';"
              " grep ' /work ' /proc/self/mountinfo")
    code, out, err = await egressd_run(tmp_path, backend, "--keep-workdir", "--", "sh", "-c", script)
    workdir = kept_workdir(err)
    try:
        assert code == 0, err
        assert "euid=0" not in out and f"euid={SANDBOX_UID}" in out
        mount = next(line for line in out.splitlines() if " /work " in line)
        options = mount.split()[5].split(",")
        assert "nosuid" in options and "nodev" in options, mount
        planted = (workdir / "x").stat()
        # The planted binary is no setuid-root program on the host: it is the sandbox user's.
        assert planted.st_uid == SANDBOX_UID and planted.st_uid != 0
        assert not (planted.st_uid == 0 and planted.st_mode & stat.S_ISUID)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert_nothing_mounted_from(workdir)


async def test_a_fresh_workdir_belongs_to_an_unprivileged_uid(backend: str, tmp_path: Path) -> None:
    code, out, err = await egressd_run(tmp_path, backend, "--keep-workdir", "--", "sh", "-c",
                                       "id -u; id -g; echo made > made")
    workdir = kept_workdir(err)
    try:
        assert code == 0, err
        assert out.split()[:2] == [str(SANDBOX_UID), str(SANDBOX_GID)]
        for path in (workdir, workdir / "made"):
            info = path.stat()
            assert (info.st_uid, info.st_gid) == (SANDBOX_UID, SANDBOX_GID), path
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o1777])
async def test_a_root_owned_workdir_is_refused_before_anything_starts(
    backend: str, tmp_path: Path, mode: int
) -> None:
    workdir = tmp_path / "root-owned"
    workdir.mkdir()
    os.chmod(workdir, mode)  # world-writable changes nothing: root owns it
    # Whatever comes first fails loudly: a network range egressd refuses (bwrap), an engine
    # that is not there (Docker). The refusal must come before either is looked at.
    unreachable = {"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    code, out, err = await egressd_run(tmp_path, backend, "--workdir", str(workdir), "--net-range", "10.0.0.0/24",
                                       "--", "touch", "/work/made", env=unreachable)
    assert code == 125, err
    assert err.splitlines() == [f"egressd: {refusal(str(workdir))}"]
    assert not (workdir / "made").exists() and out == ""
    assert not (tmp_path / "audit.jsonl").exists() or "run.start" not in (tmp_path / "audit.jsonl").read_text()


async def test_a_workdir_owned_by_group_root_is_refused(backend: str, tmp_path: Path) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="egressd-identity-"))
    try:
        os.chown(workdir, OWNER_UID, 0)
        code, _, err = await egressd_run(tmp_path, backend, "--workdir", str(workdir), "--", "true")
        assert code == 125 and "belongs to root" in err, err
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def test_a_workdir_its_owner_cannot_reach_is_refused_with_a_reason(tmp_path: Path) -> None:
    """bwrap runs as the owner, so the owner must be able to reach the directory (Docker's engine binds it)."""
    require(os.geteuid() == 0, "needs root")
    for tool in ("bwrap", "nft", "ip", "nsenter"):
        require(have(tool), f"{tool} is not installed")
    shut = Path(tempfile.mkdtemp(prefix="egressd-identity-shut-"))  # 0700, root's
    try:
        workdir = shut / "work"
        workdir.mkdir()
        os.chown(workdir, OWNER_UID, OWNER_GID)
        code, _, err = await egressd_run(tmp_path, "bwrap", "--workdir", str(workdir), "--", "true")
        assert code == 125, err
        assert len(err.splitlines()) == 1 and f"uid {OWNER_UID}" in err and "cannot reach" in err, err
    finally:
        shutil.rmtree(shut, ignore_errors=True)


async def test_the_stage_of_a_killed_docker_run_is_removed_at_the_next_start(tmp_path: Path,
                                                                             owned_workdir: Path) -> None:
    require(os.geteuid() == 0, "needs root")
    ok, why = dockerbed.engine_answers()
    require(ok, why)
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--backend", "docker", "--egressd-image", dockerbed.EGRESSD_IMAGE,
        "--audit-log", str(tmp_path / "audit.jsonl"), "--workdir", str(owned_workdir), "--", "sleep", "60",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        env=base,
    )
    stages: list[Path] = []
    try:
        for _ in range(600):
            stages = _stages_of(proc.pid)
            if stages and _status_of(["sleep", "60"]) or proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # no chance to clean up
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert len(stages) == 1, err.decode()
    assert _mounted(stages[0])  # left behind
    # The killed run's containers and networks are another test's business (test_docker); removed
    # here first, so the next start has only the stage to find.
    async with DockerEngine.connect() as engine:
        key = _run_key(await engine.labelled("egressd.run"), proc.pid)
        for _ in range(300):  # another egressd starting meanwhile may be removing them too
            with contextlib.suppress(SandboxError):
                await clean_leftovers(engine, everything_of=key)
            if not await dockerbed.leftovers(engine, f"egressd.run={key}"):
                break
            await asyncio.sleep(0.1)
    code, _, err = await egressd_run(tmp_path, "docker", "--workdir", str(owned_workdir), "--", "true")
    assert code == 0, err
    assert not _mounted(stages[0]) and not stages[0].exists()
    assert_nothing_mounted_from(owned_workdir)


def _run_key(labelled: tuple[list[dict[str, Any]], ...], pid: int) -> str:
    """The run key of the resources egressd process ``pid`` made."""
    for resources in labelled:
        for resource in resources:
            labels = resource.get("Labels") or {}
            if f":{pid}:" in labels.get(LABEL_OWNER, ""):
                return str(labels[LABEL_RUN])
    raise AssertionError(f"egressd {pid} left nothing on the engine")


def _stages_of(pid: int) -> list[Path]:
    return [p for p in STAGE_DIR.glob("*@*") if p.name.split("@")[0].split(":")[1:2] == [str(pid)]]


def _mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())
