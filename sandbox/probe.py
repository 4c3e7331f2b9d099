"""A probe's command, run to its end: its exit status and its output (stdout and stderr together)."""

from __future__ import annotations

import asyncio


async def run_probe(*argv: str, pass_fds: tuple[int, ...] = ()) -> tuple[int, str]:
    """(exit status, output stripped); 127 and why when the command cannot be started."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, pass_fds=pass_fds
        )
    except OSError as exc:
        return 127, str(exc)
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace").strip()
