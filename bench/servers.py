"""Benchmark test servers, run in a process of their own on uvloop so they are
never the bottleneck.

- the *stream* server speaks a one-line protocol: ``down N\\n`` → it sends N
  bytes and closes; ``up N\\n`` → it reads N bytes, answers ``ok\\n``;
  ``echo\\n`` → it echoes everything until EOF;
- the *http* server answers every keep-alive request at once: ``/small`` with
  a 13-byte body, ``/big`` with 1 MiB, ``/hook`` (a webhook receiver that
  answers later, i.e. never) with 202; a request with ``Connection: close``
  is answered with ``Connection: close`` and the connection closed. Heads
  are found with one ``find`` per request; no framework, so its cost is a
  few microseconds per request.

Usage: ``python bench/servers.py HOST STREAM_PORT HTTP_PORT`` (prints "ready").
"""

from __future__ import annotations

import asyncio
import sys

CHUNK = 1024 * 1024
PAYLOAD = b"\0" * CHUNK
SMALL = b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\nContent-Type: text/plain\r\n\r\nhello, world\n"
# A webhook receiver that will answer later (and never does): approvals stay held.
HOOK = b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n"
BIG = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: application/octet-stream\r\n\r\n" % CHUNK + PAYLOAD


class Stream(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""
        self.mode = ""
        self.left = 0
        self.paused: asyncio.Future[None] | None = None
        self.transport.set_write_buffer_limits(high=4 * CHUNK)

    def pause_writing(self) -> None:
        self.paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)
        self.paused = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()

    def data_received(self, data: bytes) -> None:
        if self.mode == "echo":
            self.transport.write(data)
            return
        if self.mode == "up":
            self.left -= len(data)
            if self.left <= 0:
                self.transport.write(b"ok\n")
                self.transport.close()
            return
        self.buf += data
        if b"\n" not in self.buf:
            return
        line, _, rest = self.buf.partition(b"\n")
        command, _, number = line.decode().partition(" ")
        if command == "echo":
            self.mode = "echo"
            if rest:
                self.transport.write(rest)
        elif command == "up":
            self.mode = "up"
            self.left = int(number)
            if rest:
                self.data_received(rest)
        elif command == "down":
            self.mode = "down"
            asyncio.get_running_loop().create_task(self._send(int(number)))

    async def _send(self, n: int) -> None:
        while n > 0 and not self.transport.is_closing():
            chunk = PAYLOAD if n >= CHUNK else PAYLOAD[:n]
            self.transport.write(chunk)
            n -= len(chunk)
            if self.paused is not None:
                await self.paused
        self.transport.close()


class Http(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            marker = head.lower().find(b"content-length:")
            if marker >= 0:
                length = int(head[marker + 15 :].split(b"\r\n", 1)[0])
            if len(self.buf) < end + 4 + length:
                return  # the body is still on its way
            self.buf = self.buf[end + 4 + length :]
            line = head[:200]
            response = HOOK if b" /hook" in line else BIG if b" /big" in line else SMALL
            if b"\r\nconnection: close" in head.lower():
                # The client (or the proxy for it) asked for one request on this connection: say so, and close.
                self.transport.write(response.replace(b"\r\n", b"\r\nConnection: close\r\n", 1))
                self.transport.close()
                return
            self.transport.write(response)


async def main(host: str, stream_port: int, http_port: int) -> None:
    loop = asyncio.get_running_loop()
    stream = await loop.create_server(Stream, host, stream_port, backlog=4096)
    http = await loop.create_server(Http, host, http_port, backlog=4096)
    print("ready", flush=True)
    async with stream, http:
        await asyncio.Event().wait()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
