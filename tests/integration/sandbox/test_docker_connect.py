"""``egressd run --connect``: runs of one running egressd never share a network.

The attack: two runs use the same running egressd (a container of the test
bed, configured as docker/compose.yaml configures it), each sandbox learns
its own address and listens on a port of its own, and the other sandbox
connects to that address directly, with no proxy. Neither reaches the other
(the listener counts no connection, and a closed port does not even answer
with a reset), while both still reach an allowed origin through egressd,
with the proxy variables and transparently. When the runs end their networks
are gone and egressd is attached to none of them — also when the process of
a run was killed (``clean_leftovers``).

Needs the images from ``bash docker/build.sh``; EGRESSD_TEST_IMAGE names
another egressd image to test (e.g. one built from this tree under its own
tag, so concurrent builds of ``egressd:latest`` do not interfere).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import random
import secrets
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from dnslib import DNSRecord

from egressd.cli.wiring.control_client import ControlError
from egressd.cli.wiring.docker_session import DockerSession, sidecar_environment, sidecar_secrets
from egressd.cli.wiring.session import SessionError
from egressd.config.settings import load_settings
from egressd.control.api import _run_address
from egressd.sandbox.docker.engine import DockerEngine, clean_leftovers, containers_serving  # noqa: F401
from egressd.sandbox.docker.networks import DockerRunNetwork  # noqa: F401
from egressd.sandbox.docker.sidecar import start_egressd  # noqa: F401
from tests import REPO
from tests.fakes import dockerbed
from tests.fakes.dockerbed import (
    ORIGIN_NAME,
    ORIGIN_PORT,
    ORIGIN_SCRIPT,
    TEST_LABELS,
    TEST_RANGE,
    leftovers,
    start_helper,
)
from tests.harness import require

EGRESSD = str(Path(sys.executable).with_name("egressd"))
EGRESSD_IMAGE = dockerbed.EGRESSD_IMAGE  # EGRESSD_TEST_IMAGE names another

# In a sandbox: listen on a port the kernel picks, say where (our own address:
# the source address towards egressd, which the proxy variables name), count
# connections until the test writes "stop" into the working directory.
LISTENER = textwrap.dedent("""
    import json, os, socket, time, urllib.parse
    egressd = urllib.parse.urlsplit(os.environ["HTTP_PROXY"]).hostname
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((egressd, 9))  # UDP: nothing is sent, the route picks our address
    me = probe.getsockname()[0]
    probe.close()
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(16)
    server.settimeout(0.1)
    with open("listening.tmp", "w") as fh:
        json.dump({"address": me, "port": server.getsockname()[1]}, fh)
    os.rename("listening.tmp", "listening")
    count = 0
    deadline = time.monotonic() + 60
    while not os.path.exists("stop") and time.monotonic() < deadline:
        try:
            conn, _ = server.accept()
        except (socket.timeout, TimeoutError):
            continue
        count += 1
        conn.close()
    print(json.dumps({"address": me, "connections": count}))
""")

# In the other sandbox: straight to the neighbour's address, no proxy.
ATTACK = textwrap.dedent("""
    import errno, json, socket, sys
    host, port = sys.argv[1], int(sys.argv[2])
    results = {}
    for name, target in (("listener", port), ("closed port", 1)):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((host, target))
            results[name] = "connected"
        except OSError as exc:
            results[name] = errno.errorcode.get(exc.errno, "timeout") if exc.errno else "timeout"
        finally:
            s.close()
    print(json.dumps(results))
""")


# -- egressd's side: a run with an address of its own (no Docker) ---------------------------------


def test_the_engine_container_serving_a_control_url_is_found_by_its_published_port_or_address() -> None:
    summaries = [
        {"Id": "egressd", "Ports": [{"IP": "127.0.0.1", "PrivatePort": 3129, "PublicPort": 41000, "Type": "tcp"}],
         "NetworkSettings": {"Networks": {"outgoing": {"IPAddress": "169.254.64.18"}}}},
        {"Id": "other", "Ports": [{"IP": "127.0.0.1", "PrivatePort": 3129, "PublicPort": 41001, "Type": "tcp"},
                                  {"IP": "0.0.0.0", "PrivatePort": 53, "PublicPort": 41000, "Type": "udp"}],
         "NetworkSettings": {"Networks": {"bridge": {"IPAddress": "172.17.0.2"}}}},
    ]
    assert containers_serving(summaries, "127.0.0.1", 41000) == ["egressd"]
    assert containers_serving(summaries, "localhost", 41000) == ["egressd"]
    assert containers_serving(summaries, "169.254.64.18", 3129) == ["egressd"]
    assert containers_serving(summaries, "127.0.0.1", 41002) == []
    assert containers_serving(summaries, "192.0.2.1", 41000) == []  # published on loopback only


async def test_a_run_with_an_address_of_its_own_is_answered_and_proxied_there(make_egressd) -> None:
    svc = await make_egressd(require_auth=True, dns_listen="127.0.0.1:0", dns_answer="127.0.0.1")
    own = svc.runs.create(task="own network", allow=(), sources=[ipaddress.ip_address("127.0.0.3")],
                          address=ipaddress.ip_address("127.0.0.9"))
    other = svc.runs.create(task="configured network", allow=(), sources=[ipaddress.ip_address("127.0.0.4")])
    assert svc.dns is not None
    for source, expected in (("127.0.0.3", "127.0.0.9"), ("127.0.0.4", "127.0.0.1"), ("127.0.0.3", "127.0.0.9")):
        reply = DNSRecord.parse(svc.dns.handle(DNSRecord.question("anything.test").pack(), (source, 5300), "udp"))
        assert [str(rr.rdata) for rr in reply.rr] == [expected], source
    assert own.describe()["address"] == "127.0.0.9" and other.describe()["address"] is None


async def test_the_control_api_gives_a_run_an_address_only_where_the_proxy_listens(make_egressd) -> None:
    svc = await make_egressd(require_auth=True)
    auth = {"Authorization": "Bearer test-token"}
    async with aiohttp.ClientSession(svc.control_address, headers=auth) as http:
        async with http.post("/runs", json={"sources": ["127.0.0.3"], "address": "127.0.0.1"}) as resp:
            assert resp.status == 201
            created = await resp.json()
        assert created["proxy_url"].startswith(f"http://{created['id']}:{created['token']}@127.0.0.1:")
        async with http.get(f"/runs/{created['id']}") as resp:
            assert (await resp.json())["address"] == "127.0.0.1"
        for address, status in (("127.0.0.9", 409), ("not an address", 400), (["127.0.0.1"], 400)):
            async with http.post("/runs", json={"sources": ["127.0.0.5"], "address": address}) as resp:
                assert resp.status == status, address
                if status == 409:
                    assert "listens on 127.0.0.1 only" in (await resp.json())["error"]
    assert [r.get("address") for r in svc.audit_records if r.get("event") == "run.start"] == ["127.0.0.1"]


@pytest.mark.parametrize(
    ("listening", "address", "allow_private", "ok"),
    [
        pytest.param("0.0.0.0", "169.254.80.2", (), True, id="every IPv4 address"),
        pytest.param("::", "169.254.80.2", (), True, id="every address, dual stack"),
        pytest.param("169.254.80.2", "169.254.80.2", (), True, id="exactly that address"),
        pytest.param("0.0.0.0", "169.254.80.2", ("169.254.64.21/32",), True, id="allow_private elsewhere"),
        pytest.param("169.254.64.2", "169.254.80.2", (), False, id="another address"),
        pytest.param("0.0.0.0", "fd00::2", (), False, id="every IPv4 address, an IPv6 run"),
        pytest.param("localhost", "127.0.0.1", (), False, id="a name"),
        pytest.param("0.0.0.0", "169.254.80.2", ("169.254.0.0/16",), False, id="allow_private covers it"),
        pytest.param("0.0.0.0", "192.0.2.2", (), True, id="documentation range: special, never dialled"),
        pytest.param("0.0.0.0", "8.8.8.8", (), False, id="a public address: would be dialled"),  # (nothing is)
    ],
)
def test_a_run_address_is_one_the_proxy_listens_on_and_egressd_never_dials(
    listening: str, address: str, allow_private: tuple[str, ...], ok: bool
) -> None:
    private = [ipaddress.ip_network(n) for n in allow_private]
    if ok:
        assert str(_run_address(address, listening, private)) == address
    else:
        with pytest.raises(web.HTTPConflict):
            _run_address(address, listening, private)


def test_the_compose_egressd_serves_runs_on_networks_of_their_own_and_routes_between_none() -> None:
    text = (REPO / "docker" / "compose.yaml").read_text()
    egressd = text.split("\n  egressd:\n")[1].split("\n  sandbox:\n")[0]
    for needle in ("EGRESSD_LISTEN=0.0.0.0:3128", "EGRESSD_DNS_LISTEN=0.0.0.0:53",
                   "EGRESSD_TRANSPARENT_TLS=0.0.0.0:443", "EGRESSD_TRANSPARENT_HTTP=0.0.0.0:80",
                   "net.ipv4.ip_forward: 0"):
        assert needle in egressd, needle
    assert "EGRESSD_CONTROL=${EGRESSD_CONTROL_IP" in egressd  # the control API stays on the outgoing side only


# -- the test bed: a running egressd, as docker/compose.yaml runs it ----------------------------


@pytest.fixture
async def engine() -> AsyncIterator[DockerEngine]:
    ok, why = dockerbed.engine_answers()
    require(ok, why)
    async with DockerEngine.connect() as engine:
        require(await engine.image_exists(EGRESSD_IMAGE), f"the image {EGRESSD_IMAGE} is missing")
        yield engine
        assert await leftovers(engine, "egressd.run", owner_pid=os.getpid()) == []


async def free_blocks(engine: DockerEngine, count: int) -> list[ipaddress.IPv4Network]:
    """``count`` distinct free /27s of TEST_RANGE, picked at random (test runs may share the engine)."""
    taken = [t for t in await engine.taken_subnets() if t.version == 4]
    free = [n for n in ipaddress.ip_network(TEST_RANGE).subnets(new_prefix=27) if not any(n.overlaps(t) for t in taken)]
    assert len(free) >= count, f"not {count} free /27s left in {TEST_RANGE}"
    return random.sample(free, count)  # type: ignore[arg-type]


@dataclass
class Running:
    """A running egressd shared by runs: its container, control API and an origin beside it."""

    engine: DockerEngine
    container: str
    control_url: str
    token: str
    run_range: str  # where the runs' networks come from
    networks: frozenset[str]  # egressd's own networks

    async def attached(self) -> set[str]:
        info = await self.engine.client.containers.container(self.container).show()
        return set(((info.get("NetworkSettings") or {}).get("Networks") or {}).keys())

    async def read(self, path: str) -> str:
        """A file in egressd's container, by ``cat`` in it (the archive API sees /proc files as empty)."""
        execution = await self.engine.client.containers.container(self.container).exec(["cat", path], stdout=True)
        output = []
        async with asyncio.timeout(30), execution.start(detach=False) as stream:
            while (message := await stream.read_out()) is not None:
                output.append(message.data.decode())
        return "".join(output).strip()

    def settings(self, tmp_path: Path, **values: Any) -> Any:
        values.setdefault("allow", [f"{ORIGIN_NAME}:*"])
        return load_settings({"control_token": self.token, "audit_log": str(tmp_path / "audit.jsonl"), **values})

    def session(self, tmp_path: Path, **values: Any) -> DockerSession:
        return DockerSession(self.settings(tmp_path, **values), workdir=None, task="connect bed",
                             connect=self.control_url, net_range=self.run_range, labels=TEST_LABELS)


@contextlib.asynccontextmanager
async def running_egressd(engine: DockerEngine, *, every_address: bool = True) -> AsyncIterator[Running]:
    """egressd in a container of its own, its control API on the host's loopback.

    ``every_address``: its proxy, DNS and transparent listeners take every
    address of the container (docker/compose.yaml), so a run's network
    attached later is served too; else only its first internal address.
    """
    block, run_range = await free_blocks(engine, 2)
    net = await DockerRunNetwork.create(engine, pool=str(block), labels=TEST_LABELS)
    try:
        p = net.plan
        token = secrets.token_urlsafe(24)
        origin = p.outgoing.network_address + 5
        # Exactly the origin: egressd listens on every address it has, and must never dial one of them.
        settings = load_settings({"allow_private": [f"{origin}/32"]})
        env = sidecar_environment(settings, egressd_ip=str(p.egressd_ip), control_ip=str(p.egressd_outgoing_ip),
                                  token=token)
        if every_address:
            env.update({"EGRESSD_LISTEN": "0.0.0.0:3128", "EGRESSD_DNS_LISTEN": "0.0.0.0:53",
                        "EGRESSD_TRANSPARENT_TLS": "0.0.0.0:443", "EGRESSD_TRANSPARENT_HTTP": "0.0.0.0:80"})
        sidecar = await start_egressd(net, image=EGRESSD_IMAGE, env=env, secrets=sidecar_secrets(settings, token=token))
        await start_helper(engine, network=p.outgoing_name, address=str(origin),
                           script=ORIGIN_SCRIPT, labels=net.labels_for("helper"), aliases=[ORIGIN_NAME])
        yield Running(engine, sidecar.id, sidecar.control_url, token, str(run_range),
                      frozenset({p.internal_name, p.outgoing_name}))
    finally:
        await net.destroy()
    assert await leftovers(engine, f"egressd.run={net.run_key}") == []


async def _listen_and_attack(victim: DockerSession, attacker: DockerSession) -> tuple[dict[str, Any], dict[str, Any]]:
    """The victim listens; the attacker connects to it directly. (listener's report, attacker's results)"""
    workdir = victim.workdir
    listening = asyncio.ensure_future(victim.box.run(["python3", "-c", LISTENER]))
    try:
        for _ in range(300):  # 30 s at most
            if (workdir / "listening").exists() or listening.done():
                break
            await asyncio.sleep(0.1)
        assert (workdir / "listening").exists(), (await listening).stderr
        where = json.loads((workdir / "listening").read_text())
        attack = await attacker.box.run(["env", "-u", "HTTP_PROXY", "-u", "HTTPS_PROXY", "-u", "http_proxy",
                                         "-u", "https_proxy", "-u", "ALL_PROXY", "-u", "all_proxy",
                                         "python3", "-c", ATTACK, where["address"], str(where["port"])])
        assert attack.exit_code == 0, attack.stderr
    finally:
        (workdir / "stop").touch()
    listened = await asyncio.wait_for(listening, 30)
    assert listened.exit_code == 0, listened.stderr
    for name in ("listening", "stop"):
        (workdir / name).unlink()
    return json.loads(listened.stdout), json.loads(attack.stdout)


# -- the attack -------------------------------------------------------------------------------


async def test_two_runs_of_one_running_egressd_cannot_reach_each_other(engine: DockerEngine, tmp_path: Path) -> None:
    async with running_egressd(engine) as egressd:
        baseline = await egressd.attached()
        assert baseline == egressd.networks
        async with egressd.session(tmp_path) as a, egressd.session(tmp_path) as b:
            keys = {s.resources.run_key for s in (a, b) if s.resources is not None}
            assert len(keys) == 2
            # Registered, each session speaks with its run's own control token, which reaches no other run.
            for session, other in ((a, b), (b, a)):
                assert session.control is not None and session.control._token not in ("", egressd.token)
                with pytest.raises(ControlError, match="403"):
                    await session.control.call("GET", f"/runs/{other.run_id}")
            addresses = []
            for victim, attacker in ((a, b), (b, a)):
                listened, attacked = await _listen_and_attack(victim, attacker)
                addresses.append(listened["address"])
                assert attacked["listener"] != "connected" and listened["connections"] == 0, (attacked, listened)
                # Not even a reset: nothing of the other run is on the way.
                assert attacked["closed port"] not in ("connected", "ECONNREFUSED"), attacked
            a_net, b_net = (ipaddress.ip_network(f"{address}/28", strict=False) for address in addresses)
            assert a_net != b_net
            # egressd is on each run's own network while the runs last, and routes between none of them.
            during = await egressd.attached() - baseline
            assert len(during) == 2 and all(any(key in name for key in keys) for name in during), during
            assert await egressd.read("/proc/sys/net/ipv4/ip_forward") == "0"
            # Both still reach the origin through egressd: proxy variables, and transparently.
            for session in (a, b):
                obs = await session.box.run(["sh", "-c",
                                             f"curl -sS -m 10 http://{ORIGIN_NAME}:{ORIGIN_PORT}/proxied; echo;"
                                             f" curl -sS -m 10 --noproxy '*' http://{ORIGIN_NAME}/transparent"])
                assert obs.exit_code == 0, obs.stderr
                assert "hello from origin: GET /proxied" in obs.stdout
                assert "hello from origin: GET /transparent" in obs.stdout
        # The runs' networks are gone, and egressd is attached to none of them.
        assert await egressd.attached() == baseline
        for key in keys:
            assert await leftovers(engine, f"egressd.run={key}") == []


async def test_a_killed_connect_run_leaves_a_network_that_clean_up_detaches_and_removes(
    engine: DockerEngine, tmp_path: Path
) -> None:
    async with running_egressd(engine) as egressd:
        baseline = await egressd.attached()
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {
            "XDG_STATE_HOME": str(tmp_path / "state")}
        proc = await asyncio.create_subprocess_exec(
            EGRESSD, "run", "--backend", "docker", "--connect", egressd.control_url, "--control-token", egressd.token,
            "--net-range", egressd.run_range, "--audit-log", str(tmp_path / "audit.jsonl"), "--", "sleep", "60",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL,
            env=env,
        )
        try:
            for _ in range(300):  # 30 s at most
                running, _, _ = await engine.labelled("egressd.run")
                if any(f":{proc.pid}:" in (c.get("Labels") or {}).get("egressd.owner", "")
                       and c.get("State") == "running" for c in running):
                    break
                await asyncio.sleep(0.1)
            attached = await egressd.attached() - baseline
            assert len(attached) == 1, attached
        finally:
            proc.kill()  # no chance to clean up
            await proc.wait()
        left = await leftovers(engine, "egressd.run", owner_pid=proc.pid)
        assert sorted(item.split()[0] for item in left) == ["container", "network"], left
        assert await egressd.attached() - baseline == attached  # still on the dead run's network
        await clean_leftovers(engine)
        assert await leftovers(engine, "egressd.run", owner_pid=proc.pid) == []
        assert await egressd.attached() == baseline


async def test_connect_refuses_an_egressd_that_listens_on_one_address_only(engine: DockerEngine,
                                                                          tmp_path: Path) -> None:
    async with running_egressd(engine, every_address=False) as egressd:
        baseline = await egressd.attached()
        mine = sorted(await leftovers(engine, "egressd.run", owner_pid=os.getpid()))  # the running egressd's
        with pytest.raises(SessionError, match="listens on .* only"):
            async with egressd.session(tmp_path):
                pass
        assert await egressd.attached() == baseline
        assert sorted(await leftovers(engine, "egressd.run", owner_pid=os.getpid())) == mine
