"""``egressd doctor [--clean]``: what works here, and removal of dead runs' leftovers."""

from __future__ import annotations

import argparse
import os

from egressd.audit import native
from egressd.sandbox.doctor import Check, clean_docker, render, run_checks


def audit_line_check() -> Check:
    """Which audit line this egressd writes with (the same bytes either way; the compiled one costs less)."""
    fix = "" if native.MODULE is not None else "install Rust (cargo) and run bash scripts/install.sh again"
    if native.TURNED_OFF:
        fix = f"unset {native.ENV}"
    return Check("audit line", native.MODULE is not None, native.DESCRIPTION, fix, required=False)


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..wiring.loop import run_async

    async def main() -> int:
        if args.clean:
            if os.geteuid() != 0:
                print("egressd doctor --clean: needs root to remove namespaces and cgroups")
                return 1
            from ..wiring.session import clean_stale

            removed = await clean_stale()  # with a dead run's /tmp/egressd-etc-KEY-* and egressd-run-KEY-*
            removed += await clean_docker()
            print(f"removed {len(removed)} leftover(s) of dead runs" + (": " + ", ".join(removed) if removed else ""))
        checks = [*await run_checks(), audit_line_check()]
        for line in render(checks):
            print(line)
        return 0 if all(c.ok for c in checks if c.required) else 1

    return run_async(main)
