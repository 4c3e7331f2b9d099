"""Tunnel load generator, run in a process of its own (uvloop, raw sockets).

    python bench/load.py throughput --target H:P [--proxy H:P] --direction down|up --bytes N
    python bench/load.py setup      --target H:P [--proxy H:P] --count N --concurrency C
    python bench/load.py idle       --target H:P [--proxy H:P] --count N
    python bench/load.py hold       --target H:P --proxy H:P --count N

Without ``--proxy`` it connects straight to the target (the direct baseline).
Prints one JSON object. Every loop is bounded by its count and by --max-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import sys
import time

BUF = 1024 * 1024


async def open_tunnel(proxy: tuple[str, int] | None, target: tuple[str, int]) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await loop.sock_connect(sock, proxy or target)
    if proxy is not None:
        authority = f"{target[0]}:{target[1]}"
        await loop.sock_sendall(sock, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = await loop.sock_recv(sock, 4096)
            if not data:
                raise ConnectionError("proxy closed during CONNECT")
            head += data
        status_line = head.split(b"\r\n", 1)[0]
        if b" 200 " not in status_line:
            raise ConnectionError(f"CONNECT refused: {status_line!r}")
    return sock


async def throughput(
    proxy: tuple[str, int] | None, target: tuple[str, int], direction: str, nbytes: int
) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    sock = await open_tunnel(proxy, target)
    start = time.perf_counter()
    if direction == "down":
        await loop.sock_sendall(sock, f"down {nbytes}\n".encode())
        buf = bytearray(BUF)
        got = 0
        while got < nbytes:
            n = await loop.sock_recv_into(sock, buf)
            if not n:
                break
            got += n
    else:
        await loop.sock_sendall(sock, f"up {nbytes}\n".encode())
        block = b"\0" * BUF
        sent = 0
        while sent < nbytes:
            chunk = block if nbytes - sent >= BUF else block[: nbytes - sent]
            await loop.sock_sendall(sock, chunk)
            sent += len(chunk)
        reply = await loop.sock_recv(sock, 16)
        got = nbytes if reply.startswith(b"ok") else 0
    seconds = time.perf_counter() - start
    sock.close()
    if got < nbytes:
        raise ConnectionError(f"transferred {got} of {nbytes} bytes")
    return {"seconds": seconds, "mb_s": nbytes / seconds / 1e6}


async def setup(
    proxy: tuple[str, int] | None, target: tuple[str, int], count: int, concurrency: int, max_s: float
) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + max_s
    todo = iter(range(count))
    message = b"x" * 64

    async def worker() -> None:
        nonlocal errors
        for _ in todo:
            if time.perf_counter() > deadline:
                return
            t0 = time.perf_counter()
            try:
                sock = await open_tunnel(proxy, target)
                try:
                    await loop.sock_sendall(sock, b"echo\n" + message)
                    got = b""
                    while len(got) < len(message):
                        data = await loop.sock_recv(sock, 256)
                        if not data:
                            raise ConnectionError("closed before the echo")
                        got += data
                finally:
                    sock.close()
            except OSError:
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    latencies.sort()
    done = len(latencies)
    return {
        "tunnels": done,
        "errors": errors,
        "rate": done / seconds if seconds else 0.0,
        "p50_ms": latencies[done // 2] * 1000 if done else 0.0,
        "p99_ms": latencies[min(done - 1, int(done * 0.99))] * 1000 if done else 0.0,
    }


async def idle(proxy: tuple[str, int] | None, target: tuple[str, int], count: int, max_s: float) -> dict[str, float]:
    """Open ``count`` echo tunnels, say "open" on stdout, wait for a line on stdin, then check each still echoes."""
    loop = asyncio.get_running_loop()
    deadline = time.perf_counter() + max_s
    socks: list[socket.socket] = []
    try:
        sem = asyncio.Semaphore(50)

        async def one() -> None:
            async with sem:
                if time.perf_counter() > deadline:
                    return
                sock = await open_tunnel(proxy, target)
                await loop.sock_sendall(sock, b"echo\n")
                socks.append(sock)

        await asyncio.gather(*(one() for _ in range(count)))
        print("open", len(socks), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        alive = 0
        for sock in socks:
            try:
                await loop.sock_sendall(sock, b"ping")
                got = b""
                async with asyncio.timeout(5):
                    while len(got) < 4:
                        data = await loop.sock_recv(sock, 16)
                        if not data:
                            break
                        got += data
                alive += got == b"ping"
            except (OSError, TimeoutError):
                pass
        return {"opened": len(socks), "alive": alive}
    finally:
        for sock in socks:
            sock.close()


async def hold(proxy: tuple[str, int], count: int, max_s: float) -> dict[str, float]:
    """Send ``count`` CONNECTs to distinct unknown names (each held for approval), say "held", wait for stdin."""
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    deadline = time.perf_counter() + max_s
    try:
        for i in range(count):
            if time.perf_counter() > deadline:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            await loop.sock_connect(sock, proxy)
            await loop.sock_sendall(sock, f"CONNECT h{i}.held.test:443 HTTP/1.1\r\n\r\n".encode())
            socks.append(sock)
        print("held", len(socks), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        answered = 0
        for sock in socks:
            try:
                answered += bool(sock.recv(1))
            except BlockingIOError:
                pass
        return {"sent": len(socks), "answered_while_held": answered}
    finally:
        for sock in socks:
            sock.close()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["throughput", "setup", "idle", "hold"])
    parser.add_argument("--target", required=True, type=_hostport)
    parser.add_argument("--proxy", type=_hostport)
    parser.add_argument("--direction", choices=["down", "up"], default="down")
    parser.add_argument("--bytes", type=int, default=1 << 30)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-s", type=float, default=60.0)
    args = parser.parse_args()

    import uvloop

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def run() -> dict[str, float]:
        async with asyncio.timeout(args.max_s + 30):
            if args.mode == "throughput":
                return await throughput(args.proxy, args.target, args.direction, args.bytes)
            if args.mode == "hold":
                return await hold(args.proxy, args.count, args.max_s)
            if args.mode == "idle":
                return await idle(args.proxy, args.target, args.count, args.max_s)
            return await setup(args.proxy, args.target, args.count, args.concurrency, args.max_s)

    result = uvloop.run(run())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
