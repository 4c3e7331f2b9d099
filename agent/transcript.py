"""``--transcript FILE``: JSON Lines, one object per step, then the final answer.

    {"step": 1, "command": "...", "exit_code": 0, "stdout": "...", "stderr": "...",
     "timed_out": false, "memory_exceeded": false, "egress_refusals": [{"host", "port", "reason"}]}
    ...
    {"final": "<answer or null>", "stop": "final|max_steps|timeouts|error"}

Each line is written and flushed when its step ends, so an interrupted run
leaves every finished step behind. Secrets given to the writer (the model's
API key) are cut out of every line, wherever they came from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from .loop import Stop


class TranscriptWriter:
    def __init__(self, path: Path, *, secrets: Sequence[str] = ()) -> None:
        self.path = path
        self._secrets = [s for s in secrets if s]
        self._file: IO[str] | None = path.open("w", encoding="utf-8")
        self.finished = False

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(record, ensure_ascii=False)
        for secret in self._secrets:
            line = line.replace(json.dumps(secret)[1:-1], "[redacted]")
        self._file.write(line + "\n")
        self._file.flush()

    def step(self, record: dict[str, Any]) -> None:
        self._write(record)

    def final(self, final: str | None, stop: Stop) -> None:
        """The last line; written once (later calls are ignored)."""
        if self.finished:
            return
        self.finished = True
        self._write({"final": final, "stop": stop.value})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
