"""Messages between egressd's owner process and one worker (``--workers``), over a connected unix socket.

Each side sends Python values (tuples of plain values, records, the
``replica`` images and changes); the values sent in one event-loop turn go
out as one frame (a 4-byte length and a pickle of the list), so a worker
reporting an event per connection pays one write per turn, not one per
event. Both ends are processes of the same egressd, made by the owner from
a ``socketpair``; nothing else can reach the socket, and each side trusts
the other as it trusts itself.

``closed`` resolves when the other end goes away (its process died or
closed the socket): the owner takes it as the worker's death, a worker as
the owner's.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

_LENGTH = struct.Struct(">I")
# A frame larger than this is a broken peer, not a message: the channel closes.
MAX_FRAME = 256 * 1024 * 1024


class Channel(asyncio.Protocol):
    """One end of the owner–worker socket: ``send`` queues, each received value goes to ``on_message``."""

    def __init__(self, on_message: Callable[[Any], None]) -> None:
        self._on_message = on_message
        self._transport: asyncio.Transport | None = None
        self._queued: list[Any] = []
        self._flush: asyncio.Handle | None = None
        self._buffer = bytearray()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @classmethod
    async def over(cls, sock: socket.socket, on_message: Callable[[Any], None]) -> Channel:
        """A channel on one end of a connected unix socket pair (taken over: closed with the channel)."""
        loop = asyncio.get_running_loop()
        _, channel = await loop.create_unix_connection(lambda: cls(on_message), sock=sock)
        return channel

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is one, without being a subclass

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer)
            if size > MAX_FRAME:
                self.close()
                return
            if len(buffer) < _LENGTH.size + size:
                break
            values = pickle.loads(bytes(buffer[_LENGTH.size : _LENGTH.size + size]))
            del buffer[: _LENGTH.size + size]
            for value in values:
                self._on_message(value)
                if self._transport is None:
                    return  # a message closed the channel

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self.closed.done():
            self.closed.set_result(None)

    @property
    def open(self) -> bool:
        return self._transport is not None

    def send(self, value: Any) -> None:
        """Queue ``value``; the turn's values go in one frame when the loop turn ends (lost if the peer is gone)."""
        if self._transport is None:
            return
        self._queued.append(value)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self.flush)

    def send_now(self, value: Any) -> None:
        """``send``, and everything queued before it, in one write now: before whatever this process does next."""
        if self._transport is not None:
            self._queued.append(value)
            if self._flush is not None:
                self._flush.cancel()
            self.flush()

    def flush(self) -> None:
        """Send what is queued now."""
        self._flush = None
        queued, self._queued = self._queued, []
        if queued and self._transport is not None:
            data = pickle.dumps(queued, pickle.HIGHEST_PROTOCOL)
            self._transport.write(_LENGTH.pack(len(data)) + data)

    def close(self) -> None:
        """Send what is queued and close."""
        self.flush()
        if self._transport is not None:
            self._transport.close()
