"""The person's side of a pseudo-terminal, for the terminal channel's tests: what egressd drew, and a keyboard."""

from __future__ import annotations

import asyncio
import os
import termios

from tests.harness import wait_until


class Pty:
    """A pseudo-terminal: ``path`` is the terminal egressd opens, ``output`` what it drew, ``type`` the keyboard."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        self.path = os.ttyname(self.slave)
        self.output = ""
        os.set_blocking(self.master, False)
        asyncio.get_running_loop().add_reader(self.master, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:
            return
        self.output += data.decode("utf-8", "replace")

    async def shows(self, text: str, timeout_s: float = 5.0) -> None:
        try:
            await wait_until(lambda: text in self.output, timeout_s)
        except AssertionError:
            raise AssertionError(f"{text!r} not on screen:\n{self.output!r}") from None

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def lflag(self) -> int:
        return int(termios.tcgetattr(self.slave)[3])

    def hang_up(self) -> None:
        asyncio.get_running_loop().remove_reader(self.master)
        os.close(self.master)
        self.master = -1

    def close(self) -> None:
        if self.master >= 0:
            asyncio.get_running_loop().remove_reader(self.master)
            os.close(self.master)
        os.close(self.slave)
