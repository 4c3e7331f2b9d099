"""The allow file's *always* answers as the control server sees them: what stands, and taking one back.

A revocation is appended to the file (``[[revoked]]``: the file is never
rewritten) and then the file is applied again the way a reload applies it,
so the entry leaves the running policy at once; the control API takes back
the live runs' own approvals for it (``egressd.control.api.take_back_always``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from egressd.audit.records import rfc3339
from egressd.config.allowfile import AllowFileError, Approved, Revoked, append_revoked, read_allow_file
from egressd.control.api import Lasting

log = logging.getLogger("egressd.lasting")


def lasting_answers(path: Path | None, apply: Callable[[], object]) -> Lasting:
    """``Lasting`` over the allow file at ``path`` (None: no allow file, nothing stands); ``apply`` re-reads it."""

    # Every open approvals page asks at each keep-alive: the file is read again only when it changed
    # (its inode, size and times), and a failure is logged when it first happens, not at every ask.
    last_key: object = None
    last: Sequence[Approved] | None = None
    last_error: str | None = None

    def standing() -> Sequence[Approved]:
        nonlocal last_key, last, last_error
        if path is None:
            return ()
        try:
            info = os.stat(path)
            key: object = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        except OSError as exc:
            key = exc.strerror
        if key == last_key and last is not None:
            return last
        try:
            last = read_allow_file(path).standing
            last_error = None
        except AllowFileError as exc:
            if str(exc) != last_error:
                log.error("the always entries cannot be listed: %s", exc)
            last, last_error = (), str(exc)
        last_key = key
        return last

    def revoke(entries: Sequence[str], by: str | None, channel: str | None, auth: str | None) -> None:
        if path is None:
            raise AllowFileError("no allow file (--allow-file): there is no always entry to revoke")
        at = rfc3339(time.time())
        done = 0
        try:
            for entry in entries:
                append_revoked(path, Revoked(entry=entry, at=at, by=by, channel=channel, auth=auth))
                log.info("always entry %s revoked in %s%s", entry, path, f" by {by}" if by else "")
                done += 1
        finally:
            if done:  # what the file took leaves the running policy, even if a later entry failed
                apply()

    return Lasting(standing=standing, revoke=revoke)
