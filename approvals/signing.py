"""Standard Webhooks signatures (https://www.standardwebhooks.com/), both directions.

Pure: no I/O, no clock (``now`` is passed in, epoch seconds).

A secret is ``whsec_`` + base64 of the key bytes. A message is signed as
``v1,`` + base64(HMAC-SHA256(key, f"{id}.{timestamp}.{body}")), sent in
three headers: ``webhook-id``, ``webhook-timestamp`` (integer seconds) and
``webhook-signature`` (one or more space-separated ``v1,<sig>``).

Verifying an incoming message, in order:

1. all three headers present, the timestamp an integer → else ``missing``/``malformed``;
2. the timestamp within ``tolerance_s`` of now, either way → else ``stale``;
3. one of the ``v1`` signatures matches (constant-time) → else ``bad signature``;
4. the id never seen before (``ReplayGuard``, the caller's step after a
   valid signature, so forged messages cannot fill it) → else ``replayed``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Mapping

__all__ = ["ReplayGuard", "SigningError", "VerifyError", "parse_secret", "sign", "signed_headers", "verify"]

PREFIX = "whsec_"
# Standard Webhooks' recommended tolerance; DESIGN.md: "stale (over 5 minutes skewed)".
TOLERANCE_S = 300.0
# Shortest key accepted: HMAC-SHA256 with less than 128 bits is guessable.
MIN_KEY_BYTES = 16


class SigningError(ValueError):
    """A secret is not a ``whsec_`` base64 key."""


class VerifyError(Exception):
    """An incoming message is not authentic; ``reason`` says why, for the log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_secret(text: str) -> bytes:
    """The key bytes of a ``whsec_…`` secret; SigningError when it is not one."""
    if not text.startswith(PREFIX):
        raise SigningError("must start with whsec_")
    try:
        key = base64.b64decode(text[len(PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise SigningError("is not base64 after whsec_") from None
    if len(key) < MIN_KEY_BYTES:
        raise SigningError(f"key is shorter than {MIN_KEY_BYTES} bytes")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one message."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def signed_headers(key: bytes, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers for one message."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(key, msg_id, timestamp, body),
    }


def verify(key: bytes, headers: Mapping[str, str], body: bytes, *, now: float, tolerance_s: float = TOLERANCE_S) -> str:
    """Steps 1-3 of the module docstring; returns the message id or raises VerifyError."""
    lowered = {k.lower(): v for k, v in headers.items()}
    msg_id = lowered.get("webhook-id")
    stamp = lowered.get("webhook-timestamp")
    given = lowered.get("webhook-signature")
    if not msg_id or not stamp or not given:
        raise VerifyError("missing webhook-id, webhook-timestamp or webhook-signature")
    if not stamp.isdigit() or len(stamp) > 12:
        raise VerifyError("malformed webhook-timestamp")
    timestamp = int(stamp)
    if abs(now - timestamp) > tolerance_s:
        raise VerifyError(f"stale webhook-timestamp ({now - timestamp:+.0f}s skew)")
    expected = sign(key, msg_id, timestamp, body).encode()
    for candidate in given.split():
        if hmac.compare_digest(candidate.encode(), expected):
            return msg_id
    raise VerifyError("bad signature")


class ReplayGuard:
    """Message ids seen recently; a second sighting is a replay.

    An id is remembered for ``window_s`` (twice the tolerance: a timestamp may
    be skewed either way), and at most ``max_ids`` are kept; past that the
    oldest are forgotten, which only lets through replays that the staleness
    check already refuses.
    """

    def __init__(self, *, window_s: float = 2 * TOLERANCE_S, max_ids: int = 100_000) -> None:
        self._window_s = window_s
        self._max_ids = max_ids
        self._seen: OrderedDict[str, float] = OrderedDict()

    def first_sighting(self, msg_id: str, *, now: float) -> bool:
        """True (and remember it) when the id was not seen in the window."""
        while self._seen:
            oldest_id, seen_at = next(iter(self._seen.items()))
            if now - seen_at <= self._window_s and len(self._seen) < self._max_ids:
                break
            del self._seen[oldest_id]
        if msg_id in self._seen:
            return False
        self._seen[msg_id] = now
        return True
