"""TLS in memory, under a connection whose first TLS bytes were already read.

``loop.start_tls`` takes a transport over from its next byte on. The
transparent TLS listener has already read the client's ClientHello (it
needed the name before deciding), so its interception must start the
handshake from bytes in hand: ``ServerTls`` is TLS through ``ssl.MemoryBIO``.
It sits between the socket's transport, whose protocol it becomes, and the
``stream.Peer``, whose transport it becomes: the peer reads and writes in
clear as before, with the same flow control (pausing reading pauses the
socket; the socket's write buffer pausing pauses the peer's writers).

TLS cannot half-close: the client's close_notify or FIN is the end of the
connection (the runner sets ``Peer.half_open`` off).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from egressd.proxy.net.stream import Peer, expire

# Plaintext read from the TLS object at a time: one TLS record holds at most 16 KiB.
_READ = 64 * 1024


class ServerTls(asyncio.Protocol):
    """The server side of one client's TLS, over ``raw`` (the socket's transport), for ``peer``."""

    def __init__(self, raw: asyncio.Transport, peer: Peer, context: ssl.SSLContext) -> None:
        self._raw = raw
        self._peer = peer
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._shaken: asyncio.Future[None] = peer.loop.create_future()

    async def handshake(self, first: bytes, deadline: float) -> None:
        """Take the socket over and finish the handshake begun by ``first`` (the bytes already read).

        ssl.SSLError when it fails (the alert is sent), TimeoutError past
        ``deadline`` (the loop's clock), ConnectionError when the client goes.
        """
        self._raw.set_protocol(self)
        if first:
            self.data_received(first)
        shaken = self._shaken
        timer = self._peer.loop.call_at(deadline, expire, shaken)
        try:
            await shaken
        finally:
            timer.cancel()

    # -- as the socket's protocol ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._incoming.write(data)
        if not self._shaken.done():
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                return
            except ssl.SSLError as exc:
                self._flush()  # the alert saying why
                self._shaken.set_exception(exc)
                return
            self._flush()
            self._shaken.set_result(None)
        self._read()

    def _read(self) -> None:
        """Pass what the client's records hold, in clear, to the peer."""
        tls, peer = self._tls, self._peer
        while True:
            try:
                chunk = tls.read(_READ)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLError:
                self._raw.abort()  # a record that does not decrypt: the connection is over
                break
            if not chunk:  # close_notify: nothing more will come
                peer.eof_received()
                break
            peer.data_received(chunk)
        self._flush()  # what reading wrote (TLS 1.3 key updates)

    def eof_received(self) -> bool:
        self._peer.eof_received()
        return False  # the transport closes: TLS cannot half-close

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._shaken.done():
            self._shaken.set_exception(ConnectionResetError("the client went away during the TLS handshake"))
        self._peer.connection_lost(exc)

    def pause_writing(self) -> None:
        self._peer.pause_writing()

    def resume_writing(self) -> None:
        self._peer.resume_writing()

    # -- as the peer's transport -------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._raw.is_closing():
            return
        self._tls.write(data)
        self._flush()

    def _flush(self) -> None:
        if self._outgoing.pending:
            self._raw.write(self._outgoing.read())

    def is_closing(self) -> bool:
        return self._raw.is_closing()

    def close(self) -> None:
        """Say close_notify, then close the socket once what is buffered is sent."""
        if self._raw.is_closing():
            return
        if self._shaken.done() and self._shaken.exception() is None:
            try:
                self._tls.unwrap()
            except ssl.SSLError:  # the client's close_notify has not come: ours is written all the same
                pass
            self._flush()
        self._raw.close()

    def abort(self) -> None:
        self._raw.abort()

    def pause_reading(self) -> None:
        self._raw.pause_reading()

    def resume_reading(self) -> None:
        self._raw.resume_reading()

    def can_write_eof(self) -> bool:
        return False  # TLS cannot half-close

    def get_write_buffer_size(self) -> int:
        return self._raw.get_write_buffer_size()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._tls
        return self._raw.get_extra_info(name, default)

