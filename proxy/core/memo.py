"""Bounded memos: answers that are pure functions of their key, kept for the next time.

A memo here is a plain dict that is emptied when it reaches its limit and
starts again: a client cycling through keys cannot grow it, and the handful
of keys a real workload repeats are back after one miss each. Hits are a dict
lookup at the call site (the hot paths inline them); misses go through
``remember``.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

# Enough for every name, address or client a busy egressd sees at once.
MEMO_ENTRIES = 4096


def remember(memo: dict[K, V], key: K, value: V, limit: int = MEMO_ENTRIES) -> V:
    """Keep ``value`` under ``key`` (emptying ``memo`` first when it holds ``limit``); return it."""
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value
    return value


def remembered(memo: dict[K, V], key: K, compute: Callable[[K], V], limit: int = MEMO_ENTRIES) -> V:
    """``compute(key)``, kept in ``memo``."""
    try:
        return memo[key]
    except KeyError:
        return remember(memo, key, compute(key), limit)
