"""tests/unit is pure logic: every test here fails if it starts a process or opens a network socket.

Those belong in tests/integration/<package>/ (docs/tests.md). Refused: every
way the standard library starts a process (``subprocess.Popen``, which
``subprocess.run`` and asyncio's subprocesses go through; ``os.fork`` and its
kin; a ``multiprocessing`` start) and a socket of any family but AF_UNIX
(asyncio's event loop wakes itself through an AF_UNIX socket pair). A socket
that wraps a descriptor it was given is allowed: it opens nothing. uvloop's
sockets are libuv's own and are not seen here (its subprocesses are, through
asyncio's ``create_subprocess_*``); tests/unit runs on asyncio.
"""

from __future__ import annotations

import asyncio.subprocess
import multiprocessing.process
import os
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

_REAL_SOCKET_INIT = socket.socket.__init__


def _no_process(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("tests/unit starts no process: move this test to tests/integration/<package>/")


def _unix_sockets_only(self: socket.socket, family: int = -1, type: int = -1, proto: int = -1,
                       fileno: int | None = None) -> None:
    if fileno is None and family != socket.AF_UNIX:
        raise RuntimeError("tests/unit opens no network socket: move this test to tests/integration/<package>/")
    _REAL_SOCKET_INIT(self, family, type, proto, fileno)


@pytest.fixture(autouse=True)
def _pure(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _no_process)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _no_process)
    # On uvloop a subprocess is libuv's, not Popen's: refuse it where asyncio's callers ask for it.
    for module in (asyncio, asyncio.subprocess):
        monkeypatch.setattr(module, "create_subprocess_exec", _no_process)
        monkeypatch.setattr(module, "create_subprocess_shell", _no_process)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "spawnv", "spawnve", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _no_process)
    monkeypatch.setattr(socket.socket, "__init__", _unix_sockets_only)
    yield
