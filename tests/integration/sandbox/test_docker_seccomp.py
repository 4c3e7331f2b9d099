"""The sandbox container's system-call policy, for real, against the local Docker Engine.

The same probe as the bubblewrap sandbox's (tests/integration/sandbox/test_seccomp.py) runs in a
sandbox container of a real Docker run: every socket family but four, high
bits on the family, socketpair, io_uring, the x32 and i386 ABIs. And why the
family is compared on 32 bits: a 64-bit rule of the kind Docker's default
profile uses is passed by a family with high bits set.

Needs the images from ``bash docker/build.sh`` (CI builds them first).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from egressd.cli.wiring.docker_session import DockerSession
from egressd.cli.wiring.session import SessionError
from egressd.config.settings import load_settings
from egressd.sandbox.docker.engine import DockerEngine
from egressd.sandbox.seccomp import docker_profile
from tests.fakes import dockerbed
from tests.fakes.dockerbed import SANDBOX_IMAGE, TEST_LABELS, free_test_range, leftovers
from tests.harness import require
from tests.integration.sandbox.test_seccomp import PROBE, assert_confined


@pytest.fixture
async def engine() -> AsyncIterator[DockerEngine]:
    ok, why = dockerbed.engine_answers()
    require(ok, why)
    async with DockerEngine.connect() as engine:
        yield engine
        assert await leftovers(engine, "egressd.run", owner_pid=os.getpid()) == []


def _session(tmp_path: Path, block: Any) -> DockerSession:
    settings = load_settings({"allow": [], "audit_log": str(tmp_path / "audit.jsonl")})
    return DockerSession(settings, workdir=None, task="seccomp probe", net_range=str(block), labels=TEST_LABELS,
                         egressd_image=dockerbed.EGRESSD_IMAGE)


async def test_the_docker_sandbox_refuses_foreign_socket_families_io_uring_and_other_abis(
    engine: DockerEngine, tmp_path: Path
) -> None:
    async with _session(tmp_path, await free_test_range(engine)) as session:
        obs = await session.box.run(["python3", "-c", PROBE], capture=True, max_output=1 << 20)
    assert obs.exit_code == 0, obs.stderr
    # i386 calls get runc's bad-architecture action: the process is killed or the call refused.
    assert_confined(json.loads(obs.stdout.strip().splitlines()[-1]), i386_killed=False)


async def test_an_engine_of_another_architecture_is_refused_before_anything_is_created(
    engine: DockerEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = DockerEngine.version

    async def arm64(self: DockerEngine) -> dict[str, Any]:
        return {**await real(self), "Arch": "arm64"}

    async def too_far(*args: Any, **kw: Any) -> list[str]:
        raise AssertionError("the session went on past an engine of another architecture")

    block = await free_test_range(engine)
    monkeypatch.setattr(DockerEngine, "version", arm64)
    monkeypatch.setattr("egressd.cli.wiring.docker_session.clean_leftovers", too_far)  # the first step after the check
    with pytest.raises(SessionError, match="written for x86_64 and this machine is arm64"):
        async with _session(tmp_path, block):
            pass


# A 64-bit comparison, the kind Docker's default profile (since Docker 23) refuses
# AF_VSOCK with: allow below 38, 39, above 40.
_DOCKERS_SOCKET_RULES = [
    {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 38, "op": "SCMP_CMP_LT"}]},
    {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 39, "op": "SCMP_CMP_EQ"}]},
    {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 40, "op": "SCMP_CMP_GT"}]},
]
_SMUGGLE = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for family in (40, (1 << 32) | 40):
    rc = libc.syscall(ctypes.c_ulong(41), ctypes.c_ulong(family), ctypes.c_ulong(1), ctypes.c_ulong(0))
    print(hex(family), "opened" if rc >= 0 else errno.errorcode[ctypes.get_errno()])
"""


async def _run_with_profile(engine: DockerEngine, profile: dict[str, Any], script: str) -> str:
    config = {
        "Image": SANDBOX_IMAGE, "Entrypoint": [""], "Cmd": ["python3", "-c", script], "User": "1000:1000",
        "Labels": dict(TEST_LABELS),
        "HostConfig": {"NetworkMode": "none", "CapDrop": ["ALL"], "ReadonlyRootfs": True,
                       "SecurityOpt": ["no-new-privileges:true", "seccomp=" + json.dumps(profile)]},
    }
    container = await engine.client.containers.create(config)
    try:
        await container.start()
        async with asyncio.timeout(60):
            await container.wait()
        return "".join(await container.log(stdout=True, stderr=True))
    finally:
        await container.delete(force=True)


async def test_a_64_bit_family_rule_is_passed_by_high_bits_and_ours_is_not(engine: DockerEngine) -> None:
    ours = docker_profile()
    theirs = {**ours, "syscalls": [r for r in ours["syscalls"] if "socket" not in r["names"]] + _DOCKERS_SOCKET_RULES}
    plain, smuggled = (await _run_with_profile(engine, theirs, _SMUGGLE)).splitlines()
    # Refused as AF_VSOCK (the default errno: ENOSYS, or EPERM where the engine predates defaultErrnoRet) ...
    assert plain in ("0x28 ENOSYS", "0x28 EPERM")
    assert smuggled == "0x100000028 opened"  # ... and opened as AF_VSOCK all the same
    assert (await _run_with_profile(engine, ours, _SMUGGLE)).split() == [
        "0x28", "EAFNOSUPPORT", "0x100000028", "EAFNOSUPPORT"]
