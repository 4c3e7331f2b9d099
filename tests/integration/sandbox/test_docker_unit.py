"""The hardened systemd unit for a Docker-backend job (deploy/systemd/egressd-docker-job@.service), for real.

systemd is not PID 1 on a test machine, so the unit's own settings are
applied the way systemd applies them: its ``CapabilityBoundingSet`` and
``NoNewPrivileges`` through ``setpriv``, around the unit's ``ExecStart``
(its paths pointed at the test's own). The job must run, and the unit must
hold none of the options that give a service a mount namespace of its own
(the engine would not see egressd's staged working directory: docs/docker.md).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from egressd.sandbox.docker.engine import DockerEngine
from tests import REPO
from tests.harness import require
from tests.integration.sandbox import test_docker
from tests.integration.sandbox.test_docker import EGRESSD, IMAGE, _clean_env, leftovers

engine = test_docker.engine  # the fixture: the local Docker Engine, and nothing of ours left on it after

UNIT = REPO / "deploy" / "systemd" / "egressd-docker-job@.service"
# Options that make systemd start the service in a mount namespace of its own.
MOUNT_NAMESPACE_OPTIONS = (
    "PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateDevices", "ReadOnlyPaths", "ReadWritePaths",
    "InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "ProtectKernelTunables",
    "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "PrivateMounts",
    "MountFlags", "RootDirectory", "RootImage", "ProtectClock", "ProtectHostname", "PrivateNetwork",
)  # fmt: skip


def settings() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            found[key.strip()] = value.strip()
    return found


def test_the_unit_has_no_mount_namespace_of_its_own_and_systemd_accepts_it(tmp_path: Path) -> None:
    unit = settings()
    assert [name for name in MOUNT_NAMESPACE_OPTIONS if name in unit] == []
    assert unit["NoNewPrivileges"] == "yes" and unit["CapabilityBoundingSet"] == "CAP_SYS_ADMIN CAP_NET_ADMIN"
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze is not installed (Debian: systemd)")
    local = tmp_path / "egressd-docker-job@.service"
    local.write_text(UNIT.read_text().replace("/usr/local/bin/egressd", EGRESSD))
    env = {k: v for k, v in os.environ.items() if k != "SYSTEMD_LOG_LEVEL"} | {"SYSTEMD_LOG_LEVEL": "warning"}
    done = subprocess.run(["systemd-analyze", "verify", f"{local}"], capture_output=True, text=True, timeout=60,
                          env=env)  # fmt: skip
    # A template is checked through an instance name; "Requires=docker.service" may be absent from a test machine.
    problems = [line for line in done.stderr.splitlines() if "docker.service" not in line and line.strip()]
    assert problems == [], done.stderr


async def test_a_job_runs_under_the_units_capabilities_and_no_new_privileges(
    engine: DockerEngine, tmp_path: Path
) -> None:
    require(shutil.which("setpriv") is not None, "setpriv (util-linux) applies the unit's capability bounding set")
    unit = settings()
    caps = ",".join("+" + cap.removeprefix("CAP_").lower() for cap in unit["CapabilityBoundingSet"].split())
    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "job.sh").write_text("echo job ran as $(id -u) > /work/out.txt\n")
    for path in (workdir, workdir / "job.sh"):
        os.chown(path, 1000, 1000)
    config = tmp_path / "job.toml"
    config.write_text(f'audit_log = "{tmp_path / "audit.jsonl"}"\nask = false\n')
    exec_start = shlex.split(unit["ExecStart"])
    assert exec_start[:3] == ["/usr/local/bin/egressd", "run", "--backend"]
    command = [
        EGRESSD, *exec_start[1:4], *IMAGE, "--config", str(config), "--workdir", str(workdir),
        *exec_start[exec_start.index("--"):],
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        "setpriv", "--no-new-privs", f"--bounding-set=-all,{caps}", *command,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        env=_clean_env(tmp_path / "s"),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode()
    assert (workdir / "out.txt").read_text() == "job ran as 1000\n"
    assert await leftovers(engine, "egressd.run", owner_pid=proc.pid) == []
