"""Resource limits for one sandboxed command: memory, processes, CPU time.

Memory and the process count go into a cgroup when the machine lets us make
one: cgroup v2 (``memory.max`` with ``memory.swap.max`` 0, ``pids.max``) or,
on a v1/hybrid host, the v1 memory and pids controllers
(``memory.limit_in_bytes`` = ``memory.memsw.limit_in_bytes``, ``pids.max``).
The kernel's OOM killer then ends the command inside its cgroup and we report
exit 137 with ``memory_exceeded``. Without a usable cgroup, memory falls back
to RLIMIT_AS (allocations fail instead: the program sees ENOMEM) and the
process count to nothing we can enforce for a root-mapped user (said by
``egressd doctor``). CPU time is RLIMIT_CPU in every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP = "egressd"
# Enough for a parallel build (make -j, npm) and far below a fork bomb's reach.
DEFAULT_MAX_PIDS = 512


@dataclass(frozen=True)
class Limits:
    timeout_s: float | None = None
    memory_mb: int | None = None
    max_pids: int = DEFAULT_MAX_PIDS
    cpu_s: int | None = None


def cgroup_mode() -> tuple[str | None, str]:
    """("v2"|"v1"|None, why): which cgroup flavour can hold a run here."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        if "memory" in controllers and os.access(CGROUP_ROOT, os.W_OK):
            return "v2", "cgroup v2 with the memory controller"
        return None, "cgroup v2 without a writable memory controller (run as root, or delegate one)"
    if (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists() and os.access(CGROUP_ROOT / "memory", os.W_OK):
        return "v1", "cgroup v1 memory and pids controllers (hybrid hierarchy)"
    return None, "no writable cgroup memory controller (not root, or cgroups not mounted)"


class Cgroup:
    """One command's cgroup(s); ``join_self`` runs in the child before exec."""

    def __init__(self, mode: str, dirs: list[Path]) -> None:
        self.mode = mode
        self.dirs = dirs

    @classmethod
    def create(cls, key: str, limits: Limits) -> Cgroup | None:
        mode, _ = cgroup_mode()
        try:
            if mode == "v2":
                return cls._create_v2(key, limits)
            if mode == "v1":
                return cls._create_v1(key, limits)
        except OSError:
            return None
        return None

    @classmethod
    def _create_v2(cls, key: str, limits: Limits) -> Cgroup:
        parent = CGROUP_ROOT / GROUP
        with contextlib.suppress(OSError):
            (CGROUP_ROOT / "cgroup.subtree_control").write_text("+memory +pids")
        parent.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        group = parent / f"egd-{key}"
        group.mkdir()
        cg = cls("v2", [group])
        if limits.memory_mb:
            (group / "memory.max").write_text(str(limits.memory_mb * 1024 * 1024))
            with contextlib.suppress(OSError):
                (group / "memory.swap.max").write_text("0")
        with contextlib.suppress(OSError):
            (group / "pids.max").write_text(str(limits.max_pids))
        return cg

    @classmethod
    def _create_v1(cls, key: str, limits: Limits) -> Cgroup:
        dirs = []
        memory = CGROUP_ROOT / "memory" / GROUP / f"egd-{key}"
        memory.mkdir(parents=True)
        dirs.append(memory)
        if limits.memory_mb:
            limit = str(limits.memory_mb * 1024 * 1024)
            (memory / "memory.limit_in_bytes").write_text(limit)
            # memsw = memory + swap: equal limits mean no swap at all.
            with contextlib.suppress(OSError):
                (memory / "memory.memsw.limit_in_bytes").write_text(limit)
        pids = CGROUP_ROOT / "pids" / GROUP / f"egd-{key}"
        if (CGROUP_ROOT / "pids").exists():
            with contextlib.suppress(OSError):
                pids.mkdir(parents=True)
                (pids / "pids.max").write_text(str(limits.max_pids))
                dirs.append(pids)
        return cls("v1", dirs)

    def join_self(self) -> None:
        """Move the calling process in (called in the child, before exec)."""
        pid = str(os.getpid())
        for d in self.dirs:
            (d / "cgroup.procs").write_text(pid)

    def oom_killed(self) -> bool:
        try:
            if self.mode == "v2":
                text = (self.dirs[0] / "memory.events").read_text()
            else:
                text = (self.dirs[0] / "memory.oom_control").read_text()
        except OSError:
            return False
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                return True
        return False

    def pids_exhausted(self) -> bool:
        """Whether a fork or clone failed at the process limit (``pids.events``: ``max N``, v1 and v2)."""
        for directory in self.dirs:
            try:
                text = (directory / "pids.events").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name == "max" and value.strip().isdigit() and int(value) > 0:
                    return True
        return False

    def kill_all(self) -> None:
        """SIGKILL everything still in the cgroup (the whole process tree)."""
        if self.mode == "v2" and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.dirs[0] / "cgroup.kill").write_text("1")
            return
        for _ in range(10):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def try_remove(self) -> bool:
        """Kill what is left and remove the directories; False while one is still busy."""
        self.kill_all()
        done = True
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY: an OOM-killed process can take a moment to finish dying
                done = False
        return done

    async def remove(self, timeout_s: float = 10.0) -> None:
        """``try_remove`` until it succeeds or ``timeout_s`` passes (a leftover for doctor --clean)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.try_remove() and loop.time() < deadline:  # noqa: ASYNC110 - polls rmdir (EBUSY), no event
            await asyncio.sleep(0.05)


def rlimits_in_child(limits: Limits, *, memory_fallback: bool) -> None:
    """Set the rlimits of the calling process (called in the child, before exec)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.cpu_s:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    if memory_fallback and limits.memory_mb:
        size = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size, size))


def leftover_cgroups(live_keys: set[str]) -> list[Path]:
    """egd-* cgroups whose run is not live."""
    found = []
    for base in (CGROUP_ROOT / GROUP, CGROUP_ROOT / "memory" / GROUP, CGROUP_ROOT / "pids" / GROUP):
        if base.is_dir():
            for d in base.glob("egd-*"):
                if d.name.removeprefix("egd-").split("-")[0] not in live_keys:
                    found.append(d)
    return found
