"""Who a sandboxed command is on the host: the working directory's owner, never root (pure).

Both backends run the command as the uid and gid that own the working
directory, with no other group (DESIGN.md, "The two boundaries", 1): what it
creates is that user's on the host, a setuid bit it sets gives only that
user's rights, and a root-only file stays unreadable. A directory that root
owns (uid 0 or gid 0, whatever its mode) has no such user, so it is refused
before anything is created; a fresh working directory is made for
``bwrap.SANDBOX_UID``:``SANDBOX_GID``, an unprivileged pair.
"""

from __future__ import annotations


def run_as(owner_uid: int, owner_gid: int) -> tuple[int, int] | None:
    """The uid:gid a command runs as in a working directory owned by ``owner_uid:owner_gid``.

    None when root owns it (uid 0 or gid 0): the sandbox never runs as root,
    and handing a root-owned directory to another uid would let a sandbox
    write where only root may (a world-writable one is no exception).
    """
    if owner_uid == 0 or owner_gid == 0:
        return None
    return owner_uid, owner_gid


def refusal(workdir: str) -> str:
    """The one line that says why a root-owned ``--workdir`` was refused and how to fix it."""
    return (f"the working directory {workdir} belongs to root; the sandbox never runs as root: "
            f"chown it to your user (chown -R USER:GROUP {workdir}), or leave out --workdir for a fresh one")


def unreachable(workdir: str, uid: int, gid: int) -> str:
    """The one line that says the owner cannot reach the working directory (bubblewrap runs as them)."""
    return (f"the working directory {workdir} belongs to uid {uid} (gid {gid}), who cannot reach it "
            "(it, or a directory above it, shuts them out); the sandbox runs as the owner: move it where "
            "its owner can open it, or let them search the directories above it")
