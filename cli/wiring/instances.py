"""The running egressd instances of this user: a registry under the state directory.

``egressd pending``, ``allow`` and ``deny`` find the approvals of every
running ``serve``, ``run`` and ``agent`` here (an ``egressd run`` answers on a
temporary unix socket, a Docker run on a port the engine chose), unless
``--control`` names one.

Each instance writes one entry when its control API is up (``register``)
and removes it when it stops (``Registration.remove``): a JSON file
``DIR/PID.RANDOM.json`` with its pid, the start time of that pid (so a pid
reused by another process is not taken for it), its control address, the
path of its token file, its kind, when it started and its task. The token
itself is never in an entry: only the path of a file that ``controltoken``
writes and reads (ours alone, mode 0600). The directory
(``default_state_dir()/instances``) is ours, mode 0700; entries are written
as new files (mode 0600) renamed into place, and read without following a
link, only if they are ours and no one else may read or write them. An entry
whose process is gone (killed before it could remove it) is ignored and
removed by the next reader (``live_instances``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egressd.config.settings import default_state_dir

__all__ = ["Instance", "Registration", "live_instances", "register", "registry_dir"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# An entry is a few hundred bytes; a task is cut to this many characters.
_MAX_ENTRY_BYTES = 64 * 1024
_MAX_TASK = 1000


@dataclass(frozen=True, slots=True)
class Instance:
    """One running egressd as its entry says: where its control API is and where its token file is."""

    pid: int
    control: str
    token_file: str | None
    kind: str
    started: float
    task: str | None

    @property
    def shown(self) -> str:
        """The instance as a person tells it from another: kind, pid, task."""
        task = f": {self.task}" if self.task else ""
        return f"egressd {self.kind} (pid {self.pid}){task}"


def registry_dir() -> Path:
    return default_state_dir() / "instances"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _open_dir(path: Path, *, create: bool) -> int:
    """A descriptor of the registry directory, checked to be ours and closed to others; OSError otherwise."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    fd = os.open(path, _DIR_FLAGS)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise PermissionError(f"{path} is not ours")
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class Registration:
    """An entry this process wrote; ``remove`` takes it (and the token file it wrote, if any) away."""

    path: Path
    own_token_file: Path | None = None

    def remove(self) -> None:
        for path in (self.path, self.own_token_file):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()


def register(*, kind: str, control: str, token_file: Path | None, task: str | None = None) -> Registration:
    """Write this process's entry atomically (a new 0600 file renamed into place); OSError when it cannot be."""
    directory = registry_dir()
    dir_fd = _open_dir(directory, create=True)
    try:
        pid = os.getpid()
        entry = {
            "pid": pid,
            "pid_started": _start_time(pid),
            "control": control,
            "token_file": str(token_file) if token_file is not None else None,
            "kind": kind,
            "started": time.time(),
            "task": task[:_MAX_TASK] if task else None,
        }
        name = f"{pid}.{secrets.token_hex(4)}.json"
        temp = f".{name}.new"
        fd = os.open(temp, _NEW_FILE, 0o600, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o600)
            data = json.dumps(entry).encode()
            if os.write(fd, data) != len(data):
                raise OSError("short write")
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return Registration(directory / name)
    finally:
        os.close(dir_fd)


def _read_entry(dir_fd: int, name: str) -> dict[str, Any] | None:
    """An entry's JSON if it is a regular file of ours that only we may read or write; else None."""
    try:
        fd = os.open(name, _READ_FILE, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            return None
        data = os.read(fd, _MAX_ENTRY_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > _MAX_ENTRY_BYTES:
        return None
    try:
        entry = json.loads(data)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _instance(entry: dict[str, Any]) -> Instance | None:
    pid, control = entry.get("pid"), entry.get("control")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not isinstance(control, str) or not control:
        return None
    token_file, kind, task = entry.get("token_file"), entry.get("kind"), entry.get("task")
    started = entry.get("started")
    return Instance(
        pid=pid,
        control=control,
        token_file=token_file if isinstance(token_file, str) else None,
        kind=kind if isinstance(kind, str) else "?",
        started=float(started) if isinstance(started, int | float) and not isinstance(started, bool) else 0.0,
        task=task if isinstance(task, str) else None,
    )


def live_instances() -> list[Instance]:
    """The instances whose process still runs, oldest first; entries of processes that are gone are removed."""
    try:
        dir_fd = _open_dir(registry_dir(), create=False)
    except OSError:
        return []
    found: list[Instance] = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            if not name.endswith(".json") or name.startswith("."):
                continue
            entry = _read_entry(dir_fd, name)
            instance = _instance(entry) if entry is not None else None
            if instance is None:
                continue
            started = _start_time(instance.pid)
            if started is None or started != entry.get("pid_started"):  # type: ignore[union-attr]
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)  # its process is gone: a stale entry
                continue
            found.append(instance)
    finally:
        os.close(dir_fd)
    return sorted(found, key=lambda i: (i.started, i.pid))


def register_quietly(
    *, kind: str, control: str, token_file: Path | None = None, task: str | None = None, token: str | None = None
) -> Registration | None:
    """``register``, or None with a warning when the registry cannot be written (egressd runs on without it).

    ``token``: a token no file holds yet (a Docker run's own): written to a
    token file of its own beside the entry (``controltoken.write_token_file``),
    removed with it.
    """
    import logging

    from .controltoken import TokenFileError, write_token_file

    own: Path | None = None
    try:
        if token is not None:
            own = registry_dir() / f".{os.getpid()}.{secrets.token_hex(4)}.token"
            os.close(_open_dir(registry_dir(), create=True))
            write_token_file(own, token)
            token_file = own
        registration = register(kind=kind, control=control, token_file=token_file, task=task)
        registration.own_token_file = own
        return registration
    except (OSError, TokenFileError) as exc:
        if own is not None:
            with contextlib.suppress(OSError):
                own.unlink()
        logging.getLogger("egressd").warning(
            "not in the registry of running instances (%s): egressd pending needs --control for this one", exc
        )
        return None
