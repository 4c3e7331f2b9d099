"""One audit chain written by several processes: the position shared in memory, and the lock.

``egressd serve --workers N`` writes one log from N processes, and the
write-ahead record must still be written before its dial with no round trip
to another process. Each writer takes the lock, reads where the chain stands
(the file's generation, its size and the last line's hash), writes its
batch, stores the new position and lets go: the chain follows write order
across the processes as it does within one.

The memory is a ``memfd`` made by the first writer (``SharedChain.create``)
and handed to the others as an inherited descriptor (``SharedChain.attach``).
The lock is an exclusive ``flock`` on that memfd, taken through a
description of each process's own (an inherited descriptor shares its
description, and with it the lock): the kernel releases it when its holder
dies, so ``kill -9`` of a writer never leaves the others waiting.

A writer marks the position as being written before it writes and stores
the new one after; one killed in between leaves the mark, and the next
writer reads the position back from the file (the torn line ended, the
chain continued from the last line as written), as a sink opening the file
does. No system call is spent on that check while nobody dies. Rotation and
``reopen`` raise the generation, and every writer opens the log anew before
its next batch.

A write that fails in one process (a full disk, a reader of standard output
gone) fails the log for all of them (``failed``): each sink reports itself
unhealthy and refuses egress, as one process's sink does after its own
failure.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from types import TracebackType

__all__ = ["Position", "SharedChain"]

# generation, size, has-prev, prev (64 hex digits), being written; then, apart, failed.
_LAYOUT = struct.Struct("<QQB64sB")
_WRITING = _LAYOUT.size - 1
_FAILED = _LAYOUT.size
_SIZE = _LAYOUT.size + 1


class Position:
    """Where the chain stands: the file's generation, its size and its last line's hash (None: no line yet).

    ``torn``: a writer marked it as being written and never stored what it wrote (it died): the file is the truth.
    """

    __slots__ = ("generation", "prev", "size", "torn")

    def __init__(self, generation: int, size: int, prev: str | None, torn: bool = False) -> None:
        self.generation = generation
        self.size = size
        self.prev = prev
        self.torn = torn


class SharedChain:
    """The position of one audit chain, shared by the processes that write it, behind one lock.

    ``with chain:`` holds the lock; ``read`` and ``store`` are for its
    holder. ``founder`` is True for the process that made the memory: it
    opens the log first and sets the position; the others attach.
    """

    def __init__(self, fd: int, *, founder: bool) -> None:
        self._fd = fd
        self.founder = founder
        self._map = mmap.mmap(fd, _SIZE)

    @classmethod
    def create(cls) -> SharedChain:
        """New shared memory, zeroed (generation 0, size 0, no line yet); inheritable as ``fd``."""
        fd = os.memfd_create("egressd-audit-chain", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _SIZE)
            return cls(fd, founder=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, inherited: int) -> SharedChain:
        """The chain another process made, from the descriptor it passed down; that descriptor is closed.

        Opened again through ``/proc/self/fd`` for a description (and so a
        lock) of this process's own.
        """
        try:
            fd = os.open(f"/proc/self/fd/{inherited}", os.O_RDWR | os.O_CLOEXEC)
        finally:
            os.close(inherited)
        try:
            if os.fstat(fd).st_size != _SIZE:
                raise ValueError(f"descriptor {inherited} is not an audit chain's shared memory")
            return cls(fd, founder=False)
        except BaseException:
            os.close(fd)
            raise

    @property
    def fd(self) -> int:
        """The descriptor to pass down to a process that attaches (``pass_fds``)."""
        return self._fd

    def __enter__(self) -> SharedChain:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self) -> Position:
        """Where the chain stands, marked as being written from now until ``store``."""
        generation, size, has_prev, prev, writing = _LAYOUT.unpack_from(self._map)
        self._map[_WRITING] = 1
        return Position(generation, size, prev.decode("ascii") if has_prev else None, writing != 0)

    def store(self, position: Position) -> None:
        """The new position, no longer being written."""
        prev = position.prev
        _LAYOUT.pack_into(
            self._map, 0, position.generation, position.size, prev is not None, (prev or "").encode("ascii"), 0
        )

    @property
    def failed(self) -> bool:
        """Whether a write of any process failed: a log with a hole in it is not written on by any of them."""
        return self._map[_FAILED] != 0

    def fail(self) -> None:
        """This process's write failed: every process's sink turns unhealthy (egress is refused everywhere)."""
        self._map[_FAILED] = 1

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
