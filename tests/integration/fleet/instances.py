"""Real ``egressd serve --state`` processes on loopback, for the fleet tests: started, asked, stopped."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from egressd.fleet.store import Store
from tests.fakes.dns import FakeDns
from tests.harness import ORIGIN_RANGE, aserve_ports

EGRESSD = str(Path(sys.executable).with_name("egressd"))
TOKEN = "fleet-test-token"


@dataclass
class Instance:
    proc: asyncio.subprocess.Process
    ports: dict[str, int]
    log: Path
    said: list[str]

    @property
    def id(self) -> str:
        """Its id in the fleet, from its start-up line."""
        for line in "".join(self.said).splitlines():
            if "this egressd listed as " in line:
                return line.rsplit("listed as ", 1)[1].strip()
        raise AssertionError(f"no fleet line: {self.said}")

    def records(self, event: str) -> list[dict[str, object]]:
        lines = self.log.read_bytes().splitlines() if self.log.exists() else []
        return [r for r in map(json.loads, lines) if r["event"] == event]

    async def control(self, method: str, path: str, body: object = None) -> tuple[int, dict[str, object]]:
        url = f"http://127.0.0.1:{self.ports['control']}{path}"
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.request(method, url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                return r.status, await r.json(content_type=None)

    async def pending(self) -> list[dict[str, object]]:
        status, body = await self.control("GET", "/approvals")
        assert status == 200, body
        return body["approvals"]  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def fleet(
    tmp_path: Path, dns: FakeDns, dsn: str, count: int = 3, extra: tuple[str, ...] = ()
) -> AsyncIterator[list[Instance]]:
    async with contextlib.AsyncExitStack() as stack:
        started = await asyncio.gather(*(stack.enter_async_context(serve(tmp_path / f"i{n}", dns, dsn, extra))
                                         for n in range(count)))  # fmt: skip
        yield list(started)


@contextlib.asynccontextmanager
async def serve(home: Path, dns: FakeDns, dsn: str, extra: tuple[str, ...] = ()) -> AsyncIterator[Instance]:
    await asyncio.to_thread(home.mkdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env |= {"XDG_STATE_HOME": str(home / "state"), "EGRESSD_CONTROL_TOKEN": TOKEN, "EGRESSD_STATE": dsn}
    log = home / "audit.jsonl"
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "serve", "--workers", "1", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
        "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--allow-private", ORIGIN_RANGE, "--audit-log", str(log),
        *extra,
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    said: list[str] = []
    draining = None
    try:
        ports = await aserve_ports(proc.stderr, read=said)
        draining = asyncio.create_task(drain(proc.stderr, said))
        yield Instance(proc, ports, log, said)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
        await proc.wait()
        if draining is not None:
            await asyncio.wait_for(draining, 10)


async def drain(stream: asyncio.StreamReader, said: list[str]) -> None:
    while line := await stream.readline():
        said.append(line.decode(errors="replace"))


async def connect(
    port: int, target: str, run: dict[str, object] | None = None
) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    """A CONNECT to ``target`` (for ``run``, as ``POST /runs`` made it, when given): the status and headers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = ""
    if run is not None:
        creds = base64.b64encode(f"{run['id']}:{run['token']}".encode()).decode()
        auth = f"Proxy-Authorization: Basic {creds}\r\n"
    try:
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode())
        await writer.drain()
        # Held for as long as a person takes (read_response gives a head 5 s): the head, then the rest.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    except BaseException:  # cancelled, or no answer: the connection is not left for the collector
        writer.close()
        raise
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, reader, writer


async def migrated(dsn: str) -> None:
    store = await Store.open(dsn)
    try:
        await store.migrate()
    finally:
        await store.close()


async def settled_everywhere(*instances: Instance) -> None:
    """Until none of ``instances`` lists an open approval: a holder writes a settlement to the database just
    after deciding, so another instance may list it for a moment longer."""
    for _ in range(150):
        if not any([await i.pending() for i in instances]):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"still listed: {[await i.pending() for i in instances]}")


async def listed(instance: Instance, holder: Instance | None = None) -> dict[str, object]:
    """The one approval ``instance`` lists (held by ``holder``, when given), once it does."""
    shown: list[dict[str, object]] = []
    for _ in range(150):
        shown = await instance.pending()
        if shown:
            break
        await asyncio.sleep(0.1)
    assert len(shown) == 1, (shown, "".join(holder.said) if holder else "")
    if holder is not None:
        assert shown[0].get("instance") == holder.id, shown
    return shown[0]
