"""Copy files the task asked for out of the working directory, safely.

The working directory was written by untrusted code, so a pattern names files
only by safe relative names (no ``..``, no absolute path), matches are
regular files only (no devices, sockets or FIFOs), no link is followed (a
link, or a path through a linked directory, is skipped: it could point
anywhere on the host), and what is copied is bounded in count and bytes.
Everything skipped or cut is reported, never silently dropped.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

MAX_FILES = 1000
MAX_BYTES = 256 * 1024 * 1024


class CopyOutError(ValueError):
    """A --copy-out pattern is not a safe relative pattern."""


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


@dataclass
class CopyReport:
    copied: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    bytes: int = 0

    def lines(self) -> list[str]:
        out = [f"copied {name}" for name in self.copied]
        out += [f"skipped {name}: {why}" for name, why in self.skipped]
        return out


def _walk(root: Path) -> list[str]:
    """Relative names of everything under root, not descending into links."""
    names = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = os.path.relpath(dirpath, root)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            names.append(name if rel == "." else f"{rel}/{name}")
    return sorted(names)


def copy_out(
    workdir: Path, patterns: list[str], dest: Path, *, max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES
) -> CopyReport:
    """Copy the regular files of ``workdir`` matching ``patterns`` to ``dest`` (same relative names)."""
    for pattern in patterns:
        check_pattern(pattern)
    report = CopyReport()
    root_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in _walk(workdir):
            if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            why = _copy_one(root_fd, name, dest, report, max_files, max_bytes)
            if why:
                report.skipped.append((name, why))
    finally:
        os.close(root_fd)
    return report


def _open_beneath(root_fd: int, name: str) -> int:
    """Open ``name`` under root_fd, refusing a link at every step (O_NOFOLLOW per component)."""
    parts = name.split("/")
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)


def _copy_one(root_fd: int, name: str, dest: Path, report: CopyReport, max_files: int, max_bytes: int) -> str | None:
    if len(report.copied) >= max_files:
        return f"more than {max_files} files"
    try:
        fd = _open_beneath(root_fd, name)
    except OSError as exc:
        return "a link (not followed)" if exc.errno in (40, 20) else f"cannot open: {exc.strerror}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if report.bytes + info.st_size > max_bytes:
            return f"over the {max_bytes // (1024 * 1024)} MiB copy-out limit"
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(os.dup(fd), "rb") as src, open(target, "wb") as out:
            copied = 0
            while chunk := src.read(1024 * 1024):
                copied += len(chunk)
                if report.bytes + copied > max_bytes:
                    out.close()
                    target.unlink()
                    return f"over the {max_bytes // (1024 * 1024)} MiB copy-out limit"
                out.write(chunk)
        report.bytes += copied
        report.copied.append(name)
        return None
    finally:
        os.close(fd)
