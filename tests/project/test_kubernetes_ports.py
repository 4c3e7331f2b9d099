"""deploy/kubernetes/: the agent holding egressd's ports while egressd restarts answers nobody.

egressd's ports in the pod (3128, 3129, 10053, 10080, 10443) are unprivileged: while its container
restarts, the agent (uid 1000, same network namespace) can bind them itself, and egressd then
cannot start again until the pod is recreated (fail closed: the agent's own traffic is still fenced).
What the fence stops is the impostor being talked to: every packet the agent sends from one of those
ports is dropped, the SYN-ACK of its listener included (the kernel sends it with the listener's
uid), so no client (a port-forward, the kubelet's probe, an approval relay) completes a connection
to it and hands it a request or a token. Applied in a fresh network namespace, like
tests/project/test_kubernetes.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests import REPO
from tests.harness import require

AGENT_UID = 1000

_PROBE = textwrap.dedent(
    """
    import json, os, socket

    def listen(host, port, kind=socket.SOCK_STREAM):
        s = socket.socket(socket.AF_INET, kind)
        s.bind((host, port))
        if kind == socket.SOCK_STREAM:
            s.listen(16)
        return s

    os.setegid(AGENT); os.seteuid(AGENT)  # the agent's sockets, where egressd's would be
    impostors = [listen("127.0.0.1", 3128), listen("0.0.0.0", 3129), listen("127.0.0.1", 10443),
                 listen("127.0.0.1", 10080)]
    dns = listen("127.0.0.1", 10053, socket.SOCK_DGRAM)
    dns.settimeout(2)
    os.seteuid(0); os.setegid(0)

    def tcp(port):
        s = socket.socket(); s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
            return "connected"
        except OSError as exc:
            return f"error {exc.errno}"
        finally:
            s.close()

    cases = {f"tcp {port}": tcp(port) for port in (3128, 3129, 10443, 10080)}
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); client.settimeout(2)
    client.sendto(b"q", ("127.0.0.1", 10053))
    try:
        data, peer = dns.recvfrom(64)
        cases["dns asked"] = "yes"
        dns.sendto(b"a", peer)  # the impostor answers (a dropped datagram: EPERM here)
        cases["dns"] = "reply " + client.recvfrom(64)[0].decode()
    except OSError as exc:
        cases["dns"] = f"error {exc.errno}"
    print(json.dumps(cases))
    """
).replace("AGENT", str(AGENT_UID))


@pytest.fixture
def netns() -> Iterator[str]:
    require(os.geteuid() == 0, "the fence tests need root (a network namespace of their own, nftables)")
    for tool in ("ip", "nft"):
        require(shutil.which(tool) is not None, f"{tool} is not installed")
    name = f"kubeports-{uuid.uuid4().hex[:8]}"  # not egd-*: the sandbox's leftover cleaning removes those
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)


def _in(netns: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", netns, *argv], input=stdin, capture_output=True, text=True,
                          timeout=60)


def test_the_agent_on_egressds_ports_while_egressd_restarts_answers_nobody(netns: str, tmp_path: Path) -> None:
    configmap = yaml.safe_load((REPO / "deploy" / "kubernetes" / "configmap.yaml").read_text())
    assert _in(netns, "ip", "link", "set", "lo", "up").returncode == 0
    applied = _in(netns, "nft", "-f", "-", stdin=configmap["data"]["fence.nft"])
    assert applied.returncode == 0, applied.stderr
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    ran = _in(netns, sys.executable, "-I", str(probe))
    assert ran.returncode == 0, ran.stderr
    cases = json.loads(ran.stdout)
    # The client's SYN reaches the impostor; its SYN-ACK and its DNS answer are dropped.
    for port in (3128, 3129, 10443, 10080):
        assert cases[f"tcp {port}"] in ("error None", "error 110", "error 11"), cases
    assert cases["dns asked"] == "yes" and cases["dns"].startswith("error"), cases  # asked, its answer dropped
