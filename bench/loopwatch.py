"""Loaded into egressd's processes by bench/loopgaps.py (as ``sitecustomize``): how long each loop turn took, and why.

Does nothing unless ``LOOPWATCH_OUT`` names a directory. Then, in every
Python process started with it (the owner and each worker):

- a heartbeat on the event loop (``call_later(0.001)``, re-armed each time):
  under load it runs once per loop turn, so the time between two beats is
  one turn's length, counted in 1 ms buckets;
- a sampler thread that, every 2 ms, looks at the main thread when the beat
  is older than ``LOOPWATCH_STALL_MS`` (10): its stack, counted. The thread
  can only look while the main thread has let go of the GIL (a system call,
  the loop's poll), so the stacks are biased toward system calls; a turn of
  Python that holds the GIL throughout shows as its gap and no stack;
- every garbage collection's pause, by generation;
- at exit: the process's CPU seconds and its voluntary and involuntary
  context switches (``/proc/self/status``: the involuntary ones are the
  scheduler taking the core away), written as ``LOOPWATCH_OUT/PID.json``.

The heartbeat adds a timer per loop turn: the figures describe an egressd
that does slightly more than the real one.
"""

from __future__ import annotations

import atexit
import collections
import gc
import json
import os
import sys
import threading
import time
import traceback

OUT = os.environ.get("LOOPWATCH_OUT")
STALL_S = float(os.environ.get("LOOPWATCH_STALL_MS", "10")) / 1000

gaps: collections.Counter[int] = collections.Counter()  # turn length in whole ms → turns
stalls: collections.Counter[str] = collections.Counter()
pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
_beat = [0.0]  # the last heartbeat (perf_counter); 0 until the loop runs
_gc_start = [0.0]


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    elif _beat[0]:  # start-up's collections are not the load's
        pauses[info["generation"]].append((time.perf_counter() - _gc_start[0]) * 1000)


def _heartbeat(loop: object) -> None:
    def tick() -> None:
        now = time.perf_counter()
        if _beat[0]:
            gaps[int((now - _beat[0]) * 1000)] += 1
        _beat[0] = now
        loop.call_later(0.001, tick)  # type: ignore[attr-defined]

    loop.call_soon(tick)  # type: ignore[attr-defined]


def _sample() -> None:
    main = threading.main_thread().ident
    while True:
        time.sleep(0.002)
        if _beat[0] and time.perf_counter() - _beat[0] > STALL_S:
            frame = sys._current_frames().get(main)  # noqa: SLF001 (a diagnostic: the only way to see it)
            if frame is not None:
                stack = traceback.extract_stack(frame, limit=6)
                stalls[" < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))] += 1


def _status() -> dict[str, int]:
    found = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                found[name] = int(value)
    return found


def _write() -> None:
    times = os.times()
    report = {
        "argv": sys.argv[:3],
        "gaps_ms": {str(k): v for k, v in sorted(gaps.items())},
        "stalls": stalls.most_common(5),
        "gc_ms": {str(g): sorted(v) for g, v in pauses.items()},
        "cpu_s": times.user + times.system,
        **_status(),
    }
    with open(os.path.join(OUT or ".", f"{os.getpid()}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)


def _wrap(factory_owner: object, name: str) -> None:
    original = getattr(factory_owner, name)

    def new_event_loop() -> object:
        loop = original()
        _heartbeat(loop)
        return loop

    setattr(factory_owner, name, new_event_loop)


if OUT:
    gc.callbacks.append(_on_gc)
    try:
        import uvloop
    except ImportError:
        import asyncio.events

        _wrap(asyncio.events, "new_event_loop")  # what asyncio.Runner calls
    else:
        _wrap(uvloop, "new_event_loop")
    threading.Thread(target=_sample, name="loopwatch", daemon=True).start()
    atexit.register(_write)
