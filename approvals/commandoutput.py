"""A command's output on the terminal the approval prompts are drawn on: escaped, and held back during a prompt.

``egressd run`` relays the sandboxed command's stdout and stderr through a
``TerminalOutput``; the terminal channel (``egressd.approvals.terminal``) holds
it from the moment it shows a prompt and releases it when it has finished
drawing, so no command can hide, move or paint over a prompt.
"""

from __future__ import annotations

import os
import select
from collections import deque

from egressd.names.shown import TerminalText

# A command's output held back while a prompt is shown: far more than a person
# scrolls back through; past it the rest is dropped (and counted) rather than
# letting a command that prints while a person reads grow our memory.
MAX_HELD_OUTPUT = 1024 * 1024


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` whole to ``fd`` (waiting while it is full); if it is gone, drop the rest."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            select.select([], [fd], [])
        except OSError:
            return


class TerminalOutput:
    """A command's output on the terminal the prompts are drawn on: inert, and held back during a prompt.

    ``stream(fd)`` is one of the command's streams (stdout or stderr, ``fd``
    the terminal) in the shape the sandbox's relay takes: ``add(chunk)`` as
    it arrives, ``end()`` once. Its text is escaped (``egressd.names.shown.TerminalText``).
    The terminal channel ``hold``s the output from the moment it shows a
    prompt and ``release``s it when it has finished drawing; what was held is
    then written in the order it came. Past ``max_held`` bytes the rest is
    dropped, and the release says how much.
    """

    def __init__(self, *, max_held: int = MAX_HELD_OUTPUT) -> None:
        self.max_held = max_held
        self.held = False
        self._queue: deque[tuple[int, bytes]] = deque()
        self._queued = 0
        self._dropped: dict[int, int] = {}

    def stream(self, fd: int) -> RelayedStream:
        return RelayedStream(self, fd)

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        while self._queue:
            _write_all(*self._queue.popleft())
        self._queued = 0
        dropped, self._dropped = self._dropped, {}
        for fd, count in dropped.items():
            _write_all(fd, f"\n[egressd: {count} bytes of output were dropped while an approval prompt was shown]\n"
                       .encode())

    def write(self, fd: int, data: bytes) -> None:
        """Write ``data`` (inert text) to ``fd`` now, or on release when held."""
        if not data:
            return
        if not self.held:
            _write_all(fd, data)
            return
        room = self.max_held - self._queued
        kept = data if len(data) <= room else data[:max(room, 0)].decode("utf-8", "ignore").encode()
        if kept:
            self._queue.append((fd, kept))
            self._queued += len(kept)
        if len(kept) < len(data):
            self._dropped[fd] = self._dropped.get(fd, 0) + len(data) - len(kept)


class RelayedStream:
    """One of a command's output streams on its way to the terminal (``TerminalOutput.stream``)."""

    def __init__(self, output: TerminalOutput, fd: int) -> None:
        self.fd = fd
        self._output = output
        self._text = TerminalText()

    def add(self, chunk: bytes) -> None:
        self._output.write(self.fd, self._text.feed(chunk).encode())

    def end(self) -> None:
        self._output.write(self.fd, self._text.end().encode())

