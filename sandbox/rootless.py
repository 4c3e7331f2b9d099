"""What ``egressd run`` without root could build on here: the probes ``egressd doctor`` runs as an ordinary user.

The rootless backend (issue 32) is not built yet: ``egressd run`` needs
root. These probes say what an ordinary user's sandbox would get on this
machine, and why not where it would not:

- a user and network namespace of its own (``unshare --user --net``), as
  bubblewrap's ``--unshare-user --unshare-net`` makes;
- nftables inside it (the user namespace holds CAP_NET_ADMIN over its own
  network namespace): every TCP connection and DNS query redirected to
  egressd's relay, as the root backend redirects them; where the kernel
  refuses, proxy settings only;
- a delegated cgroup (``systemd-run --user --scope``) for memory and CPU
  limits; else ``prlimit``-style limits.

Run as root, each probe drops to ``nobody`` first: the question is what an
ordinary user gets.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from .probe import run_probe

NOBODY = 65534


@dataclass(frozen=True)
class Rootless:
    """What the probes found: each part, and why not when it is missing."""

    userns: str | None  # None: works; else why not
    nftables: str | None
    cgroups: str | None

    @property
    def backend(self) -> str:
        """What an ordinary user's ``egressd run`` would get here, in a phrase."""
        if self.userns is not None:
            return "nothing: an ordinary user may not make a user and network namespace here"
        capture = ("every connection and DNS query captured (nftables in the user namespace)"
                   if self.nftables is None else "proxy settings only (no nftables in a user namespace)")  # fmt: skip
        limits = "a delegated cgroup" if self.cgroups is None else "prlimit-style limits"
        return f"bubblewrap in a user and network namespace, {capture}, {limits}"


async def _as_user(*argv: str) -> tuple[int, str]:
    drop = ["nsenter", "--setgid", str(NOBODY), "--setuid", str(NOBODY), "--"] if os.geteuid() == 0 else []
    return await run_probe(*drop, *argv)


async def probe() -> Rootless:
    if shutil.which("unshare") is None:
        return Rootless("unshare (util-linux) is not installed", "untested", "untested")
    code, out = await _as_user("unshare", "--user", "--map-root-user", "--net", "true")
    userns = None if code == 0 else f"unshare --user --net failed: {out or code}"
    nftables: str | None = "untested: no user namespace"
    if userns is None:
        if shutil.which("nft") is None:
            nftables = "nft is not installed"
        else:
            code, out = await _as_user("unshare", "--user", "--map-root-user", "--net", "nft", "add", "table", "inet",
                                       "egressd_probe")  # fmt: skip
            nftables = None if code == 0 else f"the kernel refuses nftables in a user namespace: {out or code}"
    return Rootless(userns, nftables, await _cgroups())


def _systemd_delegates() -> str | None:
    """None when systemd runs here and delegates cgroups to users' sessions, else why not (a few stats)."""
    if shutil.which("systemd-run") is None:
        return "systemd-run is not installed"
    if not os.path.isdir("/run/systemd/system"):
        return "systemd is not the init system here: no user scopes to delegate a cgroup to"
    if not os.path.isdir("/sys/fs/cgroup/user.slice"):
        return "no user.slice: systemd does not delegate cgroups to users"
    return None


async def _cgroups() -> str | None:
    """None when a user's scope can get a delegated cgroup, else why not."""
    why = _systemd_delegates()
    if why is not None or os.geteuid() == 0:
        return why  # a user's own manager is reached from their session only: as root, whether systemd delegates
    code, out = await _as_user("systemd-run", "--user", "--scope", "--quiet", "true")
    return None if code == 0 else f"systemd-run --user --scope failed: {out or code}"
