"""``--transcript FILE``: JSON Lines, one object per step, then the final answer.

    {"step": 1, "command": "...", "exit_code": 0, "stdout": "...", "stderr": "...",
     "timed_out": false, "memory_exceeded": false, "egress_refusals": [{"host", "port", "reason"}]}
    ...
    {"final": "<answer or null>", "stop": "final|max_steps|timeouts|error"}

Each line is written and flushed when its step ends, so an interrupted run
leaves every finished step behind. Secrets given to the writer (the model's
API key) are cut out of every line, wherever they came from.

The file is never written through a link (DESIGN.md, "Secrets"): a model's
text in a file a planted link points at (``t.jsonl -> ~/.bashrc``) would run
the next time that file is read. A link at the name is refused; anything
else there is replaced whole, by a fresh file (``O_EXCL | O_NOFOLLOW``, mode
0600, relative to the directory's descriptor) renamed over the name, so an
existing file is never truncated or written in place (another hard link to
it keeps its contents). The directories above the name are opened one by
one without following a link either (``egressd.config.trusted``); the CLI
refuses a transcript inside the working directory before the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from secrets import token_hex
from typing import IO, Any

from egressd.config.trusted import UntrustedFile, open_directory

from .loop import Stop

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class TranscriptError(Exception):
    """The transcript file cannot be opened; the message names it and says why."""


def _open_fresh(path: Path) -> IO[str]:
    """A new private file that has taken ``path``'s name; TranscriptError if the name is a link."""
    parent, name = os.path.split(os.fspath(path))
    if name in ("", ".", ".."):
        raise TranscriptError(f"cannot write {path}: it names a directory")
    try:
        dir_fd = open_directory(parent or ".", for_file=path)
    except UntrustedFile as exc:
        raise TranscriptError(f"cannot write {exc}") from None
    except OSError as exc:
        raise TranscriptError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with contextlib.suppress(FileNotFoundError):
            there = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if stat.S_ISLNK(there):
                raise TranscriptError(f"{path} is a link, and the transcript is never written through one")
            if not stat.S_ISREG(there):
                raise TranscriptError(f"cannot write {path}: it is not a regular file")
        temp = f".egressd-transcript-{token_hex(8)}"
        fd = os.open(temp, _NEW_FILE, 0o600, dir_fd=dir_fd)
        try:
            # Within one directory: whatever has the name now (even a link swapped in
            # since we looked) is replaced itself, never followed.
            os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
        return os.fdopen(fd, "w", encoding="utf-8")
    except OSError as exc:
        raise TranscriptError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)


class TranscriptWriter:
    """Writes the transcript to ``path`` (see the module's docstring); TranscriptError when it cannot."""

    def __init__(self, path: Path, *, secrets: Sequence[str] = ()) -> None:
        self.path = path
        self._secrets = [s for s in secrets if s]
        self._file: IO[str] | None = _open_fresh(path)
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
