"""The event loop egressd runs on: uvloop when it is installed, tuned for many long-lived objects."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable, Coroutine
from typing import Any


def run_async(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run on uvloop when it is installed, else on asyncio's own loop."""
    # A busy egressd holds thousands of long-lived objects (connections, held
    # approvals) and makes few reference cycles; the default collector would
    # walk all of them every few hundred allocations. Collect the young
    # generation less often and leave what start-up made out of it for good.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
    try:
        import uvloop
    except ImportError:
        print(
            "egressd: uvloop is not installed (pip install 'egressd[speed]'); running on asyncio's own loop, "
            "which sets up connections more slowly",
            file=sys.stderr,
            flush=True,
        )
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())
