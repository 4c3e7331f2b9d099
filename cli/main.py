"""``egressd``: the one console script.

Each subcommand parses its flags into the values ``config.settings`` takes
(flags left out are not passed, so the environment and the config file still
apply), then hands over to the module that does the work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from config.settings import Settings, SettingsError, load_settings

from .run_cmd import add_run_arguments
from .service import EgressService, StartupError

# Flags shared by serve/run/agent, as (flag, settings field, argparse kwargs).
_COMMON: list[tuple[str, str, dict[str, Any]]] = [
    ("--listen", "listen", {"metavar": "HOST:PORT", "help": "HTTP proxy address (default 127.0.0.1:3128)"}),
    ("--control", "control", {"metavar": "HOST:PORT|unix:PATH", "help": "control API (default 127.0.0.1:3129)"}),
    ("--control-token", "control_token", {"metavar": "TOKEN", "help": "control API bearer token (default: generated and written to a file)"}),
    ("--allow", "allow", {"action": "append", "metavar": "ENTRY", "help": "allow a destination: example.com, *.example.com, host:PORT, host:* (repeatable)"}),
    ("--deny", "deny", {"action": "append", "metavar": "ENTRY", "help": "deny a destination; wins over --allow (repeatable)"}),
    ("--preset", "preset", {"action": "append", "metavar": "NAME", "help": "add a named allowlist: python, node, github, ... (repeatable)"}),
    ("--allow-private", "allow_private", {"action": "append", "metavar": "CIDR", "help": "let allowed names resolve into this private/special range (repeatable)"}),
    ("--approver", "approver", {"action": "append", "choices": ["terminal", "slack", "webhook", "deny"], "help": "who answers requests for unknown domains (repeatable)"}),
    ("--approval-timeout", "approval_timeout", {"type": float, "metavar": "SECONDS", "help": "how long a request is held for an answer (default 600)"}),
    ("--upstream-dns", "upstream_dns", {"metavar": "HOST:PORT", "help": "DNS server egressd asks (default: the system resolver)"}),
    ("--audit-log", "audit_log", {"metavar": "PATH", "help": "audit log file (default ~/.local/state/egressd/audit.jsonl)"}),
    ("--max-head-bytes", "max_head_bytes", {"type": int, "metavar": "N", "help": "largest request head (default 65536)"}),
    ("--head-timeout-s", "head_timeout_s", {"type": float, "metavar": "S", "help": "time to send a request head (default 10)"}),
    ("--connect-timeout-s", "connect_timeout_s", {"type": float, "metavar": "S", "help": "time to connect upstream (default 10)"}),
    ("--idle-timeout-s", "idle_timeout_s", {"type": float, "metavar": "S", "help": "idle tunnel lifetime (default 300)"}),
    ("--max-connections", "max_connections", {"type": int, "metavar": "N", "help": "open client connections overall (default 10000)"}),
    ("--max-connections-per-run", "max_connections_per_run", {"type": int, "metavar": "N", "help": "open client connections per run (default 1000)"}),
    ("--log-level", "log_level", {"choices": ["debug", "info", "warning", "error"], "help": "stderr log level (default info)"}),
]


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file (also EGRESSD_CONFIG)")
    for flag, dest, kwargs in _COMMON:
        parser.add_argument(flag, dest=dest, default=None, **kwargs)
    parser.add_argument("--no-ask", dest="ask", action="store_const", const=False, default=None,
                        help="refuse unknown domains without asking anyone (not_allowlisted)")
    parser.add_argument("--require-auth", dest="require_auth", action="store_const", const=True, default=None,
                        help="no default run: every client needs run credentials")


def _settings(args: argparse.Namespace) -> Settings:
    fields = {dest for _, dest, _ in _COMMON} | {"ask", "require_auth"}
    return load_settings({k: getattr(args, k) for k in fields}, args.config)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s egressd %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        stream=sys.stderr,
    )


def run_async(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


async def _serve(settings: Settings) -> int:
    service = EgressService(settings)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    run = service.default_run
    host, port = service.proxy_address
    logging.getLogger("egressd").info(
        "serving: proxy %s:%d, control %s, audit log %s, %s",
        host, port, service.control_address, settings.audit_path,
        f"default run allows {', '.join(e.text for e in run.allow) or 'nothing'}" if run else "runs need credentials",
    )
    try:
        await stop.wait()
    finally:
        logging.getLogger("egressd").info("shutting down (grace %.0fs)", settings.shutdown_grace_s)
        await service.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _setup_logging(settings.log_level)
    return run_async(lambda: _serve(settings))


def cmd_audit(args: argparse.Namespace) -> int:
    from .audit_cmd import run_audit

    settings = _settings(args)
    return run_audit(args, settings)


def cmd_run_sandbox(args: argparse.Namespace) -> int:
    from .run_cmd import cmd_run

    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    settings = _settings(args)
    _setup_logging(settings.log_level if args.log_level else "warning")
    return cmd_run(args, settings)


def cmd_doctor_checks(args: argparse.Namespace) -> int:
    from .doctor_cmd import cmd_doctor

    return cmd_doctor(args)


def build_parser() -> argparse.ArgumentParser:
    try:
        ver = version("egressd")
    except PackageNotFoundError:
        ver = "unknown"
    parser = argparse.ArgumentParser(
        prog="egressd",
        description="Egress control for sandboxes: an HTTP proxy with a per-run allowlist, "
        "human approval of new domains, and an audit log of every attempt.",
    )
    parser.add_argument("--version", action="version", version=f"egressd {ver}")
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the proxy and control API in the foreground",
                           description="Run the proxy and its control API in the foreground until SIGINT/SIGTERM.")
    _add_common(serve)
    serve.set_defaults(func=cmd_serve)

    audit = sub.add_parser("audit", help="read and filter the audit log",
                           description="Print the audit log as a table (or JSON Lines), filtered; --follow keeps printing new records.")
    audit.add_argument("--config", metavar="FILE", help="TOML config file (for audit_log)")
    audit.add_argument("--audit-log", dest="audit_log", default=None, metavar="PATH", help="the log to read")
    audit.add_argument("--run", metavar="ID", help="only this run")
    audit.add_argument("--decision", choices=["allow", "deny"], help="only this decision")
    audit.add_argument("--host", metavar="HOST", help="only this host (*.example.com for subdomains)")
    audit.add_argument("--since", metavar="WHEN", help="RFC 3339 time, a date, or a duration ago: 90s, 15m, 2h, 1d")
    audit.add_argument("--follow", "-f", action="store_true", help="keep printing new records")
    audit.add_argument("--json", action="store_true", help="print JSON Lines instead of a table")
    audit.set_defaults(func=cmd_audit)

    run = sub.add_parser(
        "run",
        help="run one command in a fresh sandbox whose only way out is egressd",
        description="Run COMMAND in a fresh bubblewrap sandbox in its own network namespace, pinned to an "
        "embedded egressd; exit with the command's status (124 timeout, 137 memory, 125 no sandbox).",
        usage="egressd run [options] -- COMMAND [ARG ...]",
    )
    _add_common(run)
    add_run_arguments(run)
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    run.set_defaults(func=cmd_run_sandbox)

    doctor = sub.add_parser("doctor", help="say which sandbox backends and features work here, and why not",
                            description="Try each feature egressd run needs (bubblewrap, network namespaces, nftables, "
                            "seccomp, cgroups, Docker) and report what works; exit 1 if a required one does not.")
    doctor.add_argument("--clean", action="store_true", help="first remove leftovers of runs whose egressd died")
    doctor.set_defaults(func=cmd_doctor_checks)
    return parser


def _audit_settings_fields(args: argparse.Namespace) -> None:
    # `audit` shares only --config/--audit-log with the common options.
    for _, dest, _ in _COMMON:
        if not hasattr(args, dest):
            setattr(args, dest, None)
    for dest in ("ask", "require_auth"):
        if not hasattr(args, dest):
            setattr(args, dest, None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _audit_settings_fields(args)
    try:
        return int(args.func(args))
    except (SettingsError, StartupError) as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout.close()
        return 0
