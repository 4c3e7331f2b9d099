"""``egressd serve --workers 2``: two processes serve the proxy's port, one owner holds the runs.

A real ``egressd serve`` subprocess and its worker, real sockets: the kernel
spreads connections over both processes (SO_REUSEPORT), so every test
sends many and checks, by the descriptors each process holds, that both
served some. The attacks are on the seams: a policy change made in the
owner (a revocation through the control API) must hold in the worker at
once; a question asked from the worker is answered through the owner's
channels and its answer applies in both; each process's death fails
closed (``kill -9`` of the worker: its open tunnels' records end as
``worker_lost``, the owner serves on and starts another; of the owner: the
worker stops, a new connection is refused, nothing reaches the origin);
and the audit chain written by both stays whole. A second egressd on the
same port is refused as without workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from dnslib import RCODE, DNSRecord

from egressd.audit.chain import verify_files
from tests.conftest import HttpsOrigin, Listener
from tests.fakes.dns import FakeDns
from tests.harness import ORIGIN_RANGE, aserve_ports, have, read_response, require, wait_until

EGRESSD = str(Path(sys.executable).with_name("egressd"))
TOKEN = "workers-test-token"
# Connections sent at once: the chance that the kernel gives all of them to one of two processes is 2**-39.
SPREAD = 40


@dataclass
class Serve:
    proc: asyncio.subprocess.Process
    ports: dict[str, int]
    log: Path
    seen: list[str]

    @property
    def workers(self) -> list[int]:
        """The owner's children: its worker (none for a moment after one died)."""
        return [int(pid) for pid in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()]

    @property
    def worker(self) -> int:
        """The worker's pid: the owner's one child."""
        children = self.workers
        assert len(children) == 1, children
        return children[0]

    def records(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.log.read_bytes().splitlines()]

    def ended(self) -> int:
        """How many egress.end records the log holds."""
        return sum(r["event"] == "egress.end" for r in self.records())


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env["EGRESSD_CONTROL_TOKEN"] = TOKEN
    return env


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, dns: FakeDns, *args: str, private: bool = True, env: dict[str, str] | None = None
) -> AsyncIterator[Serve]:
    log = tmp_path / "audit.jsonl"
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "serve", "--workers", "2", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
        "--upstream-dns", f"127.0.0.1:{dns.address[1]}", *(("--allow-private", ORIGIN_RANGE) if private else ()),
        "--audit-log", str(log), *args,
        env=_env(tmp_path) | (env or {}), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    seen: list[str] = []
    assert proc.stderr is not None
    drain: asyncio.Task[None] | None = None
    try:
        ports = await aserve_ports(proc.stderr, read=seen)
        drain = asyncio.create_task(_drain(proc.stderr, seen))
        yield Serve(proc, ports, log, seen)
    finally:
        workers: list[int] = []
        with contextlib.suppress(OSError):
            workers = Serve(proc, {}, log, seen).workers
        if proc.returncode is None:
            # Stopped as an operator stops it: every process writes what it holds (a refusal's record
            # follows its answer in the loop turn's batch, which a kill -9 would lose), then exits.
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
        await proc.wait()
        for worker in workers:  # ours: the children of the owner this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        # Its standard error ends when the last process holding it (the worker shares it) is gone.
        if drain is not None:
            await asyncio.wait_for(drain, 10)
        else:
            await proc.communicate()


async def _drain(stream: asyncio.StreamReader, seen: list[str]) -> None:
    while line := await stream.readline():
        seen.append(line.decode(errors="replace"))


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _sockets(pid: int) -> int:
    """How many sockets the process holds."""
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith("socket:")
    return count


async def _connect(port: int, target: str) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    await writer.drain()
    status, headers, _ = await asyncio.wait_for(read_response(reader), 30)
    return status, headers, reader, writer


async def _control(serve: Serve, method: str, path: str, body: object = None) -> tuple[int, object]:
    url = f"http://127.0.0.1:{serve.ports['control']}{path}"
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.request(method, url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            return resp.status, await resp.json(content_type=None)


async def _run_ca(serve: Serve, run: str, path: Path) -> Path:
    """The run's CA certificate, from the control API, written to ``path``."""
    url = f"http://127.0.0.1:{serve.ports['control']}/runs/{run}/ca"
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200
            await asyncio.to_thread(path.write_bytes, await resp.read())
    return path


async def _hold_tunnels(serve: Serve, target: str, count: int) -> list[asyncio.StreamWriter]:
    """``count`` open tunnels, each checked with an echo: the writers, to close."""
    opened = await asyncio.gather(*(_connect(serve.ports["proxy"], target) for _ in range(count)))
    writers = []
    for status, _, reader, writer in opened:
        assert status == 200
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
        writers.append(writer)
    return writers


async def test_both_processes_serve_the_port_and_write_one_chain(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with serving(tmp_path, dns, "--allow", target) as serve:
        owner, worker = serve.proc.pid, serve.worker
        before = _sockets(owner), _sockets(worker)
        writers = await _hold_tunnels(serve, target, SPREAD)
        during = _sockets(owner), _sockets(worker)
        # Each tunnel is two sockets (the client's and the origin's) in the process that took it.
        assert during[0] > before[0] and during[1] > before[1], (before, during)
        assert (during[0] - before[0]) + (during[1] - before[1]) == 2 * SPREAD
        # /metrics counts every process's connections: one egressd's figures.
        url = f"http://127.0.0.1:{serve.ports['control']}/metrics"
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                text = await resp.text()
        assert f'egressd_connections_total{{kind="connect"}} {SPREAD}' in text, text
        assert f"egressd_connections_open {SPREAD}" in text, text
        for writer in writers:
            writer.close()
        await wait_until(lambda: serve.ended() == SPREAD, 10)
    records = serve.records()
    assert sum(r["event"] == "egress" and r["decision"] == "allow" for r in records) == SPREAD
    assert verify_files([serve.log]).ok


async def test_a_revocation_made_in_the_owner_holds_in_the_worker_from_the_next_connection(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    target = f"origin.test:{echo_origin.port}"
    # Every refusal one by one: each process writes its share of --max-refusal-records (a flood's cap).
    async with serving(tmp_path, dns, "--allow", target, "--max-refusal-records", "1000") as serve:
        for writer in await _hold_tunnels(serve, target, SPREAD):
            writer.close()
        arrived = echo_origin.connections
        status, _ = await _control(serve, "PATCH", "/runs/default", {"deny": {"add": ["origin.test"]}})
        assert status == 200
        answers = await asyncio.gather(*(_connect(serve.ports["proxy"], target) for _ in range(SPREAD)))
        for _, _, _, writer in answers:
            writer.close()
        assert {(status, headers["x-egress-reason"]) for status, headers, _, _ in answers} == {(403, "denylisted")}
        assert echo_origin.connections == arrived  # nothing reached the origin after the change
    refused = [r for r in serve.records() if r["event"] == "egress" and r["decision"] == "deny"]
    assert len(refused) == SPREAD and {r["reason"] for r in refused} == {"denylisted"}


async def test_a_question_from_either_process_is_answered_through_the_owner_and_the_answer_holds_in_both(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with serving(tmp_path, dns, "--approver", "web", "--web-inbox") as serve:
        held = [asyncio.create_task(_connect(serve.ports["proxy"], target)) for _ in range(SPREAD)]

        async def pending() -> list[dict[str, object]]:
            return (await _control(serve, "GET", "/approvals"))[1]["approvals"]  # type: ignore[index]

        for _ in range(100):
            listed = await pending()
            if listed:
                break
            await asyncio.sleep(0.1)
        assert len(listed) == 1  # one question for the host, whichever process holds each client
        assert all(not task.done() for task in held)
        status, _ = await _control(serve, "POST", f"/approvals/{listed[0]['id']}/allow", {"scope": "run"})
        assert status == 200
        answers = await asyncio.gather(*held)
        assert {status for status, _, _, _ in answers} == {200}
        for _, _, _, writer in answers:
            writer.close()
        await wait_until(lambda: serve.ended() == SPREAD, 10)
        # The run's approval is in both processes: nobody is asked again, on either.
        owner, worker = serve.proc.pid, serve.worker
        before = _sockets(owner), _sockets(worker)
        writers = await _hold_tunnels(serve, target, SPREAD)
        during = _sockets(owner), _sockets(worker)
        assert during[0] > before[0] and during[1] > before[1], (before, during)
        for writer in writers:
            writer.close()
        assert await pending() == []
    asked = [r for r in serve.records() if r["event"] == "approval.requested"]
    assert len(asked) == 1


async def test_kill_9_of_the_worker_ends_its_tunnels_as_worker_lost_and_the_owner_serves_on(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with serving(tmp_path, dns, "--allow", target) as serve:
        worker = serve.worker
        before = _sockets(worker)
        writers = await _hold_tunnels(serve, target, SPREAD)
        on_worker = (_sockets(worker) - before) // 2  # two sockets per tunnel
        assert on_worker > 0
        os.kill(worker, signal.SIGKILL)
        await wait_until(lambda: any("worker 1 (pid" in line for line in serve.seen), 10)
        lost = [r for r in serve.records() if r.get("end") == "worker_lost"]
        assert len(lost) == on_worker
        assert all(r["bytes_up"] is None and r["bytes_down"] is None for r in lost)
        await wait_until(lambda: serve.workers not in ([], [worker]), 10)  # another one started in its place
        for writer in writers:
            writer.close()
        for writer in await _hold_tunnels(serve, target, SPREAD):  # both processes serve again
            writer.close()
        await wait_until(lambda: serve.ended() == 2 * SPREAD, 10)
    records = serve.records()
    opened = {r["id"] for r in records if r["event"] == "egress"}
    ended = [r["id"] for r in records if r["event"] == "egress.end"]
    assert sorted(ended) == sorted(opened)  # every record of what went out has its one end
    assert verify_files([serve.log]).ok


async def test_kill_9_of_the_owner_stops_the_worker_and_nothing_more_goes_out(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with serving(tmp_path, dns, "--allow", target) as serve:
        worker = serve.worker
        writers = await _hold_tunnels(serve, target, SPREAD)
        serve.proc.kill()
        await serve.proc.wait()
        for _ in range(100):
            if not _alive(worker):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the worker outlived its owner")
        arrived = echo_origin.connections
        with pytest.raises(OSError):
            await _connect(serve.ports["proxy"], target)  # nobody listens: refused
        assert echo_origin.connections == arrived
        for writer in writers:
            writer.close()
    assert verify_files([serve.log]).ok


async def test_a_second_egressd_on_the_port_is_refused_as_without_workers(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    async with serving(tmp_path, dns) as serve:
        taken = f"127.0.0.1:{serve.ports['proxy']}"
        other = tmp_path / "other"
        other.mkdir()
        result = await asyncio.create_subprocess_exec(
            EGRESSD, "serve", "--workers", "2", "--listen", taken, "--control", "127.0.0.1:0",
            "--audit-log", str(other / "audit.jsonl"),
            env=_env(other), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(result.communicate(), 30)
        assert result.returncode != 0
        assert "bad setting listen: cannot listen on" in err.decode()


async def test_inspected_https_is_served_by_either_process_with_the_runs_one_ca(
    tmp_path: Path, dns: FakeDns, https_origin: HttpsOrigin
) -> None:
    require(have("curl"), "curl is not installed")
    rule = f"GET origin.test:{https_origin.port}/docs/**"
    async with serving(tmp_path, dns, "--allow", rule, "--inspect-origin-ca-file", str(https_origin.ca_file)) as serve:
        status, _ = await _control(serve, "GET", "/runs/default")
        assert status == 200
        ca = await _run_ca(serve, "default", tmp_path / "run-ca.pem")

        async def curl(method: str) -> str:
            proc = await asyncio.create_subprocess_exec(
                "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", "--noproxy", "",
                "-x", f"http://127.0.0.1:{serve.ports['proxy']}", "--cacert", str(ca), "-X", method,
                f"https://origin.test:{https_origin.port}/docs/a",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await proc.communicate()
            return out.decode() or err.decode()

        # One connection each, spread over both processes: every one trusts the run's one CA.
        got = await asyncio.gather(*(curl("GET") for _ in range(SPREAD // 2)), *(curl("POST") for _ in range(4)))
        assert got == ["200"] * (SPREAD // 2) + ["403"] * 4, got
    assert [m for m, _, _ in https_origin.requests] == ["GET"] * (SPREAD // 2)  # no POST went out
    https = [r for r in serve.records() if r.get("kind") == "https"]
    assert sorted(r["decision"] for r in https) == ["allow"] * (SPREAD // 2) + ["deny"] * 4


async def test_a_declared_secret_is_put_in_by_either_process_for_the_placeholder_the_run_was_given(
    tmp_path: Path, dns: FakeDns, https_origin: HttpsOrigin
) -> None:
    """Each process made its own placeholders: a run's placeholder, sent through the worker, reached the
    origin as it was and the secret was never put in. The workers take the owner's."""
    require(have("curl"), "curl is not installed")
    name = f"origin.test:{https_origin.port}"
    value = "real-" + os.urandom(8).hex()
    async with serving(tmp_path, dns, "--inspect-origin-ca-file", str(https_origin.ca_file), "--require-auth",
                       "--secret", f"ORIGIN_TOKEN@{name}", env={"ORIGIN_TOKEN": value}) as serve:  # fmt: skip
        status, created = await _control(serve, "POST", "/runs", {"task": "t", "allow": [f"GET {name}/docs/**"]})
        assert status == 201, created
        assert isinstance(created, dict)
        run, token, mark = created["id"], created["token"], created["secrets"]["ORIGIN_TOKEN"]
        ca = await _run_ca(serve, run, tmp_path / "run-ca.pem")

        async def curl() -> str:
            proc = await asyncio.create_subprocess_exec(
                "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", "--noproxy", "",
                "-x", f"http://{run}:{token}@127.0.0.1:{serve.ports['proxy']}", "--cacert", str(ca),
                "-H", f"Authorization: Bearer {mark}", f"https://{name}/docs/a",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await proc.communicate()
            return out.decode() or err.decode()

        got = await asyncio.gather(*(curl() for _ in range(SPREAD // 2)))  # spread over both processes
        assert got == ["200"] * (SPREAD // 2), got
    assert [headers.get("Authorization") for _, _, headers in https_origin.requests] == [f"Bearer {value}"] * (
        SPREAD // 2)
    assert value not in serve.log.read_text()


async def test_a_reload_that_takes_back_a_private_range_holds_in_the_worker(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    target = f"origin.test:{echo_origin.port}"
    config = tmp_path / "egressd.toml"
    config.write_text(f'allow = ["{target}"]\nallow_private = ["{ORIGIN_RANGE}"]\n')
    async with serving(tmp_path, dns, "--config", str(config), private=False) as serve:
        for writer in await _hold_tunnels(serve, target, SPREAD):
            writer.close()
        arrived = echo_origin.connections
        config.write_text(f'allow = ["{target}"]\n')  # the origin's private range taken back
        serve.proc.send_signal(signal.SIGHUP)
        await wait_until(lambda: any("policy reloaded" in line for line in serve.seen), 10)
        answers = await asyncio.gather(*(_connect(serve.ports["proxy"], target) for _ in range(SPREAD)))
        for _, _, _, writer in answers:
            writer.close()
        assert {(status, headers["x-egress-reason"]) for status, headers, _, _ in answers} == {
            (403, "private_address")
        }
        assert echo_origin.connections == arrived


async def _query(port: int, name: str, timeout_s: float, source: str = "127.0.0.1") -> DNSRecord | None:
    """One UDP query from a fresh socket (a fresh source port: the kernel may pick either process); None: no reply."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    try:
        sock.bind((source, 0))
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, DNSRecord.question(name).pack())
        return DNSRecord.parse(await asyncio.wait_for(loop.sock_recv(sock, 4096), timeout_s))
    except TimeoutError:
        return None
    finally:
        sock.close()


async def test_dns_is_answered_by_both_processes_under_the_one_policy(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    strict = ("--dns-listen", "127.0.0.1:0", "--dns-strict", "--no-ask")  # a name the run cannot reach: NXDOMAIN
    async with serving(tmp_path, dns, "--allow", "origin.test", *strict) as serve:
        port = serve.ports["dns"]
        worker = serve.worker
        os.kill(worker, signal.SIGSTOP)  # the worker's share of the queries goes unanswered while it is stopped
        try:
            stopped = await asyncio.gather(*(_query(port, "origin.test", 1.0) for _ in range(SPREAD)))
        finally:
            os.kill(worker, signal.SIGCONT)
        unanswered = sum(reply is None for reply in stopped)
        assert 0 < unanswered < SPREAD  # both processes have a share
        answered = await asyncio.gather(*(_query(port, "origin.test", 5.0) for _ in range(SPREAD)))
        refused = await asyncio.gather(*(_query(port, "leak.test", 5.0) for _ in range(SPREAD // 4)))
        assert all(reply is not None and reply.header.rcode == RCODE.NOERROR and reply.rr for reply in answered)
        assert all(reply is not None and reply.header.rcode == RCODE.NXDOMAIN for reply in refused), refused[0]
        # Every query's record (the stopped worker's too, once it went on) before the processes are killed:
        # a record follows its answer, in the loop turn's batch, and a kill -9 would lose the batch.
        expected = SPREAD * 2 + SPREAD // 4
        await wait_until(lambda: sum(r.get("kind") == "dns" for r in serve.records()) >= expected, 10)
    queries = [r for r in serve.records() if r.get("kind") == "dns"]
    assert sum(r["host"] == "leak.test" and r["decision"] == "deny" for r in queries) == SPREAD // 4
    assert verify_files([serve.log]).ok


async def test_a_runs_distinct_names_are_recorded_one_by_one_up_to_one_cap_across_the_processes(
    tmp_path: Path, dns: FakeDns
) -> None:
    """The attack: a run enumerating names (1,200 distinct ones) past the per-run cap of 1,000 that stops
    them going to the log one by one; with each process keeping its own ledger, all 1,200 were written.
    The processes now keep a share of the cap each."""
    async with serving(tmp_path, dns, "--dns-listen", "127.0.0.1:0", "--allow", "origin.test") as serve:
        port = serve.ports["dns"]
        # From 12 loopback addresses, 100 queries each: every client within its rate, whichever process.
        sources = [f"127.0.{index}.9" for index in range(1, 13)]
        for batch in range(100):
            replies = await asyncio.gather(
                *(_query(port, f"n{batch}-{index}.enumerate.test", 5.0, source) for index, source in enumerate(sources))
            )
            assert all(reply is not None for reply in replies)
        await wait_until(lambda: sum(r.get("kind") == "dns" for r in serve.records()) >= 900, 10)
        await asyncio.sleep(0.5)
        named = [r for r in serve.records() if r.get("kind") == "dns" and r.get("host")]
        assert 900 <= len(named) <= 1000, len(named)


async def test_a_change_made_while_a_worker_starts_holds_in_it(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with serving(tmp_path, dns, "--allow", target) as serve:
        worker = serve.worker
        os.kill(worker, signal.SIGKILL)
        await wait_until(lambda: serve.workers not in ([], [worker]), 15)  # its replacement is starting
        # Sent while the new worker loads (it says it serves about a second later): the change must reach it.
        status, _ = await _control(serve, "PATCH", "/runs/default", {"deny": {"add": ["origin.test"]}})
        assert status == 200
        await wait_until(lambda: _sockets(serve.worker) >= 3, 15)  # serving: its listener, channel, resolver
        await asyncio.sleep(1.0)
        answers = await asyncio.gather(*(_connect(serve.ports["proxy"], target) for _ in range(SPREAD)))
        for _, _, _, writer in answers:
            writer.close()
        assert {(status, headers["x-egress-reason"]) for status, headers, _, _ in answers} == {(403, "denylisted")}


async def test_a_runs_upload_budget_is_one_budget_across_the_processes(
    tmp_path: Path, dns: FakeDns, sink_origin: Listener
) -> None:
    """The attack: tunnels spread over both processes, each process counting alone, would send the budget
    twice before anyone was asked. The owner keeps the budget and lends each worker bytes of it."""
    target = f"origin.test:{sink_origin.port}"
    budget = 256 * 1024
    async with serving(tmp_path, dns, "--allow", target, "--upload-budget-mb", "0.25", "--approver", "web",
                       "--web-inbox") as serve:  # fmt: skip
        owner, worker = serve.proc.pid, serve.worker
        before = _sockets(owner), _sockets(worker)
        opened = await asyncio.gather(*(_connect(serve.ports["proxy"], target) for _ in range(SPREAD)))
        during = _sockets(owner), _sockets(worker)
        assert during[0] > before[0] and during[1] > before[1], (before, during)  # both hold some
        for status, _, _, writer in opened:
            assert status == 200
            writer.write(b"z" * 32768)  # 40 x 32 KiB against a 256 KiB budget
        for answer, reached in (("allow", budget), ("deny", 2 * budget)):
            # Asked once for the run's budget, whichever process holds each client; an allow grants one more.
            question = await _one_question(serve)
            await asyncio.sleep(0.5)  # any byte past the budget would be at the origin by now
            assert sink_origin.bytes_in == reached, (answer, sink_origin.bytes_in)
            assert (await _control(serve, "GET", "/approvals"))[1]["approvals"] == [question]  # type: ignore[index]
            status, _ = await _control(serve, "POST", f"/approvals/{question['id']}/{answer}", {})
            assert status == 200
        # Every tunnel that waited is cut; one that fitted whole in the budgets (16 of 32 KiB at most) goes on.
        await wait_until(lambda: serve.ended() >= SPREAD - 2 * budget // 32768, 10)
        for _, _, _, writer in opened:
            writer.close()
        await wait_until(lambda: serve.ended() == SPREAD, 10)
    ends = [r for r in serve.records() if r["event"] == "egress.end"]
    assert sum(r["end"] == "denied" for r in ends) >= SPREAD - 2 * budget // 32768, ends
    assert sum(r["bytes_up"] for r in ends) == 2 * budget == sink_origin.bytes_in


async def _one_question(serve: Serve) -> dict[str, object]:
    """The one approval the owner's page lists, once it lists one."""
    for _ in range(100):
        listed = (await _control(serve, "GET", "/approvals"))[1]["approvals"]  # type: ignore[index]
        if listed:
            assert len(listed) == 1, listed
            return listed[0]  # type: ignore[no-any-return]
        await asyncio.sleep(0.1)
    raise AssertionError("no question in 10 s")
