"""The Docker backend and the sidecar deployment, for real, against the local Docker Engine.

The same bypass suite as the bubblewrap backend, from inside real containers:
each attempt asserts that it failed inside the sandbox and that nothing
arrived at a leak detector — a container on egressd's outgoing network, and
listeners on the host's loopback and on the outgoing bridge's host address.
Plus the normal path through egressd to an origin container on its outgoing
network, a held request allowed from the test through the control API, the
limits, copy-out, and no leftovers (containers, networks, volumes) after
every run — also after a run whose egressd was killed outright. The compose
example is started and checked the same way.

Needs the images from ``bash docker/build.sh`` (CI builds them first).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from egressd.audit.views import Refusal
from egressd.cli.wiring.docker_session import PASSTHROUGH, SIDECAR_OWN, DockerSession, sidecar_environment
from egressd.cli.wiring.session import SessionError
from egressd.config.settings import load_settings
from egressd.sandbox.backend import SandboxError
from egressd.sandbox.copyout import CopyReport
from egressd.sandbox.docker.commands import WORKDIR_UNSEEN
from egressd.sandbox.docker.config import (
    DEFAULT_DOCKER_RANGE,
    SECRETS_DIR,
    CommandSpec,
    DockerPlan,
    MemberCheck,
    addresses_inside,
    check_member,
    choose_subnets,
    command_config,
    fence_owner,
    fence_ruleset,
    fence_table,
    network_config,
    sandbox_user,
)
from egressd.sandbox.docker.engine import DockerEngine, already_gone, owner_alive
from egressd.sandbox.docker.fence import fence_tables
from egressd.sandbox.docker.networks import DockerRunNetwork
from egressd.sandbox.limits import Limits
from egressd.sandbox.network import DEFAULT_RANGE
from egressd.sandbox.seccomp import docker_profile
from egressd.sandbox.stage import STAGE_DIR
from tests import REPO
from tests.fakes import dockerbed
from tests.fakes.dockerbed import (
    LEAK_SCRIPT,
    ORIGIN_NAME,
    ORIGIN_PORT,
    ORIGIN_SCRIPT,
    PROBE,
    SOCKET_FAMILY_PROBE,
    TEST_LABELS,
    free_test_range,
    hook_receiver,
    host_listeners,
    leftovers,
    split_range,
    start_helper,
    tls_origin_script,
)
from tests.fakes.tls import make_pki
from tests.harness import IN_CI, LEAK, listening_socket, require

EGRESSD = str(Path(sys.executable).with_name("egressd"))
HOST_LEAK = LEAK  # an address of the host's loopback (the harness's), unreachable from any container
HELD_NAME = "held.test"  # another name of the origin, on no allowlist: asked about
# The sidecar's image under test: the client passes it settings (secret files) only this tree's egressd reads.
IMAGE = ("--egressd-image", dockerbed.EGRESSD_IMAGE)


# -- pure parts (no engine) ----------------------------------------------------------------


def _check(name: str, kind: str = "file", size: int = 1, patterns: tuple[str, ...] = ("dist/*",),
           links: set[str] | None = None, report: CopyReport | None = None, **kw: Any) -> MemberCheck:
    return check_member(name, kind, size, root="work", patterns=list(patterns), links=set() if links is None else links,
                        report=report or CopyReport(), **kw)


def test_copy_out_takes_a_matching_regular_file() -> None:
    assert _check("work/dist/a.whl") == MemberCheck("dist/a.whl")


def test_copy_out_ignores_names_outside_the_working_directory_or_unsafe() -> None:
    for name in ("etc/passwd", "/work/dist/a.whl", "work/../etc/dist/a", "work/dist/../../x", "work//dist/a.whl",
                 "work/./dist/a.whl", "work/dist/a\0.whl", "work"):
        assert _check(name).name is None, name


def test_copy_out_skips_links_and_everything_reached_through_one() -> None:
    links: set[str] = set()
    assert _check("work/dist/b.whl", "symlink", links=links) == MemberCheck("dist/b.whl", "a link (not followed)")
    assert _check("work/dist/h.whl", "hardlink", links=links).skip == "a link (not followed)"
    _check("work/linked", "symlink", patterns=("linked/*",), links=links)
    assert _check("work/linked/x", patterns=("linked/*",), links=links).skip == "a link (not followed)"


def test_copy_out_skips_devices_and_fifos_and_says_so() -> None:
    assert _check("work/dist/c.whl", "other") == MemberCheck("dist/c.whl", "not a regular file")


def test_copy_out_is_bounded_in_count_and_bytes() -> None:
    report = CopyReport(copied=["a"], bytes=10)
    assert _check("work/dist/x", report=report, max_files=1).skip == "more than 1 files"
    big = _check("work/dist/x", size=2 * 1024 * 1024, report=report, max_bytes=1024 * 1024)
    assert big.skip == "over the 1 MiB copy-out limit"


def test_copy_out_does_not_mention_what_no_pattern_matches() -> None:
    assert _check("work/src/main.py") == MemberCheck(None)
    assert _check("work/dist", "dir") == MemberCheck(None)


def test_inits_message_for_a_missing_command_becomes_the_backends_one_line() -> None:
    from egressd.sandbox.docker.commands import said_by_init

    said = b"[FATAL tini (7)] exec nope failed: No such file or directory\n"
    assert said_by_init(said, "nope") == b"egressd: nope: command not found in the sandbox\n"
    for other in (b"[FATAL tini (7)] exec nope failed: Permission denied\n", b"hello\n", said + b"more"):
        assert said_by_init(other, "nope") == other


def test_subnets_are_link_local_or_cgnat_and_never_overlap() -> None:
    taken = [ipaddress.ip_network("169.254.64.0/28")]
    internal, outgoing = choose_subnets("169.254.64.0/18", taken)
    assert str(internal) == "169.254.64.16/28" and str(outgoing) == "169.254.64.32/28"
    for pool in ("10.0.0.0/24", "172.16.0.0/24", "192.168.1.0/24", "8.8.8.0/24", "169.254.64.0/30"):
        with pytest.raises(ValueError):
            choose_subnets(pool, [])
    assert choose_subnets("100.64.64.0/24", [])[0] == ipaddress.ip_network("100.64.64.0/28")


def test_runs_starting_together_can_spread_over_the_free_subnets() -> None:
    first = choose_subnets("100.64.64.0/24", [])
    assert first == [ipaddress.ip_network("100.64.64.0/28"), ipaddress.ip_network("100.64.64.16/28")]
    assert choose_subnets("100.64.64.0/24", [], skip=3)[0] == ipaddress.ip_network("100.64.64.48/28")
    assert choose_subnets("100.64.64.0/24", [], skip=15) == first  # past the last pair: round to the start


def test_subnets_skip_the_cloud_metadata_range() -> None:
    picked = choose_subnets("169.254.168.0/22", [ipaddress.ip_network("169.254.168.0/24")], count=16)
    assert all(not net.overlaps(ipaddress.ip_network("169.254.169.0/24")) for net in picked)


def test_the_bubblewrap_and_docker_ranges_are_disjoint() -> None:
    # A bubblewrap run's host veth holds its /30's first address: inside a Docker run's network that is the gateway.
    assert not ipaddress.ip_network(DEFAULT_RANGE).overlaps(ipaddress.ip_network(DEFAULT_DOCKER_RANGE))


def test_the_fence_drops_what_arrives_on_the_bridge_but_what_it_bridges() -> None:
    rules = fence_ruleset("egressd-fence-k-1-2", "egdbk")
    assert "type filter hook input priority -10; policy accept;\n    iifname \"egdbk\" drop\n" in rules
    assert 'iifname "egdbk" oifname != "egdbk" drop' in rules  # sandbox to egressd: one port to another
    assert fence_owner(fence_table("0a1b2c3d", 42, "777")) == (42, "777")
    assert fence_owner("egressd-fence-x") is None and fence_owner("filter") is None


def test_a_host_address_inside_the_run_network_is_found_and_the_runs_own_bridge_is_not() -> None:
    subnet = ipaddress.ip_network("169.254.64.0/28")
    links = [
        {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
        {"ifname": "egd12345678h", "addr_info": [{"family": "inet", "local": "169.254.64.1", "prefixlen": 30}]},
        {"ifname": "egdbk", "addr_info": [{"family": "inet", "local": "169.254.64.1", "prefixlen": 28}]},
        {"ifname": "dummy0", "addr_info": [{"family": "inet", "local": "169.254.64.17", "prefixlen": 28}]},
    ]
    assert addresses_inside(links, subnet, bridge="egdbk") == ["egd12345678h 169.254.64.1/30"]  # type: ignore[arg-type]
    plan = DockerPlan("0a1b2c3d", subnet, ipaddress.ip_network("169.254.64.16/28"))  # type: ignore[arg-type]
    config = network_config(plan.internal_name, plan.internal, internal=True, labels={}, bridge=plan.bridge)
    assert config["Options"]["com.docker.network.bridge.name"] == "egdb0a1b2c3d" and len(plan.bridge) <= 15


def test_the_plan_gives_egressd_and_the_sandbox_fixed_addresses() -> None:
    plan = DockerPlan("k", ipaddress.ip_network("169.254.64.0/28"), ipaddress.ip_network("169.254.64.16/28"))  # type: ignore[arg-type]
    assert (str(plan.egressd_ip), str(plan.sandbox_ip), str(plan.egressd_outgoing_ip)) == (
        "169.254.64.2", "169.254.64.3", "169.254.64.18")


def test_a_removal_already_under_way_elsewhere_counts_as_removed_and_other_conflicts_do_not() -> None:
    assert already_gone(404, "No such container: abc")
    assert already_gone(409, "removal of container abc is already in progress")
    assert not already_gone(409, "error while removing network: network egd has active endpoints")
    assert not already_gone(500, "removal of container abc is already in progress")


def test_the_sandbox_never_runs_as_root() -> None:
    assert sandbox_user(1001, 1002, workdir="/w") == (1001, 1002)
    for owner in ((0, 0), (0, 1002), (1001, 0)):  # a world-writable root-owned directory is refused too
        with pytest.raises(SandboxError, match="/w belongs to root"):
            sandbox_user(*owner, workdir="/w")


def test_a_command_container_is_hardened() -> None:
    config = command_config(CommandSpec(
        image="img", argv=["true"], env={"A": "1"}, workdir="/w", network="net", address="169.254.64.3",
        dns="169.254.64.2", labels={}, limits=Limits(memory_mb=64, max_pids=50, cpu_s=5),
    ))
    host = config["HostConfig"]
    assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"] and host["IpcMode"] == "private"
    assert host["SecurityOpt"][0] == "no-new-privileges:true" and not host["Privileged"] and host["Init"]
    assert host["SecurityOpt"][1:] == ["seccomp=" + json.dumps(docker_profile(), separators=(",", ":"))]
    assert host["Memory"] == host["MemorySwap"] == 64 * 1024 * 1024  # no swap
    assert host["PidsLimit"] == 50 and {"Name": "cpu", "Soft": 5, "Hard": 6} in host["Ulimits"]
    assert host["Tmpfs"]["/tmp"].startswith("rw,nosuid,nodev")
    assert host["Dns"] == ["169.254.64.2"] and host["Sysctls"]["net.ipv6.conf.all.disable_ipv6"] == "1"
    assert [m["Target"] for m in host["Mounts"]] == ["/work"]  # the working directory, nothing else of the host
    assert config["User"] == "1000:1000" and config["Env"] == ["A=1"]


def test_a_run_that_inspects_binds_its_ca_bundle_read_only_over_the_standard_one() -> None:
    config = command_config(CommandSpec(
        image="img", argv=["true"], env={}, workdir="/w", network="net", address="169.254.64.3",
        dns="169.254.64.2", labels={}, trust_bundle="/tmp/egressd-trust-x/ca-bundle.crt",
    ))
    mounts = config["HostConfig"]["Mounts"]
    assert [m["Target"] for m in mounts] == ["/work", "/etc/ssl/certs/ca-certificates.crt"]
    assert mounts[1]["ReadOnly"] and mounts[1]["Source"] == "/tmp/egressd-trust-x/ca-bundle.crt"


def test_the_sidecar_gets_our_policy_settings_but_its_own_listeners() -> None:
    settings = load_settings({"allow_private": ["169.254.64.16/28"], "approver": ["terminal", "webhook"],
                              "webhook_url": "http://h/hook", "unsafe_webhook_http": True,
                              "webhook_secret": "whsec_AAAA", "listen": "127.0.0.1:9", "workers": 4})
    env = sidecar_environment(settings, egressd_ip="169.254.64.2", control_ip="169.254.64.18", token="t")
    assert env["EGRESSD_ALLOW_PRIVATE"] == "169.254.64.16/28" and env["EGRESSD_APPROVER"] == "webhook"
    assert env["EGRESSD_UNSAFE_WEBHOOK_HTTP"] == "true"  # the terminal relay's plain http to the gateway
    assert env["EGRESSD_WEBHOOK_SECRET_FILE"] == f"{SECRETS_DIR}/webhook_secret"
    assert env["EGRESSD_REQUIRE_AUTH"] == "true"
    assert "EGRESSD_WEBHOOK_SECRET" not in env and "EGRESSD_CONTROL_TOKEN" not in env  # files: not in docker inspect
    assert env["EGRESSD_LISTEN"] == "169.254.64.2:3128" and env["EGRESSD_CONTROL"] == "169.254.64.18:3129"
    assert env["EGRESSD_SOCKS"] == "169.254.64.2:1080"
    assert env["EGRESSD_WORKERS"] == "1"  # one sandbox's: one process, whatever serve's setting says
    assert "EGRESSD_ALLOW" not in env  # the allowlist is the run's, sent with POST /runs


def test_every_setting_is_passed_to_the_sidecar_or_named_as_its_own() -> None:
    from egressd.config.settings import Settings

    fields = set(Settings.model_fields)
    assert SIDECAR_OWN <= fields  # no stale name
    secret_files = {name for name in fields if name.endswith("_file")}
    assert set(PASSTHROUGH) == fields - SIDECAR_OWN - secret_files
    assert {"max_refusal_records", "upstream_dns", "approver"} <= set(PASSTHROUGH)


def test_an_owner_is_alive_only_while_its_process_runs() -> None:
    assert owner_alive("boot:42:777", boot_id="boot", start_time_of=lambda pid: "777")
    assert not owner_alive("boot:42:777", boot_id="boot", start_time_of=lambda pid: "778")  # pid reused
    assert not owner_alive("boot:42:777", boot_id="other", start_time_of=lambda pid: "777")  # rebooted
    assert not owner_alive("", boot_id="boot")


# -- the engine -------------------------------------------------------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[DockerEngine]:
    ok, why = dockerbed.engine_answers()
    require(ok, why)
    async with DockerEngine.connect() as engine:
        yield engine
        assert await leftovers(engine, "egressd.run", owner_pid=os.getpid()) == []


SECURE_NAME = "secure.test"  # an HTTPS origin's name (tls_origin_script)


@dataclass
class Bed:
    session: DockerSession
    engine: DockerEngine
    origin: dockerbed.Helper
    leak: dockerbed.Helper
    host: dockerbed.HostListeners
    internal: ipaddress.IPv4Network
    outgoing: ipaddress.IPv4Network
    hooks: list[dict[str, Any]]

    @property
    def egressd_ip(self) -> str:
        return str(self.internal.network_address + 2)

    @property
    def gateway(self) -> str:
        return str(self.outgoing.network_address + 1)

    async def sh(self, script: str, **kw: Any) -> Any:
        return await self.session.box.run(["sh", "-c", script], **kw)


@pytest.fixture
async def make_bed(engine: DockerEngine, tmp_path: Path) -> AsyncIterator[Any]:
    """``async with make_bed(**settings) as bed``: a run on Docker with an origin and leak detectors."""

    @contextlib.asynccontextmanager
    async def make(tty_path: str = "/dev/tty", **values: Any) -> AsyncIterator[Bed]:
        block = await free_test_range(engine)
        internal, outgoing = split_range(block)
        gateway = str(outgoing.network_address + 1)
        # Held from now on: the gateway address appears when the session makes the network.
        hook_sock = listening_socket(gateway, freebind=True)
        hook_port = hook_sock.getsockname()[1]
        values.setdefault("allow", [f"{ORIGIN_NAME}:*"])
        values.setdefault("allow_private", [str(outgoing)])
        values.setdefault("audit_log", str(tmp_path / "audit.jsonl"))
        if values.get("approver") == ["webhook"]:
            values.setdefault("webhook_url", f"http://{gateway}:{hook_port}/hook")
            values.setdefault("unsafe_webhook_http", True)  # the gateway is no loopback address
            values.setdefault("webhook_secret", "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode())
        settings = load_settings(values)
        with contextlib.closing(hook_sock):
            session = DockerSession(settings, workdir=None, task="docker bed", net_range=str(block),
                                    labels=TEST_LABELS, tty_path=tty_path, egressd_image=dockerbed.EGRESSD_IMAGE)
            async with session:
                net = session.resources
                assert net is not None
                run_label = f"egressd.run={net.run_key}"
                outgoing_name = f"egressd-{net.run_key}-outgoing"
                labels = net.labels_for("helper")
                origin = await start_helper(engine, network=outgoing_name, address=str(outgoing.network_address + 5),
                                            script=ORIGIN_SCRIPT, labels=labels, aliases=[ORIGIN_NAME])
                leak = await start_helper(engine, network=outgoing_name, address=str(outgoing.network_address + 6),
                                          script=LEAK_SCRIPT, labels=labels)
                async with host_listeners([HOST_LEAK, gateway]) as host, hook_receiver(hook_sock) as hooks:
                    yield Bed(session, engine, origin, leak, host, internal, outgoing, hooks)
            assert await leftovers(engine, run_label) == []

    yield make


async def test_allowed_origin_is_reached_through_the_sidecar(make_bed: Any, tmp_path: Path) -> None:
    async with make_bed() as bed:
        obs = await bed.sh(
            f"curl -sS -m 10 http://{ORIGIN_NAME}:{ORIGIN_PORT}/from-curl; echo;"
            f" python3 -c \"import urllib.request; print(urllib.request.urlopen("
            f"'http://{ORIGIN_NAME}:{ORIGIN_PORT}/from-python', timeout=10).read().decode())\";"
            f" curl -sS -m 10 --noproxy '*' http://{ORIGIN_NAME}/transparent; echo;"
            f" dig +short {ORIGIN_NAME}"
        )
        assert obs.exit_code == 0, obs.stderr
        assert "hello from origin: GET /from-curl" in obs.stdout
        assert "hello from origin: GET /from-python" in obs.stdout
        assert "hello from origin: GET /transparent" in obs.stdout  # ignored the proxy: landed on egressd anyway
        assert obs.stdout.strip().splitlines()[-1] == bed.egressd_ip  # every name resolves to egressd
        assert await bed.leak.leaks() == [] and bed.host.tcp == bed.host.udp == 0
        # Three requests reached the origin, every one from egressd's outgoing address, none from the sandbox.
        peers = [line.split()[1] for line in await bed.origin.arrivals()]
        assert len(peers) == 3 and set(peers) == {str(bed.outgoing.network_address + 2)}, peers
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    kinds = {(r.get("kind"), r.get("decision")) for r in records if r.get("event") == "egress"}
    assert ("http", "allow") in kinds and ("dns", "allow") in kinds  # egressd's records, appended to ours
    assert any(r.get("event") == "run.end" for r in records)


async def test_inspection_and_a_declared_secret_work_through_the_sidecar(
    make_bed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An inspected name on Docker: the command trusts the run's CA with no flags, a GET goes through with the
    real secret put in by the sidecar, a POST no rule covers is refused, a program ignoring the proxy is
    inspected too; the command holds only the placeholder."""
    value = f"real-{secrets.token_hex(8)}"
    monkeypatch.setenv("SECURE_TOKEN", value)  # egressd run's environment, as a user would export it
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki", [SECURE_NAME])
    async with make_bed(allow=[f"GET {SECURE_NAME}/docs/**"], secret=[f"SECURE_TOKEN@{SECURE_NAME}"],
                        inspect_origin_ca_file=str(pki.ca_pem), ask=False) as bed:
        net = bed.session.resources
        secure = await start_helper(
            bed.engine, network=f"egressd-{net.run_key}-outgoing", address=str(bed.outgoing.network_address + 7),
            script=tls_origin_script(pki.cert_pem.read_text(), pki.key_pem.read_text()),
            labels=net.labels_for("helper"), aliases=[SECURE_NAME],
        )
        obs = await bed.sh(
            f'curl -sS -m 10 -H "Authorization: Bearer $SECURE_TOKEN" https://{SECURE_NAME}/docs/a; echo;'
            f" curl -sS -m 10 -o /dev/null -w 'post=%{{http_code}}\\n' -X POST -d k=v https://{SECURE_NAME}/docs/up;"
            f" curl --noproxy '*' -sS -m 10 https://{SECURE_NAME}/docs/./direct; echo;"
            ' echo "placeholder=$SECURE_TOKEN"'
        )
        logs = await secure.logs()
    assert obs.exit_code == 0, obs.stderr
    assert "hello from tls origin: GET /docs/a" in obs.stdout and "post=403" in obs.stdout, (obs.stdout, obs.stderr)
    assert "hello from tls origin: GET /docs/direct" in obs.stdout, obs.stdout
    assert "placeholder=egressd-secret-" in obs.stdout and value not in obs.stdout + obs.stderr
    assert f"AUTH Bearer {value}" in logs.splitlines(), logs  # the sidecar put the real value in
    assert len([line for line in logs.splitlines() if line.startswith("AUTH")]) == 2  # the POST reached nothing
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    decided = {(r["kind"], r["decision"], r.get("method")) for r in records if r.get("event") == "egress"}
    assert {("https", "allow", "GET"), ("https", "deny", "POST"), ("tls", "allow", None)} <= decided, decided
    assert value not in json.dumps(records)


async def test_all_proxy_names_the_sidecars_socks_listener(make_bed: Any, tmp_path: Path) -> None:
    async with make_bed() as bed:
        obs = await bed.sh(
            f'case "$ALL_PROXY" in socks5h://*:1080) ;; *) echo "ALL_PROXY=$ALL_PROXY"; exit 3;; esac;'
            f' curl -sS -m 10 --proxy "$ALL_PROXY" http://{ORIGIN_NAME}:{ORIGIN_PORT}/from-socks; echo;'
            f' curl -sS -m 5 --proxy "$all_proxy" http://leak.test:8080/; echo curl=$?',
            capture=True,
        )
        assert obs.exit_code == 0, obs.stdout + obs.stderr
        assert "hello from origin: GET /from-socks" in obs.stdout and "curl=0" not in obs.stdout
        assert await bed.leak.leaks() == []
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    socks = [(r["host"], r["decision"]) for r in records if r.get("event") == "egress" and r.get("kind") == "socks"]
    assert socks == [(ORIGIN_NAME, "allow"), ("leak.test", "deny")]


async def test_unknown_domain_is_refused_and_reported(make_bed: Any) -> None:
    async with make_bed() as bed:
        cursor = bed.session.cursor()
        bed.session.set_command("curl leak.test")
        obs = await bed.sh("curl -fsS -m 5 http://leak.test:8080/; echo curl=$?", capture=True)
        assert "curl=0" not in obs.stdout
        refusals = bed.session.refusals_since(cursor)
        assert Refusal(host="leak.test", port=8080, reason="no_approver", kind="http") in refusals
        assert await bed.leak.leaks() == []


async def test_network_bypasses_fail_and_reach_nothing(make_bed: Any) -> None:
    async with make_bed() as bed:
        leak_port = bed.host.ports[bed.gateway]
        targets = {
            "tcp": {
                "leak container": [bed.leak.address, 8080],
                # Forwarded off the internal network (the path any outside address would take): dropped.
                "origin container directly": [bed.origin.address, ORIGIN_PORT],
                "host via the outgoing bridge": [bed.gateway, leak_port],
                "host via the internal gateway": [str(bed.internal.network_address + 1), 22],
                "egressd's control port": [bed.egressd_ip, 3129],
                "egressd on another port": [bed.egressd_ip, 22],
                "the host's loopback": [HOST_LEAK, bed.host.ports[HOST_LEAK]],
            },
            "udp": {
                "leak container": [bed.leak.address, 53],
                "host via the outgoing bridge": [bed.gateway, leak_port],
                "egressd on another port": [bed.egressd_ip, 9],
            },
            "dns": {"leak container": bed.leak.address, "host": bed.gateway},
        }
        obs = await bed.session.box.run(["python3", "-c", PROBE, json.dumps(targets)], capture=True)
        assert obs.exit_code == 0, obs.stderr
        results = json.loads(obs.stdout.strip().splitlines()[-1])
        for name, result in results.items():
            if name.startswith(("udp ", "detail ", "table ")):
                continue  # a datagram may "send"; the listeners below say whether it arrived
            assert result not in ("connected", "answered"), (name, result, results)
        assert results["raw socket"] == "EPERM"
        assert results["tcp egressd's control port"] == "ECONNREFUSED"  # the control API is not on the sandbox's side
        await asyncio.sleep(0.5)
        assert await bed.leak.leaks() == []
        assert await bed.origin.arrivals() == []  # egressd dialled nothing here, and nothing else reached it
        assert bed.host.tcp == 0 and bed.host.udp == 0


# -- the internal bridge, fenced off the host (issue 26, item 5) -----------------------------------


@contextlib.contextmanager
def host_address(address: str) -> Any:
    """``address``/32 on a veth pair of the test's own in the host's namespace, removed after.

    What a bubblewrap run whose range overlaps a Docker run's does: the
    host end of its veth holds the first address of a /30, the internal
    network's gateway (.1) when the /30 is the /28's first.
    """
    require(os.geteuid() == 0 and shutil.which("ip") is not None, "a host address of the test's own needs root and ip")
    name = f"egxt{secrets.token_hex(4)}"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"], check=True, timeout=10)
    try:
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", name], check=True, timeout=10)
        subprocess.run(["ip", "link", "set", name, "up"], check=True, timeout=10)
        yield name
    finally:
        subprocess.run(["ip", "link", "del", name], timeout=10)


@contextlib.contextmanager
def route_to(address: str, device: str) -> Any:
    """A route of the test's own to ``address`` by ``device``: so that what reaches the host can be answered
    there (a connection counted), instead of the answer going to the host's default route."""
    subprocess.run(["ip", "route", "add", f"{address}/32", "dev", device], check=True, timeout=10)
    try:
        yield
    finally:
        subprocess.run(["ip", "route", "del", f"{address}/32", "dev", device], timeout=10)


async def _bridge_of(engine: DockerEngine, network: str) -> str:
    info = await engine.client.networks.get(network)
    details = await info.show()
    return str((details.get("Options") or {}).get("com.docker.network.bridge.name") or f"br-{details['Id'][:12]}")


async def test_a_host_address_inside_the_run_network_refuses_the_run(engine: DockerEngine, tmp_path: Path) -> None:
    block = await free_test_range(engine)
    internal, _ = split_range(block)
    settings = load_settings({"audit_log": str(tmp_path / "audit.jsonl")})
    with host_address(str(internal.network_address + 1)) as dummy:
        session = DockerSession(settings, workdir=None, task="collision", net_range=str(block), labels=TEST_LABELS,
                                egressd_image=dockerbed.EGRESSD_IMAGE)
        with pytest.raises(SessionError) as refused:
            async with session:
                pass
    assert str(refused.value) == (f"the host holds {dummy} {internal.network_address + 1}/32, inside the sandbox's "
                                  f"network {internal}: remove it or give --net-range a range clear of it")
    assert [t for t in await fence_tables() if f"-{os.getpid()}-" in t] == []


async def test_a_host_address_at_the_gateway_after_the_start_reaches_nothing_of_the_host(
    make_bed: Any, engine: DockerEngine
) -> None:
    # Issue 26: a bubblewrap run started after a Docker run put the internal network's .1 on its veth; the
    # sandbox's default route names .1, the host answered its ARP and took its packets.
    async with make_bed() as bed:
        gateway, sandbox = str(bed.internal.network_address + 1), str(bed.internal.network_address + 3)
        assert bed.session.resources is not None
        bridge = await _bridge_of(engine, f"egressd-{bed.session.resources.run_key}-internal")
        with host_address(gateway), route_to(sandbox, bridge):
            async with host_listeners([gateway]) as at_gateway:
                targets = {
                    "tcp": {"the host at the gateway": [gateway, at_gateway.ports[gateway]],
                            "the host at the outgoing gateway": [bed.gateway, bed.host.ports[bed.gateway]],
                            "a container routed to by the host": [bed.leak.address, 8080]},
                    "udp": {"the host at the gateway": [gateway, at_gateway.ports[gateway]],
                            "the host at the outgoing gateway": [bed.gateway, bed.host.ports[bed.gateway]]},
                    "dns": {},
                }
                arp_ignore = Path(f"/proc/sys/net/ipv4/conf/{bridge}/arp_ignore")
                assert await asyncio.to_thread(arp_ignore.read_text) == "8\n"
                for layer in ("ARP and nftables", "nftables alone"):
                    if layer == "nftables alone":
                        # The host answers ARP for .1 again: the table still drops what arrives.
                        await asyncio.to_thread(arp_ignore.write_text, "0\n")
                    obs = await bed.session.box.run(["python3", "-c", PROBE, json.dumps(targets)], capture=True)
                    assert obs.exit_code == 0, obs.stderr
                    results = json.loads(obs.stdout.strip().splitlines()[-1])
                    for name in ("tcp the host at the gateway", "tcp the host at the outgoing gateway",
                                 "tcp a container routed to by the host"):
                        assert results[name] != "connected", (layer, name, results)
                    await asyncio.sleep(0.5)
                    counts = (at_gateway.tcp, at_gateway.udp, bed.host.tcp, bed.host.udp)
                    assert counts == (0, 0, 0, 0) and await bed.leak.leaks() == [], (layer, results)
        assert [t for t in await fence_tables() if f"-{os.getpid()}-" in t]  # fenced while the run lasts
    assert [t for t in await fence_tables() if f"-{os.getpid()}-" in t] == []  # and not after


async def test_the_host_filesystem_secrets_and_processes_stay_out_of_reach(make_bed: Any, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    home_ssh = Path.home() / ".ssh"
    home_ssh.mkdir(exist_ok=True)
    key = home_ssh / f"egressd-test-key-{uuid.uuid4().hex}"
    marker = f"FAKE-PRIVATE-KEY-{uuid.uuid4().hex}"
    key.write_text(marker)
    monkeypatch.setenv("EGRESSD_TEST_SECRET", "s3cret")
    try:
        async with make_bed() as bed:
            obs = await bed.sh(
                f"cat {key} 2>&1; cat {tmp_path}/audit.jsonl 2>&1; cat /var/run/docker.sock 2>&1;"
                " echo x > /etc/egressd-x 2>&1; echo etc=$?; echo x > /usr/egressd-x 2>&1; echo usr=$?;"
                " echo x > /tmp/x; echo tmp=$?; echo inside > /work/made-inside; echo work=$?;"
                " echo pids=$(ls /proc | grep -c '^[0-9]'); env | grep -c EGRESSD_TEST_SECRET;"
                " grep -E 'NoNewPrivs|CapEff' /proc/self/status; unshare -U true 2>&1; echo unshare=$?;"
                " id -u", capture=True)
            workdir = bed.session.workdir
            assert (workdir / "made-inside").read_text() == "inside\n"
    finally:
        key.unlink()
    out = obs.stdout
    assert marker not in out and marker not in obs.stderr
    # The container's /root is the image's (empty, not ours to read), never the host's.
    assert f"{key}: No such file or directory" in out or f"{key}: Permission denied" in out
    assert f"{tmp_path}/audit.jsonl: No such file or directory" in out
    assert "/var/run/docker.sock: No such file or directory" in out
    assert "etc=0" not in out and "usr=0" not in out and "Read-only file system" in obs.stderr
    assert "tmp=0" in out and "work=0" in out
    assert int(out.split("pids=")[1].split()[0]) < 10  # only the sandbox's own processes
    assert "s3cret" not in out and "\n0\n" in out
    assert "NoNewPrivs:\t1" in out and "CapEff:\t0000000000000000" in out
    assert "unshare=0" not in out and out.strip().splitlines()[-1] == "1000"


async def test_limits_time_memory_and_output(make_bed: Any) -> None:
    async with make_bed() as bed:
        workdir = bed.session.workdir
        obs = await bed.sh("(sleep 3; touch /work/survivor) & setsid sh -c 'sleep 3; touch /work/survivor2' &"
                           " sleep 60", limits=Limits(timeout_s=1))
        assert obs.exit_code == 124 and obs.timed_out
        obs = await bed.session.box.run(["python3", "-c", "x = bytearray(512 * 1024 * 1024); print(len(x))"],
                                        limits=Limits(memory_mb=64))
        assert obs.exit_code == 137 and obs.memory_exceeded
        spawn = ("import subprocess\nstarted = []\ntry:\n    for _ in range(100):\n"
                 "        started.append(subprocess.Popen(['sleep', '30']))\n"
                 "except OSError as exc:\n    print('refused', exc.strerror)\nprint('started', len(started))")
        obs = await bed.session.box.run(["python3", "-c", spawn], limits=Limits(max_pids=32, timeout_s=20))
        assert "refused" in obs.stdout and int(obs.stdout.split("started ")[1]) < 32, obs.stdout
        obs = await bed.sh("head -c 300000 /dev/zero | tr '\\0' x", max_output=1000)
        assert len(obs.stdout) < 1100 and obs.stdout_truncated == 299000 and "truncated" in obs.stdout
        await asyncio.sleep(3)
        assert not (workdir / "survivor").exists() and not (workdir / "survivor2").exists()


async def test_a_held_request_is_allowed_from_the_control_api(make_bed: Any) -> None:
    async with make_bed(approver=["webhook"], allow=[]) as bed:
        bed.session.set_command("curl origin")
        run = asyncio.ensure_future(bed.sh(f"curl -sS -m 60 http://{ORIGIN_NAME}:{ORIGIN_PORT}/held"))
        control = bed.session.control
        assert control is not None
        approvals: list[dict[str, Any]] = []
        for _ in range(200):  # 20 s at most
            approvals = (await control.call("GET", "/approvals"))["approvals"]
            if approvals and bed.hooks:
                break
            await asyncio.sleep(0.1)
        assert approvals and approvals[0]["host"] == ORIGIN_NAME and approvals[0]["command"] == "curl origin"
        assert bed.hooks and bed.hooks[0]["host"] == ORIGIN_NAME  # delivered to the approval channel
        answer = await control.call("POST", f"/approvals/{approvals[0]['id']}/allow", {"by": "test"})
        assert answer["decision"] == "allow"
        obs = await asyncio.wait_for(run, 60)
        assert obs.exit_code == 0 and "hello from origin: GET /held" in obs.stdout


async def test_egressd_pending_and_allow_find_a_docker_run_by_themselves(
    make_bed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 16: a --backend docker run printed no control address, and `egressd pending` could not find it.
    state = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))  # where this run registers, and the commands look
    env = _clean_env(state)
    async with make_bed(approver=["webhook"], allow=[]) as bed:
        run = asyncio.ensure_future(bed.sh(f"curl -sS -m 60 http://{ORIGIN_NAME}:{ORIGIN_PORT}/held"))
        approvals: list[dict[str, Any]] = []
        for _ in range(100):  # 20 s at most
            listed = await asyncio.create_subprocess_exec(
                EGRESSD, "pending", "--json", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            out, err = await listed.communicate()
            approvals = json.loads(out or b"[]")
            if approvals:
                break
            await asyncio.sleep(0.2)
        assert [(a["host"], a["instance"]["kind"]) for a in approvals] == [(ORIGIN_NAME, "run")], err
        entries = list((state / "egressd" / "instances").glob("*.json"))
        assert len(entries) == 1 and bed.session.control is not None
        assert "token" not in json.loads(entries[0].read_text())["control"]
        allow = await asyncio.create_subprocess_exec(
            EGRESSD, "allow", approvals[0]["id"], env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await allow.communicate()
        assert allow.returncode == 0, err
        obs = await asyncio.wait_for(run, 60)
        assert obs.exit_code == 0 and "hello from origin: GET /held" in obs.stdout
    assert list((state / "egressd" / "instances").iterdir()) == []  # its entry and its token file, gone


async def test_a_held_request_is_allowed_at_the_terminal_the_run_was_started_from(make_bed: Any) -> None:
    master, slave = os.openpty()
    os.set_blocking(master, False)
    screen = bytearray()

    async def read_until(text: bytes, limit_s: float = 20) -> None:
        async with asyncio.timeout(limit_s):
            while text not in screen:
                with contextlib.suppress(BlockingIOError):
                    screen.extend(os.read(master, 65536))
                await asyncio.sleep(0.05)

    try:
        async with make_bed(approver=["terminal"], allow=[], tty_path=os.ttyname(slave)) as bed:
            assert bed.session.relay is not None  # egressd's approvals come to our terminal
            bed.session.set_command("curl origin")
            run = asyncio.ensure_future(bed.sh(f"curl -sS -m 60 http://{ORIGIN_NAME}:{ORIGIN_PORT}/typed"))
            await read_until(ORIGIN_NAME.encode())
            assert b"curl origin" in screen  # the approval message, on our terminal
            await asyncio.sleep(0.2)
            os.write(master, b"allow\r")
            obs = await asyncio.wait_for(run, 60)
            assert obs.exit_code == 0 and "hello from origin: GET /typed" in obs.stdout
            await read_until(b"allowed for this run")
    finally:
        os.close(master)
        os.close(slave)


async def test_copy_out_goes_through_the_archive_api_with_the_same_checks(make_bed: Any, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    async with make_bed() as bed:
        obs = await bed.sh("mkdir -p dist sub && echo wheel > dist/a.whl && ln -s /etc/passwd dist/b.whl"
                           " && mkfifo dist/c.whl && ln -s /etc dist/d && echo deep > sub/x.whl")
        assert obs.exit_code == 0, obs.stderr
        report = await bed.session.box.copy_out(["dist/*", "sub/*.whl"], out_dir)
    assert (out_dir / "dist" / "a.whl").read_text() == "wheel\n" and (out_dir / "sub" / "x.whl").exists()
    assert not (out_dir / "dist" / "b.whl").exists() and not (out_dir / "dist" / "c.whl").exists()
    assert dict(report.skipped) == {"dist/b.whl": "a link (not followed)", "dist/c.whl": "not a regular file",
                                    "dist/d": "a link (not followed)"}
    assert sorted(report.copied) == ["dist/a.whl", "sub/x.whl"]


# -- egressd run --backend docker, as a user runs it ------------------------------------------


def _clean_env(state: Path) -> dict[str, str]:
    """Our environment without EGRESSD_* settings, with a state directory of the test's own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(state)}


async def egressd_run(tmp_path: Path, *args: str, limit_s: float = 90) -> tuple[int, str, str]:
    """``egressd run --backend docker ARGS`` as a user runs it; checks it left nothing behind."""
    env = _clean_env(tmp_path / "s")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--backend", "docker", *IMAGE, "--audit-log", str(tmp_path / "audit.jsonl"), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    assert proc.returncode is not None
    async with DockerEngine.connect() as engine:
        assert await leftovers(engine, "egressd.run", owner_pid=proc.pid) == []
    assert [t for t in await fence_tables() if f"-{proc.pid}-" in t] == []
    return proc.returncode, out.decode(), err.decode()


async def test_egressd_run_exits_with_the_commands_status_and_limits(engine: DockerEngine, tmp_path: Path) -> None:
    code, out, err = await egressd_run(tmp_path, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (code, out, err.strip().splitlines()[-1]) == (7, "out\n", "err"), err
    code, _, err = await egressd_run(tmp_path, "--timeout", "1", "--", "sleep", "30")
    assert code == 124 and "--timeout" in err
    code, _, err = await egressd_run(tmp_path, "--memory", "64", "--", "python3", "-c", "x = bytearray(1 << 29)")
    assert code == 137 and "--memory" in err
    code, _, err = await egressd_run(tmp_path, "--image", "egressd-no-such-image:1", "--", "true")
    assert code == 125 and "egressd-no-such-image:1" in err


async def test_a_missing_command_exits_127_with_one_clear_line(engine: DockerEngine, tmp_path: Path) -> None:
    # Issue 16: the container's init said "[FATAL tini (7)] exec ... failed"; now the line bubblewrap's run says.
    code, out, err = await egressd_run(tmp_path, "--", "no-such-command-xyz", "arg")
    assert (code, out) == (127, ""), err
    assert err == "egressd: no-such-command-xyz: command not found in the sandbox\n"


async def test_egressd_run_copies_out_through_the_engine(engine: DockerEngine, tmp_path: Path) -> None:
    workdir, out_dir = tmp_path / "work", tmp_path / "out"
    workdir.mkdir()
    out_dir.mkdir()
    os.chown(workdir, 1000, 1000)
    code, _, err = await egressd_run(
        tmp_path, "--workdir", str(workdir), "--copy-out", "dist/*.whl", "--copy-out-dir", str(out_dir), "--",
        "sh", "-c", "mkdir dist && echo wheel > dist/a.whl && ln -s /etc/passwd dist/b.whl",
    )
    assert code == 0, err
    assert (out_dir / "dist" / "a.whl").read_text() == "wheel\n" and not (out_dir / "dist" / "b.whl").exists()
    assert "copy-out: skipped dist/b.whl: a link (not followed)" in err


async def test_a_run_in_a_mount_namespace_of_its_own_refuses_before_the_command_starts(
    engine: DockerEngine, tmp_path: Path
) -> None:
    # Issue 26: the nosuid,nodev stage is a mount in egressd's namespace; an engine outside it mounted the bare,
    # root-owned stage directory at /work: "Permission denied" on the user's files, nothing copied out, no word.
    require(shutil.which("unshare") is not None, "unshare (util-linux) makes the private mount namespace")
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "mine.txt").write_text("the user's file\n")
    for path in (workdir, workdir / "mine.txt"):
        os.chown(path, 1000, 1000)
    env = _clean_env(tmp_path / "s")
    proc = await asyncio.create_subprocess_exec(
        "unshare", "-m", "--propagation", "private",
        EGRESSD, "run", "--backend", "docker", *IMAGE, "--audit-log", str(tmp_path / "audit.jsonl"),
        "--workdir", str(workdir), "--", "sh", "-c", "cat mine.txt && echo written > out.txt",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert (proc.returncode, out.decode(), err.decode()) == (125, "", f"egressd: {WORKDIR_UNSEEN}\n")
    assert sorted(p.name for p in workdir.iterdir()) == ["mine.txt"]  # nothing ran, nothing was left in it
    assert await leftovers(engine, "egressd.run", owner_pid=proc.pid) == []
    assert [p for p in STAGE_DIR.iterdir() if f":{proc.pid}:" in p.name] == []
    # In the engine's mount namespace the same run sees the user's directory.
    code, out_text, err_text = await egressd_run(tmp_path, "--workdir", str(workdir), "--", "sh", "-c",
                                                 "cat mine.txt && echo written > out.txt")
    assert (code, out_text) == (0, "the user's file\n"), err_text
    assert (workdir / "out.txt").read_text() == "written\n"


async def test_egressd_agent_runs_its_commands_in_a_docker_sandbox(engine: DockerEngine, tmp_path: Path) -> None:
    script = tmp_path / "steps.json"
    script.write_text(json.dumps([
        {"command": "echo built > report.txt && cat /etc/hostname > /dev/null && id -u"},
        {"command": "cat /root/.ssh/id_rsa"},
        {"final": "done"},
    ]))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = _clean_env(tmp_path / "s")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "agent", "--backend", "docker", *IMAGE, "--audit-log", str(tmp_path / "audit.jsonl"),
        "--task", "write a report", "--model", f"script:{script}", "--transcript", str(tmp_path / "t.jsonl"),
        "--copy-out", "report.txt", "--copy-out-dir", str(out_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "done"
    steps = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert steps[0]["exit_code"] == 0 and steps[0]["stdout"].strip() == "1000"
    assert steps[1]["exit_code"] != 0
    assert steps[-1] == {"final": "done", "stop": "final"}
    assert (out_dir / "report.txt").read_text() == "built\n"
    assert await leftovers(engine, "egressd.run", owner_pid=proc.pid) == []


async def _wait_for_run_containers(engine: DockerEngine, pid: int, count: int = 2) -> None:
    for _ in range(300):  # 30 s at most
        containers, _, _ = await engine.labelled("egressd.run")
        running = [c for c in containers if c.get("State") == "running"
                   and f":{pid}:" in (c.get("Labels") or {}).get("egressd.owner", "")]
        if len(running) >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the run's containers did not start")


async def test_sigterm_destroys_everything_the_run_made(engine: DockerEngine, tmp_path: Path) -> None:
    env = _clean_env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--backend", "docker", *IMAGE, "--audit-log", str(tmp_path / "a.jsonl"), "--", "sleep", "60",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
    )
    await _wait_for_run_containers(engine, proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 128 + 15 and b"destroyed" in err
    assert await leftovers(engine, "egressd.run", owner_pid=proc.pid) == []


async def test_leftovers_of_a_killed_run_are_removed_by_doctor_clean_and_at_the_next_start(
    engine: DockerEngine, tmp_path: Path
) -> None:
    env = _clean_env(tmp_path)
    for cleaner in ("doctor --clean", "next run"):
        proc = await asyncio.create_subprocess_exec(
            EGRESSD, "run", "--backend", "docker", *IMAGE, "--audit-log", str(tmp_path / "a.jsonl"), "--",
            "sleep", "60", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            stdin=asyncio.subprocess.DEVNULL, env=env,
        )
        await _wait_for_run_containers(engine, proc.pid)
        proc.kill()  # no chance to clean up
        await proc.wait()
        left = await leftovers(engine, "egressd.run", owner_pid=proc.pid)
        assert len(left) == 5  # two containers, two networks, one volume, left behind
        assert [t for t in await fence_tables() if f"-{proc.pid}-" in t]  # and the fence on the host
        if cleaner == "doctor --clean":
            doctor = await asyncio.create_subprocess_exec(
                EGRESSD, "doctor", "--clean", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env)
            out, _ = await asyncio.wait_for(doctor.communicate(), 120)
            assert b"docker " in out and b"removed " in out, out
            if IN_CI:  # elsewhere another egressd starting meanwhile may have removed them first
                assert all(name.split()[1].encode() in out for name in left if name.startswith("network")), out
        else:
            code, _, err = await egressd_run(tmp_path, "--", "true")
            assert code == 0, err
        assert await leftovers(engine, "egressd.run", owner_pid=proc.pid) == []
        assert [t for t in await fence_tables() if f"-{proc.pid}-" in t] == []


# -- the compose example -------------------------------------------------------------------------


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        import subprocess

        if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
            return ["docker", "compose"]
    return None


async def _exec(engine: DockerEngine, container: str, argv: list[str], limit_s: float = 60) -> tuple[int, str]:
    """Run ``argv`` in a running container as its own user; (exit code, stdout+stderr)."""
    c = engine.client.containers.container(container)
    execution = await c.exec(argv, stdout=True, stderr=True)
    output = []
    async with asyncio.timeout(limit_s):
        async with execution.start(detach=False) as stream:
            while (message := await stream.read_out()) is not None:
                output.append(message.data.decode(errors="replace"))
        info = await execution.inspect()
    return int(info["ExitCode"]), "".join(output)


async def test_the_compose_example_holds_the_same_boundaries(engine: DockerEngine, tmp_path: Path) -> None:
    compose = _compose_command()
    require(compose is not None, "neither docker compose nor docker-compose is installed")
    assert compose is not None
    block = await free_test_range(engine)
    internal, outgoing = split_range(block)
    gateway = str(outgoing.network_address + 1)
    sidecar, sandbox_ip = str(internal.network_address + 2), str(internal.network_address + 3)
    control_ip = str(outgoing.network_address + 2)
    project = f"egdtest{secrets.token_hex(4)}"
    token = secrets.token_urlsafe(24)
    webhook_secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    # The host's end of the control port is Docker's to choose (read back after `up`); the webhook
    # receiver's socket is held from now on, on the gateway address `up` brings.
    hook_sock = listening_socket(gateway, freebind=True)
    hook_port = hook_sock.getsockname()[1]
    # The secrets as the compose file's comment says: files of egressd's user (10001) that no one else may
    # read, in the directory EGRESSD_SECRETS; the test's own copy of the token is root's (ours).
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir(mode=0o700)
    for name, value in (("control_token", token), ("webhook_secret", webhook_secret)):
        (secret_dir / name).write_text(value + "\n")
        (secret_dir / name).chmod(0o400)
        os.chown(secret_dir / name, 10001, 10001)
    os.chown(secret_dir, 10001, 10001)
    our_token = tmp_path / "control_token"
    our_token.write_text(token + "\n")
    our_token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {
        "EGRESSD_SANDBOX_SUBNET": str(internal), "EGRESSD_OUTGOING_SUBNET": str(outgoing),
        "EGRESSD_SIDECAR_IP": sidecar, "EGRESSD_SANDBOX_IP": sandbox_ip, "EGRESSD_CONTROL_IP": control_ip,
        "EGRESSD_CONTROL_PORT": "0", "EGRESSD_SECRETS": str(secret_dir),
        # Exactly the origin: egressd listens on every address it has, and must never dial one of them.
        "EGRESSD_ALLOW": f"{ORIGIN_NAME}:{ORIGIN_PORT}", "EGRESSD_ALLOW_PRIVATE": f"{outgoing.network_address + 5}/32",
        "EGRESSD_IMAGE": dockerbed.EGRESSD_IMAGE,
        "EGRESSD_APPROVER": "webhook", "EGRESSD_WEBHOOK_URL": f"http://{gateway}:{hook_port}/hook",
        "EGRESSD_UNSAFE_WEBHOOK_HTTP": "true",  # the gateway is no loopback address
        "EGRESSD_WEBHOOK_SECRET_FILE": "/run/secrets/egressd/webhook_secret",
        "XDG_STATE_HOME": str(tmp_path / "s"),
    }
    base = [*compose, "-f", str(REPO / "docker" / "compose.yaml"), "-p", project]

    async def run(*argv: str, limit_s: float = 180, environment: dict[str, str] = env) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT, env=environment,
                                                    cwd=REPO)  # as the README runs it
        out, _ = await asyncio.wait_for(proc.communicate(), limit_s)
        return proc.returncode or 0, out.decode(errors="replace")

    helpers: list[dict[str, Any]] = []
    try:
        code, out = await run(*base, "up", "-d", "--no-build")
        assert code == 0, out
        egressd = f"{project}-egressd-1" if compose != ["docker-compose"] else f"{project}_egressd_1"
        published = (await engine.client.containers.container(egressd).show())["NetworkSettings"]["Ports"]
        control_port = int(published["3129/tcp"][0]["HostPort"])
        sandbox = f"{project}_sandbox_1" if compose == ["docker-compose"] else f"{project}-sandbox-1"
        outgoing_net = f"{project}_outgoing"
        labels = {"egressd.test": "1", "com.docker.compose.project": project}
        origin = await start_helper(engine, network=outgoing_net, address=str(outgoing.network_address + 5),
                                    script=ORIGIN_SCRIPT, labels=labels, aliases=[ORIGIN_NAME, HELD_NAME])
        leak = await start_helper(engine, network=outgoing_net, address=str(outgoing.network_address + 6),
                                  script=LEAK_SCRIPT, labels=labels)
        helpers = [{"Id": origin.id}, {"Id": leak.id}]
        async with host_listeners([HOST_LEAK, gateway]) as host, hook_receiver(hook_sock) as hooks:
            # The normal path: through the proxy variables, and transparently.
            code, out = await _exec(engine, sandbox, ["sh", "-c",
                                    f"curl -sS -m 10 http://{ORIGIN_NAME}:{ORIGIN_PORT}/compose; echo;"
                                    " id -u; grep -E 'NoNewPrivs|CapEff' /proc/self/status; touch /etc/x"])
            assert "hello from origin: GET /compose" in out, out
            assert "\n1000\n" in out and "NoNewPrivs:\t1" in out and "CapEff:\t0000000000000000" in out
            assert "Read-only file system" in out
            # egressd's seccomp profile, not Docker's default: AF_VSOCK and io_uring are refused.
            code, out = await _exec(engine, sandbox, ["python3", "-c", SOCKET_FAMILY_PROBE])
            assert out.split() == ["97", "97", "1"], out
            # The bypasses.
            targets = {
                "tcp": {"leak container": [leak.address, 8080], "origin directly": [origin.address, ORIGIN_PORT],
                        "host via the outgoing bridge": [gateway, host.ports[gateway]],
                        "egressd's control port": [sidecar, 3129]},
                "udp": {"leak container": [leak.address, 53], "host": [gateway, host.ports[gateway]]},
                "dns": {"leak container": leak.address, "host": gateway},
            }
            code, out = await _exec(engine, sandbox, ["python3", "-c", PROBE, json.dumps(targets)])
            results = json.loads(out.strip().splitlines()[-1])
            for name, result in results.items():
                if not name.startswith("udp "):
                    assert result not in ("connected", "answered"), (name, result)
            # A held request, allowed from the test through the published control API.
            held = asyncio.ensure_future(_exec(engine, sandbox, ["curl", "-sS", "-m", "60", f"http://{HELD_NAME}:{ORIGIN_PORT}/held"]))
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                url = f"http://127.0.0.1:{control_port}"
                approvals: list[dict[str, Any]] = []
                for _ in range(200):
                    async with http.get(f"{url}/approvals") as resp:
                        approvals = (await resp.json())["approvals"]
                    if approvals and hooks:
                        break
                    await asyncio.sleep(0.1)
                assert approvals and approvals[0]["host"] == HELD_NAME
                assert hooks and hooks[0]["host"] == HELD_NAME  # delivered to the approval channel
                async with http.post(f"{url}/approvals/{approvals[0]['id']}/allow", json={"by": "test"}) as resp:
                    assert resp.status == 200
            code, out = await asyncio.wait_for(held, 60)
            assert "hello from origin: GET /held" in out, out
            # egressd run --connect: a new sandbox on a network of its own, with compose's egressd
            # attached for the run; it reaches the origin through egressd, and not compose's sandbox.
            workdir = tmp_path / "work"
            workdir.mkdir()
            os.chown(workdir, 1000, 1000)
            reach = ("import socket; s = socket.socket(); s.settimeout(2);"
                     f" print('sandbox:', s.connect_ex(('{sandbox_ip}', 1)) or 'connected')")
            code, out = await run(EGRESSD, "run", "--backend", "docker", "--connect", f"http://127.0.0.1:{control_port}",
                                  "--control-token-file", str(our_token), "--allow", f"{ORIGIN_NAME}:{ORIGIN_PORT}",
                                  "--net-range", str(await free_test_range(engine)), "--workdir", str(workdir), "--",
                                  "sh", "-c", f"curl -sS -m 10 http://{ORIGIN_NAME}:{ORIGIN_PORT}/connect; echo;"
                                  f" python3 -c \"{reach}\"",
                                  environment={k: v for k, v in env.items() if not k.endswith("_SECRET_FILE")})
            assert code == 0 and "hello from origin: GET /connect" in out, out
            # Not even a reset (ECONNREFUSED, 111) from the compose sandbox: it is on no network of the run.
            assert "sandbox: " in out and "sandbox: 111" not in out and "sandbox: connected" not in out, out
            info = await engine.client.containers.container(egressd).show()
            assert set(info["NetworkSettings"]["Networks"]) == {f"{project}_sandbox", outgoing_net}
            config = json.dumps(info["Config"])  # docker inspect: the secrets are files, not in the environment
            assert token not in config and webhook_secret not in config, info["Config"]["Env"]
            assert (await _exec(engine, egressd, ["cat", "/proc/sys/net/ipv4/ip_forward"]))[1].strip() == "0"
            await asyncio.sleep(0.5)
            assert await leak.leaks() == [] and host.tcp == 0 and host.udp == 0
    finally:
        hook_sock.close()
        for helper in helpers:
            await engine.remove_container(helper["Id"])
        code, out = await run(*base, "down", "-v", "--remove-orphans")
        assert code == 0, out
    assert await leftovers(engine, f"com.docker.compose.project={project}") == []


def test_the_compose_file_hardens_the_sandbox_as_documented() -> None:
    text = (REPO / "docker" / "compose.yaml").read_text()
    sandbox = text.split("\n  sandbox:\n")[1].split("\nnetworks:\n")[0]
    for needle in ("read_only: true", "cap_drop: [ALL]", "no-new-privileges:true", 'user: "1000:1000"',
                   "ipc: private", "pids_limit:", "mem_limit:", "memswap_limit:", "cpus:", "/tmp:", "runtime:",
                   "dns:", "HTTP_PROXY=", '"seccomp=${EGRESSD_SANDBOX_SECCOMP:-./docker/sandbox-seccomp.json}"'):
        assert needle in sandbox, needle
    assert "internal: true" in text and '"127.0.0.1:${EGRESSD_CONTROL_PORT:-3129}:3129"' in text


def test_the_compose_sandboxs_seccomp_profile_is_the_one_egressd_generates() -> None:
    # Regenerate with: .venv/bin/python -c 'import json; from egressd.sandbox.seccomp import docker_profile;
    #   print(json.dumps(docker_profile(), indent=1, sort_keys=True))' > docker/sandbox-seccomp.json
    path = REPO / "docker" / "sandbox-seccomp.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(docker_profile(machine="x86_64")))


class _StaleView:
    """The engine, except that its first list of taken subnets is one from before another run took one."""

    def __init__(self, engine: DockerEngine, stale: list[Any]) -> None:
        self._engine = engine
        self._stale: list[Any] | None = stale

    async def taken_subnets(self) -> list[Any]:
        if self._stale is not None:
            stale, self._stale = self._stale, None
            return stale
        return await self._engine.taken_subnets()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


async def test_a_subnet_another_run_took_meanwhile_is_given_up_for_another(engine: DockerEngine) -> None:
    """The race two runs starting together lose: both pick the same free /28, the engine refuses the second."""
    before = await engine.taken_subnets()
    [wanted, _] = choose_subnets(DEFAULT_DOCKER_RANGE, before, count=2)
    blocker = f"egressd-test-blocker-{secrets.token_hex(4)}"
    await engine.client.networks.create(
        network_config(blocker, wanted, internal=True, labels={"egressd.test": str(os.getpid())})
    )
    net = None
    try:
        stale = _StaleView(engine, before)
        net = await DockerRunNetwork.create(stale, labels={"egressd.test": str(os.getpid())})  # type: ignore[arg-type]
        assert not net.plan.internal.overlaps(wanted) and not net.plan.outgoing.overlaps(wanted)
        pool = ipaddress.ip_network(DEFAULT_DOCKER_RANGE)
        assert net.plan.internal.subnet_of(pool) and net.note == ""  # retried in the pool, not sent elsewhere
    finally:
        if net is not None:
            await net.destroy()
        await engine.remove_network(blocker)


async def test_runs_started_together_never_collide(engine: DockerEngine, tmp_path: Path) -> None:
    runs = [tmp_path / str(n) for n in range(3)]
    results = await asyncio.gather(*(egressd_run(path, "--", "sh", "-c", "echo ran") for path in runs))
    assert [(code, out) for code, out, _ in results] == [(0, "ran\n")] * 3, [err for _, _, err in results]
