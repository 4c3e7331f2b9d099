"""The sandbox's pure parts: subnet choice, nftables text, bwrap argv, seccomp program, copy-out names."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import struct
from pathlib import Path

import pytest

from egressd.sandbox.backend import (
    EXIT_MEMORY,
    EXIT_TIMEOUT,
    BoundedOutput,
    ended,
    observation,
    within_time_limit,
)
from egressd.sandbox.bwrap import BwrapSpec, base_environment, bwrap_argv, generated_etc
from egressd.sandbox.copyout import CopyOutError, check_pattern, copy_out
from egressd.sandbox.network import METADATA_NET, EgressPorts, NetworkError, choose_subnet, nft_ruleset
from egressd.sandbox.seccomp import DENIED_SYSCALLS, build_filter


def test_subnet_choice_skips_taken_ranges_and_metadata() -> None:
    pool = ipaddress.ip_network("169.254.168.0/22")
    taken = [ipaddress.ip_network("169.254.168.0/29")]
    chosen = choose_subnet(pool, taken)
    assert chosen == ipaddress.ip_network("169.254.168.8/30")
    every = list(pool.subnets(new_prefix=30))
    free = [n for n in every if not n.overlaps(METADATA_NET) and not n.overlaps(taken[0]) and n != chosen]
    # With only the last free /30 left (after the metadata /24), that one is chosen.
    assert choose_subnet(pool, [*taken, chosen, *free[:-1]]) == free[-1]
    assert not free[-1].overlaps(METADATA_NET)


def test_subnet_choice_fails_clearly_when_the_pool_is_full() -> None:
    pool = ipaddress.ip_network("169.254.100.0/30")
    with pytest.raises(NetworkError, match="no free /30"):
        choose_subnet(pool, [pool])


def test_nft_ruleset_allows_only_egressd_ports_on_the_host_address() -> None:
    text = nft_ruleset(ipaddress.ip_address("169.254.100.1"), EgressPorts())
    assert "policy drop" in text
    assert "ip daddr 169.254.100.1 tcp dport { 53, 80, 443, 1080, 3128 } accept" in text
    assert "ip daddr 169.254.100.1 udp dport 53 accept" in text
    assert text.count("accept") == 5  # lo out, tcp, udp, lo in, established


def test_bwrap_argv_unshares_everything_but_net_and_binds_only_toolchain_and_workdir() -> None:
    argv = bwrap_argv(BwrapSpec(workdir="/host/work", etc_dir="/tmp/etc", env={"A": "1"}, argv=["sh", "-c", "x"],
                                seccomp_fd=5, usr_links={"bin": "usr/bin"}, etc_readonly=["ssl"]))
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                 "--new-session"):
        assert flag in argv
    assert "--setenv" not in argv and "--clearenv" not in argv  # the environment comes by descriptor (--args)
    assert "--unshare-net" not in argv and "--share-net" not in argv  # the namespace is entered before bwrap
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    assert argv[argv.index("--seccomp") + 1] == "5"
    writable = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert writable == ["/host/work"]
    assert argv[argv.index("--") + 1:] == ["sh", "-c", "x"]
    assert argv.index("--remount-ro") > argv.index("--bind")


def test_environment_is_built_from_nothing() -> None:
    os.environ["EGRESSD_UNIT_SECRET"] = "x"
    try:
        env = base_environment(term="xterm", proxy_url="http://r:t@169.254.100.1:3128", extra={"FOO": "bar"})
    finally:
        del os.environ["EGRESSD_UNIT_SECRET"]
    assert "EGRESSD_UNIT_SECRET" not in env and env["FOO"] == "bar"
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://r:t@169.254.100.1:3128"
    assert env["HOME"] == "/work"
    assert env["ALL_PROXY"] == env["all_proxy"] == "http://r:t@169.254.100.1:3128"  # no SOCKS listener named
    env = base_environment(term=None, proxy_url="http://r:t@h:3128", socks_url="socks5h://r:t@h:1080")
    assert env["ALL_PROXY"] == env["all_proxy"] == "socks5h://r:t@h:1080"
    assert env["HTTPS_PROXY"] == env["HTTP_PROXY"] == "http://r:t@h:3128"


def test_generated_etc_points_dns_at_egressd() -> None:
    etc = generated_etc(nameserver="169.254.100.1")
    assert etc["resolv.conf"].startswith("nameserver 169.254.100.1\n")
    assert "agent:x:1000:1000" in etc["passwd"]


def test_seccomp_program_is_well_formed() -> None:
    program = build_filter("x86_64")
    assert len(program) % 8 == 0
    insns = [struct.unpack("<HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    assert len(insns) < 4096  # BPF_MAXINSNS
    assert insns[-1] == (0x06, 0, 0, 0x7FFF0000)  # default: allow
    denied = {k for code, _, _, k in insns if code == 0x15}
    assert set(DENIED_SYSCALLS.values()) <= denied
    for i, (code, jt, jf, _) in enumerate(insns):
        if code & 0x07 == 0x05:  # jumps stay inside the program
            assert i + 1 + max(jt, jf) < len(insns)


@pytest.mark.parametrize("pattern", ["../x", "/etc/passwd", "a/../../b", "", "dist/\0x"])
def test_unsafe_copy_out_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(CopyOutError):
        check_pattern(pattern)


def test_copy_out_skips_links_and_links_to_directories(tmp_path: Path) -> None:
    work, dest, secret = tmp_path / "work", tmp_path / "dest", tmp_path / "secret"
    work.mkdir()
    secret.mkdir()
    (secret / "key").write_text("private")
    (work / "out").mkdir()
    (work / "out" / "ok.txt").write_text("fine")
    (work / "out" / "link.txt").symlink_to(secret / "key")
    (work / "linkdir").symlink_to(secret)
    report = copy_out(work, ["out/*", "linkdir/*", "linkdir"], dest)
    assert report.copied == ["out/ok.txt"]
    assert (dest / "out" / "ok.txt").read_text() == "fine"
    assert not list(dest.rglob("key")) and not (dest / "out" / "link.txt").exists()
    assert {name for name, _ in report.skipped} == {"out/link.txt", "linkdir"}


def test_copy_out_says_which_files_it_replaced(tmp_path: Path) -> None:
    """Issue 29: a file already at the destination was replaced without a word."""
    work, dest = tmp_path / "work", tmp_path / "dest"
    work.mkdir()
    dest.mkdir()
    (work / "new.txt").write_text("new")
    (work / "old.txt").write_text("from the run")
    (dest / "old.txt").write_text("the user's")
    report = copy_out(work, ["*.txt"], dest)
    assert sorted(report.lines()) == ["copied new.txt", "copied old.txt (replaced the file that was there)"]
    assert (dest / "old.txt").read_text() == "from the run"


def test_copy_out_is_bounded_and_says_what_it_cut(tmp_path: Path) -> None:
    work, dest = tmp_path / "work", tmp_path / "dest"
    work.mkdir()
    for i in range(5):
        (work / f"f{i}.bin").write_bytes(b"x" * 1000)
    report = copy_out(work, ["*.bin"], dest, max_files=3, max_bytes=10_000)
    assert len(report.copied) == 3 and len(report.skipped) == 2
    assert all("more than 3 files" in why for _, why in report.skipped)


# -- why a command ended: backend.ended / backend.observation, shared by both backends (issue 27) ---------------


@pytest.mark.parametrize(
    ("status", "timed_out", "oom_killed", "expected"),
    [
        (0, False, False, (0, False, False)),
        (7, False, False, (7, False, False)),
        (-9, False, False, (137, False, False)),  # killed by SIGKILL, not by us: its own 137, neither flag
        (137, False, False, (137, False, False)),  # a container's ExitCode for the same
        (-15, False, False, (143, False, False)),
        (None, False, False, (137, False, False)),  # never seen to end
        (-9, True, False, (EXIT_TIMEOUT, True, False)),
        (-9, True, True, (EXIT_TIMEOUT, True, False)),  # a child ran out of memory, the time limit ended it
        (-9, False, True, (EXIT_MEMORY, False, True)),
        (0, False, True, (EXIT_MEMORY, False, True)),
    ],
)
def test_a_finished_commands_one_reason(
    status: int | None, timed_out: bool, oom_killed: bool, expected: tuple[int, bool, bool]
) -> None:
    assert ended(status, timed_out=timed_out, oom_killed=oom_killed) == expected


def test_an_observation_carries_the_reason_and_the_cut_output() -> None:
    out, err = BoundedOutput(3), BoundedOutput(3)
    out.add(b"abcdef")
    err.add(b"e")
    obs = observation(-9, timed_out=True, oom_killed=True, out=out, err=err, duration_s=1.5)
    assert (obs.exit_code, obs.timed_out, obs.memory_exceeded, obs.duration_s) == (EXIT_TIMEOUT, True, False, 1.5)
    assert (obs.stdout, obs.stdout_truncated) == ("abc\n[… 3 more bytes truncated]", 3)
    assert (obs.stderr, obs.stderr_truncated) == ("e", 0)
    relayed = observation(0, timed_out=False, oom_killed=False, out=None, err=None, duration_s=0.0)
    assert (relayed.stdout, relayed.stderr, relayed.stdout_truncated) == ("", "", 0)


async def test_within_the_time_limit_the_command_is_left_alone() -> None:
    killed: list[bool] = []

    async def kill() -> None:
        killed.append(True)

    work = asyncio.ensure_future(asyncio.sleep(0))
    assert await within_time_limit(work, 5, kill, grace_s=1) is False
    assert not killed and work.done()


async def test_past_the_time_limit_the_command_is_killed_and_its_rest_collected_or_cancelled() -> None:
    done = asyncio.Event()

    async def kill() -> None:
        done.set()

    collected = asyncio.ensure_future(done.wait())  # ends once killed: its rest is collected
    assert await within_time_limit(collected, 0.01, kill, grace_s=1) is True
    assert collected.done() and not collected.cancelled()

    async def ignored() -> None:
        pass

    stuck = asyncio.ensure_future(asyncio.Event().wait())  # never ends: cancelled after the grace
    assert await within_time_limit(stuck, 0.01, ignored, grace_s=0.01) is True
    await asyncio.sleep(0)
    assert stuck.cancelled()
