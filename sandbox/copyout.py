"""Copy files the task asked for out of the working directory, safely.

The working directory was written by untrusted code, and so may be a
destination that an earlier run used as its working directory. Copy-out
therefore never follows a link on either side (DESIGN.md, "Command line"):

- Source: a pattern names files only by safe relative names (no ``..``, no
  absolute path); the working directory is walked through directory
  descriptors, each step opened relative to the last with ``O_NOFOLLOW``; a
  match is copied only if it is a regular file (no devices, sockets, FIFOs),
  and a link, or anything reached through one, is skipped.
- The destination (``CopyDestination``, shared with the Docker backend): a
  destination inside the working directory, or reached through it, is
  refused (``check_destination``: before the run, and again at copy time);
  the destination's last component and every directory under it are opened
  relative to a directory descriptor with ``O_NOFOLLOW``; a file is written
  to a fresh name made with ``O_EXCL`` and renamed into place within that
  directory, so nothing existing is ever written through or in place, and
  nothing is copied onto itself.
- What is copied is bounded in count and bytes; everything skipped or cut,
  and every pattern that matched nothing, is reported, never silently dropped.

The parts of the destination's path above its last component are the user's
own path and are resolved as usual (so ``/tmp`` being a link still works).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

MAX_FILES = 1000
MAX_BYTES = 256 * 1024 * 1024
# Deeper than any build output; a tree deeper than this is reported, not walked
# (one descriptor is held per level, and an attacker could nest without end).
MAX_DEPTH = 128
# Above PATH_MAX / 2 components no real directory exists: past it, "is this
# inside the working directory?" answers yes (fail closed).
MAX_ANCESTORS = 2048
CHUNK = 1024 * 1024

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_DIR_NOFOLLOW = _DIR | os.O_NOFOLLOW
# A matched name may be a FIFO the command made: O_NONBLOCK keeps open() from
# waiting for a writer (fstat then says it is not a regular file).
_SOURCE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

Identity = tuple[int, int]  # (st_dev, st_ino): what a file is, whatever its name


class CopyOutError(ValueError):
    """A --copy-out pattern or destination is refused; nothing was copied."""


def check_pattern(pattern: str) -> str:
    """Return the pattern if it is a safe relative glob; CopyOutError otherwise (pure)."""
    if not pattern or "\0" in pattern:
        raise CopyOutError(f"bad --copy-out pattern {pattern!r}: empty or NUL")
    path = PurePosixPath(pattern)
    if path.is_absolute():
        raise CopyOutError(f"bad --copy-out pattern {pattern!r}: must be relative to the working directory")
    if any(part == ".." for part in path.parts):
        raise CopyOutError(f"bad --copy-out pattern {pattern!r}: '..' is not allowed")
    return pattern


def unmatched_patterns(patterns: Iterable[str], matched: Iterable[str]) -> list[str]:
    """The patterns no matched name (copied or skipped) fits, in the order given (pure)."""
    names = list(matched)
    return [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in names)]


@dataclass
class CopyReport:
    copied: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # of the copied, those that replaced a file already there
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    unmatched: list[str] = field(default_factory=list)  # patterns that matched nothing
    bytes: int = 0

    def lines(self) -> list[str]:
        replaced = set(self.replaced)
        out = [f"copied {name}" + (" (replaced the file that was there)" if name in replaced else "")
               for name in self.copied]  # fmt: skip
        out += [f"skipped {name}: {why}" for name, why in self.skipped]
        out += [f"nothing matched {pattern!r}" for pattern in self.unmatched]
        return out


def _over_limit(max_bytes: int) -> str:
    return f"over the {max_bytes // (1024 * 1024)} MiB copy-out limit"


# -- the destination -------------------------------------------------------------------


def _identity(info: os.stat_result) -> Identity:
    return info.st_dev, info.st_ino


def _inside(fd: int, root: Identity) -> bool:
    """Whether the directory open at ``fd`` is ``root`` or below it (by walking ``..``, no names)."""
    current = os.dup(fd)
    try:
        for _ in range(MAX_ANCESTORS):
            here = os.fstat(current)
            if _identity(here) == root:
                return True
            parent = os.open("..", _DIR, dir_fd=current)
            if _identity(os.fstat(parent)) == _identity(here):  # "/" is its own parent
                os.close(parent)
                return False
            os.close(current)
            current = parent
        return True
    finally:
        os.close(current)


def _is_link(name: str, dir_fd: int) -> bool:
    # O_NOFOLLOW | O_DIRECTORY on a link fails with ENOTDIR (the link is not a
    # directory), not ELOOP: look at the entry itself to say which it was.
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _prefixes(path: Path) -> Iterator[str]:
    """Each leading part of ``path`` as written (not normalised: ``a/link/..`` passes through ``a/link``)."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    parts = text.split("/")
    for i in range(2, len(parts) + 1):
        prefix = "/".join(parts[:i])
        if prefix and not prefix.endswith("/"):
            yield prefix


def check_destination(dest: Path, workdir: Path | None) -> None:
    """Refuse a destination the command could have planted links in; CopyOutError says why.

    1. ``dest`` itself must not be a link (it is opened without following one);
    2. no leading part of ``dest`` as written (``work/x/..`` passes through
       ``work/x``) may be ``workdir`` or lie inside it, whatever links or bind
       mounts lead there: compared by device and inode, walking ``..`` up.

    Called before the run starts (the CLI) and again when the destination is
    opened; ``workdir`` None (a fresh one, not made yet) checks only 1.
    """
    if dest.is_symlink():
        raise CopyOutError(f"the destination {dest} is a link, and copy-out never follows one")
    if workdir is None:
        return
    try:
        root = _identity(os.stat(workdir))
    except FileNotFoundError:
        return  # nothing is inside it, and no run starts without it (the session says so)
    except OSError as exc:
        raise CopyOutError(f"cannot look at the working directory {workdir}: {exc.strerror}") from None
    for prefix in _prefixes(dest):
        try:
            fd = os.open(prefix, _DIR)
        except OSError:
            break  # missing (made under the last existing part, already checked) or not a directory
        try:
            if _inside(fd, root):
                raise CopyOutError(
                    f"the destination {dest} is inside the working directory {workdir}, "
                    "where the command could plant links"
                )
        finally:
            os.close(fd)


class Source(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class CopyDestination:
    """The copy-out destination, written only relative to directory descriptors, never through a link.

    Open it with ``CopyDestination.open`` (a context manager closes it).
    ``write(name, source, ...)`` puts one file at a safe relative name:

    1. each directory on the way is made (``mkdirat``) if missing and opened
       relative to its parent with ``O_NOFOLLOW | O_DIRECTORY``: a link, a
       non-directory or the working directory itself stops the write;
    2. what already has the name is looked at without following it: a
       regular file is replaced, the source file itself is left as it is
       (never copied onto itself), anything else (a link, a directory) is
       left alone;
    3. the data go to a fresh name made with ``O_EXCL | O_NOFOLLOW`` in that
       directory, renamed over the name within the same directory only when
       complete: an existing file is replaced whole, never truncated or
       written in place (another hard link to it keeps the old contents).

    A refused write is a reason (str), recorded by the caller; a done one is
    recorded in the report here (it needs the report's byte count anyway).
    """

    def __init__(self, fd: int, workdir: Identity) -> None:
        self.fd = fd
        self.workdir = workdir

    @classmethod
    def open(cls, dest: Path, *, workdir: Path) -> CopyDestination:
        """Make (if missing) and open ``dest``; CopyOutError if it is a link or inside ``workdir``."""
        check_destination(dest, workdir)
        workdir_id = _identity(os.stat(workdir))
        parent, base = dest.parent, dest.name
        try:
            if base in ("", ".", ".."):  # never a link; the path as the user wrote it
                fd = os.open(dest, _DIR)
            else:
                os.makedirs(parent, exist_ok=True)
                parent_fd = os.open(parent, _DIR)
                try:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(base, dir_fd=parent_fd)
                    fd = os.open(base, _DIR_NOFOLLOW, dir_fd=parent_fd)
                finally:
                    os.close(parent_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and dest.is_symlink()):
                raise CopyOutError(f"the destination {dest} is a link, and copy-out never follows one") from None
            raise CopyOutError(f"cannot open the destination {dest}: {exc.strerror}") from None
        if _inside(fd, workdir_id):  # the path changed under us since check_destination: still refused
            os.close(fd)
            raise CopyOutError(f"the destination {dest} is inside the working directory {workdir}")
        return cls(fd, workdir_id)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> CopyDestination:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(
        self, name: str, source: Source, *, report: CopyReport, max_bytes: int, identity: Identity | None = None
    ) -> str | None:
        """Write ``source`` to ``name`` (a checked relative name); None when done, else why not.

        ``identity`` is the source file's (device, inode), when it has one.
        """
        parts = name.split("/")
        directory = os.dup(self.fd)
        try:
            for i, part in enumerate(parts[:-1]):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=directory)
                where = "/".join(parts[: i + 1])
                try:
                    inner = os.open(part, _DIR_NOFOLLOW, dir_fd=directory)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, directory):
                        return f"the destination has a link at {where} (not followed)"
                    if exc.errno == errno.ENOTDIR:
                        return f"the destination has a file at {where}, not a directory (left alone)"
                    return f"cannot open the destination's {where}: {exc.strerror}"
                os.close(directory)
                directory = inner
                if _identity(os.fstat(directory)) == self.workdir:
                    return f"the destination has the working directory at {where} (not written to)"
            return self._write_file(directory, name, parts[-1], source, report, max_bytes, identity)
        except OSError as exc:
            return f"cannot write: {exc.strerror}"
        finally:
            os.close(directory)

    @staticmethod
    def _write_file(
        directory: int,
        name: str,
        base: str,
        source: Source,
        report: CopyReport,
        max_bytes: int,
        identity: Identity | None,
    ) -> str | None:
        try:
            there = os.stat(base, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            there = None
        if there is not None:
            if stat.S_ISLNK(there.st_mode):
                return "the destination has a link there (left alone)"
            if not stat.S_ISREG(there.st_mode):
                return "the destination has something other than a file there (left alone)"
            if identity is not None and _identity(there) == identity:
                return "it is the source file itself"
        temp = f".egressd-copy-{secrets.token_hex(8)}"
        fd = os.open(temp, _NEW_FILE, 0o666, dir_fd=directory)
        done = False
        try:
            with os.fdopen(fd, "wb") as out:
                copied = 0
                while chunk := source.read(CHUNK):
                    copied += len(chunk)
                    if report.bytes + copied > max_bytes:
                        return _over_limit(max_bytes)
                    out.write(chunk)
            os.rename(temp, base, src_dir_fd=directory, dst_dir_fd=directory)
            done = True
        finally:
            if not done:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=directory)
        report.bytes += copied
        report.copied.append(name)
        if there is not None:
            report.replaced.append(name)
        return None


# -- the bubblewrap backend: the working directory is on this host ---------------------------


def copy_out(
    workdir: Path, patterns: list[str], dest: Path, *, max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES
) -> CopyReport:
    """Copy the regular files of ``workdir`` matching ``patterns`` to ``dest`` (same relative names).

    CopyOutError (nothing copied) for a bad pattern or a refused destination.
    """
    for pattern in patterns:
        check_pattern(pattern)
    report = CopyReport()
    matched: list[str] = []
    try:
        root_fd = os.open(workdir, _DIR_NOFOLLOW)
    except OSError as exc:
        raise CopyOutError(f"cannot open the working directory {workdir}: {exc.strerror}") from None
    try:
        with CopyDestination.open(dest, workdir=workdir) as out:
            for name, directory, kind in _walk(root_fd):
                if kind == "deep":
                    report.skipped.append((name, f"deeper than {MAX_DEPTH} directories (not walked)"))
                    continue
                if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    continue
                matched.append(name)
                why = _copy_one(directory, name, out, report, max_files, max_bytes)
                if why:
                    report.skipped.append((name, why))
    finally:
        os.close(root_fd)
    report.unmatched = unmatched_patterns(patterns, matched)
    return report


def _walk(root_fd: int) -> Iterator[tuple[str, int, str]]:
    """(relative name, descriptor of its directory, kind) for everything under root_fd but directories.

    Depth first, names sorted within a directory; a directory is entered by
    opening it relative to its parent with O_NOFOLLOW, so a link (or a
    directory swapped for one) is a name reported here, never walked.
    ``kind`` is ``entry``, or ``deep`` for a directory past MAX_DEPTH.
    """
    stack: list[tuple[str, int, Iterator[os.DirEntry[str]]]] = []

    def enter(prefix: str, fd: int) -> None:
        with os.scandir(fd) as listing:
            entries = sorted(listing, key=lambda e: e.name)
        stack.append((prefix, fd, iter(entries)))

    enter("", os.dup(root_fd))
    try:
        while stack:
            prefix, fd, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                os.close(fd)
                stack.pop()
                continue
            name = f"{prefix}{entry.name}"
            if not entry.is_dir(follow_symlinks=False):
                yield name, fd, "entry"
                continue
            if len(stack) > MAX_DEPTH:
                yield name, fd, "deep"
                continue
            try:
                inner = os.open(entry.name, _DIR_NOFOLLOW, dir_fd=fd)
            except OSError:
                yield name, fd, "entry"  # swapped for a link or a file since listed: _copy_one says which
                continue
            enter(f"{name}/", inner)
    finally:
        for _, fd, _ in stack:
            os.close(fd)


def _copy_one(
    directory: int, name: str, out: CopyDestination, report: CopyReport, max_files: int, max_bytes: int
) -> str | None:
    if len(report.copied) >= max_files:
        return f"more than {max_files} files"
    try:
        fd = os.open(name.rsplit("/", 1)[-1], _SOURCE, dir_fd=directory)
    except OSError as exc:
        return "a link (not followed)" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else f"cannot open: {exc.strerror}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if report.bytes + info.st_size > max_bytes:
            return _over_limit(max_bytes)
        with os.fdopen(os.dup(fd), "rb") as source:
            return out.write(name, source, report=report, max_bytes=max_bytes, identity=_identity(info))
    finally:
        os.close(fd)
