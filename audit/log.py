"""Audit sinks: where records go, and what happens when they cannot.

The proxy writes one record per egress attempt through an ``AuditSink``. A
sink that cannot write raises ``AuditError`` and reports ``healthy == False``
from then on; the proxy refuses new egress while its sink is unhealthy, so
no connection ever goes unrecorded (fail closed).

``JsonlAuditSink`` appends to a JSON Lines file, chains its records (each
carries ``prev``, the SHA-256 of the line before it as written), rotates it
by size and reopens it on request; ``MemoryAuditSink`` keeps records in a
list for tests (unchained: the chain is a property of the file's bytes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
from collections.abc import Mapping
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

__all__ = ["AuditError", "AuditSink", "JsonlAuditSink", "MemoryAuditSink"]

logger = logging.getLogger("egressd.audit")

# Owner read/write only: the log names every host the sandbox tried and
# every command it ran.
_FILE_MODE = 0o600
# O_RDWR rather than O_WRONLY only so opening can read the last line (to end a
# torn one, and to chain onto it); writes all go through O_APPEND. O_NOFOLLOW: the log's own
# name is never followed (a planted link would have our records, or a model's
# text in them, appended to whatever it points at). O_CLOEXEC keeps the
# descriptor out of sandboxes we spawn.
_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


# How much is read at a time when finding and hashing the last line to chain onto.
_CHUNK_BYTES = 64 * 1024

# One encoder for every line: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


class AuditError(Exception):
    """A record could not be written, or the sink could not be opened."""


@runtime_checkable
class AuditSink(Protocol):
    """Where audit records go.

    ``write`` returns only once the record is as durable as the sink
    promises; otherwise it raises ``AuditError`` and the caller must refuse
    the egress it was recording.
    """

    def write(self, record: Mapping[str, object]) -> None:
        """Append one record; raise ``AuditError`` if it was not stored."""
        ...

    @property
    def healthy(self) -> bool:
        """False once a write has failed (or the sink is closed)."""
        ...

    def close(self) -> None:
        """Release the sink; further writes raise ``AuditError``."""
        ...


class JsonlAuditSink:
    """Append records to a JSON Lines file, one ``os.write`` per record, chained.

    Each record is one compact, ASCII-only JSON line written by a single
    ``os.write`` on an ``O_APPEND`` descriptor, so a line is never split by
    another of our lines, and a crash leaves at most one torn last line
    (readers skip it; the next sink opened on the file ends it first).

    Not thread-safe by design: egressd's event loop is the only writer in the
    process. Across processes an exclusive ``flock`` on the file keeps a
    second egressd out (``AuditError``), since two writers would interleave
    their runs of records. Device files such as ``/dev/full`` are accepted
    but not locked.

    The file is opened relative to its directory's descriptor and never
    through a link (DESIGN.md, "Secrets"): a link at its name (including
    ``/dev/stderr``, which is one) and a regular file with a second name (a
    hard link) are refused with ``AuditError``; an existing regular file is
    appended to; a missing one is made with ``O_EXCL``, mode 0600. The
    directories above the last component are the operator's own and are
    resolved as usual.

    The first failed write (``ENOSPC``, ``EIO``, a short write, ...) is
    logged once on the ``egressd.audit`` logger and makes the sink unhealthy
    for good: a log with a hole in it is not trusted to carry on. With
    ``fsync=True`` every write is followed by ``fsync`` (slower; survives a
    machine crash, not only a process crash).

    The chain: every record is written with ``prev`` set to the SHA-256 (hex)
    of the previous line's bytes as written, newline included; the writer
    sets it (a ``prev`` in the record given is replaced), at the moment of
    writing, so the chain follows write order. The first record of a log
    with nothing before it has ``prev: null``. On opening, the chain goes on
    from the file's last line (a torn one included, once ended); an empty
    file goes on from the last line of ``PATH.1`` if there is one, so a log
    moved away while egressd was stopped does not restart the chain.

    Rotation: with ``max_bytes > 0``, a record that would take the file past
    ``max_bytes`` first moves ``PATH`` to ``PATH.1`` (``PATH.1`` to
    ``PATH.2``, ..., dropping what would become ``PATH.{keep+1}``) and opens
    a fresh ``PATH``, so rotation happens between two records and no record
    is split; the fresh file's first ``prev`` is the hash of the moved
    file's last line. A record longer than ``max_bytes`` still goes whole
    into a file of its own. ``reopen()`` (``SIGUSR1``) opens ``PATH`` anew
    after logrotate moved it; records written in between went to the moved
    file, so none is lost.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = False,
        max_bytes: int = 0,
        keep: int = 5,
    ) -> None:
        if max_bytes < 0 or keep < 1:
            raise ValueError("max_bytes must be >= 0 and keep >= 1")
        self._path = os.fspath(path)
        self._fsync = fsync
        self._max_bytes = max_bytes
        self._keep = keep
        self._failure: str | None = None
        self._closed = False
        self._prev: str | None = None
        self._fd, self._size, last = _open_chained(self._path)
        # Only a regular file is rotated: renaming /dev/null or a FIFO would be someone else's business.
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        if last is None and self._size == 0 and self._regular:
            last = _last_line_hash_of(self._path + ".1")
        self._prev = last

    @property
    def prev(self) -> str | None:
        """The ``prev`` the next record will carry."""
        return self._prev

    @property
    def path(self) -> str:
        """The file this sink appends to."""
        return self._path

    @property
    def healthy(self) -> bool:
        """False once a write has failed or the sink is closed."""
        return self._failure is None and not self._closed

    def write(self, record: Mapping[str, object]) -> None:
        """Append ``record`` as one JSON line.

        Raises ``AuditError`` when the sink is closed or unhealthy, when the
        write fails (which makes it unhealthy), or when the record does not
        serialise to JSON (a caller's bug; the sink stays healthy).
        """
        if self._closed:
            raise AuditError(f"audit log {self._path} is closed")
        if self._failure is not None:
            raise AuditError(f"audit log {self._path} failed earlier: {self._failure}")
        try:
            # ensure_ascii: the line cannot hold a raw newline or a byte that
            # fails to encode (lone surrogates from hostile input), and a
            # terminal reading the file sees no raw control characters.
            # allow_nan=False: NaN is not JSON, and strict readers reject it.
            line = _ENCODER.encode(_chained(record, self._prev))
        except (TypeError, ValueError) as exc:
            raise AuditError(f"audit record does not serialise to JSON: {exc}") from exc
        data = line.encode("ascii") + b"\n"
        if self._max_bytes and self._regular and self._size and self._size + len(data) > self._max_bytes:
            self._rotate()
        try:
            written = os.write(self._fd, data)
            if self._fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._fail(exc.strerror or str(exc))
            raise AuditError(f"audit log {self._path} write failed: {self._failure}") from exc
        if written != len(data):
            self._fail(f"short write ({written} of {len(data)} bytes)")
            raise AuditError(f"audit log {self._path} write failed: {self._failure}")
        self._size += written
        self._prev = hashlib.sha256(data).hexdigest()

    def reopen(self) -> None:
        """Open ``PATH`` anew (after logrotate moved it) and go on with the chain there.

        If ``PATH`` is still the file being written, nothing changes. If it
        cannot be opened, the error is logged and records keep going to the
        file already open: a reopen that failed loses nothing.
        """
        if self._closed or self._failure is not None:
            return
        try:
            fd, size, last = _open_chained(self._path, same_as=self._fd)
        except AuditError as exc:
            logger.error("audit log %s not reopened (%s); records still go to the file open before", self._path, exc)
            return
        if fd == self._fd:
            return
        os.close(self._fd)
        self._fd, self._size = fd, size
        if last is not None:  # someone else's records there: chain onto what is actually before ours
            self._prev = last
        logger.info("audit log %s reopened", self._path)

    def close(self) -> None:
        """Close the file and release the lock; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        os.close(self._fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _rotate(self) -> None:
        # Between two records, in the single writer: PATH.{keep-1} -> PATH.{keep}, ..., PATH -> PATH.1.
        # The moves are renames inside the log's directory (a rename never follows the name it moves).
        parent, name = os.path.split(self._path)
        try:
            dir_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for n in range(self._keep - 1, 0, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(f"{name}.{n}", f"{name}.{n + 1}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                os.rename(name, f"{name}.1", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            fd, size, last = _open_chained(self._path)
        except (OSError, AuditError) as exc:
            self._fail(f"rotation failed: {exc}")
            raise AuditError(f"audit log {self._path} write failed: {self._failure}") from exc
        os.close(self._fd)
        self._fd, self._size = fd, size
        if last is not None:
            self._prev = last

    def _fail(self, reason: str) -> None:
        self._failure = reason
        logger.error(
            "audit log %s failed: %s; no further records will be written and egress is refused",
            self._path,
            reason,
        )


def _chained(record: Mapping[str, object], prev: str | None) -> dict[str, object]:
    # prev goes last, so the record's own fields keep their order; one the caller set is replaced.
    chained = {key: value for key, value in record.items() if key != "prev"}
    chained["prev"] = prev
    return chained


def _open_chained(path: str, *, same_as: int | None = None) -> tuple[int, int, str | None]:
    """Open the log for appending: (descriptor, size, SHA-256 of its last line, or None if empty).

    Refuses a file with a second name and one another egressd holds; ends a
    torn last line. With ``same_as``, a ``path`` that is still the file open
    on that descriptor returns ``same_as`` itself (locking it twice would fail).
    """
    fd = _open_log(path)
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
        _lock(fd, path)
        size = _end_torn_line(fd, path, info.st_size)
        return fd, size, _last_line_hash(fd, size, path)
    except BaseException:
        os.close(fd)
        raise


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise AuditError(
            f"another egressd is writing the audit log {path}; give each instance its own --audit-log"
        ) from exc
    except OSError as exc:
        raise AuditError(f"cannot lock audit log {path}: {exc.strerror}") from exc


def _end_torn_line(fd: int, path: str, size: int) -> int:
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


def _last_line_hash(fd: int, size: int, path: str) -> str | None:
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
            begin = max(0, end - _CHUNK_BYTES)
            cut = os.pread(fd, end - begin, begin).rfind(b"\n")
            if cut >= 0:
                start = begin + cut + 1
                break
            end = begin
        digest = hashlib.sha256()
        offset = start
        while offset < size:
            chunk = os.pread(fd, min(_CHUNK_BYTES, size - offset), offset)
            if not chunk:
                raise AuditError(f"audit log {path} shrank while its last record was read")
            digest.update(chunk)
            offset += len(chunk)
    except OSError as exc:
        raise AuditError(f"cannot read the last record of {path}: {exc.strerror}") from exc
    return digest.hexdigest()


def _last_line_hash_of(path: str) -> str | None:
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
        return _last_line_hash(fd, info.st_size, path)
    except (OSError, AuditError):
        return None
    finally:
        os.close(fd)


def _open_log(path: str) -> int:
    """The log's descriptor: ``path`` opened if it exists, else made, its last component never followed."""
    parent, name = os.path.split(path)
    if not name:
        raise AuditError(f"cannot open audit log {path}: it names a directory")
    try:
        dir_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        directory = os.path.dirname(os.path.abspath(path))
        raise AuditError(f"cannot open audit log {path}: directory {directory} does not exist") from None
    except OSError as exc:
        raise AuditError(f"cannot open audit log {path}: {exc.strerror}") from None
    try:
        # Two turns: a file that appears between "not there" and O_EXCL is opened as an existing one.
        for _ in range(2):
            try:
                return os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            try:
                return os.open(name, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, _FILE_MODE, dir_fd=dir_fd)
            except FileExistsError:
                continue
        raise AuditError(f"cannot open audit log {path}: it keeps appearing and disappearing")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AuditError(f"audit log {path} is a link, and the audit log is never opened through one") from None
        raise AuditError(f"cannot open audit log {path}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)


class MemoryAuditSink:
    """Keep records in ``records`` (a list), for tests.

    Each record is copied through JSON, so a record the file sink could not
    serialise fails here too. ``fail_after=N`` stores N records, then fails
    the next write like a full disk: unhealthy, ``AuditError`` from then on.
    """

    def __init__(self, *, fail_after: int | None = None) -> None:
        self.records: list[dict[str, object]] = []
        self._fail_after = fail_after
        self._failed = False
        self._closed = False

    @property
    def healthy(self) -> bool:
        """False once a (simulated) write has failed or the sink is closed."""
        return not self._failed and not self._closed

    def write(self, record: Mapping[str, object]) -> None:
        """Store a JSON copy of ``record``; raise ``AuditError`` like the file sink."""
        if self._closed:
            raise AuditError("memory audit sink is closed")
        if self._failed:
            raise AuditError("memory audit sink failed earlier")
        if self._fail_after is not None and len(self.records) >= self._fail_after:
            self._failed = True
            raise AuditError(f"memory audit sink fails after {self._fail_after} records")
        try:
            copy = json.loads(json.dumps(record, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise AuditError(f"audit record does not serialise to JSON: {exc}") from exc
        self.records.append(copy)

    def close(self) -> None:
        """Refuse further writes; the stored records stay readable."""
        self._closed = True
