"""The audit log's file: opened without following a link, locked, its torn last line ended, its last line read back.

What ``JsonlAuditSink`` (``egressd.audit.log``) needs of the file under it,
apart from writing: the checked open (DESIGN.md, "Secrets"), the ``flock``
that keeps a second egressd out, and the chain's starting point (the hash
of the last line as written). Standard output is taken here too.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat

from egressd.config.trusted import UntrustedFile, check_descriptor, open_directory

logger = logging.getLogger("egressd.audit")

# Owner read/write only: the log names every host the sandbox tried and
# every command it ran.
FILE_MODE = 0o600
# O_RDWR rather than O_WRONLY only so opening can read the last line (to end a
# torn one, and to chain onto it); writes all go through O_APPEND. O_NOFOLLOW: the log's own
# name is never followed (a planted link would have our records, or a model's
# text in them, appended to whatever it points at). O_CLOEXEC keeps the
# descriptor out of sandboxes we spawn.
# A FIFO at the name opens at once even so (O_RDWR never waits for the other end on Linux) and is then refused.
OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


# How much is read at a time when finding and hashing the last line to chain onto.
CHUNK_BYTES = 64 * 1024


class AuditError(Exception):
    """A record could not be written, or the sink could not be opened."""


def take_stdout() -> int:
    """A private, blocking, close-on-exec duplicate of descriptor 1; descriptor 1 then points at stderr.

    The audit records are then the only bytes written to what was standard
    output: a ``print``, a library's warning or a child's output goes to
    standard error instead.
    """
    try:
        fd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    except OSError as exc:
        raise AuditError(f"cannot write the audit log to standard output: {exc.strerror}") from None
    try:
        # A line is written whole or the sink fails: never EAGAIN halfway through a batch.
        os.set_blocking(fd, True)
        os.dup2(2, 1)
    except OSError as exc:
        os.close(fd)
        raise AuditError(f"cannot write the audit log to standard output: {exc.strerror}") from None
    return fd


def open_chained(path: str, *, same_as: int | None = None, joining: bool = False) -> tuple[int, int, str | None]:
    """Open the log for appending: (descriptor, size, SHA-256 of its last line, or None if empty).

    Refuses a file with a second name and one another egressd holds; ends a
    torn last line. With ``same_as``, a ``path`` that is still the file open
    on that descriptor returns ``same_as`` itself (locking it twice would fail).
    ``joining``: a process of an egressd whose founder holds the file (a
    shared lock, which that founder's exclusive one would have refused).
    """
    fd = open_log(path)
    try:
        info = os.fstat(fd)
        if same_as is not None:
            old = os.fstat(same_as)
            if (info.st_dev, info.st_ino) == (old.st_dev, old.st_ino):
                os.close(fd)
                return same_as, info.st_size, None
        if not stat.S_ISREG(info.st_mode):
            return fd, 0, None  # /dev/full and the like: nothing to chain onto
        if info.st_nlink > 1:
            # Another name for the same file may be anyone's file (a hard link made to it).
            raise AuditError(f"audit log {path} has more than one name (a hard link); not appended to")
        lock(fd, path, joining)
        size = end_torn_line(fd, path, info.st_size)
        return fd, size, last_line_hash(fd, size, path)
    except BaseException:
        os.close(fd)
        raise


def lock(fd: int, path: str, joining: bool) -> None:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if joining else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise AuditError(
            f"another egressd is writing the audit log {path}; give each instance its own --audit-log"
        ) from exc
    except OSError as exc:
        raise AuditError(f"cannot lock audit log {path}: {exc.strerror}") from exc


def end_torn_line(fd: int, path: str, size: int) -> int:
    # A crash mid-write can leave a last line without its newline; our
    # first record would then be glued onto it and lost to readers.
    if size == 0:
        return 0
    try:
        last = os.pread(fd, 1, size - 1)
        if last != b"\n":
            logger.warning("audit log %s ended in a torn line; ending it", path)
            if os.write(fd, b"\n") != 1:
                raise AuditError(f"cannot end the torn last line of {path}")
            return size + 1
    except OSError as exc:
        raise AuditError(f"cannot prepare audit log {path}: {exc.strerror}") from exc
    return size


def last_line_hash(fd: int, size: int, path: str) -> str | None:
    """SHA-256 (hex) of the last line (newline included) of a file that ends in one; None if empty.

    Reads back from the end a chunk at a time to the newline before it, then
    hashes forward, so no line is too long to chain onto.
    """
    if size == 0:
        return None
    try:
        start = 0
        end = size - 1  # the last line's own newline is not its start
        while end > 0:
            begin = max(0, end - CHUNK_BYTES)
            cut = os.pread(fd, end - begin, begin).rfind(b"\n")
            if cut >= 0:
                start = begin + cut + 1
                break
            end = begin
        digest = hashlib.sha256()
        offset = start
        while offset < size:
            chunk = os.pread(fd, min(CHUNK_BYTES, size - offset), offset)
            if not chunk:
                raise AuditError(f"audit log {path} shrank while its last record was read")
            digest.update(chunk)
            offset += len(chunk)
    except OSError as exc:
        raise AuditError(f"cannot read the last record of {path}: {exc.strerror}") from exc
    return digest.hexdigest()


def last_line_hash_of(path: str) -> str | None:
    """The last line's hash of a rotated log (``PATH.1``), if it is a regular file that ends in a newline."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            return None
        if os.pread(fd, 1, info.st_size - 1) != b"\n":
            return None  # a torn tail: its chain cannot be continued honestly; start afresh
        return last_line_hash(fd, info.st_size, path)
    except (OSError, AuditError):
        return None
    finally:
        os.close(fd)


def open_log(path: str) -> int:
    """The log's descriptor: ``path`` opened if it exists, else made; no link followed, on the way or at the name.

    A regular file must be ours or root's and not writable by anyone else
    (``egressd.config.trusted.check_descriptor``): the log is evidence, and
    ``egressd audit suggest`` turns it into allowlists. A character device
    (``/dev/full``, ``/dev/null``) is taken as it is; anything else (a FIFO,
    a socket, a directory) is refused.
    """
    parent, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise AuditError(f"cannot open audit log {path}: it names a directory")
    try:
        dir_fd = open_directory(parent or ".", for_file=path)
    except FileNotFoundError:
        directory = os.path.dirname(os.path.abspath(path))
        raise AuditError(f"cannot open audit log {path}: directory {directory} does not exist") from None
    except UntrustedFile as exc:
        raise AuditError(f"audit log {exc}") from None
    try:
        fd = open_in(dir_fd, name, path)
    finally:
        os.close(dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISCHR(mode):
            check_descriptor(fd, path)
    except UntrustedFile as exc:
        os.close(fd)
        raise AuditError(f"audit log {exc}") from None
    return fd


def open_in(dir_fd: int, name: str, path: str) -> int:
    try:
        # Two turns: a file that appears between "not there" and O_EXCL is opened as an existing one.
        for _ in range(2):
            try:
                return os.open(name, OPEN_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            try:
                return os.open(name, OPEN_FLAGS | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=dir_fd)
            except FileExistsError:
                continue
        raise AuditError(f"cannot open audit log {path}: it keeps appearing and disappearing")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AuditError(f"audit log {path} is a link, and the audit log is never opened through one") from None
        raise AuditError(f"cannot open audit log {path}: {exc.strerror}") from None
