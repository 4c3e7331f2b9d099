"""deploy/kubernetes/fleet/: the sidecar layout made a fleet, checked offline like the layout itself.

1. Valid: every resource, and the sidecar Deployment as the fleet's patch
   leaves it, pass kubernetes-validate (strict, the pinned schema, no
   network); the kustomization lists every file.
2. Secure: nothing runs as root or with a capability; the state URI comes
   from a Secret volume as a file, never a variable or an argument; the
   database's network policy selects exactly the fleet's pods.
3. Working: the settings are egressd's, and a real ``egressd state migrate``
   then a sidecar and the approvals instance, each started with the
   manifests' own arguments and settings on a real PostgreSQL, share an
   approval: held by the sidecar, listed and answered on the approvals
   instance.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from egressd.cli.main import build_parser
from egressd.config.settings import Settings, read_config_file
from tests import REPO
from tests.harness import wait_serve_ports
from tests.postgres import Postgres
from tests.project.test_kubernetes import validated

BASE = REPO / "deploy" / "kubernetes"
FLEET = BASE / "fleet"
RESOURCES = ("migrate-job.yaml", "approvals-configmap.yaml", "approvals-deployment.yaml", "approvals-service.yaml",
             "approvals-networkpolicy.yaml", "state-networkpolicy.yaml")  # fmt: skip
BIN = Path(sys.executable).parent
SECRETS = "/run/secrets/egressd"


def _load(path: Path) -> Any:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(documents) == 1, path
    return documents[0]


def _patched_sidecars() -> dict[str, Any]:
    """deploy/kubernetes/deployment.yaml with the fleet's JSON patch applied (test, replace)."""
    deployment = copy.deepcopy(_load(BASE / "deployment.yaml"))
    for op in _load(FLEET / "sidecar-state.yaml"):
        *parents, last = op["path"].strip("/").split("/")
        node = deployment
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        key = int(last) if isinstance(node, list) else last
        if op["op"] == "test":
            assert node[key] == op["value"], op
        else:
            assert op["op"] == "replace" and key in (range(len(node)) if isinstance(node, list) else node), op
            node[key] = op["value"]
    return deployment


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _sidecar_args() -> list[str]:
    spec = _patched_sidecars()["spec"]["template"]["spec"]
    return next(c for c in spec["initContainers"] if c["name"] == "egressd")["args"]


# 1. Valid.


def test_every_resource_and_the_patched_sidecars_pass_strict_validation(tmp_path: Path) -> None:
    patched = tmp_path / "deployment.yaml"
    patched.write_text(yaml.safe_dump(_patched_sidecars()))
    validated([str(FLEET / name) for name in RESOURCES] + [str(patched)])


def test_the_kustomization_lists_every_file_and_patches_the_sidecar_deployment() -> None:
    kustomization = _load(FLEET / "kustomization.yaml")
    assert kustomization["resources"] == ["../", *RESOURCES]
    assert {p.name for p in FLEET.glob("*.yaml")} == {*RESOURCES, "kustomization.yaml", "sidecar-state.yaml"}
    (patch,) = kustomization["patches"]
    assert patch["path"] == "sidecar-state.yaml"
    assert patch["target"] == {"kind": "Deployment", "name": _load(BASE / "deployment.yaml")["metadata"]["name"]}


# 2. Secure.


def test_nothing_runs_as_root_or_with_a_capability() -> None:
    pods = [_load(FLEET / "migrate-job.yaml"), _load(FLEET / "approvals-deployment.yaml")]
    for pod in pods:
        spec = pod["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
        for container in _containers(spec):
            context = container["securityContext"]
            assert context["runAsUser"] != 0 and context["privileged"] is False, container["name"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}, container["name"]


def test_the_state_uri_is_a_file_from_a_secret_never_a_variable_or_an_argument() -> None:
    sidecar_args = _sidecar_args()
    assert sidecar_args[sidecar_args.index("--state-file") + 1] == f"{SECRETS}/state"
    assert "--state" not in sidecar_args
    migrate = _load(FLEET / "migrate-job.yaml")["spec"]["template"]["spec"]
    assert migrate["containers"][0]["args"] == ["state", "migrate", "--state-file", f"{SECRETS}/state"]
    approvals = _load(FLEET / "approvals-deployment.yaml")["spec"]["template"]["spec"]
    for spec in (migrate, approvals, _patched_sidecars()["spec"]["template"]["spec"]):
        for container in _containers(spec):
            assert not any("STATE" in e["name"] or "postgresql://" in str(e.get("value")) for e in
                           container.get("env", [])), container["name"]  # fmt: skip
            assert not any("postgresql://" in str(a) for a in container.get("args", [])), container["name"]
        secrets = [v for v in spec["volumes"] if "secret" in v]
        assert secrets and all(v["secret"]["secretName"].startswith("egressd-") for v in secrets)


def test_the_database_policy_selects_the_fleets_pods_and_one_port() -> None:
    policy = _load(FLEET / "state-networkpolicy.yaml")["spec"]
    (selector,) = policy["podSelector"]["matchExpressions"]
    names = {
        _load(BASE / "deployment.yaml")["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"],
        _load(FLEET / "approvals-deployment.yaml")["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"],
        _load(FLEET / "migrate-job.yaml")["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"],
    }
    assert selector["key"] == "app.kubernetes.io/name" and set(selector["values"]) == names
    database = [rule for rule in policy["egress"] if "ipBlock" in rule["to"][0]]
    assert [p["port"] for rule in database for p in rule["ports"]] == [5432]
    assert all(rule["to"][0]["ipBlock"]["cidr"].endswith("/32") for rule in database)


# 3. Working.


def test_the_manifests_settings_make_a_working_fleet(tmp_path: Path, postgres: Postgres, database: str) -> None:
    parsed = build_parser().parse_args(_sidecar_args())
    assert parsed.share_denials == "group" and parsed.state_file == f"{SECRETS}/state"
    toml = _load(FLEET / "approvals-configmap.yaml")["data"]["egressd.toml"]
    (tmp_path / "check.toml").write_text(toml)
    assert set(read_config_file(tmp_path / "check.toml")) <= set(Settings.model_fields)

    state = tmp_path / "state"
    state.write_text(postgres.dsn(database))
    state.chmod(0o600)
    token = tmp_path / "control_token"
    token.write_text("k" * 64)
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(tmp_path)}
    migrated = subprocess.run([str(BIN / "egressd"), "state", "migrate", "--state-file", str(state)],
                              capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    config = tmp_path / "approvals.toml"
    config.write_text(toml.replace(f"{SECRETS}/state", str(state)).replace(f"{SECRETS}/control_token", str(token))
                      .replace('"127.0.0.1:3128"', '"127.0.0.1:0"').replace('"0.0.0.0:3129"', '"127.0.0.1:0"'))
    sidecar_argv = [a.replace(f"{SECRETS}/state", str(state)) for a in _sidecar_args()]
    sidecar_argv[sidecar_argv.index("-")] = str(tmp_path / "sidecar.jsonl")
    started: list[subprocess.Popen[bytes]] = []
    try:
        approvals = subprocess.Popen([str(BIN / "egressd"), "serve", "--config", str(config), "--audit-log",
                                      str(tmp_path / "approvals.jsonl")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)  # fmt: skip
        started.append(approvals)
        sidecar = subprocess.Popen([str(BIN / "egressd"), *sidecar_argv, "--listen", "127.0.0.1:0", "--control",
                                    "127.0.0.1:0", "--control-token-file", str(token)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)  # fmt: skip
        started.append(sidecar)
        control = wait_serve_ports(approvals)["control"]
        proxy = wait_serve_ports(sidecar)["proxy"]
        held = subprocess.Popen([sys.executable, "-c", _HOLD, str(proxy)], stdout=subprocess.PIPE)
        started.append(held)
        listed = _until_listed(control, "k" * 64)
        assert listed["host"] == "held.example.test", listed
        request = urllib.request.Request(f"http://127.0.0.1:{control}/approvals/{listed['id']}/deny",
                                         data=b'{"by": "ops"}', method="POST",
                                         headers={"Authorization": f"Bearer {'k' * 64}"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 (loopback)
            assert json.load(response)["decision"] == "deny"
        out, _ = held.communicate(timeout=30)
        assert out.startswith(b"HTTP/1.1 403"), out
    finally:
        for proc in started:
            proc.terminate()
        for proc in started:
            proc.communicate(timeout=30)


_HOLD = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"CONNECT held.example.test:443 HTTP/1.1\\r\\nHost: held.example.test:443\\r\\n\\r\\n")
s.settimeout(60)
sys.stdout.buffer.write(s.recv(200))
"""


def _until_listed(port: int, token: str) -> dict[str, Any]:
    for _ in range(150):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/approvals",
                                         headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 (loopback)
            approvals = json.load(response)["approvals"]
        if approvals:
            return approvals[0]
        time.sleep(0.1)
    raise AssertionError("the sidecar's held request was never listed on the approvals instance")


def test_the_approvals_slack_lines_are_egressds_settings(tmp_path: Path) -> None:
    toml = _load(FLEET / "approvals-configmap.yaml")["data"]["egressd.toml"]
    slack = toml.split("# Slack for the whole fleet", 1)[1].splitlines()[2:]  # the commented settings
    assert slack and all(line.strip().startswith("# ") and " = " in line for line in slack), slack
    uncommented = "\n".join(line for line in toml.splitlines() if not line.strip().startswith("approver ="))
    uncommented += "\n" + "\n".join(line.strip().removeprefix("# ") for line in slack)
    path = tmp_path / "slack.toml"
    path.write_text(uncommented)
    values = read_config_file(path)
    assert set(values) <= set(Settings.model_fields), set(values) - set(Settings.model_fields)
    assert values["slack_relay"] is True and values["approver"] == ["web", "slack"]
