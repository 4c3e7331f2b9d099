"""docker/compose.fleet.yaml: three sandboxes, each fenced with its own egressd, sharing one PostgreSQL.

Checked offline, as compose itself reads the file (``compose config``): each
sandbox shares its one internal network with its own egressd and nothing
else; no sandbox reaches the database; every egressd reads the state URI
from a file; each sandbox is hardened as compose.yaml's sandbox is. (The
database image comes from a registry, which the test machine cannot reach:
the file is not brought up here; tests/integration/fleet runs the same
settings against a real PostgreSQL.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import REPO
from tests.harness import require

FLEET = REPO / "docker" / "compose.fleet.yaml"
SIDECAR = REPO / "docker" / "compose.yaml"


def _config(path: Path) -> dict[str, Any]:
    if shutil.which("docker-compose"):
        argv = ["docker-compose", "-f", str(path), "config"]
    else:
        require(shutil.which("docker") is not None, "no compose: docker-compose or docker's compose plugin")
        argv = ["docker", "compose", "-f", str(path), "config"]
    env = os.environ | {"EGRESSD_SECRETS": "/srv/egressd-secrets", "EGRESSD_DB_SECRETS": "/srv/egressd-db-secrets"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def fleet() -> dict[str, Any]:
    return _config(FLEET)


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_each_sandbox_shares_its_one_internal_network_with_its_own_egressd_only(fleet: dict[str, Any]) -> None:
    services, networks = fleet["services"], fleet["networks"]
    sandboxes = sorted(name for name in services if name.startswith("sandbox-"))
    assert sandboxes == ["sandbox-1", "sandbox-2", "sandbox-3"]
    for name in sandboxes:
        n = name.removeprefix("sandbox-")
        (network,) = services[name]["networks"]
        assert networks[network]["internal"] is True
        members = {s for s, service in services.items() if network in (service.get("networks") or {})}
        assert members == {name, f"egressd-{n}"}, members
        address = services[f"egressd-{n}"]["networks"][network]["ipv4_address"]
        env = _environment(services[name])
        assert {env[k] for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")} == {
            f"http://{address}:3128"
        }
        assert services[name]["dns"] == [address]
        assert _environment(services[f"egressd-{n}"])["EGRESSD_DNS_ANSWER"] == address


def test_no_sandbox_reaches_the_database_and_every_egressd_reads_the_uri_from_a_file(fleet: dict[str, Any]) -> None:
    services = fleet["services"]
    on_state = {s for s, service in services.items() if "state" in (service.get("networks") or {})}
    assert on_state == {"state-db", "migrate", "approvals", "egressd-1", "egressd-2", "egressd-3"}
    assert fleet["networks"]["state"]["internal"] is True
    for name, service in services.items():
        env = _environment(service)
        assert not any("postgresql://" in value for value in env.values()), name
        assert "EGRESSD_STATE" not in env, name
        if name.startswith("egressd-") or name == "approvals":
            assert env["EGRESSD_STATE_FILE"] == "/run/secrets/egressd/state", name
            assert env["EGRESSD_SHARE_DENIALS"] == "group" and env["EGRESSD_GROUP"] == "compose", name
        if name.startswith("egressd-"):
            assert env["EGRESSD_CONTROL"].startswith("127.0.0.1:"), name  # nobody else reaches a sidecar's API
    assert services["migrate"]["command"] == ["state", "migrate", "--state-file", "/run/secrets/egressd/state"]
    published = {name: service["ports"] for name, service in services.items() if service.get("ports")}
    assert list(published) == ["approvals"], published  # only the fleet's page, and on the host's loopback
    (port,) = published["approvals"]
    assert (port["host_ip"] if isinstance(port, dict) else port.split(":")[0]) == "127.0.0.1", port


def test_each_sandbox_is_hardened_as_the_sidecar_example_is(fleet: dict[str, Any]) -> None:
    reference = _config(SIDECAR)["services"]["sandbox"]
    placement = {"networks", "environment", "dns", "volumes", "depends_on", "build"}
    expected = {k: v for k, v in reference.items() if k not in placement}
    for name in ("sandbox-1", "sandbox-2", "sandbox-3"):
        service = fleet["services"][name]
        assert {k: v for k, v in service.items() if k not in placement} == expected, name
