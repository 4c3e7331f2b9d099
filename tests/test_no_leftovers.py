"""No port picked and bound later, no temporary directory left behind.

A port chosen by closing a socket and handed to a process started later can be
taken by another process in between (a flaky test); ``egressd serve`` binds
port 0 itself and reports what it got. A run that ends, fails to start or is
killed leaves no /tmp/egressd-* directory that ``egressd doctor --clean``
cannot remove.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.harness import serve_ports, wait_serve_ports

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return env


def test_serve_ports_reads_the_report_only_when_its_line_is_whole() -> None:
    report = (
        "egressd: transparent: dns 127.0.0.44:5353, tls 127.0.0.44:443\n"
        "egressd: serving: proxy 127.0.0.1:4001, control http://127.0.0.1:4002, audit log /x, runs need credentials\n"
    )
    assert serve_ports(report) == {"proxy": 4001, "control": 4002, "dns": 5353, "tls": 443}
    assert serve_ports(report[:-1]) is None  # the port may still be being written: 4001 is not 40
    assert serve_ports("egressd: serving: proxy [::1]:7, control unix:/run/c.sock, audit log /x, x\n") == {"proxy": 7}


def test_serve_given_port_0_for_every_listener_reports_the_bound_ports_and_they_answer(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0", "--dns-listen", "127.0.0.1:0",
         "--transparent-tls", "127.0.0.1:0", "--transparent-http", "127.0.0.1:0", "--control-token", "t",
         "--no-ask", "--audit-log", str(tmp_path / "audit.jsonl")],
        env=_env(tmp_path), stderr=subprocess.PIPE,
    )
    try:
        ports = wait_serve_ports(proc)
        assert set(ports) == {"proxy", "control", "dns", "tls", "http"}
        assert 0 not in ports.values()
        for name in ("proxy", "control", "tls", "http"):
            with socket.create_connection(("127.0.0.1", ports[name]), timeout=5):
                pass  # something listens where it said
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.settimeout(5)
            # A query for example.test, type A: egressd's DNS answers (any answer: it is listening there).
            query = bytes.fromhex("abcd01000001000000000000") + b"\x07example\x04test\x00" + bytes.fromhex("00010001")
            udp.sendto(query, ("127.0.0.1", ports["dns"]))
            answer, _ = udp.recvfrom(512)
            assert answer[:2] == b"\xab\xcd"
    finally:
        proc.terminate()
        proc.wait(20)
        assert proc.stderr is not None
        proc.stderr.close()
