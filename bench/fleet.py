"""A fleet's approvals under load: 1,000 held requests across three instances, answered in bulk on one of them.

    .venv/bin/python bench/fleet.py [--held 1000] [--instances 3] [--concurrency 20]

Starts a PostgreSQL server of its own (tests/postgres.py: initdb in a
temporary directory, a unix socket, no port), migrates it, and starts
``--instances`` ``egressd serve --state`` of this checkout on port-0
listeners, none with an approver of its own (a fleet of sidecars). Then:

1. opens ``--held`` CONNECTs for distinct unknown names (``hN.bench.test``),
   spread over the instances in turn: each is held for an approval;
2. waits until the first instance lists all of them (``GET /approvals``:
   its own and the others');
3. answers every one through the first instance's control API, ``deny``,
   ``--concurrency`` at a time, and times, for each, from the moment its
   answer was sent to the moment its client got the refusal: the answer
   carried to the holder (a letter, LISTEN/NOTIFY), decided there, and the
   held request let go.

A denial is the answer here because it releases the request without a dial
or a DNS query: the figure is the fleet's path and nothing else. Prints the
time to list everything, then the p50, p99 and max from answer to release,
for the requests the answering instance held itself and for those the
others held, and the answers per second. Every process is started here and
stopped by its pid; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from egressd.fleet.store import Store  # noqa: E402
from tests.postgres import running_postgres  # noqa: E402

EGRESSD = str(Path(sys.executable).with_name("egressd"))
TOKEN = "bench-fleet-token"
SERVING = re.compile(r"serving: proxy 127\.0\.0\.1:(\d+), control http://127\.0\.0\.1:(\d+)")


async def start(home: Path, dsn: str, held: int) -> tuple[asyncio.subprocess.Process, int, int]:
    await asyncio.to_thread(home.mkdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env |= {"XDG_STATE_HOME": str(home), "EGRESSD_CONTROL_TOKEN": TOKEN, "EGRESSD_STATE": dsn}
    limit = str(held * 2)
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "serve", "--workers", "1", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
        "--audit-log", str(home / "audit.jsonl"),
        "--max-pending-approvals", limit, "--max-approvals-per-run", limit, "--max-connections", limit,
        "--max-connections-per-run", limit, "--upstream-dns", "127.0.0.1:9",  # never asked: every answer is deny
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    said = b""
    async with asyncio.timeout(60):
        while (found := SERVING.search(said.decode(errors="replace"))) is None:
            line = await proc.stderr.readline()
            if not line:
                raise RuntimeError(f"egressd did not start: {said.decode(errors='replace')[-2000:]}")
            said += line
    asyncio.get_running_loop().create_task(_drain(proc.stderr))
    return proc, int(found.group(1)), int(found.group(2))


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(1 << 16):
        pass


async def hold(port: int, host: str, released: dict[str, float]) -> None:
    """A CONNECT held for an approval; ``released[host]`` is when its answer arrived."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 600)
        released[host] = time.perf_counter()
    finally:
        writer.close()


async def main_async(args: argparse.Namespace) -> int:
    with running_postgres() as server, tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        server.psql("CREATE DATABASE fleet")
        dsn = server.dsn("fleet")
        store = await Store.open(dsn)
        await store.migrate()
        await store.close()
        started = [await start(Path(tmp) / f"i{n}", dsn, args.held) for n in range(args.instances)]
        procs = [proc for proc, _, _ in started]
        try:
            return await measure(args, [(proxy, control) for _, proxy, control in started])
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def measure(args: argparse.Namespace, ports: list[tuple[int, int]]) -> int:
    hosts = [f"h{n}.bench.test" for n in range(args.held)]
    released: dict[str, float] = {}
    holding = [asyncio.create_task(hold(ports[n % len(ports)][0], host, released)) for n, host in enumerate(hosts)]
    control = f"http://127.0.0.1:{ports[0][1]}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(trust_env=False, headers=headers) as http:
        listed: list[dict[str, object]] = []
        while len(listed) < args.held:
            if time.perf_counter() - t0 > 300:
                raise RuntimeError(f"only {len(listed)} of {args.held} listed after 300 s")
            await asyncio.sleep(0.25)
            async with http.get(f"{control}/approvals") as resp:
                listed = (await resp.json())["approvals"]
        listing_s = time.perf_counter() - t0
        ids = {str(a["host"]): (str(a["id"]), bool(a.get("instance"))) for a in listed}
        sent: dict[str, float] = {}
        statuses: list[int] = []
        gate = asyncio.Semaphore(args.concurrency)

        async def answer(host: str) -> None:
            async with gate:
                sent[host] = time.perf_counter()
                async with http.post(f"{control}/approvals/{ids[host][0]}/deny", json={"by": "bench"}) as resp:
                    statuses.append(resp.status)

        t1 = time.perf_counter()
        await asyncio.gather(*(answer(host) for host in hosts))
        answering_s = time.perf_counter() - t1
    await asyncio.wait_for(asyncio.gather(*holding, return_exceptions=True), 120)
    bad = [s for s in statuses if s != 200]
    print(f"fleet: {args.instances} instances, {args.held} held, all listed on the first after {listing_s:.1f} s; "
          f"answered {len(statuses)} in {answering_s:.1f} s ({len(statuses) / answering_s:.0f} answers/s), "
          f"{len(bad)} not 200")  # fmt: skip
    for label, remote in (("held by the answering instance", False), ("held by another instance", True)):
        times = sorted((released[h] - sent[h]) * 1000 for h in hosts if ids[h][1] is remote and h in released)
        if times:
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            print(f"  answer to release, {label}: {len(times)} requests, p50 {statistics.median(times):.1f} ms, "
                  f"p99 {p99:.1f} ms, max {times[-1]:.1f} ms")  # fmt: skip
    return 1 if bad or len(released) != args.held else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, default=1000, help="requests held (1-5000)")
    parser.add_argument("--instances", type=int, default=3, help="egressd instances (1-8)")
    parser.add_argument("--concurrency", type=int, default=20, help="answers in flight at once (1-200)")
    args = parser.parse_args()
    if not (1 <= args.held <= 5000 and 1 <= args.instances <= 8 and 1 <= args.concurrency <= 200):
        parser.error("--held 1-5000, --instances 1-8, --concurrency 1-200")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a socket per held request, here
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.held + 256)), hard))
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
