"""tests/unit is pure logic: a unit test that starts a process or opens a network socket fails.

tests/unit/conftest.py refuses them for every test in the folder; these tests
attack that guard (each attempt would succeed without it) and check that what
pure tests still need keeps working: asyncio's event loop, whose self-pipe is
an AF_UNIX socket pair.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import subprocess
import sys

import pytest


def test_a_subprocess_is_refused() -> None:
    with pytest.raises(RuntimeError, match="tests/unit starts no process"):
        subprocess.run([sys.executable, "-c", "pass"], check=False, timeout=10)


async def test_an_asyncio_subprocess_is_refused() -> None:
    with pytest.raises(RuntimeError, match="tests/unit starts no process"):
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await process.wait()


def test_a_fork_is_refused() -> None:
    with pytest.raises(RuntimeError, match="tests/unit starts no process"):
        pid = os.fork()
        if pid == 0:  # only reached without the guard: the child leaves at once
            os._exit(0)
        os.waitpid(pid, 0)


def test_a_multiprocessing_process_is_refused() -> None:
    process = multiprocessing.get_context("spawn").Process(target=print)
    with pytest.raises(RuntimeError, match="tests/unit starts no process"):
        process.start()
    if process.pid is not None:  # only without the guard
        process.join(10)


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_a_network_socket_is_refused(family: socket.AddressFamily, kind: socket.SocketKind) -> None:
    with pytest.raises(RuntimeError, match="tests/unit opens no network socket"):
        socket.socket(family, kind).close()


def test_a_default_socket_is_refused() -> None:
    with pytest.raises(RuntimeError, match="tests/unit opens no network socket"):
        socket.socket().close()


async def test_an_asyncio_server_is_refused() -> None:
    with pytest.raises(RuntimeError, match="tests/unit opens no network socket"):
        server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
        server.close()  # only without the guard
        await server.wait_closed()


async def test_the_event_loop_and_a_unix_socket_pair_still_work() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"ping")
        assert right.recv(4) == b"ping"
    await asyncio.sleep(0)
    assert await asyncio.get_running_loop().run_in_executor(None, sum, [1, 2]) == 3
