"""No port picked and bound later, no temporary directory left behind.

A port chosen by closing a socket and handed to a process started later can be
taken by another process in between (a flaky test); ``egressd serve`` binds
port 0 itself and reports what it got. A run that ends, fails to start or is
killed leaves no /tmp/egressd-* directory that ``egressd doctor --clean``
cannot remove.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness import have, require, serve_ports, wait_serve_ports

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return env


def test_serve_ports_reads_the_report_only_when_its_line_is_whole() -> None:
    report = (
        "egressd: sandbox-facing: dns 127.0.0.44:5353, tls 127.0.0.44:443, socks 127.0.0.44:1080\n"
        "egressd: serving: proxy 127.0.0.1:4001, control http://127.0.0.1:4002, audit log /x, runs need credentials\n"
    )
    assert serve_ports(report) == {"proxy": 4001, "control": 4002, "dns": 5353, "tls": 443, "socks": 1080}
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


async def test_an_in_process_service_on_port_0_says_where_each_listener_is(tmp_path: Path) -> None:
    from egressd.cli.wiring.service import EgressService
    from egressd.config.settings import load_settings

    settings = load_settings({
        "listen": "127.0.0.1:0", "control": "127.0.0.1:0", "dns_listen": "127.0.0.1:0",
        "transparent_tls": "127.0.0.1:0", "transparent_http": "127.0.0.1:0", "control_token": "t", "ask": False,
        "audit_log": str(tmp_path / "audit.jsonl"),
    })
    async with EgressService(settings) as svc:
        addresses = [svc.proxy_address, svc.dns_address, svc.transparent_tls_address, svc.transparent_http_address]
        control = int(svc.control_address.rsplit(":", 1)[1])
        assert all(a is not None and a[1] != 0 for a in addresses) and control != 0
        for port in [a[1] for a in addresses if a is not None] + [control]:
            _, writer = await asyncio.open_connection("127.0.0.1", port)  # TCP: DNS listens on both
            writer.close()


# -- temporary directories ----------------------------------------------------------------


def test_only_a_dead_runs_etc_and_run_directories_are_stale() -> None:
    from egressd.sandbox.doctor import stale_tmp_names

    names = [
        "egressd-etc-0123abcd-x1_y", "egressd-run-0123abcd-q9", "egressd-etc-feedbeef-z", "egressd-work-0123abcd-a",
        "egressd-etc-0123ABCD-x", "egressd-etc-0123abc-x", "egressd-run-0123abcd", "egressd-run-0123abcd-../x",
        "other-0123abcd",
    ]
    alive = {"feedbeef"}
    assert stale_tmp_names(names, lambda key: key in alive) == ["egressd-etc-0123abcd-x1_y", "egressd-run-0123abcd-q9"]


def _ours(key: str, tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.name.startswith((f"egressd-etc-{key}-", f"egressd-run-{key}-")))


@pytest.mark.parametrize(
    "cleaner",
    [["doctor", "--clean"], ["run", "--audit-log", "b.jsonl", "--", "true"]],  # the next start cleans as well
    ids=["doctor-clean", "next-run"],
)
async def test_a_killed_runs_tmp_directories_are_removed_and_nobody_elses(tmp_path: Path, cleaner: list[str]) -> None:
    require(os.geteuid() == 0, "egressd run needs root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter"):
        require(have(tool), f"{tool} is not installed")
    from egressd.sandbox.network import OWNERS_DIR
    from tests.integration.sandbox.test_sandbox import wait_for_sandbox

    # The run's TMPDIR is this test's own: another egressd starting meanwhile (another
    # suite on this machine) cleans the shared /tmp, not this, so what is seen here is ours.
    tmp = Path(tempfile.mkdtemp(prefix="egressd-test-tmpdir-"))
    os.chmod(tmp, 0o1777)  # as /tmp: the sandbox user reaches its etc directory through it
    env = _env(tmp_path) | {"TMPDIR": str(tmp)}
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--audit-log", str(tmp_path / "a.jsonl"), "--", "sleep", "60",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=env,
    )
    decoy = tmp
    try:
        await wait_for_sandbox(proc.pid)
        [key] = [p.name for p in OWNERS_DIR.iterdir() if p.read_text().strip() == str(proc.pid)]
        left = _ours(key, tmp)
        assert [p.name.split("-")[1] for p in left] == ["etc", "run"]
        # Someone else's directory with the same dead run key in its name: not provably ours, kept.
        decoy = tmp / f"egressd-etc-{key}-notours"
        decoy.mkdir()
        os.chown(decoy, 65534, 65534)
        proc.kill()  # kill -9: no chance to clean up
        await proc.wait()
        assert all(p.exists() for p in left)  # left behind by design
        done = await asyncio.to_thread(
            subprocess.run, [EGRESSD, *cleaner], env=env, capture_output=True, text=True,
            timeout=120, cwd=tmp_path,
        )
        assert not any(p.exists() for p in left), done.stdout + done.stderr
        if cleaner[0] == "doctor":
            assert all(str(p) in done.stdout for p in left)
        assert decoy.is_dir()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_a_run_that_fails_to_start_with_keep_workdir_leaves_no_working_directory(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "egressd run needs root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter"):
        require(have(tool), f"{tool} is not installed")
    tmp = tmp_path / "tmp"  # egressd's TMPDIR: what is in it, this test's run made
    tmp.mkdir()
    # The working directory is made, then the run cannot start: its owner (uid 1000) cannot reach it
    # under pytest's root-only directory, and the network's range is too small (and loopback) besides.
    done = await asyncio.to_thread(
        subprocess.run, [EGRESSD, "run", "--keep-workdir", "--net-range", "127.0.0.0/31", "--audit-log",
                         str(tmp_path / "a.jsonl"), "--", "true"],
        env=_env(tmp_path) | {"TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 125 and "egressd-work-" in done.stderr, done.stderr  # it made one, then failed
    assert not list(tmp.iterdir())


async def test_a_dead_runs_cgroup_still_holding_a_process_is_emptied_and_removed(tmp_path: Path) -> None:
    # A sandbox can outlive an egressd killed before bwrap armed its parent-death signal.
    require(os.geteuid() == 0, "cgroups need root")
    from egressd.sandbox.limits import Cgroup, Limits

    key = "dead0000"  # no owner file in /run/egressd/runs: a dead run
    group = Cgroup.create(f"{key}-1", Limits())
    require(group is not None, "no cgroup can be made here")
    assert group is not None
    survivor = subprocess.Popen(["sleep", "60"], preexec_fn=group.join_self)  # noqa: ASYNC220 - a child to kill
    try:
        done = await asyncio.to_thread(
            subprocess.run, [EGRESSD, "doctor", "--clean"], env=_env(tmp_path), capture_output=True, text=True,
            timeout=120, cwd=tmp_path,
        )
        assert await asyncio.to_thread(survivor.wait, 10) == -9, done.stdout + done.stderr
        assert not any(d.exists() for d in group.dirs), done.stdout + done.stderr
    finally:
        if survivor.poll() is None:
            survivor.kill()
            survivor.wait()
        await group.remove(timeout_s=5)
