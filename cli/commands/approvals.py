"""``egressd pending``, ``egressd allow ID``, ``egressd deny ID``: a running egressd's approvals, from a shell.

Without ``--control`` they ask every running egressd of this user that the
registry of running instances lists (``wiring.instances``: ``serve``, ``run``
and ``agent``, on either backend), each with the token file its entry names:
``pending`` lists the approvals of them all (each under its instance when
there are several), ``allow`` and ``deny`` answer at the one holding the
approval. With ``--control`` (or no instance registered) they talk to that
control API (default ``127.0.0.1:3129``, or ``unix:PATH``) with the bearer
token from ``--control-token`` or the token file the running egressd wrote
(``service.token_path``). The token goes only
to an endpoint we can trust (``controltoken``: a unix socket or loopback TCP
socket of ours, checked through the kernel before a byte is sent), and the
token file is read only if it is ours alone. Exit status: 0 done; 1 the
approval is unknown or already settled, or the scope asked for is not
offered (stderr says how); 2 egressd could not be reached, was not trusted
with the token, or refused it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import getpass
import json
import sys
from pathlib import Path
from typing import Any

from egressd.config.settings import Settings, token_path
from egressd.names.shown import escape

from ..wiring.control_client import ControlClient, ControlError
from ..wiring.controltoken import TokenFileError, read_token_file
from ..wiring.instances import Instance, live_instances

# The control API answers at once; anything slower means it is not there.
REQUEST_TIMEOUT_S = 10.0


class CommandError(Exception):
    """egressd could not be asked; the message says why (exit status 2)."""


def _token(settings: Settings) -> str:
    if settings.control_token is not None:
        return settings.control_token.get_secret_value()
    path = token_path(settings)
    try:
        token = read_token_file(path)
    except TokenFileError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(
            f"no control token in {path} ({exc.strerror}): is egressd running with --control {settings.control}? "
            "Or give --control-token"
        ) from None
    if not token:
        raise CommandError(f"the control token file {path} is empty")
    return token


async def _call(
    control: str, token: str, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, Any]:
    """One call to the control API at ``control``: ``HOST:PORT``, ``unix:PATH``, or a registered http URL."""
    try:
        if control.startswith(("http://", "https://")):
            client = ControlClient.for_url(control, token, timeout_s=REQUEST_TIMEOUT_S)
        else:
            client = ControlClient.for_control(control, token, timeout_s=REQUEST_TIMEOUT_S)
        async with client:
            return await client.request(method, path, body)
    except ControlError as exc:
        raise CommandError(str(exc)) from None


def _instance_token(instance: Instance) -> str:
    if instance.token_file is None:
        raise CommandError(f"{instance.shown} wrote no token file (started with --control-token): give --control")
    try:
        token = read_token_file(Path(instance.token_file))
    except (TokenFileError, OSError) as exc:
        raise CommandError(f"{instance.shown}: cannot read its token file {instance.token_file}: {exc}") from None
    if not token:
        raise CommandError(f"{instance.shown}: its token file {instance.token_file} is empty")
    return token


async def _registered(args: argparse.Namespace, instances: list[Instance]) -> int:
    """``pending``, ``allow``, ``deny`` across the registered instances."""
    asked: list[tuple[Instance, str, list[dict[str, Any]]]] = []
    for instance in instances:
        try:
            token = _instance_token(instance)
            status, data = await _call(instance.control, token, "GET", "/approvals")
        except CommandError as exc:
            print(f"egressd: {exc}", file=sys.stderr)
            continue
        approvals = data.get("approvals") if status == 200 and isinstance(data, dict) else None
        if status == 404:
            approvals = []  # no approval channel: nothing is ever held there
        if approvals is None:
            print(f"egressd: {instance.shown} answered {status}", file=sys.stderr)
            continue
        asked.append((instance, token, list(approvals)))
    if not asked:
        raise CommandError("no running egressd of yours could be asked (see above)")
    if args.approval_action == "pending":
        if args.json:
            rows = [a | {"instance": {"pid": i.pid, "kind": i.kind, "control": i.control}} for i, _, got in asked
                    for a in got]  # fmt: skip
            print(json.dumps(rows, indent=2))
        elif len(asked) == 1:
            _print_pending(asked[0][2])
        else:
            for instance, _, got in asked:
                print(f"{escape(instance.shown)}, control {escape(instance.control)}:")
                _print_pending(got)
                print()
        return 0
    wanted = args.approval_id
    held = [(instance, token, str(a.get("id"))) for instance, token, got in asked for a in got
            if str(a.get("id")).startswith(wanted)]  # fmt: skip
    exact = [match for match in held if match[2] == wanted]
    held = exact or held
    if len(held) > 1:  # a prefix is taken only when one approval has it
        ids = ", ".join(escape(match[2]) for match in held)
        print(f"egressd: {escape(wanted)} names more than one waiting approval: {ids}", file=sys.stderr)
        return 1
    if held:
        instance, token, args.approval_id = held[0]
        return await _answer(args, instance.control, token)
    # Not waiting anywhere: the egressd that settled it says how and by whom (409), as with --control;
    # the others do not know the id (404) and nothing changes there.
    for instance, token, _ in asked:
        status, data = await _call(instance.control, token, "POST", f"/approvals/{wanted}/{args.approval_action}",
                                   {"by": args.by or getpass.getuser()})  # fmt: skip
        if status == 409:
            error = data.get("error") if isinstance(data, dict) else None
            print(f"egressd: {escape(str(error or 'already settled'))}", file=sys.stderr)
            return 1
    print(f"egressd: no running egressd of yours holds approval {escape(wanted)}", file=sys.stderr)
    return 1


def _left(expires_at: str, now: dt.datetime) -> str:
    try:
        expires = dt.datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return "?"
    seconds = max(0, int((expires - now).total_seconds()))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _print_pending(approvals: list[dict[str, Any]]) -> None:
    if not approvals:
        print("nothing is waiting for an answer")
        return
    now = dt.datetime.now(dt.UTC)
    rows = [("ID", "RUN", "DOMAIN", "LEFT", "COMMAND")]
    for a in approvals:
        domain = escape(f"{a.get('host')}:{a.get('port')}") + (" (unrelated)" if a.get("unrelated") else "")
        held = a.get("request")
        if isinstance(held, dict):  # a request inside an inspected connection: what it is
            request = escape(f"{held.get('method')} {held.get('path')}")
            domain += " " + (request[:60] + "…" if len(request) > 60 else request)
        if a.get("abandoned"):
            domain += " (client gave up)"  # still answerable: the answer applies to the run
        if a.get("instance"):  # a fleet's: another instance holds it, and decides when answered here
            domain += f" (held on {escape(str(a['instance']))})"
        command = escape(str(a.get("command") or "-"))
        rows.append(
            (
                escape(str(a.get("id"))),
                escape(str(a.get("run"))),
                domain,
                _left(str(a.get("expires_at")), now),
                command[:60] + ("…" if len(command) > 60 else ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4])
    print("\nanswer with: egressd allow ID [--scope once|run|always]   or   egressd deny ID")


async def _main(args: argparse.Namespace, settings: Settings, token: str) -> int:
    return await _answer(args, settings.control, token)


async def _answer(args: argparse.Namespace, control: str, token: str) -> int:
    action = args.approval_action
    if action == "pending":
        status, data = await _call(control, token, "GET", "/approvals")
    else:
        by = args.by or getpass.getuser()
        body: dict[str, Any] = {"by": by}
        if action == "allow":
            body["scope"] = getattr(args, "scope", None) or "run"
        status, data = await _call(control, token, "POST", f"/approvals/{args.approval_id}/{action}", body)
    error = data.get("error") if isinstance(data, dict) else None
    if status == 401:
        raise CommandError("the control API refused the token (--control-token, or the token file of this egressd)")
    if status in (400, 404, 409):
        print(f"egressd: {escape(str(error or status))}", file=sys.stderr)
        return 1
    if status != 200 or not isinstance(data, dict):
        raise CommandError(f"the control API answered {status}: {escape(str(error or data))}")
    if action == "pending":
        approvals = data.get("approvals") or []
        if args.json:
            print(json.dumps(approvals, indent=2))
        else:
            _print_pending(approvals)
    else:
        verb = "denied"
        if data.get("decision") == "allow":
            verb = _ALLOWED.get(str(data.get("scope")), "allowed (this run only)")
            if data.get("scope") == "always" and data.get("entry"):
                verb += f": {escape(str(data['entry']))} appended to the allow file"
            if data.get("scope_error"):
                print(f"egressd: not kept always: {escape(str(data['scope_error']))}", file=sys.stderr)
        print(f"{escape(str(data.get('id')))}: {verb} by {escape(str(data.get('by')))}")
    return 0


_ALLOWED = {
    "once": "allowed (this connection only)",
    "run": "allowed (this run only)",
    "always": "allowed (always)",
}


def run_approvals(args: argparse.Namespace, settings: Settings) -> int:
    """Entry point for the three subcommands (``args.approval_action``)."""
    try:
        # An explicit --control (or --control-token) names the egressd to ask; else every registered one.
        if args.control is None and args.control_token is None and args.control_token_file is None:
            instances = live_instances()
            if instances:
                return asyncio.run(_registered(args, instances))
            if not token_path(settings).exists():
                raise CommandError(
                    "no egressd is running: none of yours is registered, and no control token is at "
                    f"{token_path(settings)} (start one with egressd serve, run or agent; or name one with "
                    "--control and --control-token)"
                )
        token = _token(settings)
        return asyncio.run(_main(args, settings, token))
    except CommandError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 2
