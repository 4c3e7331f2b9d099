"""deploy/kubernetes/: valid manifests, the security they promise, and a fence that works.

1. yamllint (strict) and kubernetes-validate (strict, against the pinned
   schema version the package bundles: no network; as root, run in a network
   namespace of its own to prove it).
2. The properties a reviewer would check by hand, read from the parsed YAML:
   the agent has no capability and is not root; the fence installer adds
   NET_ADMIN only; nothing is privileged; secrets come from Secret volumes,
   never variables; egressd is a native sidecar probed on /health.
3. egressd's settings in the ConfigMap are settings egressd accepts, and
   their ports are the ones the fence redirects to.
4. The fence itself (fence.nft): checked by ``nft -c``, then applied in a
   fresh network namespace and attacked from the agent's uid: redirected
   where it must be, refused everywhere else, and not one packet out of the
   namespace's only other interface.
5. The pod's network whole: the fence and ``egressd serve`` with the
   ConfigMap's settings, as egressd's uid, in one namespace; the agent's
   uid asks DNS anywhere, dials port 80 anywhere, the proxy and the control
   API: answered by egressd, refused, recorded on its stdout.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from egressd.config.settings import Settings, read_config_file
from tests import REPO
from tests.harness import require, wait_serve_ports

DEPLOY = REPO / "deploy" / "kubernetes"
# The Kubernetes schema the manifests are validated against, from those kubernetes-validate
# bundles. 1.29 is the first with native sidecars on by default; 1.30 is widely deployed.
KUBERNETES_VERSION = "1.30.0"
RESOURCE_FILES = ("configmap.yaml", "pod.yaml", "deployment.yaml", "networkpolicy.yaml")
EGRESSD_UID = 10001
BIN = Path(sys.executable).parent


def _load(name: str) -> dict[str, Any]:
    documents = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]
    assert len(documents) == 1, name
    return documents[0]


def _offline(argv: list[str]) -> list[str]:
    """``argv`` in a network namespace with no interface up, where root can make one."""
    if os.geteuid() == 0 and shutil.which("unshare"):
        return ["unshare", "--net", *argv]
    return argv


def _pod_spec() -> dict[str, Any]:
    return _load("pod.yaml")["spec"]


def _containers(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


# 1. Valid.


def test_yamllint_strict_passes() -> None:
    config = DEPLOY / ".yamllint.yaml"
    result = subprocess.run(
        _offline([sys.executable, "-m", "yamllint", "--strict", "-c", str(config), str(DEPLOY)]),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def validated(files: list[str]) -> None:
    """kubernetes-validate --strict against the pinned schema, offline: each of ``files`` passes."""
    validate = BIN / "kubernetes-validate"
    require(validate.exists(), "kubernetes-validate is not installed (pip install -e '.[test]')")
    result = subprocess.run(
        _offline([str(validate), "--strict", "--kubernetes-version", KUBERNETES_VERSION, *files]),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(files), result.stdout


def test_kubernetes_validate_strict_against_the_pinned_schema() -> None:
    validated([str(DEPLOY / name) for name in RESOURCE_FILES])


def test_the_schema_check_can_fail() -> None:
    # An unknown field is an error under --strict: the validation above is not a formality.
    validate = BIN / "kubernetes-validate"
    require(validate.exists(), "kubernetes-validate is not installed (pip install -e '.[test]')")
    bad = subprocess.run(
        _offline([str(validate), "--strict", "--kubernetes-version", KUBERNETES_VERSION, "-"]),
        input=(DEPLOY / "pod.yaml").read_text().replace("readOnlyRootFilesystem:", "readOnlyRootFilesytem:", 1),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode != 0 and "readOnlyRootFilesytem" in bad.stdout + bad.stderr


def test_kustomization_lists_every_resource_and_the_deployment_runs_the_pod() -> None:
    kustomization = _load("kustomization.yaml")
    assert set(kustomization["resources"]) == set(RESOURCE_FILES) - {"pod.yaml"}
    deployment = _load("deployment.yaml")
    assert deployment["spec"]["template"]["spec"] == _pod_spec()
    assert deployment["spec"]["template"]["metadata"]["labels"] == _load("pod.yaml")["metadata"]["labels"]
    selector = _load("networkpolicy.yaml")["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert selector == deployment["spec"]["selector"]["matchLabels"]


# 2. Secure.


def test_the_agent_has_no_capability_and_no_way_to_gain_one() -> None:
    spec = _pod_spec()
    agent = _containers(spec)["agent"]
    context = agent["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["runAsNonRoot"] is True and context["runAsUser"] not in (0, EGRESSD_UID)
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context.get("privileged", False) is False
    assert context["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
    assert spec["automountServiceAccountToken"] is False  # no API credentials inside
    assert not spec.get("shareProcessNamespace") and not spec.get("hostNetwork") and not spec.get("hostPID")
    # Nothing of egressd's is mounted where the agent can read it.
    assert {m["name"] for m in agent["volumeMounts"]} == {"work", "tmp"}
    assert "envFrom" not in agent
    assert all("valueFrom" not in e for e in agent["env"])


def test_the_fence_installer_adds_net_admin_only_and_nothing_is_privileged() -> None:
    spec = _pod_spec()
    containers = _containers(spec)
    fence = containers["egressd-fence"]
    assert spec["initContainers"][0]["name"] == "egressd-fence"  # before everything else
    assert fence["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert fence["securityContext"]["allowPrivilegeEscalation"] is False
    assert fence["command"][:2] == ["nft", "-f"]
    for name, container in containers.items():
        added = container["securityContext"]["capabilities"].get("add", [])
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        assert added == (["NET_ADMIN"] if name == "egressd-fence" else []), name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert "resources" in container and {"requests", "limits"} <= container["resources"].keys(), name
    for name in ("pod.yaml", "deployment.yaml"):
        document = _load(name)
        assert all(not (key == "privileged" and value is True) for key, value in _walk(document)), name
        assert all(key not in ("hostNetwork", "hostPID", "hostIPC") or value is False for key, value in _walk(document))
        assert all(key != "hostPath" for key, _ in _walk(document)), name


def test_secrets_come_from_a_secret_volume_never_from_variables() -> None:
    spec = _pod_spec()
    volumes = {v["name"]: v for v in spec["volumes"]}
    secret_volumes = [name for name, v in volumes.items() if "secret" in v]
    assert secret_volumes == ["egressd-secrets-in"]
    containers = _containers(spec)
    # Mounted only by the copier, which writes them as egressd's own, mode 0400 (umask 077).
    mounting = [n for n, c in containers.items() for m in c.get("volumeMounts", []) if m["name"] in secret_volumes]
    assert mounting == ["egressd-secrets"]
    copier = containers["egressd-secrets"]
    assert copier["securityContext"]["runAsUser"] == EGRESSD_UID
    assert "umask 077" in copier["command"][-1]
    assert volumes["egressd-secrets"]["emptyDir"]["medium"] == "Memory"
    egressd = containers["egressd"]
    mounts = {m["name"]: m for m in egressd["volumeMounts"]}
    assert mounts["egressd-secrets"]["readOnly"] is True
    # No fsGroup: it would add the group's read bit, and egressd refuses a secret file others may read.
    assert "fsGroup" not in spec.get("securityContext", {})
    for name, container in containers.items():
        for variable in container.get("env", []):
            assert "secretKeyRef" not in variable.get("valueFrom", {}), (name, variable)
            assert not re.search(r"TOKEN|SECRET", variable["name"]) or variable["name"].endswith("_FILE"), variable
        assert all("secretRef" not in source for source in container.get("envFrom", [])), name
    settings = _egressd_toml()
    for key in ("control_token", "slack_bot_token", "slack_app_token", "slack_signing_secret", "webhook_secret"):
        assert key not in settings
    assert settings["control_token_file"].startswith(mounts["egressd-secrets"]["mountPath"] + "/")


def test_egressd_is_a_native_sidecar_probed_on_health_with_its_audit_log_on_stdout() -> None:
    spec = _pod_spec()
    names = [c["name"] for c in spec["initContainers"]]
    egressd = _containers(spec)["egressd"]
    assert egressd["restartPolicy"] == "Always" and names.index("egressd") > names.index("egressd-fence")
    assert egressd["image"] == "egressd:latest" and egressd["imagePullPolicy"] in ("IfNotPresent", "Never")
    assert egressd["securityContext"]["runAsUser"] == EGRESSD_UID
    assert egressd["args"] == ["serve", "--audit-log", "-"]
    control_port = int(_egressd_toml()["control"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in egressd["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = egressd[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert ports[get["port"]] == control_port, probe


def test_egressds_config_is_the_mounted_file_itself_not_a_configmap_volumes_link() -> None:
    # A ConfigMap volume's files are links (name -> ..data/name); egressd opens its config without
    # following one (config/trusted.py), so only a subPath mount (a bind mount of the file) is taken.
    for workload in ("pod.yaml", "deployment.yaml"):
        spec = _load(workload)["spec"]
        spec = spec["template"]["spec"] if "template" in spec else spec
        mounts = [m for m in _containers(spec)["egressd"]["volumeMounts"] if m["name"] == "egressd-config"]
        assert mounts == [
            {"name": "egressd-config", "mountPath": "/etc/egressd/egressd.toml", "subPath": "egressd.toml",
             "readOnly": True}
        ], workload


def test_the_network_policy_allows_only_dns_and_web_ports_off_private_ranges() -> None:
    policy = _load("networkpolicy.yaml")["spec"]
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"} and policy["ingress"] == []
    ports = sorted((p["protocol"], p["port"]) for rule in policy["egress"] for p in rule["ports"])
    assert ports == [("TCP", 53), ("TCP", 80), ("TCP", 443), ("UDP", 53)]
    for rule in policy["egress"]:
        for peer in rule["to"]:
            if "ipBlock" in peer:
                assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"} <= set(
                    peer["ipBlock"]["except"]
                )


# 3. Consistent.


def _egressd_toml() -> dict[str, Any]:
    import tomllib

    return tomllib.loads(_load("configmap.yaml")["data"]["egressd.toml"])


def _fence() -> str:
    return str(_load("configmap.yaml")["data"]["fence.nft"])


def test_the_configmap_settings_are_egressds_and_match_the_fence(tmp_path: Path) -> None:
    path = tmp_path / "egressd.toml"
    path.write_text(_load("configmap.yaml")["data"]["egressd.toml"])
    values = read_config_file(path)
    assert set(values) <= set(Settings.model_fields), set(values) - set(Settings.model_fields)
    port = {
        k: int(str(values[k]).rsplit(":", 1)[1])
        for k in ("listen", "dns_listen", "transparent_tls", "transparent_http")
    }
    for k in ("listen", "dns_listen", "transparent_tls", "transparent_http"):
        assert str(values[k]).startswith("127.0.0.1:"), k  # the redirect lands on 127.0.0.1
    fence = _fence()
    assert f"tcp dport 443 redirect to :{port['transparent_tls']}" in fence
    assert f"tcp dport 80 redirect to :{port['transparent_http']}" in fence
    assert f"udp dport 53 redirect to :{port['dns_listen']}" in fence
    assert f"tcp dport 53 redirect to :{port['dns_listen']}" in fence
    assert f"meta skuid != {EGRESSD_UID} jump agent" in fence
    control_port = int(str(values["control"]).rsplit(":", 1)[1])
    assert f"tcp dport {control_port} drop" in fence
    agent = _containers(_pod_spec())["agent"]
    proxy = {e["name"]: e["value"] for e in agent["env"]}
    assert proxy["HTTPS_PROXY"] == f"http://{values['listen']}"


# 4. The fence works.


@pytest.fixture
def netns() -> Iterator[str]:
    require(os.geteuid() == 0, "the fence tests need root (a network namespace of their own, nftables)")
    for tool in ("ip", "nft"):
        require(shutil.which(tool) is not None, f"{tool} is not installed")
    # Not egd-*: that prefix is the sandbox's, whose leftover cleaning (in any egressd run) removes such namespaces.
    name = f"kubefence-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)


def _in(netns: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", netns, *argv], input=stdin, capture_output=True, text=True, timeout=60
    )


def test_nft_accepts_the_fence(netns: str, tmp_path: Path) -> None:
    rules = tmp_path / "fence.nft"
    rules.write_text(_fence())
    checked = _in(netns, "nft", "-c", "-f", str(rules))
    assert checked.returncode == 0, checked.stderr
    # And refuses a broken one: the check is real.
    rules.write_text(_fence().replace("redirect to", "redirect too", 1))
    assert _in(netns, "nft", "-c", "-f", str(rules)).returncode != 0


# Run as root inside the namespace: listeners as egressd's uid, then probes from a child that
# became the agent's uid (1000) or egressd's. 192.0.2.2 is behind a veth of its own: a packet
# there would be counted in its tx_packets.
_PROBE = textwrap.dedent(
    """
    import json, os, socket, sys

    EGRESSD, AGENT = 10001, 1000

    def listen(host, port, kind=socket.SOCK_STREAM):
        s = socket.socket(socket.AF_INET, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        if kind == socket.SOCK_STREAM:
            s.listen(16)
        s.settimeout(2)
        return s

    os.setegid(EGRESSD); os.seteuid(EGRESSD)  # egressd's sockets belong to its uid
    listeners = {
        "proxy": listen("127.0.0.1", 3128), "control": listen("0.0.0.0", 3129),
        "tls": listen("127.0.0.1", 10443), "http": listen("127.0.0.1", 10080),
        "dns": listen("127.0.0.1", 10053, socket.SOCK_DGRAM),
    }
    os.seteuid(0); os.setegid(0)
    listeners["elsewhere"] = listen("127.0.0.2", 443)  # a loopback "origin" egressd may reach itself

    def as_user(uid, what, host, port, udp=False):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.setgroups([]); os.setgid(uid); os.setuid(uid)
            try:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
                s.settimeout(2)
                if udp:
                    s.sendto(b"q", (host, port))
                    data, peer = s.recvfrom(64)
                    out = f"reply {data.decode()} from {peer[0]}:{peer[1]}"
                else:
                    s.connect((host, port))
                    out = "connected"
            except OSError as exc:
                out = f"error {exc.errno}"
            os.write(w, out.encode()); os._exit(0)
        os.close(w)
        landed = None
        if not udp and what:
            try:
                conn, _ = listeners[what].accept()
                landed = what
                conn.close()
            except OSError:
                landed = None
        elif udp and what:
            try:
                data, peer = listeners[what].recvfrom(64)
                listeners[what].sendto(b"a", peer)
                landed = what
            except OSError:
                landed = None
        os.waitpid(pid, 0)
        result = os.read(r, 256).decode()
        os.close(r)
        return {"result": result, "landed": landed}

    cases = {
        "agent_https_anywhere": as_user(AGENT, "tls", "192.0.2.2", 443),
        "agent_http_anywhere": as_user(AGENT, "http", "192.0.2.2", 80),
        "agent_dns_anywhere": as_user(AGENT, "dns", "192.0.2.2", 53, udp=True),
        "agent_proxy": as_user(AGENT, "proxy", "127.0.0.1", 3128),
        "agent_other_port": as_user(AGENT, None, "192.0.2.2", 8443),
        "agent_other_udp": as_user(AGENT, None, "192.0.2.2", 123, udp=True),
        "agent_control": as_user(AGENT, "control", "127.0.0.1", 3129),
        "agent_loopback_443": as_user(AGENT, "tls", "127.0.0.2", 443),
        "egressd_loopback_443": as_user(EGRESSD, "elsewhere", "127.0.0.2", 443),
        "egressd_control": as_user(EGRESSD, "control", "127.0.0.1", 3129),
    }
    print(json.dumps(cases))
    """
)


def test_the_fence_redirects_the_agent_to_egressd_and_drops_everything_else(netns: str, tmp_path: Path) -> None:
    for argv in (
        ["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", "outside", "type", "veth", "peer", "name", "outside-peer"],
        ["ip", "addr", "add", "192.0.2.1/24", "dev", "outside"],
        ["ip", "link", "set", "outside", "up"],
        ["ip", "link", "set", "outside-peer", "up"],
    ):
        done = _in(netns, *argv)
        assert done.returncode == 0, (argv, done.stderr)
    applied = _in(netns, "nft", "-f", "-", stdin=_fence())
    assert applied.returncode == 0, applied.stderr
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    ran = _in(netns, sys.executable, "-I", str(probe))
    assert ran.returncode == 0, ran.stderr
    cases = json.loads(ran.stdout)
    # A dropped packet: EPERM at once (UDP) or a connect that times out (TCP retries its SYN).
    refused = {f"error {errno.EPERM}", "error None"}
    # Redirected to egressd's listeners, whatever the destination named.
    assert cases["agent_https_anywhere"] == {"result": "connected", "landed": "tls"}
    assert cases["agent_http_anywhere"] == {"result": "connected", "landed": "http"}
    assert cases["agent_dns_anywhere"] == {"result": "reply a from 192.0.2.2:53", "landed": "dns"}
    assert cases["agent_proxy"] == {"result": "connected", "landed": "proxy"}
    assert cases["agent_loopback_443"] == {"result": "connected", "landed": "tls"}
    # Dropped: another port, other UDP, and egressd's control API.
    assert cases["agent_other_port"]["result"] in refused
    assert cases["agent_other_udp"]["result"] in refused
    assert cases["agent_control"]["result"] in refused and cases["agent_control"]["landed"] is None
    # egressd's own uid is not redirected: it reaches what it dials.
    assert cases["egressd_loopback_443"] == {"result": "connected", "landed": "elsewhere"}
    assert cases["egressd_control"] == {"result": "connected", "landed": "control"}
    # Not one packet left by the namespace's other interface.
    shown = _in(netns, "ip", "-s", "-j", "link", "show", "outside")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)[0]["stats64"]["tx"]["packets"] == 0, shown.stdout


# The pod's network, whole: the fence, and egressd run with the ConfigMap's own settings as
# its uid, in one namespace; the agent's uid tries its ways out. Nothing is allowlisted for it
# here, so every attempt must end at egressd, refused, and be on egressd's stdout.
_AGENT = textwrap.dedent(
    """
    import json, socket, struct

    def dns(name):
        query = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
        query += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\\0" + struct.pack(">HH", 1, 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(5)
        s.sendto(query, ("192.0.2.53", 53))
        reply, peer = s.recvfrom(512)
        return {"peer": f"{peer[0]}:{peer[1]}", "answer": socket.inet_ntoa(reply[-4:])}

    def http(host, port, request):
        try:
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(request)
            return s.recv(4096).decode(errors="replace")
        except OSError as exc:
            return f"error {exc.errno}"

    CONNECT = b"CONNECT blocked.example:443 HTTP/1.1\\r\\nHost: blocked.example:443\\r\\n\\r\\n"
    print(json.dumps({
        "dns": dns("blocked.example"),
        "transparent_http": http("192.0.2.80", 80, b"GET / HTTP/1.1\\r\\nHost: blocked.example\\r\\n\\r\\n"),
        "proxy": http("127.0.0.1", 3128, CONNECT),
        "control": http("127.0.0.1", 3129, b"GET /health HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n"),
    }))
    """
)


def test_the_pod_network_with_egressd_as_configured_refuses_and_records(netns: str) -> None:
    require(shutil.which("setpriv") is not None, "setpriv is not installed (util-linux)")
    egressd = BIN / "egressd"
    runs = subprocess.run(
        ["setpriv", f"--reuid={EGRESSD_UID}", f"--regid={EGRESSD_UID}", "--clear-groups", str(egressd), "--help"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    require(runs.returncode == 0, f"uid {EGRESSD_UID} cannot run {egressd} from this checkout")
    for argv in (
        ["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", "outside", "type", "veth", "peer", "name", "outside-peer"],
        ["ip", "addr", "add", "192.0.2.1/24", "dev", "outside"],
        ["ip", "link", "set", "outside", "up"],
        ["ip", "link", "set", "outside-peer", "up"],
    ):
        done = _in(netns, *argv)
        assert done.returncode == 0, (argv, done.stderr)
    applied = _in(netns, "nft", "-f", "-", stdin=_fence())
    assert applied.returncode == 0, applied.stderr
    # egressd's files, as the pod has them: readable by its uid (pytest's tmp_path is not).
    home = Path(tempfile.mkdtemp(prefix="egressd-kube-"))
    try:
        home.chmod(0o755)
        token = home / "control_token"
        token.write_text("t" * 64)
        token.chmod(0o400)
        os.chown(token, EGRESSD_UID, EGRESSD_UID)
        config = home / "egressd.toml"
        config.write_text(
            _load("configmap.yaml")["data"]["egressd.toml"].replace("/run/secrets/egressd/control_token", str(token))
        )
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "XDG_STATE_HOME": str(home / "state"),
        }
        serve = subprocess.Popen(
            ["ip", "netns", "exec", netns, "setpriv", f"--reuid={EGRESSD_UID}", f"--regid={EGRESSD_UID}",
             "--clear-groups", str(egressd), "serve", "--config", str(config), "--audit-log", "-"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )  # fmt: skip
        try:
            ports = wait_serve_ports(serve)
            assert ports["proxy"] == 3128 and ports["tls"] == 10443 and ports["dns"] == 10053
            agent = subprocess.run(
                ["ip", "netns", "exec", netns, "setpriv", "--reuid=1000", "--regid=1000", "--clear-groups",
                 sys.executable, "-I", "-c", _AGENT],
                capture_output=True, text=True, timeout=60, env=env,
            )  # fmt: skip
            assert agent.returncode == 0, agent.stderr
            seen = json.loads(agent.stdout)
        finally:
            serve.terminate()
            out, err = serve.communicate(timeout=30)
    finally:
        shutil.rmtree(home)
    # DNS to any server is egressd's: every name answered with 127.0.0.1, from where it was asked.
    assert seen["dns"] == {"peer": "192.0.2.53:53", "answer": "127.0.0.1"}
    # Port 80 to anywhere lands on the transparent listener: refused, no one to ask.
    assert seen["transparent_http"].startswith("HTTP/1.1 403"), seen
    assert "X-Egress-Reason: no_approver" in seen["transparent_http"]
    assert seen["proxy"].startswith("HTTP/1.1 403") and "X-Egress-Reason: no_approver" in seen["proxy"]
    # The control API is egressd's alone.
    assert seen["control"].startswith("error"), seen
    records = [json.loads(line) for line in out.splitlines()]  # stdout: records and nothing else
    egress = [(r["kind"], r["host"], r["decision"]) for r in records if r.get("event") == "egress"]
    assert sorted(egress) == [
        ("connect", "blocked.example", "deny"),
        ("dns", "blocked.example", "allow"),  # answered with egressd's address
        ("http", "blocked.example", "deny"),
    ], (egress, err.decode(errors="replace"))
    assert b"DENY  http blocked.example:80" in err  # the log lines went to stderr
    shown = _in(netns, "ip", "-s", "-j", "link", "show", "outside")
    assert json.loads(shown.stdout)[0]["stats64"]["tx"]["packets"] == 0, shown.stdout
