"""What every sandbox backend is and gives: the ``Sandbox`` protocol and its vocabulary.

Two backends implement it: bubblewrap in a network namespace
(``launcher.BwrapSandbox``) and a container per command on a Docker Engine
(``docker.commands.DockerSandbox``). ``egressd run`` and ``egressd agent``
use only what is here, whichever made the sandbox, and one conformance
suite (tests/conformance) holds both to it: a command's exit code and
output, the time limit (exit 124) and the memory limit (exit 137), output
cut at ``max_output``, a working directory that persists between commands
(and a /tmp that does not), and copy-out's rules.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from egressd.audit.views import Refusal

from .copyout import CopyReport
from .limits import Limits

EXIT_TIMEOUT = 124
EXIT_CANNOT_START = 125
EXIT_NOT_FOUND = 127  # the shell's "command not found"
EXIT_MEMORY = 137
# Captured output beyond this is cut (with a marker): an observation for a model
# has to fit in its context, and a runaway command must not fill our memory.
DEFAULT_MAX_OUTPUT = 64 * 1024
# run()'s default: no time or memory limit, DEFAULT_MAX_PIDS processes.
NO_LIMITS = Limits()


def not_found_line(name: str) -> str:
    """The one line both backends print (on the command's stderr) for a command the sandbox does not have."""
    return f"egressd: {name}: command not found in the sandbox\n"


class SandboxError(Exception):
    """The sandbox could not be created or the command could not be started."""


@dataclass
class Observation:
    """What one command did, as the agent runner reports it."""

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    memory_exceeded: bool = False
    pids_exhausted: bool = False  # a process could not be started at the process limit (bubblewrap's cgroup)
    duration_s: float = 0.0
    stdout_truncated: int = 0
    stderr_truncated: int = 0
    egress_refusals: list[Refusal] = field(default_factory=list)


class BoundedOutput:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            text += f"\n[… {self.dropped} more bytes truncated]"
        return text


async def within_time_limit(
    work: asyncio.Future[Any], timeout_s: float | None, kill: Callable[[], Awaitable[None]], *, grace_s: float
) -> bool:
    """Wait for ``work`` (a command's run to its end) for ``timeout_s``; True when the time limit fired.

    Past the limit: ``kill`` the command, then give ``work`` ``grace_s`` to
    collect what is left (its output, its status) before it is cancelled.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(work)
        return False
    except TimeoutError:
        pass
    await kill()
    try:
        async with asyncio.timeout(grace_s):
            await asyncio.shield(work)
    except TimeoutError:
        work.cancel()
    return True


def ended(status: int | None, *, timed_out: bool, oom_killed: bool) -> tuple[int, bool, bool]:
    """(exit code, timed_out, memory_exceeded) for a finished command: the one reason both backends give.

    ``status``: the command's status as its backend saw it: a process's
    return code (negative: killed by that signal), a container's ExitCode,
    or None when it was never seen to end. ``timed_out``: the time limit
    killed it; ``oom_killed``: the memory limit killed something of it
    (the cgroup's oom_kill count, Docker's OOMKilled). At most one reason
    is given, the limit that ended the command: the time limit, once it
    fired, whatever the memory limit killed before (a child), then the
    memory limit; otherwise the command's own status and neither flag.
    """
    if timed_out:
        return EXIT_TIMEOUT, True, False
    if oom_killed:
        return EXIT_MEMORY, False, True
    if status is None:  # never seen to end: it was killed
        return 128 + signal.SIGKILL, False, False
    return (128 - status if status < 0 else status), False, False  # a signal: the shell's 128 + N


def observation(
    status: int | None,
    *,
    timed_out: bool,
    oom_killed: bool,
    out: BoundedOutput | None,
    err: BoundedOutput | None,
    duration_s: float,
    pids_exhausted: bool = False,
) -> Observation:
    """The ``Observation`` of a finished command (``ended``); ``out``/``err`` None: passed on, not kept."""
    code, timed_out, memory_exceeded = ended(status, timed_out=timed_out, oom_killed=oom_killed)
    return Observation(
        exit_code=code,
        stdout=out.text() if out is not None else "",
        stderr=err.text() if err is not None else "",
        timed_out=timed_out,
        memory_exceeded=memory_exceeded,
        pids_exhausted=pids_exhausted,
        duration_s=duration_s,
        stdout_truncated=out.dropped if out is not None else 0,
        stderr_truncated=err.dropped if err is not None else 0,
    )


class OutputSink(Protocol):
    """Where ``relay=`` passes one of a command's streams: each chunk as it arrives, then its end.

    ``FdOutput`` writes the bytes as they are; a terminal gets a sink from
    cli that makes them inert first (``egressd.approvals.terminal.TerminalOutput``).
    """

    def add(self, chunk: bytes) -> None: ...

    def end(self) -> None: ...


class FdOutput:
    """An ``OutputSink`` that writes the bytes as they are to one of our descriptors (a file, a pipe)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def add(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                select.select([], [self.fd], [])
            except OSError:  # our own output is gone (closed pipe): drop, keep draining
                return

    def end(self) -> None:
        pass


@runtime_checkable
class Sandbox(Protocol):
    """A working directory, an environment and a network whose only way out is egressd."""

    async def run(
        self,
        command: Sequence[str],
        *,
        limits: Limits = NO_LIMITS,
        capture: bool = True,
        max_output: int = DEFAULT_MAX_OUTPUT,
        stdin: int | None = None,
        relay: tuple[OutputSink, OutputSink] | None = None,
    ) -> Observation:
        """Run one command to completion (or its limits); raise ``SandboxError`` if it cannot start.

        ``capture=False`` passes stdout and stderr on as they come (to
        ``relay``'s sinks, else to ours); ``stdin``: a descriptor to read, or
        /dev/null.
        """
        ...

    async def copy_out(self, patterns: list[str], dest: Path) -> CopyReport:
        """Copy the working directory's regular files matching ``patterns`` to ``dest`` (``copyout``'s rules)."""
        ...

    async def destroy(self) -> None:
        """Remove what the sandbox made (idempotent); its network is its creator's."""
        ...
