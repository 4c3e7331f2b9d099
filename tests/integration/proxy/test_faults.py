"""Faults egressd survives (issue 13): a broken upstream resolver, origins that stall, reset or read
slowly, approval channels that are down, slow or answer too late, and SIGTERM in the middle of it all.

Each fault is played against a real egressd (the in-process service the other tests use, or
``egressd serve``), on loopback only. For each one the client hears what the design promises, within
a bound, the audit log says so, nothing leaks (the open-connection gauge and the run's count go back
to 0) and egressd keeps serving other traffic meanwhile: an allowed tunnel to an IP-literal origin
echoes while the fault lasts.

Faults covered elsewhere, not repeated here (files under tests/integration/): an unknown name
(proxy/test_proxy.py test_unknown_name_is_resolve_failed), an origin refusing the connection
(proxy/test_proxy.py test_upstream_refusing_the_connection_is_a_502), bodies that stall either way
and a client that stops reading (proxy/test_body_idle.py), the resolver's own timeouts and garbage
parsing (proxy/test_resolver.py), Slack rate limits retried (approvals/test_slack.py
test_rate_limits_are_retried_by_slack_sdk), a Slack outage with another channel answering
(approvals/test_approvals_e2e.py test_a_channel_that_is_down_while_another_answers), shutdown in
process (proxy/test_proxy.py test_shutdown_*, proxy/test_precision.py
test_a_request_held_when_egressd_stops_*).
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
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from dnslib import QTYPE, RR, A, DNSRecord

from tests.conftest import Listener, MakeEgressd
from tests.fakes.dns import FakeDns
from tests.fakes.slack import FakeSlack
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import (
    ORIGIN,
    ORIGIN_RANGE,
    connect_via,
    egress,
    listening_socket,
    open_proxy,
    wait_serve_ports_in,
    wait_until,
)
from tests.integration.approvals.test_approvals_e2e import egressd, fake_slack, records, relay, slack_settings  # noqa: F401
from tests.integration.proxy.test_body_idle import origin, read_head, read_to_close

EGRESSD = str(Path(sys.executable).with_name("egressd"))

# egressd's resolver asks over UDP twice, 3 s each (proxy/net/resolver.py DnsResolver): the longest a
# lookup can take is 6 s; a refusal must come by then, with a margin for a loaded machine.
RESOLVE_BOUND_S = 6.0 + 2.0


# -- helpers ------------------------------------------------------------------------------------


async def refusal(svc: Any, authority: str, limit_s: float) -> tuple[int, str, float]:
    """CONNECT ``authority``; (status, X-Egress-Reason, seconds until the answer). Fails after ``limit_s``."""
    reader, writer = await open_proxy(svc)
    started = time.monotonic()
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), limit_s)
    took = time.monotonic() - started
    writer.close()
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    return int(lines[0].split(" ")[1]), headers.get("x-egress-reason", ""), took


async def echo_once(svc: Any, authority: str, limit_s: float = 2.0) -> None:
    """An allowed tunnel echoes, all within ``limit_s``.

    The payload has no space: an opaque tunnel's first line with a space and no end yet could
    still become an HTTP request line, which the tunnel's HTTP check holds until it ends
    (docs/security-model.md, "Tunnels carry only what was decided").
    """

    async def go() -> None:
        status, _, _, reader, writer = await connect_via(svc, authority)
        assert status == 200
        writer.write(b"still-here")
        await writer.drain()
        assert await reader.readexactly(10) == b"still-here"
        writer.close()

    await asyncio.wait_for(go(), limit_s)


@contextlib.asynccontextmanager
async def keeps_serving(svc: Any, authority: str) -> AsyncIterator[list[int]]:
    """Echo through ``authority`` every 0.2 s while the block runs; the list counts the echoes."""
    done: list[int] = [0]
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            await echo_once(svc, authority)
            done[0] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    task = asyncio.create_task(loop())
    try:
        yield done
    finally:
        stop.set()
        await task  # an echo that failed fails the test here


def ended(svc: Any, host: str) -> dict[str, Any]:
    """The one finished attempt to ``host``: its egress record joined with its ``egress.end``."""
    [record] = [r for r in egress(svc) if r["host"] == host]
    return record


async def released(svc: Any) -> None:
    """Nothing leaks: the open-connection gauge and the run's count are back to 0."""
    await wait_until(lambda: svc.path.recorder.metrics.connections_open == 0 == svc.default_run.open_connections, 3)


# -- 1. the upstream resolver is slow, dead or answers garbage --------------------------------------


class ChaosDns(asyncio.DatagramProtocol):
    """A UDP upstream that mishandles each name its own way; every answer would say ORIGIN."""

    SLOW_S = 8.0  # longer than egressd's whole lookup

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.timers: list[asyncio.TimerHandle] = []
        self.asked: list[str] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        assert self.transport is not None
        query = DNSRecord.parse(data)
        name = str(query.q.qname).rstrip(".")
        self.asked.append(name)
        reply = query.reply()
        if query.q.qtype == QTYPE.A:
            reply.add_answer(RR(query.q.qname, QTYPE.A, ttl=60, rdata=A(ORIGIN)))
        packed = reply.pack()
        behaviour = name.split(".")[0]
        if behaviour == "slow":
            self.timers.append(asyncio.get_running_loop().call_later(self.SLOW_S, self.transport.sendto, packed, addr))
        elif behaviour == "garbage":
            self.transport.sendto(os.urandom(len(packed)), addr)
        elif behaviour == "wrongid":
            self.transport.sendto(((int.from_bytes(packed[:2], "big") ^ 0x5A5A).to_bytes(2, "big")) + packed[2:], addr)
        elif behaviour == "cut":
            self.transport.sendto(packed[: len(packed) // 2], addr)
        # "silent": the query is dropped

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()
        if self.transport is not None:
            self.transport.close()


@pytest.fixture
async def chaos_dns() -> AsyncIterator[tuple[ChaosDns, int]]:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_datagram_endpoint(ChaosDns, local_addr=("127.0.0.1", 0))
    assert protocol.transport is not None
    yield protocol, protocol.transport.get_extra_info("sockname")[1]
    protocol.close()


def dead_udp_port() -> int:
    """A UDP port nobody listened on a moment ago: only for queries that must find nothing (ICMP refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


FAULTY_NAMES = ["slow.test", "silent.test", "garbage.test", "wrongid.test", "cut.test"]


async def test_a_slow_silent_dead_or_garbled_resolver_is_resolve_failed_in_bounded_time_and_others_flow(
    make_egressd: MakeEgressd, echo_origin: Listener, chaos_dns: tuple[ChaosDns, int]
) -> None:
    chaos, chaos_port = chaos_dns
    literal = f"{ORIGIN}:{echo_origin.port}"
    allow = [f"{name}:*" for name in [*FAULTY_NAMES, "dead.test"]] + [literal]
    svc = await make_egressd(allow=allow, upstream_dns=f"127.0.0.1:{chaos_port}")
    dead = await make_egressd(allow=allow, upstream_dns=f"127.0.0.1:{dead_udp_port()}")
    await echo_once(svc, literal)  # an IP literal named by an entry needs no resolver
    async with keeps_serving(svc, literal) as echoes, keeps_serving(dead, literal) as echoes_dead:
        results = await asyncio.gather(
            *(refusal(svc, f"{name}:443", RESOLVE_BOUND_S) for name in FAULTY_NAMES),
            refusal(dead, "dead.test:443", RESOLVE_BOUND_S),
        )
    for name, (status, reason, took) in zip([*FAULTY_NAMES, "dead.test"], results, strict=True):
        assert (status, reason) == (502, "resolve_failed"), (name, status, reason)
        assert took < RESOLVE_BOUND_S, (name, took)
    assert set(FAULTY_NAMES) <= set(chaos.asked)
    assert echoes[0] >= 5 and echoes_dead[0] >= 1  # allowed traffic flowed all along
    for service, names in ((svc, FAULTY_NAMES), (dead, ["dead.test"])):
        for name in names:
            [record] = [r for r in egress(service) if r["host"] == name]
            assert (record["decision"], record["reason"], record["address"]) == ("deny", "resolve_failed", None)
        await released(service)
    assert echo_origin.connections >= 6 + 1  # and none of the faulty names was dialled: they were never resolved


# -- 2. origins that never answer, reset mid-stream, or read one byte a second ------------------------


@pytest.mark.parametrize("kind", ["http", "connect"])
async def test_an_origin_that_accepts_and_never_answers_is_closed_by_the_idle_timeout(
    make_egressd: MakeEgressd, echo_origin: Listener, kind: str
) -> None:
    async def silent(reader, writer, state):  # type: ignore[no-untyped-def]
        if kind == "http":
            await read_head(reader, state)

    async with origin(silent) as state:
        svc = await make_egressd(allow=["origin.test:*", f"{ORIGIN}:{echo_origin.port}"], idle_timeout_s=0.5)
        async with keeps_serving(svc, f"{ORIGIN}:{echo_origin.port}") as echoes:
            started = time.monotonic()
            if kind == "http":
                reader, writer = await open_proxy(svc)
                writer.write(f"GET http://origin.test:{state.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            else:
                status, _, _, reader, writer = await connect_via(svc, f"origin.test:{state.port}")
                assert status == 200
                writer.write(b"hello?")
            await writer.drain()
            got = await read_to_close(reader, 3.0)
            took = time.monotonic() - started
            writer.close()
        assert took < 0.5 + 1.5, took
        if kind == "http":
            assert got.startswith(b"HTTP/1.1 504 ") and b"X-Egress-Reason: upstream_timeout" in got, got
        else:
            assert got == b""
        await asyncio.wait_for(state.closed.wait(), 3)
        await released(svc)
        assert echoes[0] >= 2
        record = ended(svc, "origin.test")
        if kind == "http":  # the request went out, and the origin said nothing
            assert (record["end"], record["bytes_up"], record["bytes_down"]) == (
                "upstream_timeout",
                len(state.received),
                0,
            ), record
        else:
            assert (record["end"], record["bytes_up"], record["bytes_down"]) == ("idle_timeout", 6, 0), record


@pytest.mark.parametrize("kind", ["http", "connect"])
async def test_an_origin_that_resets_mid_stream_ends_the_client_connection_at_once(
    make_egressd: MakeEgressd, echo_origin: Listener, kind: str
) -> None:
    async def reset(reader, writer, state):  # type: ignore[no-untyped-def]
        if kind == "http":
            await read_head(reader, state)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"y" * 1000)
        else:
            state.received += await reader.readexactly(5)
            writer.write(b"y" * 1000)
        await writer.drain()
        await asyncio.sleep(0.2)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        writer.transport.abort()
        state.closed.set()

    async with origin(reset) as state:
        svc = await make_egressd(allow=["origin.test:*", f"{ORIGIN}:{echo_origin.port}"], idle_timeout_s=30)
        async with keeps_serving(svc, f"{ORIGIN}:{echo_origin.port}"):
            if kind == "http":
                reader, writer = await open_proxy(svc)
                writer.write(f"GET http://origin.test:{state.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            else:
                status, _, _, reader, writer = await connect_via(svc, f"origin.test:{state.port}")
                assert status == 200
                writer.write(b"hello")
            await writer.drain()
            started = time.monotonic()
            got = await read_to_close(reader, 3.0)  # well before the 30 s idle timeout
            took = time.monotonic() - started
            writer.close()
        assert took < 2.0 and got.endswith(b"y" * 1000), (took, got[:100])
        await released(svc)
        record = ended(svc, "origin.test")
        assert record["end"] != "idle_timeout" and record["bytes_down"] == len(got), (record, len(got))


# The client's send buffer and the slow origin's receive buffer, fixed (no autotuning) so that
# what the test can push is bounded by egressd's own sockets and buffers.
_SMALL_BUFFER = 64 * 1024


def kernel_queue_bound() -> int:
    """The most the kernel can queue on egressd's two sockets of a held-back relay, plus the two small
    fixed buffers at the ends and a margin for egressd's own (``stream.HIGH_WATER``, one read).

    egressd's receive buffer from the client autotunes up to ``tcp_rmem``'s maximum (32 MiB on some
    machines) while it still reads fast, and its send buffer to the origin up to ``tcp_wmem``'s: that is
    the kernel's, not egressd's, and a fixed bound below it (this test once had 16 MiB) fails when the
    machine is busy and autotuning reaches further.
    """
    rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    return rmem + wmem + 4 * _SMALL_BUFFER + 2 * 1024 * 1024


@pytest.mark.parametrize("kind", ["http", "connect"])
async def test_an_upload_to_an_origin_reading_a_byte_a_second_is_held_back_then_closed_by_the_idle_timeout(
    make_egressd: MakeEgressd, echo_origin: Listener, kind: str
) -> None:
    bound = kernel_queue_bound()
    upload = max(64 * 1024 * 1024, 2 * bound)  # an egressd that took it all in would pass the bound
    loop = asyncio.get_running_loop()

    async def slow(reader, writer, state):  # type: ignore[no-untyped-def]
        writer.transport.pause_reading()  # read by hand: one byte a second
        with socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno())) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SMALL_BUFFER)
            sock.setblocking(False)
            while True:
                await asyncio.sleep(1.0)
                try:
                    byte = sock.recv(1)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    return
                if not byte:
                    return
                state.received += byte

    async with origin(slow) as state:
        svc = await make_egressd(allow=["origin.test:*", f"{ORIGIN}:{echo_origin.port}"], idle_timeout_s=1.0)
        async with keeps_serving(svc, f"{ORIGIN}:{echo_origin.port}") as echoes:
            if kind == "http":
                reader, writer = await open_proxy(svc)
                writer.write(
                    f"POST http://origin.test:{state.port}/up HTTP/1.1\r\nHost: x\r\n"
                    f"Content-Length: {upload}\r\n\r\n".encode()
                )
            else:
                status, _, _, reader, writer = await connect_via(svc, f"origin.test:{state.port}")
                assert status == 200
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SMALL_BUFFER)
            started, sent, chunk = loop.time(), 0, bytes(65536)  # opaque (NULs): not a first line the HTTP check holds
            with contextlib.suppress(ConnectionError, TimeoutError):
                while sent < upload and loop.time() - started < 10:
                    writer.write(chunk)
                    await asyncio.wait_for(writer.drain(), 10 - (loop.time() - started))
                    sent += len(chunk)
            got = await read_to_close(reader, 3.0)
            took = loop.time() - started
            writer.close()
        assert sent < bound, (sent, bound)  # held back: egressd did not take the upload in for the origin
        assert took < 1.0 + 4.0, took
        assert got == b"" or got.startswith(b"HTTP/1.1 504 "), got[:200]
        await released(svc)
        assert echoes[0] >= 2
        assert ended(svc, "origin.test").get("end") == "idle_timeout"


# -- 3. approval channels that are down, rate-limited, failing, slow, or answer too late -------------


async def held_refusal(svc: Any, echo_origin: Listener, limit_s: float) -> tuple[int, str, float]:
    return await refusal(svc, f"origin.test:{echo_origin.port}", limit_s)


@pytest.mark.parametrize("fault", ["500s", "hang"])
async def test_a_webhook_receiver_failing_or_hanging_ends_the_request_at_the_deadline(
    egressd: Callable[..., Any],  # noqa: F811
    echo_origin: Listener,
    fault: str,
) -> None:
    secret, key = make_secret()
    async with WebhookReceiver(key, mode="hang" if fault == "hang" else "now") as receiver:
        receiver.fail_first = 10**6 if fault == "500s" else 0
        svc = await egressd(
            approver=["webhook"], webhook_url=receiver.url, webhook_secret=secret, approval_timeout=1.0,
            allow=[f"{ORIGIN}:{echo_origin.port}"],
        )  # fmt: skip
        async with keeps_serving(svc, f"{ORIGIN}:{echo_origin.port}"):
            status, reason, took = await held_refusal(svc, echo_origin, 5)
        assert (status, reason) == (403, "approval_timeout") and 0.9 < took < 3.0, (status, reason, took)
        assert receiver.requests, "the receiver was tried"
        [decided] = records(svc, "approval.decided")
        assert (decided["decision"], decided["reason"]) == ("deny", "approval_timeout")
        [record] = [r for r in egress(svc) if r["host"] == "origin.test"]
        assert (record["reason"], record["approval"]["id"]) == ("approval_timeout", decided["id"])
        await released(svc)


@pytest.mark.parametrize("fault", ["down", "rate_limited"])
async def test_slack_down_or_rate_limiting_for_ever_never_allows(
    egressd: Callable[..., Any],  # noqa: F811
    fake_slack: FakeSlack,  # noqa: F811
    echo_origin: Listener,
    fault: str,
) -> None:
    svc = await egressd(**slack_settings(fake_slack), approval_timeout=30.0, allow=[f"{ORIGIN}:{echo_origin.port}"])
    if fault == "down":
        fake_slack.down = True
    else:
        fake_slack.rate_limit = 10**6
    async with keeps_serving(svc, f"{ORIGIN}:{echo_origin.port}"):
        status, reason, took = await held_refusal(svc, echo_origin, 15)
    # slack-sdk retries 5xx and 429 with backoff, a few times: then the one channel has failed for certain,
    # long before the 30 s deadline (a deadline passing during the retries is approval_timeout instead:
    # tests/integration/proxy/test_precision.py).
    assert (status, reason) == (403, "no_approver") and took < 10.0, (status, reason, took)
    assert len(fake_slack.posted) >= 2 and (fault == "down" or fake_slack.rate_limited >= 2)  # tried, and retried
    [decided] = records(svc, "approval.decided")
    assert (decided["decision"], decided["reason"]) == ("deny", reason)
    [record] = [r for r in egress(svc) if r["host"] == "origin.test"]
    assert (record["decision"], record["reason"]) == ("deny", reason)
    assert echo_origin.connections >= 1 and not [r for r in egress(svc) if r["host"] == "origin.test" and r["address"]]


async def test_a_callback_after_the_approval_expired_is_refused_and_changes_nothing(
    egressd: Callable[..., Any],  # noqa: F811
    echo_origin: Listener,
) -> None:
    secret, key = make_secret()
    callback_secret, callback_key = make_secret()
    front = listening_socket()
    async with WebhookReceiver(key, callback_key=callback_key, mode="later") as receiver, relay(front) as to:
        svc = await egressd(
            approver=["webhook"], webhook_url=receiver.url, webhook_secret=secret,
            webhook_callback_secret=callback_secret, public_url=f"http://127.0.0.1:{front.getsockname()[1]}",
            approval_timeout=0.5,
        )  # fmt: skip
        to.append(svc.control_address)
        status, reason, _ = await held_refusal(svc, echo_origin, 5)
        assert (status, reason) == (403, "approval_timeout")
        first = receiver.requests[0].payload["id"]
        status, answer, _ = await receiver.callback(first, "allow", by="late-larry")
        assert (status, answer) == (409, {"error": "already settled"})
        [decided] = records(svc, "approval.decided")
        assert (decided["id"], decided["reason"], decided["by"]) == (first, "approval_timeout", None)
        # Nothing was allowed: the next request is asked again (a timeout does not stick) and expires again.
        status, reason, _ = await held_refusal(svc, echo_origin, 5)
        assert (status, reason) == (403, "approval_timeout")
        assert len({r.payload["id"] for r in receiver.requests}) == 2
        assert echo_origin.connections == 0
        assert [r["reason"] for r in egress(svc)] == ["approval_timeout", "approval_timeout"]


# -- 4. SIGTERM with tunnels open and approvals pending ---------------------------------------------


async def test_sigterm_ends_held_requests_with_shutting_down_gives_tunnels_their_grace_and_exits_0(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    grace_s = 1.5
    secret, key = make_secret()
    audit, err = tmp_path / "audit.jsonl", tmp_path / "stderr.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and k.lower() != "http_proxy"}
    env |= {"XDG_STATE_HOME": str(tmp_path / "state"), "EGRESSD_SHUTDOWN_GRACE_S": str(grace_s)}
    async with WebhookReceiver(key, mode="never") as receiver:
        with err.open("w") as stderr:
            proc = await asyncio.to_thread(
                subprocess.Popen,
                [EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
                 "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--audit-log", str(audit),
                 "--allow-private", ORIGIN_RANGE, "--allow", f"origin.test:{echo_origin.port}",
                 "--approver", "webhook", "--webhook-url", receiver.url, "--webhook-secret", secret,
                 "--log-level", "info"],
                env=env, stderr=stderr, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        try:
            port = (await asyncio.to_thread(wait_serve_ports_in, err, proc))["proxy"]

            class Proxy:
                proxy_address = ("127.0.0.1", port)

            tunnels = [await connect_via(Proxy, f"origin.test:{echo_origin.port}") for _ in range(2)]  # type: ignore[arg-type]
            for status, _, _, reader, writer in tunnels:
                assert status == 200
                writer.write(b"ping")
                assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
            held = [asyncio.create_task(refusal(Proxy, f"held{i}.test:443", 10)) for i in range(2)]
            for _ in range(500):
                if len({r.payload["host"] for r in receiver.requests}) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len({r.payload["host"] for r in receiver.requests}) == 2
            stopped = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for status, reason, _ in await asyncio.gather(*held):
                assert (status, reason) == (503, "shutting_down")
            assert time.monotonic() - stopped < 1.0  # at once, not after the grace
            # A tunnel keeps working during the grace ...
            status, _, _, reader, writer = tunnels[0]
            writer.write(b"during-grace")
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(12), 1) == b"during-grace"
            # ... and both are closed when it is over.
            for _, _, _, reader, writer in tunnels:
                assert await read_to_close(reader, grace_s + 3) == b""
                writer.close()
            closed_after = time.monotonic() - stopped
            code = await asyncio.to_thread(proc.wait, grace_s + 10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 0
    assert grace_s - 0.2 < closed_after < grace_s + 3, closed_after
    text = audit.read_text()
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]  # every line whole
    decided = [r for r in lines if r["event"] == "approval.decided"]
    assert sorted(r["reason"] for r in decided) == ["shutting_down", "shutting_down"]
    denied = [r for r in lines if r["event"] == "egress" and r["decision"] == "deny"]
    assert {(r["host"], r["reason"]) for r in denied} == {
        ("held0.test", "shutting_down"),
        ("held1.test", "shutting_down"),
    }
    assert {r["approval"]["id"] for r in denied} == {r["id"] for r in decided}
    allowed = {r["id"] for r in lines if r["event"] == "egress" and r["decision"] == "allow"}
    ends = {r["id"]: r.get("end") for r in lines if r.get("id") in allowed and r.get("end") is not None}
    assert ends == dict.fromkeys(allowed, "shutdown"), ends
    assert lines[-1]["event"] == "run.end"
    log = err.read_text()
    assert log.endswith("\n") and "shutting down" in log
