"""What a refusal is on each wire egressd answers on, as the RFCs number it.

Pure enums; the bytes are made where each protocol is spoken
(``proxy.core.clienthello.tls_alert``, ``proxy.core.socks5.reply``,
``proxy.core.dnsanswer``).
"""

from __future__ import annotations

import enum

__all__ = ["Alert", "Rcode", "SocksReply"]


class Alert(enum.IntEnum):
    """RFC 8446 §6.2 alert descriptions a listener may send before closing."""

    HANDSHAKE_FAILURE = 40
    ACCESS_DENIED = 49
    DECODE_ERROR = 50
    INTERNAL_ERROR = 80
    MISSING_EXTENSION = 109
    UNRECOGNIZED_NAME = 112


class SocksReply(enum.IntEnum):
    """RFC 1928 §6 REP: what a request's reply says."""

    SUCCEEDED = 0
    GENERAL_FAILURE = 1
    NOT_ALLOWED = 2  # connection not allowed by ruleset
    NETWORK_UNREACHABLE = 3
    HOST_UNREACHABLE = 4
    CONNECTION_REFUSED = 5
    TTL_EXPIRED = 6
    COMMAND_NOT_SUPPORTED = 7
    ADDRESS_TYPE_NOT_SUPPORTED = 8


class Rcode(enum.IntEnum):
    """RFC 1035 §4.1.1 response codes the DNS server sends."""

    NOERROR = 0
    FORMERR = 1
    NXDOMAIN = 3
    NOTIMP = 4
    REFUSED = 5
