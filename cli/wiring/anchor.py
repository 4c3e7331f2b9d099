"""The audit log's head, said outside the log: its hash chain shows an edit, an insertion or a removal
between records, but not records cut from its tail, since what is left is still a valid chain. egressd's
own log (stderr: the terminal, the journal, the cluster's log collector) gets an ``audit head`` line
every ``HEAD_INTERVAL_S`` while records are written, and one when egressd stops; `egressd audit verify
--head HASH` then checks that the log still holds that record."""

from __future__ import annotations

import asyncio
import logging

from egressd.audit.log import AuditSink

log = logging.getLogger("egressd")

HEAD_INTERVAL_S = 60.0


def say_head(sink: AuditSink, said: str | None = None) -> str | None:
    """Log the sink's head (the hash of its last line) when it has one other than ``said``; the head."""
    head = getattr(sink, "prev", None)  # a file's sink has one; a memory sink (tests) has none
    if isinstance(head, str) and head != said:
        log.info("audit head %s (egressd audit verify --head %s checks the log still holds it)", head, head)
    return head if isinstance(head, str) else said


async def say_heads(sink: AuditSink, interval_s: float = HEAD_INTERVAL_S) -> None:
    """``say_head`` every ``interval_s`` until cancelled (only when the head moved)."""
    said = None
    while True:
        await asyncio.sleep(interval_s)
        said = say_head(sink, said)
