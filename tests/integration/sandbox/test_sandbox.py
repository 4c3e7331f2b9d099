"""`egressd run` for real: bubblewrap in a network namespace pinned to egressd, as root.

Each bypass attempt asserts that it failed inside the sandbox and that nothing
arrived at a leak-detector listener on the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from egressd.sandbox.network import OWNERS_DIR, PREFIX, owner_alive
from tests.harness import LEAK, ORIGIN_RANGE, have, require

EGRESSD = str(Path(sys.executable).with_name("egressd"))


@pytest.fixture(autouse=True)
def _needs_root_and_tools() -> None:
    require(os.geteuid() == 0, "the sandbox tests need root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter", "curl"):
        require(have(tool), f"{tool} is not installed")


class UdpCounter(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.datagrams = 0

    def datagram_received(self, data: bytes, addr: tuple) -> None:  # type: ignore[type-arg]
        self.datagrams += 1


async def egressd_run(  # type: ignore[no-untyped-def]
    tmp_path: Path, dns, *args: str, limit_s: float = 60, env: dict | None = None  # type: ignore[type-arg]
) -> tuple[int, str, str]:
    """Run `egressd run` as a user would; returns (exit code, stdout, stderr)."""
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base_env["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--allow-private", ORIGIN_RANGE,
        "--audit-log", str(tmp_path / "audit.jsonl"), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        env=base_env | (env or {}),
    )
    out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def sh(command: str) -> str:
    import subprocess

    return subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30).stdout


def _is_leftover(run_key: str) -> bool:
    """A run's resource is a leftover once its owner is gone, or when it is this process's own.

    Other runs may be live on the same machine (other test sessions, a user's
    `egressd run`): their resources belong to a live owner and are not ours to judge.
    """
    try:
        owner = int((OWNERS_DIR / run_key).read_text().strip())
    except (OSError, ValueError):
        return True
    return owner == os.getpid() or not owner_alive(run_key)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process we can read."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        table[int(entry)] = (ppid, args)
    return table


def descendants(pid: int) -> list[str]:
    """The command lines of every live descendant of ``pid``."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(table[child][1])
        todo += children.get(child, [])
    return found


async def wait_for_sandbox(pid: int, limit_s: float = 10, command: str = "sleep ") -> None:
    """Wait until the egressd process ``pid`` runs ``command`` in its bubblewrap sandbox.

    Waiting for the command, not just for bwrap, means bwrap has finished setting up
    (its parent-death signal armed), so a kill -9 of egressd now takes the sandbox down.
    """
    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        running = descendants(pid)
        if any(a.startswith(("bwrap ", "/usr/bin/bwrap ")) for a in running) and any(
            a.startswith(command) for a in running
        ):
            return
        assert asyncio.get_running_loop().time() < deadline, "the sandbox never started"
        await asyncio.sleep(0.1)


async def assert_no_leftovers() -> None:
    """Nothing of a finished run remains: no namespace, veth, cgroup or sandbox process."""
    netns = [line.split()[0] for line in sh("ip netns list").splitlines() if line.startswith(f"{PREFIX}-")]
    assert not [n for n in netns if _is_leftover(n.removeprefix(f"{PREFIX}-"))]
    links = [line.split(":")[1].strip().split("@")[0] for line in sh("ip -o link show").splitlines()
             if f": {PREFIX}" in line]
    assert not [name for name in links if _is_leftover(name[len(PREFIX):-1])]
    for base in ("/sys/fs/cgroup/memory/egressd", "/sys/fs/cgroup/pids/egressd", "/sys/fs/cgroup/egressd"):
        if os.path.isdir(base):  # noqa: ASYNC240 - test check of /sys
            groups = [d for d in os.listdir(base) if d.startswith("egd-")]
            assert not [d for d in groups if _is_leftover(d.removeprefix("egd-").split("-")[0])]
    # A sandbox process outliving its egressd is an orphan (bwrap dies with its
    # parent otherwise); one under this process is a sandbox this test left running.
    ours = descendants(os.getpid())
    orphans = [args for ppid, args in _processes().values() if ppid == 1]
    assert not [args for args in ours + orphans if args.startswith(("bwrap ", "/usr/bin/bwrap "))]


async def test_allowed_origin_is_reached_through_egressd_with_curl_and_python(tmp_path, dns, http_origin) -> None:
    url = f"http://origin.test:{http_origin.port}/from-python"
    script = textwrap.dedent(f"""
        set -e
        curl -sS -m 10 http://origin.test:{http_origin.port}/from-curl
        echo
        python3 -c "import urllib.request; print(urllib.request.urlopen('{url}', timeout=10).read().decode())"
    """)
    code, out, err = await egressd_run(tmp_path, dns, "--allow", "origin.test:*", "--", "sh", "-c", script)
    assert code == 0, err
    assert "hello from origin: GET /from-curl" in out and "hello from origin: GET /from-python" in out
    await assert_no_leftovers()


async def test_name_lookups_of_an_allowed_host_print_nothing_and_every_deny_has_a_reason(
    tmp_path, dns, http_origin
) -> None:
    # Issue 16: every lookup printed "egressd: blocked NAME (dns) ()" (its AAAA query, a deny without a reason).
    script = textwrap.dedent(f"""
        set -e
        python3 -c "import socket; print(len(socket.getaddrinfo('origin.test', 80)))"
        curl -sS -m 10 http://origin.test:{http_origin.port}/ >/dev/null
        echo done
    """)
    code, out, err = await egressd_run(tmp_path, dns, "--allow", "origin.test:*", "--", "sh", "-c", script)
    assert code == 0 and "done" in out, err
    assert "blocked" not in err, err
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    lookups = [r for r in records if r.get("event") == "egress" and r.get("kind") == "dns" and r["host"]]
    assert {r["qtype"] for r in lookups} >= {"A", "AAAA"}
    assert all(r["decision"] == "allow" for r in lookups if r["qtype"] == "A"), lookups
    # DESIGN.md records an AAAA with no address deny (not egressd's address); it says why, and is not printed.
    assert all(r["reason"] == "empty_answer" for r in lookups if r["qtype"] == "AAAA"), lookups
    assert all(r["reason"] for r in records if r.get("decision") == "deny"), records
    await assert_no_leftovers()


@pytest.mark.parametrize("command", ["no-such-command-xyz", "./not-in-workdir", "/usr/bin/no-such-xyz"])
async def test_a_missing_command_exits_127_with_one_clear_line(tmp_path, dns, command: str) -> None:
    # Issue 16: bwrap said "bwrap: execvp ...: No such file or directory" and egressd run exited 1.
    code, out, err = await egressd_run(tmp_path, dns, "--", command, "arg")
    assert (code, out) == (127, ""), err
    assert err == f"egressd: {command}: command not found in the sandbox\n"
    # A command that is there still runs as itself, with its own status, in the same process the shell was.
    code, out, err = await egressd_run(tmp_path, dns, "--", "sh", "-c", 'echo "$0"; exit 5', "named")
    assert (code, out) == (5, "named\n"), err


async def test_all_proxy_names_the_socks_listener_and_it_carries_the_run(tmp_path, dns, http_origin, leak) -> None:
    script = textwrap.dedent(f"""
        case "$ALL_PROXY" in socks5h://*) ;; *) echo "ALL_PROXY=$ALL_PROXY"; exit 3;; esac
        curl -sS -m 10 --proxy "$ALL_PROXY" http://origin.test:{http_origin.port}/from-socks
        echo
        curl -sS -m 5 --proxy "$all_proxy" http://leak.test:{leak.port}/; echo curl=$?
    """)
    code, out, err = await egressd_run(tmp_path, dns, "--allow", "origin.test:*", "--", "sh", "-c", script)
    assert code == 0, out + err
    assert "hello from origin: GET /from-socks" in out and "curl=0" not in out
    assert leak.connections == 0 and not dns.asked("leak.test")
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    socks = [r for r in records if r.get("event") == "egress" and r.get("kind") == "socks"]
    assert [(r["host"], r["decision"]) for r in socks] == [("origin.test", "allow"), ("leak.test", "deny")]
    assert socks[0]["run"] == socks[1]["run"] != "default"
    await assert_no_leftovers()


async def test_unknown_domain_is_blocked_and_reported_on_stderr(tmp_path, dns, leak) -> None:
    code, out, err = await egressd_run(
        tmp_path, dns, "--allow", "origin.test", "--", "sh", "-c", "curl -fsS -m 5 http://leak.test/; echo curl=$?"
    )
    assert code == 0 and "curl=" in out and "curl=0" not in out
    assert "egressd: blocked leak.test:80 (no approver attached)" in err
    assert leak.connections == 0 and not dns.asked("leak.test")
    await assert_no_leftovers()


async def test_network_bypasses_fail_and_reach_nothing(tmp_path, dns, leak) -> None:
    udp_leak = UdpCounter()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: udp_leak, local_addr=(LEAK, 0))
    udp_port = transport.get_extra_info("sockname")[1]
    probe = textwrap.dedent(f"""
        import errno, socket, json, subprocess
        results = {{}}
        def attempt(name, fn):
            try:
                fn()
                results[name] = "connected"
            except OSError as exc:
                results[name] = errno.errorcode.get(exc.errno, str(exc.errno))
        def tcp(host, port, family=socket.AF_INET):
            s = socket.socket(family, socket.SOCK_STREAM); s.settimeout(2)
            try: s.connect((host, port))
            finally: s.close()
        gateway = open("/etc/resolv.conf").read().split()[1]
        attempt("host_loopback", lambda: tcp("{LEAK}", {leak.port}))
        attempt("veth_other_port", lambda: tcp(gateway, 22))
        # No route anywhere but the veth's own /30 (read, not tried: no test sends to an outside address).
        routes = open("/proc/net/route").readlines()[1:]
        results["default_route"] = any(line.split()[1] == "00000000" for line in routes)
        attempt("ipv6_loopback_of_host", lambda: tcp("::1", {leak.port}, socket.AF_INET6))
        attempt("raw_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
        def udp():
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                s.sendto(b"x", ("{LEAK}", {udp_port}))
                s.sendto(b"x", (gateway, 9))
            finally: s.close()
        attempt("udp", udp)
        dig = subprocess.run(
            ["dig", "+time=1", "+tries=1", "@{LEAK}", "-p", "{udp_port}", "leak.test"], capture_output=True, text=True
        )
        results["dns_elsewhere"] = "answered" if "ANSWER SECTION" in dig.stdout else "no answer"
        print(json.dumps(results))
    """)
    try:
        code, out, err = await egressd_run(tmp_path, dns, "--", "python3", "-c", probe)
    finally:
        transport.close()
    assert code == 0, err
    import json

    results = json.loads(out.strip().splitlines()[-1])
    assert results["host_loopback"] in ("ECONNREFUSED", "ENETUNREACH")  # the namespace's own loopback, or no route
    assert results["veth_other_port"] != "connected"  # dropped by the namespace's nftables fence
    assert results["default_route"] is False  # any outside address is unreachable by the sandbox's own route table
    assert results["ipv6_loopback_of_host"] != "connected"
    assert results["raw_socket"] == "EPERM"
    assert results["udp"] in ("EPERM", "ENETUNREACH", "connected")  # datagrams may "send", but go nowhere
    assert results["dns_elsewhere"] == "no answer"
    assert leak.connections == 0 and udp_leak.datagrams == 0
    assert not dns.queries
    await assert_no_leftovers()


async def test_the_host_filesystem_secrets_and_processes_stay_out_of_reach(tmp_path, dns, workdir) -> None:
    home_ssh = Path.home() / ".ssh"
    home_ssh.mkdir(exist_ok=True)
    key = home_ssh / f"egressd-test-key-{uuid.uuid4().hex}"
    marker = f"FAKE-PRIVATE-KEY-{uuid.uuid4().hex}"
    key.write_text(marker)
    tmp_name = f"egressd-test-{uuid.uuid4().hex}"
    script = textwrap.dedent(f"""
        cat {key} 2>&1
        cat ~/.aws/credentials 2>&1
        cat {tmp_path}/audit.jsonl 2>&1
        echo x > /etc/egressd-x 2>&1; echo etc=$?
        echo x > /usr/egressd-x 2>&1; echo usr=$?
        echo x > /tmp/{tmp_name}; echo tmp=$?
        echo inside > /work/made-inside; echo work=$?
        echo pids=$(ls /proc | grep -c '^[0-9]')
        env | grep -c EGRESSD_TEST_SECRET || true
        grep NoNewPrivs /proc/self/status
        grep CapEff /proc/self/status
        unshare -U true 2>&1; echo unshare=$?
    """)
    try:
        code, out, err = await egressd_run(
            tmp_path, dns, "--workdir", str(workdir), "--", "sh", "-c", script, env={"EGRESSD_TEST_SECRET": "s3cret"}
        )
    finally:
        key.unlink()
    assert marker not in out and marker not in err
    assert f"cat: {key}: No such file or directory" in out
    assert "No such file or directory" in out.splitlines()[2]  # the audit log is absent inside
    assert "etc=0" not in out and "usr=0" not in out
    assert "tmp=0" in out and not Path(f"/tmp/{tmp_name}").exists()  # a private /tmp  # noqa: ASYNC240 - test check
    assert "work=0" in out and (workdir / "made-inside").read_text() == "inside\n"
    pids = int(out.split("pids=")[1].split()[0])
    assert pids < 10  # only the sandbox's own processes
    assert "s3cret" not in out and "\n0\n" in out  # no host environment
    assert "NoNewPrivs:\t1" in out and "CapEff:\t0000000000000000" in out
    assert "unshare=0" not in out  # refused by seccomp
    assert not Path("/etc/egressd-x").exists() and not Path("/usr/egressd-x").exists()  # noqa: ASYNC240 - test check
    await assert_no_leftovers()


async def test_timeout_kills_the_whole_process_tree(tmp_path, dns, workdir) -> None:
    code, _, err = await egressd_run(
        tmp_path, dns, "--workdir", str(workdir), "--timeout", "1", "--",
        "sh", "-c", "(sleep 3; touch /work/survivor) & setsid sh -c 'sleep 3; touch /work/survivor2' & sleep 60",
    )
    assert code == 124 and "--timeout" in err
    await asyncio.sleep(3.5)
    assert not (workdir / "survivor").exists() and not (workdir / "survivor2").exists()
    await assert_no_leftovers()


async def test_memory_limit_ends_the_command_with_137(tmp_path, dns) -> None:
    code, _, err = await egressd_run(
        tmp_path, dns, "--memory", "64", "--", "python3", "-c", "x = bytearray(512 * 1024 * 1024); print(len(x))"
    )
    assert code == 137 and "--memory" in err
    await assert_no_leftovers()


async def test_the_cpu_limit_and_the_process_limit_are_said_when_they_ended_or_refused_something(tmp_path, dns) -> None:
    """Issue 29: a command killed by --cpu (SIGXCPU) or refused a process by --max-pids got no word of why."""
    code, _, err = await egressd_run(tmp_path, dns, "--cpu", "1", "--timeout", "20", "--",
                                     "sh", "-c", "while :; do :; done")  # fmt: skip
    assert code == 128 + 24 and "used its --cpu 1s of CPU time and was killed (SIGXCPU" in err, (code, err)
    code, _, err = await egressd_run(tmp_path, dns, "--max-pids", "12", "--timeout", "20", "--",
                                     "sh", "-c", "for i in $(seq 30); do sleep 2 & done 2>/dev/null; wait")  # fmt: skip
    assert "reached --max-pids 12: a process it tried to start was refused" in err, (code, err)
    code, _, err = await egressd_run(tmp_path, dns, "--max-pids", "12", "--", "sh", "-c", "sleep 0.1 & wait")
    assert code == 0 and "--max-pids" not in err and "--cpu" not in err, err  # nothing met: nothing said
    await assert_no_leftovers()


async def test_exit_status_is_the_commands_own(tmp_path, dns) -> None:
    code, _, _ = await egressd_run(tmp_path, dns, "--", "sh", "-c", "curl -s -m 5 http://leak.test/; exit 7")
    assert code == 7
    # The run.end record says how it ended and what it did (issue 29).
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    (end,) = [r for r in records if r["event"] == "run.end"]
    assert (end["exit_status"], end["allowed"], end["refused"], end["answered"]) == (7, 0, 1, 0), end
    assert end["duration_s"] > 0


async def test_copy_out_takes_only_safe_regular_files(tmp_path, dns, workdir) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    script = "mkdir -p dist && echo wheel > dist/a.whl && ln -s /etc/passwd dist/b.whl && mkfifo dist/c.whl"
    code, _, err = await egressd_run(
        tmp_path, dns, "--workdir", str(workdir), "--copy-out", "dist/*.whl", "--copy-out-dir", str(out_dir), "--",
        "sh", "-c", script,
    )
    assert code == 0, err
    assert (out_dir / "dist" / "a.whl").read_text() == "wheel\n"
    assert not (out_dir / "dist" / "b.whl").exists() and not (out_dir / "dist" / "c.whl").exists()
    assert "skipped dist/b.whl" in err and "skipped dist/c.whl" in err
    code, _, err = await egressd_run(tmp_path, dns, "--copy-out", "../x", "--", "true")
    assert code == 2 and "'..' is not allowed" in err


async def test_interrupting_egressd_run_destroys_the_sandbox(tmp_path, dns) -> None:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base_env["XDG_STATE_HOME"] = str(tmp_path / "s")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--audit-log", str(tmp_path / "a.jsonl"), "--", "sleep", "60",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=base_env,
    )
    await wait_for_sandbox(proc.pid)
    proc.send_signal(15)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 128 + 15 and b"destroyed" in err
    await assert_no_leftovers()


async def test_sigusr1_reopens_egressd_runs_audit_log_instead_of_killing_the_run(tmp_path, dns) -> None:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base_env["XDG_STATE_HOME"] = str(tmp_path / "s")
    log = tmp_path / "a.jsonl"
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--audit-log", str(log), "--", "sleep", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=base_env,
    )
    await wait_for_sandbox(proc.pid)
    log.rename(tmp_path / "a.jsonl.1")  # as logrotate moves it, then signals
    proc.send_signal(signal.SIGUSR1)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]  # noqa: ASYNC240
    assert events[-1] == "run.end" and "run.start" not in events  # the rest went to the reopened file
    await assert_no_leftovers()


async def test_leftovers_of_a_killed_run_are_removed_at_the_next_start(tmp_path, dns) -> None:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base_env["XDG_STATE_HOME"] = str(tmp_path / "s")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--audit-log", str(tmp_path / "a.jsonl"), "--", "sleep", "60",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=base_env,
    )
    await wait_for_sandbox(proc.pid)
    # Read while the run lives: once it is dead, any egressd starting on this machine may clean it up.
    ours = [p.name for p in OWNERS_DIR.iterdir() if p.read_text().strip() == str(proc.pid)]
    proc.kill()  # no chance to clean up
    await proc.wait()
    assert ours and f"{PREFIX}-{ours[0]}" in sh("ip netns list")  # left behind
    code, _, err = await egressd_run(tmp_path, dns, "--", "true")
    assert code == 0, err
    await assert_no_leftovers()


async def test_kill_9_mid_run_leaves_no_way_out_and_a_log_of_every_request_that_went_out(
    tmp_path, dns, http_origin
) -> None:
    """egressd run killed while its command keeps making requests: nothing more gets out,
    every request the origin saw has its record in a log of whole lines, and the next start cleans up."""
    log = tmp_path / "audit.jsonl"
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base_env["XDG_STATE_HOME"] = str(tmp_path / "state")
    loop = f"while :; do curl -sS -m 2 -o /dev/null http://origin.test:{http_origin.port}/again; sleep 0.1; done"
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--allow-private", ORIGIN_RANGE,
        "--allow", "origin.test:*", "--audit-log", str(log), "--", "sh", "-c", loop,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL,
        env=base_env,
    )  # fmt: skip
    try:
        await wait_for_sandbox(proc.pid, command="sh -c")
        ours = [p.name for p in OWNERS_DIR.iterdir() if p.read_text().strip() == str(proc.pid)]
        deadline = asyncio.get_running_loop().time() + 30
        while len(http_origin.requests) < 5:
            assert asyncio.get_running_loop().time() < deadline, "the command's requests never arrived"
            await asyncio.sleep(0.05)
    finally:
        proc.kill()  # kill -9, mid-request quite possibly
        await proc.wait()
    reached = len(http_origin.requests)
    await asyncio.sleep(3)  # a command still running would have made many more requests by now
    assert len(http_origin.requests) == reached, "requests got out after egressd died"
    data = log.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    records = [json.loads(line) for line in whole.splitlines()]  # valid JSON Lines up to the last whole record
    allowed = [r for r in records if r["event"] == "egress" and r["decision"] == "allow" and r["host"] == "origin.test"]
    assert len(allowed) >= reached  # every request that went out has its record (a dial may have failed after)
    assert ours and f"{PREFIX}-{ours[0]}" in sh("ip netns list")  # left behind, for the next start
    code, _, err = await egressd_run(tmp_path, dns, "--", "true")
    assert code == 0, err
    await assert_no_leftovers()


def test_the_sandbox_mounts_nothing_of_the_host_but_the_toolchain_and_workdir() -> None:
    from egressd.sandbox.bwrap import BwrapSpec, bwrap_argv

    argv = bwrap_argv(BwrapSpec(workdir="/w", etc_dir="/e", env={}, argv=["true"]))
    binds = [argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--ro-bind")]
    assert binds[0] == "/usr" and "/w" in binds
    assert not any(b.startswith(("/root", "/home", "/run", "/var", str(Path.home()))) for b in binds)


async def test_no_file_descriptor_of_egressd_or_its_parent_reaches_the_sandbox(tmp_path, dns) -> None:
    secret = tmp_path / "parent-secret"
    secret.write_text("parent's open file")
    fd = os.open(secret, os.O_RDONLY)  # inheritable into egressd on purpose
    os.set_inheritable(fd, True)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base_env["XDG_STATE_HOME"] = str(tmp_path / "s")
    try:
        proc = await asyncio.create_subprocess_exec(
            EGRESSD, "run", "--audit-log", str(tmp_path / "a.jsonl"), "--", "sh", "-c", "ls /proc/self/fd",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=base_env, pass_fds=(fd,),
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        os.close(fd)
    assert proc.returncode == 0, err
    assert out.decode().split() == ["0", "1", "2", "3"]  # stdio, and the directory ls itself opened


async def test_a_held_request_is_allowed_with_egressd_allow_from_another_process(tmp_path, dns, http_origin) -> None:
    import json

    from tests.fakes.webhook import WebhookReceiver, make_secret

    secret, key = make_secret()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base_env["XDG_STATE_HOME"] = str(tmp_path / "s")
    async with WebhookReceiver(key, mode="later") as receiver:  # a channel that answers later: the request is held
        proc = await asyncio.create_subprocess_exec(
            EGRESSD, "run", "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--allow-private", ORIGIN_RANGE,
            "--audit-log", str(tmp_path / "audit.jsonl"), "--approver", "webhook", "--webhook-url", receiver.url,
            "--webhook-secret", secret, "--",
            "curl", "-fsS", "-m", "30", f"http://origin.test:{http_origin.port}/held",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
            env=base_env,
        )
        assert proc.stderr is not None
        # Issue 29: the "answer from another terminal" line comes once a request is held, not before.
        line = ""
        for _ in range(20):
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
            if "from another terminal" in line:
                break
        assert "--control unix:" in line, line
        control = line.rsplit("--control ", 1)[1].strip()
        approvals: list = []
        for _ in range(100):
            pending = await asyncio.create_subprocess_exec(
                EGRESSD, "pending", "--json", "--control", control, stdout=asyncio.subprocess.PIPE, env=base_env)
            out, _ = await pending.communicate()
            approvals = json.loads(out or b"[]")
            if approvals:
                break
            await asyncio.sleep(0.1)
        assert [a["host"] for a in approvals] == ["origin.test"]
        assert http_origin.requests == []  # held: nothing went out yet
        allow = await asyncio.create_subprocess_exec(
            EGRESSD, "allow", approvals[0]["id"], "--control", control, stdout=asyncio.subprocess.PIPE, env=base_env)
        await allow.communicate()
        assert allow.returncode == 0
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    assert b"hello from origin: GET /held" in out
    records = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    decided = [r for r in records if r.get("event") == "approval.decided"]
    assert decided and decided[0]["decision"] == "allow"
    await assert_no_leftovers()


async def test_a_run_that_holds_nothing_never_says_answer_from_another_terminal(tmp_path, dns) -> None:
    from tests.fakes.webhook import WebhookReceiver, make_secret

    secret, key = make_secret()
    async with WebhookReceiver(key, mode="later") as receiver:
        code, _, err = await egressd_run(tmp_path, dns, "--approver", "webhook", "--webhook-url", receiver.url,
                                         "--webhook-secret", secret, "--", "true")  # fmt: skip
    assert code == 0, err
    assert "another terminal" not in err and not receiver.received, err


async def test_runs_started_together_never_collide(tmp_path, dns, http_origin) -> None:
    """Three `egressd run` at once: each gets its own namespace, addresses and cgroup, and reaches its origin."""
    url = f"http://origin.test:{http_origin.port}/together"
    runs = [tmp_path / str(n) for n in range(3)]
    for path in runs:
        path.mkdir()
    results = await asyncio.gather(*(
        egressd_run(path, dns, "--allow", "origin.test:*", "--", "curl", "-fsS", "-m", "10", url) for path in runs
    ))
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    assert len([r for r in http_origin.requests if r["path"] == "/together"]) == 3
    await assert_no_leftovers()


async def test_pending_and_allow_find_a_run_by_themselves_among_several_instances(
    tmp_path, dns, http_origin
) -> None:
    # Issue 16: `egressd pending` could not find the approvals of an `egressd run` (a temporary control socket).
    import json
    import stat

    from tests.fakes.webhook import WebhookReceiver, make_secret
    from tests.harness import wait_serve_ports

    secret, key = make_secret()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    base_env["XDG_STATE_HOME"] = str(tmp_path / "s")
    registry = tmp_path / "s" / "egressd" / "instances"
    registry.mkdir(parents=True, mode=0o700)
    # A stale entry: its process is gone (pid 2**22 + 1 is above any pid_max); ignored, then removed.
    stale = registry / "4194305.00000000.json"
    stale.write_text(json.dumps({"pid": 4194305, "pid_started": "1", "control": "unix:/nowhere", "kind": "serve"}))
    stale.chmod(0o600)

    async def egressd(*args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            EGRESSD, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=base_env
        )

    import subprocess

    serve = subprocess.Popen(  # noqa: ASYNC220 - wait_serve_ports reads its stderr, in a thread
        [EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0", "--audit-log",
         str(tmp_path / "serve.jsonl")], env=base_env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_serve_ports, serve)
        async with WebhookReceiver(key, mode="later") as receiver:
            proc = await asyncio.create_subprocess_exec(
                EGRESSD, "run", "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--allow-private", ORIGIN_RANGE,
                "--audit-log", str(tmp_path / "audit.jsonl"), "--approver", "webhook", "--webhook-url", receiver.url,
                "--webhook-secret", secret, "--",
                "curl", "-fsS", "-m", "30", f"http://origin.test:{http_origin.port}/held",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
                env=base_env,
            )
            approvals: list = []
            for _ in range(100):
                pending = await egressd("pending", "--json")
                out, err = await pending.communicate()
                approvals = json.loads(out or b"[]")
                if approvals:
                    break
                await asyncio.sleep(0.1)
            assert [(a["host"], a["instance"]["kind"]) for a in approvals] == [("origin.test", "run")], err
            assert not stale.exists()
            entries = sorted(registry.glob("*.json"))
            assert len(entries) == 2  # serve's and the run's
            for entry in [registry, *entries]:
                mode = os.lstat(entry).st_mode
                assert stat.S_IMODE(mode) == (0o700 if entry == registry else 0o600), entry
                assert "token" not in json.loads(entry.read_text()).get("control", "") if entry != registry else True
            tokens = {json.loads(e.read_text())["token_file"] for e in entries}
            assert all(t and "control" in t for t in tokens)  # the path of a token file, never a token
            table = await egressd("pending")
            out, err = await table.communicate()
            assert b"egressd run (pid" in out and b"egressd serve (pid" in out, err  # named: there are several
            missing = await egressd("deny", "a-no-such-approval")
            _, err = await missing.communicate()
            assert missing.returncode == 1 and b"holds approval" in err
            assert http_origin.requests == []  # held: nothing went out yet
            allow = await egressd("allow", approvals[0]["id"])
            out, err = await allow.communicate()
            assert allow.returncode == 0, err
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err
        assert b"hello from origin: GET /held" in out
        assert len(list(registry.glob("*.json"))) == 1  # the run removed its entry; serve's is left
    finally:
        serve.terminate()
        serve.wait(10)
        if serve.stderr is not None:
            serve.stderr.close()
    assert list(registry.glob("*.json")) == []  # each removed its entry at exit
    await assert_no_leftovers()
