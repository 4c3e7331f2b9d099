"""Floods from inside a run (issue 13): one run cannot starve another, and a flood cannot fill the disk.

Each test is an attack from one run ("flood", on its own loopback source
address or with its own credentials) while another run ("quiet") goes about
its business; the checks are what the quiet run saw and what the audit log
holds afterwards. All traffic stays on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import random
import struct
import time
from collections import Counter
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from egressd.audit.log import JsonlAuditSink
from egressd.proxy.core.policy import parse_entry
from egressd.proxy.core.runs import Run
from tests.conftest import Listener, MakeEgressd
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import wait_until

FLOOD_SOURCE = "127.0.0.11"
DNS_QUERIES = 20_000
REFUSED_CONNECTS = 2_000
CONNECT_WORKERS = 40
QUIET_TUNNELS = 20
NEW_DOMAINS = 200
PER_RUN = 5
# The defaults (egressd.config.settings): 50 refusal records per run per 10 s.
MAX_REFUSAL_RECORDS = 50
REFUSAL_INTERVAL_S = 10.0
# The DNS server's own cap on distinct names recorded per run (egressd.proxy.net.dnsserver).
DNS_NAMES_PER_RUN = 1000


def credentials(run: Run) -> str:
    token = base64.b64encode(f"{run.id}:{run.token}".encode()).decode()
    return f"Proxy-Authorization: Basic {token}\r\n"


def dns_query(name: str, qtype: int, ident: int) -> bytes:
    labels = b"".join(bytes([len(part)]) + part.encode() for part in name.split("."))
    return struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + labels + b"\x00" + struct.pack("!HH", qtype, 1)


async def dns_flood(address: tuple[str, int], rng: random.Random) -> int:
    """DNS_QUERIES random-label queries (A and TXT) over one TCP connection; the replies read back."""
    reader, writer = await asyncio.open_connection(*address, local_addr=(FLOOD_SOURCE, 0))
    replies = 0

    async def read_replies() -> None:
        nonlocal replies
        while True:
            try:
                size = await reader.readexactly(2)
            except asyncio.IncompleteReadError:
                return  # the server answered everything it read, then closed after our EOF
            await reader.readexactly(int.from_bytes(size, "big"))
            replies += 1

    reading = asyncio.create_task(read_replies())
    for i in range(DNS_QUERIES):
        label = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(30))
        packet = dns_query(f"{label}.exfil.test", 16 if i % 2 else 1, i & 0xFFFF)  # TXT: REFUSED; A: answered
        writer.write(len(packet).to_bytes(2, "big") + packet)
        if i % 500 == 0:
            await writer.drain()
    await writer.drain()
    writer.write_eof()
    await asyncio.wait_for(reading, 60)
    writer.close()
    return replies


async def connect_once(proxy: tuple[str, int], authority: str, extra: str, timeout_s: float = 10) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection(*proxy)
    try:
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        status = int(head.split(b" ", 2)[1])
        reason = next(
            (
                line.split(b":", 1)[1].strip().decode()
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"x-egress-reason:")
            ),
            "",
        )
        return status, reason
    finally:
        writer.close()


async def connect_flood(proxy: tuple[str, int], run: Run, rng: random.Random) -> Counter[tuple[int, str]]:
    seen: Counter[tuple[int, str]] = Counter()
    hosts = [f"h{rng.getrandbits(48):x}.unknown.test:443" for _ in range(REFUSED_CONNECTS)]

    async def worker(mine: list[str]) -> None:
        for authority in mine:
            seen[await connect_once(proxy, authority, credentials(run))] += 1

    await asyncio.gather(*(worker(hosts[i::CONNECT_WORKERS]) for i in range(CONNECT_WORKERS)))
    return seen


async def quiet_traffic(proxy: tuple[str, int], run: Run, origin: Listener) -> list[float]:
    """QUIET_TUNNELS allowed tunnels (a round trip each) and three refusals; the time each tunnel took."""
    took = []
    for i in range(QUIET_TUNNELS):
        started = time.monotonic()
        reader, writer = await asyncio.open_connection(*proxy)
        authority = f"origin.test:{origin.port}"
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{credentials(run)}\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.write(b"ping-%d" % i)
        assert await asyncio.wait_for(reader.readexactly(len(b"ping-%d" % i)), 10) == b"ping-%d" % i
        writer.close()
        took.append(time.monotonic() - started)
        await asyncio.sleep(0.05)
    for i in range(3):
        assert await connect_once(proxy, f"quiet{i}.unknown.test:443", credentials(run)) == (403, "not_allowlisted")
    return took


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class FileSink(JsonlAuditSink):
    """The real log file (the disk a flood would fill); ``records`` reads it back for ``make_egressd``."""

    @property
    def records(self) -> list[dict[str, Any]]:
        return read_log(Path(self.path))


async def test_a_refusal_flood_from_one_run_leaves_the_log_bounded_and_the_other_run_untouched(
    make_egressd: MakeEgressd, echo_origin: Listener, tmp_path: Path
) -> None:
    path = tmp_path / "flood.jsonl"
    sink = FileSink(path)
    try:
        svc = await make_egressd(audit=sink, dns_listen="127.0.0.1:0", dns_answer="127.0.0.1", ask=False)
        flood = svc.runs.create(task="flood", allow=[], ask=False, sources=[ip_address(FLOOD_SOURCE)])
        quiet = svc.runs.create(task="quiet", allow=[parse_entry("origin.test:*")], ask=False)
        rng = random.Random(13)
        started = time.monotonic()
        dns_task = asyncio.create_task(dns_flood(svc.dns_address, rng))
        connect_task = asyncio.create_task(connect_flood(svc.proxy_address, flood, rng))
        took = await asyncio.wait_for(quiet_traffic(svc.proxy_address, quiet, echo_origin), 60)
        refused = await asyncio.wait_for(connect_task, 120)
        replies = await dns_task
        await svc.close(grace_s=0)
        elapsed = time.monotonic() - started
    finally:
        sink.close()

    # Every flooding CONNECT was refused exactly as without a flood (fail closed).
    assert refused == {(403, "not_allowlisted"): REFUSED_CONNECTS}
    assert 0 < replies <= DNS_QUERIES
    # The quiet run: every tunnel worked, promptly, and every one of its records is there.
    assert len(took) == QUIET_TUNNELS and max(took) < 5.0, took
    records = read_log(path)
    quiet_records = [r for r in records if r.get("run") == quiet.id]
    assert Counter((r["event"], r.get("decision")) for r in quiet_records) == {
        ("egress", "allow"): QUIET_TUNNELS,  # written ahead, before each dial
        ("egress.end", None): QUIET_TUNNELS,
        ("egress", "deny"): 3,
    }
    assert echo_origin.connections == QUIET_TUNNELS

    # The flooding run: a bounded number of lines, and the counts add up exactly.
    mine = [r for r in records if r.get("run") == flood.id]
    intervals = math.floor(elapsed / REFUSAL_INTERVAL_S) + 2
    individual = [r for r in mine if r["event"] == "egress" and "suppressed" not in r]
    denies = [r for r in individual if r["decision"] == "deny"]
    summaries = [r for r in mine if r["event"] == "egress.suppressed"]
    assert len(denies) <= MAX_REFUSAL_RECORDS * intervals, (len(denies), elapsed)
    assert len(summaries) <= intervals
    assert len(mine) <= DNS_NAMES_PER_RUN + (MAX_REFUSAL_RECORDS + 1) * intervals + 2, (len(mine), elapsed)
    assert len(records) < (DNS_QUERIES + REFUSED_CONNECTS) // 10
    limited = [r for r in mine if r["event"] == "egress" and "suppressed" in r]  # the DNS server's own limits
    for kind, sent in (("dns", DNS_QUERIES), ("connect", REFUSED_CONNECTS)):
        one_by_one = sum(1 for r in individual if r["kind"] == kind)
        by_dns_limits = sum(r["suppressed"] for r in limited if r["kind"] == kind)
        by_budget = sum(n for s in summaries for n in s["counts"].get(kind, {}).values())
        assert one_by_one + by_dns_limits + by_budget == sent, (kind, one_by_one, by_dns_limits, by_budget)
    assert all(s["suppressed"] == sum(n for c in s["counts"].values() for n in c.values()) for s in summaries)
    assert all(s["samples"] and len(s["samples"]) <= 5 for s in summaries)


# --- new-domain requests: at most max_pending_approvals per run reach a channel --------------------


async def test_a_flood_of_new_domains_asks_a_channel_at_most_the_pending_cap_and_the_other_run_still_asks(
    make_egressd: MakeEgressd, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret, key = make_secret()
    monkeypatch.setenv("EGRESSD_APPROVER", "webhook")  # make_egressd's approver= is an Approver object
    async with WebhookReceiver(key, mode="never") as receiver:  # answers 202 and never decides: all stay pending
        svc = await make_egressd(
            require_auth=True, webhook_url=receiver.url, webhook_secret=secret, approval_timeout=60
        )
        assert svc.settings.approver == ["webhook"] and svc.settings.max_pending_approvals == 5
        flood = svc.runs.create(task="flood", allow=[])
        quiet = svc.runs.create(task="quiet", allow=[])
        tasks = [
            asyncio.create_task(connect_once(svc.proxy_address, f"h{i}.unknown.test:443", credentials(flood), 60))
            for i in range(NEW_DOMAINS)
        ]
        await wait_until(lambda: sum(t.done() for t in tasks) >= NEW_DOMAINS - 5, timeout_s=30)
        await asyncio.sleep(0.3)  # and no more than those
        done = [t for t in tasks if t.done()]
        held = [t for t in tasks if not t.done()]
        assert Counter(t.result() for t in done) == {(403, "too_many_pending"): NEW_DOMAINS - 5}
        assert len(held) == 5
        await wait_until(lambda: len(receiver.requests) == 5)
        # The other run is not starved of its own approvals.
        quiet_task = asyncio.create_task(
            connect_once(svc.proxy_address, "quiet.unknown.test:443", credentials(quiet), 60)
        )
        await wait_until(lambda: len(receiver.requests) == 6)
        await asyncio.sleep(0.3)  # nothing more arrives
        asked = Counter(r.payload["run"] for r in receiver.requests)
        assert asked == {flood.id: 5, quiet.id: 1}
        assert len({r.payload["id"] for r in receiver.requests}) == 6
        await svc.close(grace_s=0)
        for task in [*held, quiet_task]:
            assert (await asyncio.wait_for(task, 10))[0] == 503  # shutting_down: nobody is left to answer
    refused = [r for r in svc.audit_records if r.get("reason") == "too_many_pending"]  # type: ignore[attr-defined]
    summarised = sum(
        s["counts"].get("connect", {}).get("too_many_pending", 0)
        for s in svc.audit_records  # type: ignore[attr-defined]
        if s["event"] == "egress.suppressed"
    )
    assert len(refused) + summarised == NEW_DOMAINS - 5


# --- connections: one run at its cap does not stop another run's ------------------------------------


async def open_tunnel(proxy: tuple[str, int], authority: str, extra: str) -> tuple[int, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(*proxy)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return int(head.split(b" ", 2)[1]), writer


async def test_a_run_at_its_connection_cap_does_not_stop_another_runs_connections(
    make_egressd: MakeEgressd, echo_origin: Listener
) -> None:
    svc = await make_egressd(require_auth=True, max_connections_per_run=PER_RUN, max_connections=3 * PER_RUN)
    allow = [parse_entry("origin.test:*")]
    flood = svc.runs.create(task="flood", allow=allow, ask=False)
    quiet = svc.runs.create(task="quiet", allow=allow, ask=False)
    authority = f"origin.test:{echo_origin.port}"
    held = [await open_tunnel(svc.proxy_address, authority, credentials(flood)) for _ in range(PER_RUN)]
    assert [status for status, _ in held] == [200] * PER_RUN
    over = [await open_tunnel(svc.proxy_address, authority, credentials(flood)) for _ in range(PER_RUN)]
    assert [status for status, _ in over] == [429] * PER_RUN
    theirs = [await open_tunnel(svc.proxy_address, authority, credentials(quiet)) for _ in range(PER_RUN)]
    assert [status for status, _ in theirs] == [200] * PER_RUN
    for _, writer in held + over + theirs:
        writer.close()


# --- slow request heads (slowloris): a run's unfinished heads count against its own cap -------------


@pytest.mark.parametrize("listener", ["proxy", "transparent_tls"])
async def test_a_run_holding_slow_heads_does_not_stop_another_runs_connections(
    make_egressd: MakeEgressd, echo_origin: Listener, listener: str
) -> None:
    svc = await make_egressd(
        require_auth=True,
        max_connections_per_run=PER_RUN,
        max_connections=3 * PER_RUN,
        head_timeout_s=5,
        transparent_tls="127.0.0.1:0",
    )
    allow = [parse_entry("origin.test:*")]
    flood = svc.runs.create(task="flood", allow=allow, ask=False, sources=[ip_address(FLOOD_SOURCE)])
    quiet = svc.runs.create(task="quiet", allow=allow, ask=False)
    address = svc.proxy_address if listener == "proxy" else svc.transparent_tls_address
    start = b"CONNECT origin.te" if listener == "proxy" else b"\x16\x03\x01\x02\x00\x01"  # never finished
    slow = []
    for _ in range(3 * PER_RUN):  # as many as egressd takes overall
        reader, writer = await asyncio.open_connection(*address, local_addr=(FLOOD_SOURCE, 0))
        writer.write(start)
        slow.append((reader, writer))
    try:

        def flood_records() -> list[dict[str, Any]]:
            return [r for r in svc.audit_records if r.get("run") == flood.id]  # type: ignore[attr-defined]

        # Every slow client reached egressd: it holds a connection for it, or refused it.
        await wait_until(lambda: svc.path.recorder.metrics.connections_open + len(flood_records()) >= 3 * PER_RUN)
        status, writer = await open_tunnel(svc.proxy_address, f"origin.test:{echo_origin.port}", credentials(quiet))
        writer.close()
        assert status == 200, "the quiet run was starved by the other run's slow heads"
        # The flooding run's heads past its cap were refused at once, and said so.
        over = flood_records()
        assert (
            flood.waiting_heads == PER_RUN
            and len(over) == 2 * PER_RUN
            and {r["reason"] for r in over} == {"limit_exceeded"}
        )
    finally:
        for _, writer in slow:
            writer.close()
    await wait_until(lambda: flood.waiting_heads == 0 and flood.open_connections == 0)
