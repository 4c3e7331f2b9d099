"""``egressd policy RUN_ID [--allow E] [--deny E] [--remove-allow E] [--remove-deny E] [--revoke HOST[:PORT]]``:
a live run's entries, and the approvals given for it.

``PATCH /runs/RUN_ID`` on a running egressd's control API, with the global
control token (a run's own token is refused: a run never widens its own
policy), found as ``egressd pending`` finds it. With no change given, shows
the run's entries. Exit status: 0 done; 1 the run is unknown or an entry was
refused (stderr says which, nothing was applied); 2 egressd could not be
reached, was not trusted with the token, or refused it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from egressd.config.settings import Settings
from egressd.names.shown import escape

from .approvals import CommandError, _call, _token


def _body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for kind, add, remove in (("allow", args.add_allow, args.remove_allow), ("deny", args.add_deny, args.remove_deny)):
        part = {k: v for k, v in (("add", add), ("remove", remove)) if v}
        if part:
            body[kind] = part
    if args.revoke:
        body["revoke"] = args.revoke
    return body


def _print_run(run: dict[str, Any]) -> None:
    def listed(key: str) -> str:
        return ", ".join(escape(str(e)) for e in run.get(key) or []) or "-"

    print(f"run {escape(str(run.get('id')))}")
    print(f"  allow:        {listed('allow')}")
    print(f"  deny:         {listed('deny')}")
    print(f"  operator deny: {listed('global_deny')}")
    print(f"  approved:     {listed('approved')}")


async def _main(args: argparse.Namespace, settings: Settings, token: str) -> int:
    body = _body(args)
    path = f"/runs/{args.run_id}"
    control = settings.control
    status, data = await (_call(control, token, "PATCH", path, body) if body else _call(control, token, "GET", path))
    error = data.get("error") if isinstance(data, dict) else None
    if status == 401:
        raise CommandError("the control API refused the token (--control-token, or the token file of this egressd)")
    if status == 403:
        raise CommandError(f"the control API refused: {escape(str(error))}")
    if status in (400, 404):
        print(f"egressd: {escape(str(error or status))}", file=sys.stderr)
        return 1
    if status != 200 or not isinstance(data, dict):
        raise CommandError(f"the control API answered {status}: {escape(str(error or data))}")
    _print_run(data)
    return 0


def run_policy(args: argparse.Namespace, settings: Settings) -> int:
    """Entry point for ``egressd policy``."""
    try:
        token = _token(settings)
        return asyncio.run(_main(args, settings, token))
    except CommandError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 2


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="RUN_ID", help="the run (`default` for serve's default run)")
    for flag, dest, what in (
        ("--allow", "add_allow", "add an allow entry"),
        ("--deny", "add_deny", "add a deny entry"),
        ("--remove-allow", "remove_allow", "remove an allow entry of the run"),
        ("--remove-deny", "remove_deny", "remove a deny entry of the run"),
    ):
        parser.add_argument(flag, dest=dest, action="append", default=[], metavar="ENTRY", help=f"{what} (repeatable)")
    parser.add_argument("--revoke", action="append", default=[], metavar="HOST[:PORT]",
                        help="take back an approval given for the run (HOST: every port, and the requests "
                        "approved inside its inspected connections; HOST:PORT: that port alone, though an approval "
                        "for another port gave 80 and 443 too) from its next request on (repeatable)")
