"""A run's internal bridge, fenced off from the host it lives on.

The sandbox's container keeps a default route to the internal network's
gateway (.1), which nobody holds: the bridge has no address
(``inhibit_ipv4``). But if anything on the host held that address, or any
other inside the network (another tool's interface, a bubblewrap run given
an overlapping ``--net-range``), the host would answer the sandbox's ARP and
take its packets. So, per run, before any container is on the network:

- an nftables table (``config.fence_ruleset``) drops whatever arrives on the
  bridge for the host itself or for routing elsewhere; frames between the
  bridge's own ports (sandbox and egressd) pass;
- the bridge answers no ARP for the host's addresses (``arp_ignore`` 8) and
  names none in its own (``arp_announce`` 2);
- a host address inside the network refuses the run (``FenceError``).

The table is removed when the run ends; one whose egressd is gone (killed
outright) is removed by the next run (``clean_leftover_fences``). The bridge,
and its sysctls with it, go with the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path

from ..backend import SandboxError
from .config import BRIDGE_SYSCTLS, RunPlan, addresses_inside, fence_owner, fence_ruleset, fence_table
from .engine import boot_id, owner_alive, owner_token

SYS_NET = Path("/sys/class/net")
PROC_CONF = Path("/proc/sys/net/ipv4/conf")
TOOL_TIMEOUT_S = 30.0


class FenceError(SandboxError):
    """The run's bridge cannot be fenced off from the host, or the host holds an address inside it."""


async def _run(*argv: str, stdin: bytes | None = None) -> str:
    if shutil.which(argv[0]) is None:
        raise FenceError(f"{argv[0]} is not installed: egressd needs it to fence the sandbox's network off the host")
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(TOOL_TIMEOUT_S):
            out, err = await proc.communicate(stdin)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise FenceError(f"{' '.join(argv[:3])} took longer than {TOOL_TIMEOUT_S:g}s") from None
    if proc.returncode != 0:
        raise FenceError(f"{' '.join(argv[:3])} failed: {err.decode(errors='replace').strip()}")
    return out.decode()


class Fence:
    """One run's fence on the host; ``remove`` takes it down (idempotent)."""

    def __init__(self, table: str) -> None:
        self.table = table
        self._removed = False

    @classmethod
    async def install(cls, plan: RunPlan) -> Fence:
        """Fence ``plan``'s bridge, then check no host address lies inside its network.

        Raises ``FenceError`` (nothing left behind) when the bridge is not in
        this network namespace (the engine's host network is not ours to
        fence), nft or ip is missing, or the host holds an address inside.
        """
        _, pid, start = owner_token().split(":")
        fence = cls(fence_table(plan.run_key, int(pid), start))
        try:
            await _run("nft", "-f", "-", stdin=fence_ruleset(fence.table, plan.bridge).encode())
            if not (SYS_NET / plan.bridge).exists():
                raise FenceError(f"the sandbox network's bridge {plan.bridge} is not in egressd's network namespace: "
                                 "egressd must run in the Docker Engine's host network namespace to fence it off")
            for name, value in BRIDGE_SYSCTLS:
                (PROC_CONF / plan.bridge / name).write_text(f"{value}\n")
            links = json.loads(await _run("ip", "-j", "-4", "addr", "show") or "[]")
            inside = addresses_inside(links, plan.internal, bridge=plan.bridge)
            if inside:
                raise FenceError(f"the host holds {', '.join(inside)}, inside the sandbox's network {plan.internal}: "
                                 "remove it or give --net-range a range clear of it")
        except BaseException:
            await fence.remove()
            raise
        return fence

    async def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        await remove_table(self.table)


async def remove_table(table: str) -> None:
    """Delete one fence table; one already gone is fine."""
    with contextlib.suppress(FenceError):
        await _run("nft", "delete", "table", "inet", table)


async def fence_tables() -> list[str]:
    """The names of the fence tables on this host."""
    try:
        listing = json.loads(await _run("nft", "-j", "list", "tables", "inet") or "{}")
    except (FenceError, ValueError):
        return []
    names = [str(item["table"]["name"]) for item in listing.get("nftables", []) if "table" in item]
    return [n for n in names if fence_owner(n) is not None]


async def clean_leftover_fences() -> list[str]:
    """Remove the fence tables whose egressd no longer runs; returns their names."""
    boot = boot_id()
    removed = []
    for table in await fence_tables():
        owner = fence_owner(table)
        assert owner is not None
        if not owner_alive(f"{boot}:{owner[0]}:{owner[1]}", boot_id=boot):
            await remove_table(table)
            removed.append(table)
    return removed
