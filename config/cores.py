"""How many cores egressd may use: what ``workers = 0`` (one per core) resolves to.

The CPUs this process may run on (its affinity), fewer when a cgroup v2
quota (``cpu.max`` of its cgroup or an ancestor) allows less: a sidecar
limited to half a core on a 64-core node gets one process, not 64.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cores(cpu_max: str) -> int | None:
    """Cores a ``cpu.max`` line ("QUOTA PERIOD", or "max PERIOD") allows, rounded up; None when unlimited."""
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def own_cgroup(proc_self_cgroup: str) -> str | None:
    """The cgroup v2 path in ``/proc/self/cgroup`` (the "0::/path" line), or None."""
    for line in proc_self_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def usable_cores(root: Path = CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")) -> int:
    """The affinity's CPU count, lowered by the tightest cgroup quota from this cgroup up to the root."""
    cores = len(os.sched_getaffinity(0))
    try:
        path = own_cgroup(membership.read_text())
    except OSError:
        return cores
    if path is None:
        return cores
    directory = root / path.lstrip("/")
    while True:
        try:
            allowed = quota_cores((directory / "cpu.max").read_text())
        except OSError:
            allowed = None
        if allowed is not None:
            cores = min(cores, allowed)
        if directory == root or root not in directory.parents:
            return cores
        directory = directory.parent
