"""The working directory as the Docker engine mounts it: our own bind mount of it, nosuid and nodev.

Docker's bind mounts take no nosuid or nodev option (``BindOptions`` has
none, and a local volume with ``o=bind,nosuid,nodev`` hands them to a plain
MS_BIND, which ignores them), but a bind mount copies the flags of the mount
it binds. So egressd, as root, binds the working directory at a path of its
own under ``STAGE_DIR``, remounts that nosuid,nodev (keeping read-only,
noexec and the atime flags of the mount beneath), and gives the engine that
path: the container's /work inherits the flags.

The directory is opened once; that one descriptor gives both its owner (who
the command runs as) and the mount's source, so the path cannot be swapped
between the check and the mount. ``STAGE_DIR`` is root's alone (0700): a
stage shows the directory without the protection of the directories above
it.

The engine must see the stage: a mount egressd makes in a mount namespace
of its own (systemd's PrivateTmp or ProtectSystem, a container, ``unshare
-m``) is not in the engine's, which would mount the bare directory beneath
it at /work. So the directory holds a marker file (``marker``) before the
mount covers it: whoever finds the marker at /work sees the bare directory,
not the working directory (``DockerSandbox`` asks the engine, and refuses).

Each stage is named ``OWNER@RANDOM`` after the egressd that made it;
``stage`` first removes the stages whose owner is gone (an egressd killed
outright), ``unstage`` removes one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
from collections.abc import Callable
from pathlib import Path

STAGE_DIR = Path("/run/egressd/workdirs")

# <linux/mount.h>; statvfs's ST_* flags are the same bits for the first four only.
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 0x20, 0x400, 0x800, 0x1000
_MS_RELATIME = 0x200000
_MNT_DETACH, _UMOUNT_NOFOLLOW = 0x2, 0x8
_KEPT = ((os.ST_RDONLY, _MS_RDONLY), (os.ST_NOEXEC, _MS_NOEXEC), (os.ST_NOATIME, _MS_NOATIME),
         (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME))


def remount_flags(statvfs_flags: int) -> int:
    """The flags that make a stage nosuid,nodev and keep what the mount beneath had (pure).

    A bind remount sets the mount's flags to exactly these: read-only,
    noexec and the atime choice of the mount beneath are carried over, so
    the stage never grants what a plain bind of the directory would not.
    """
    flags = _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV
    for statvfs_bit, mount_bit in _KEPT:
        if statvfs_flags & statvfs_bit:
            flags |= mount_bit
    return flags


def stage_name(owner: str, nonce: str) -> str:
    return f"{owner}@{nonce}"


def stage_owner(name: str) -> str:
    return name.partition("@")[0]


def marker(target: Path) -> str:
    """The name of the file in the bare stage directory, under the mount (pure).

    Named after the stage, so unlinking it where the mount is still in place
    finds nothing of the working directory's.
    """
    return f".egressd-stage-not-mounted-{target.name.partition('@')[2]}"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: str | None, target: Path, flags: int) -> None:
    if _libc.mount(source.encode() if source else None, str(target).encode(), None, flags, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), str(target))


def _umount(target: Path) -> None:
    # MNT_DETACH: a container that still has it mounted keeps its own copy.
    if _libc.umount2(str(target).encode(), _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), str(target))


def stage(workdir: Path, *, owner: str, alive: Callable[[str], bool],
          identity: Callable[[int, int], tuple[int, int]]) -> tuple[Path, tuple[int, int]]:
    """Mount ``workdir`` nosuid,nodev at a new path under ``STAGE_DIR``: (that path, who runs in it).

    ``identity(owner_uid, owner_gid)`` says who the command runs as, or
    raises to refuse the directory (before anything is mounted); ``alive``
    tells whether the owner a stage is named after still runs. OSError when
    the mount cannot be made (not root).
    """
    sweep(alive)
    fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        user = identity(info.st_uid, info.st_gid)
        STAGE_DIR.mkdir(parents=True, exist_ok=True)
        STAGE_DIR.chmod(0o700)
        target = STAGE_DIR / stage_name(owner, secrets.token_hex(6))
        target.mkdir(mode=0o700)
        try:
            (target / marker(target)).touch(mode=0o400)
            _mount(f"/proc/self/fd/{fd}", target, _MS_BIND)
            try:
                _mount(None, target, remount_flags(os.fstatvfs(fd).f_flag))
            except OSError:
                _umount(target)
                raise
        except OSError:
            _remove_directory(target)
            raise
    finally:
        os.close(fd)
    return target, user


def _remove_directory(target: Path) -> None:
    with contextlib.suppress(OSError):
        (target / marker(target)).unlink()
    with contextlib.suppress(OSError):
        target.rmdir()


def unstage(target: Path) -> None:
    """Remove one stage (its mount and its directory); gone already is fine."""
    with contextlib.suppress(OSError):  # EINVAL: not mounted (any more)
        _umount(target)
    _remove_directory(target)


def sweep(alive: Callable[[str], bool]) -> list[Path]:
    """Remove the stages whose owner no longer runs; returns them."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for target in STAGE_DIR.iterdir():
            if not alive(stage_owner(target.name)):
                unstage(target)
                removed.append(target)
    return removed
