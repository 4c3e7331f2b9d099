"""Opening the files egressd reads or writes with authority, so nobody else can have chosen their contents.

DESIGN.md, "Policy": files that shape policy or hold secrets (config, allow
file, audit log, transcript, token files) are opened without following links
and checked on the open descriptor: a regular file of the invoking user or
root, not writable by others. Whoever could write such a file (a sandboxed
command, another local user) could otherwise rewrite the policy of every
later run, or read its secrets.

How, so a check and the open see the same file:

1. ``open_directory`` walks the path's directories one at a time from ``/``
   (or the current directory for a relative path), each opened relative to
   the last with ``O_DIRECTORY | O_NOFOLLOW``: a link anywhere on the way is
   refused, not followed (the message gives the real path to name instead);
2. the file itself is opened relative to that directory with ``O_NOFOLLOW``
   and ``O_NONBLOCK`` (a FIFO at the name opens at once instead of waiting
   for a writer), or made there with ``O_CREAT | O_EXCL``, mode 0600;
3. ``check_descriptor`` then looks at the descriptor: a regular file, owned by
   us (the effective uid) or root, not writable by its group or others (and
   for a secret, not readable by them either).

Every refusal is ``UntrustedFile``, whose message names the path, says what is
wrong and how to fix it; callers put the setting's name in front.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

__all__ = ["UntrustedFile", "check_descriptor", "open_directory", "open_trusted", "read_trusted"]

# O_PATH (Linux): a directory we may search but not list (mode 0711) is walked through as
# the kernel's own lookup would; the descriptor serves only as the next lookup's start.
_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO opens without waiting for a writer (check_descriptor then refuses it);
# O_NOCTTY: a terminal named by mistake does not become ours.
_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# A config or allow file is a page of text; anything much larger is the wrong file.
MAX_TRUSTED_BYTES = 16 * 1024 * 1024


class UntrustedFile(Exception):
    """A file egressd would take with authority is not one it can trust; the message says why and what to do."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _link_refusal(path: str | os.PathLike[str], where: str) -> UntrustedFile:
    real = os.path.realpath(path)
    return UntrustedFile(
        f"{os.fspath(path)}: {where} is a link, and egressd never follows one to this file: "
        f"name it by its real path ({real}) or move it"
    )


def open_directory(path: str | os.PathLike[str], *, for_file: str | os.PathLike[str] | None = None) -> int:
    """The directory ``path`` names, opened with no link followed on the way; UntrustedFile otherwise.

    Absolute paths are walked from ``/``, relative ones from the current
    directory (the operator's own, however it was reached). ``for_file``: the
    file it is opened for, which the messages name.
    """
    text = os.fspath(path)
    shown = os.fspath(for_file) if for_file is not None else text
    fd = os.open("/" if text.startswith("/") else ".", _DIR & ~os.O_NOFOLLOW)
    walked = "/" if text.startswith("/") else ""
    try:
        for part in text.split("/"):
            if part in ("", "."):
                continue
            walked = os.path.join(walked, part)
            try:
                inner = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                    raise _link_refusal(shown, walked) from None
                if exc.errno == errno.ENOTDIR:
                    raise UntrustedFile(f"{shown}: {walked} is not a directory") from None
                if exc.errno == errno.ENOENT:
                    raise FileNotFoundError(errno.ENOENT, f"{walked} does not exist", shown) from None
                raise UntrustedFile(f"{shown}: cannot open {walked}: {exc.strerror}") from None
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def check_descriptor(
    fd: int, path: str | os.PathLike[str], *, secret: bool = False, euid: int | None = None
) -> os.stat_result:
    """Refuse (UntrustedFile) what ``fd`` is unless a regular file of ours or root's that only they may change.

    ``secret``: nobody else may read it either. ``euid``: who "ours" is (default:
    our effective uid). Returns the descriptor's stat.
    """
    info = os.fstat(fd)
    shown = os.fspath(path)
    if not stat.S_ISREG(info.st_mode):
        raise UntrustedFile(f"{shown} is {_kind(info.st_mode)}, not a regular file: name a file")
    if euid is None:
        euid = os.geteuid()
    if info.st_uid not in (euid, 0):
        raise UntrustedFile(
            f"{shown} belongs to uid {info.st_uid}, not to uid {euid} (us) or root, so that user could change it: "
            f"chown it to {euid} or root"
        )
    mode = stat.S_IMODE(info.st_mode)
    if secret and mode & 0o077:
        raise UntrustedFile(f"{shown} has mode {mode:04o}, so other users may read or change it: chmod 600 {shown}")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedFile(f"{shown} has mode {mode:04o}, so other users may change it: chmod go-w {shown}")
    return info


def open_trusted(
    path: str | os.PathLike[str],
    *,
    flags: int = os.O_RDONLY,
    create: bool = False,
    secret: bool = False,
    euid: int | None = None,
) -> int:
    """``path`` opened (``flags``: O_RDONLY, or O_RDWR/O_WRONLY with O_APPEND) and checked; UntrustedFile if not.

    ``create``: a missing file is made (``O_CREAT | O_EXCL``, mode 0600);
    otherwise FileNotFoundError is raised as it is, for the caller to say what
    a missing file means. The descriptor is the caller's to close.
    """
    text = os.fspath(path)
    parent, name = os.path.split(text)
    if name in ("", ".", ".."):
        raise UntrustedFile(f"{text} names a directory: name a file")
    dir_fd = open_directory(parent or ".", for_file=text)
    try:
        fd = _open_in(dir_fd, name, text, flags | _FILE, create)
    finally:
        os.close(dir_fd)
    try:
        check_descriptor(fd, text, secret=secret, euid=euid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_in(dir_fd: int, name: str, shown: str, flags: int, create: bool) -> int:
    try:
        # Two turns: a file that appears between "not there" and O_EXCL is opened as an existing one.
        for _ in range(2):
            try:
                return os.open(name, flags, dir_fd=dir_fd)
            except FileNotFoundError:
                if not create:
                    raise
            with contextlib.suppress(FileExistsError):
                return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
        raise UntrustedFile(f"{shown} keeps appearing and disappearing")
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(name, dir_fd)):
            raise _link_refusal(shown, shown) from None
        raise UntrustedFile(f"cannot open {shown}: {exc.strerror}") from None


def read_trusted(
    path: str | os.PathLike[str], *, secret: bool = False, limit: int = MAX_TRUSTED_BYTES, euid: int | None = None
) -> bytes:
    """The bytes of the file at ``path``, opened and checked by ``open_trusted``; FileNotFoundError if missing."""
    fd = open_trusted(path, secret=secret, euid=euid)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise UntrustedFile(f"{path} is larger than {limit} bytes: not the file egressd expects here")
    return data
