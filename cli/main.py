"""``egressd``: the one console script.

Each subcommand parses its flags into the values ``egressd.config.settings`` takes
(flags left out are not passed, so the environment and the config file still
apply), then hands over to the module that does the work. Once the settings
are read, the variables that held secrets are dropped from our environment,
so nothing egressd starts later inherits them (DESIGN.md: secrets never reach
a sandbox).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from egressd.config.settings import (
    Settings,
    SettingsError,
    load_settings,
    secret_variables,
    unknown_variables,
)

from .flags import COMMON, OWN_FLAGS, add_common, refuse_unknown, subcommand, visible
from .logformat import setup_logging
from .wiring.errors import StartupError

# Every subcommand's arguments are made, and its modules imported, only when that subcommand is
# the one asked for (``build_parser``): `egressd --version` and `egressd pending` do not load the
# sandbox, Docker and agent modules (issue 29: a second at every start).
ALL = "*"
_COMMON = COMMON  # the flags shared by serve, run and agent (``flags``)


def _settings(args: argparse.Namespace) -> Settings:
    """The settings from the flags, environment and config file; then the secret variables are dropped."""
    return _settings_and_reader(args)[0]


def _settings_and_reader(args: argparse.Namespace) -> tuple[Settings, Callable[[], Settings]]:
    """``_settings``, and how to read them again later (``serve`` on SIGHUP) from the same sources.

    The same flags, the same config file (``--config`` or ``EGRESSD_CONFIG``) and
    environment; the secret variables, dropped from our environment now, are
    kept in the reader and given to it as the environment would.
    """
    fields = {dest for _, dest, _ in COMMON} | set(OWN_FLAGS)
    cli_values = {k: getattr(args, k) for k in fields}
    settings = load_settings(cli_values, args.config)
    for name, meant in unknown_variables(os.environ):
        print(f"egressd: warning: {name} is no setting of egressd and is ignored"
              + (f" (did you mean {meant}?)" if meant else ""), file=sys.stderr)  # fmt: skip
    secrets = {name.lower().removeprefix("egressd_"): os.environ[name] for name in secret_variables(os.environ)}
    # Read once, kept in ``settings``: whatever we start from now on (ip, nft, nsenter,
    # a shell of the user's) does not inherit them.
    for name in secret_variables(os.environ):
        del os.environ[name]

    def read_again() -> Settings:
        # Init values outrank the config file, as the environment they came from did; flags still win.
        given = {k: v for k, v in cli_values.items() if v is not None}
        return load_settings({**secrets, **given}, args.config)

    return settings, read_again


def person_at_terminal() -> bool:
    """A person is at egressd's terminal: stdin and stderr are a terminal, and ours (``/dev/tty`` opens).

    stderr too, so a program that starts egressd with its stderr in a file
    or a pipe (a test, a service) is not taken for a person.
    """
    if not (sys.stdin is not None and sys.stdin.isatty() and sys.stderr is not None and sys.stderr.isatty()):
        return False
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def default_approvers(settings: Settings, *, serve: bool, at_terminal: bool) -> Settings:
    """DESIGN.md: with no ``--approver``, ask at the terminal when a person is at one, and nobody otherwise.

    ``serve`` also offers its approvals page there (``web``), unless its
    control API is a unix socket, which no browser reaches. A sidecar, with
    no terminal, keeps refusing new domains as ``no_approver``.
    """
    if settings.approver or not at_terminal:
        return settings
    web = serve and settings.control is not None and not settings.control.startswith("unix:")
    chosen: list[str] = ["terminal", "web"] if web else ["terminal"]
    return settings.model_copy(update={"approver": chosen})


def refuse_page_approver(settings: Settings, command: str, *, connected: bool) -> None:
    """``run`` and ``agent`` serve no approvals page (their control API is a private unix socket):
    ``--approver web`` there would refuse every new domain at once, so it is refused at start instead.

    Not with ``--connect``: the egressd connected to decides, with its own approvers (and page).
    """
    if "web" in settings.approver and not connected:
        raise SettingsError(
            f"bad setting approver: egressd {command} serves no approvals page, so web could never answer; "
            "use terminal (or `egressd pending|allow|deny` from another shell), or start `egressd serve --approver web`"
        )



def raise_open_file_limit() -> tuple[int, int]:
    """Raise our soft RLIMIT_NOFILE to the hard limit: each tunnel holds two descriptors.

    The usual soft default (1024) would refuse new connections at some 500
    tunnels with EMFILE; only the hard limit is the administrator's choice.
    Returns the (soft, hard) limits now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit still stops at the kernel's fs.nr_open (1048576 by default).
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logging.getLogger("egressd").warning("could not raise the open-file limit to %d: %s", target, exc)
    return soft, hard


def cmd_serve(args: argparse.Namespace) -> int:
    settings, read_given = _settings_and_reader(args)
    at_terminal = person_at_terminal()
    settings = default_approvers(settings, serve=True, at_terminal=at_terminal)

    def read() -> Settings:  # a reload keeps the start's choice of default approvers
        return default_approvers(read_given(), serve=True, at_terminal=at_terminal)

    setup_logging(settings.log_level, settings.log_format)
    open_files = raise_open_file_limit()
    from .commands.serve import serve
    from .wiring.loop import run_async

    return run_async(lambda: serve(settings, open_files, read))


def cmd_audit(args: argparse.Namespace) -> int:
    from .commands.audit import run_audit

    settings = _settings(args)
    return run_audit(args, settings)


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from .commands.audit import run_verify

    settings = _settings(args)
    return run_verify(args, settings)


def cmd_audit_suggest(args: argparse.Namespace) -> int:
    from .commands.audit import run_suggest

    settings = _settings(args)
    return run_suggest(args, settings)


def cmd_run_sandbox(args: argparse.Namespace) -> int:
    from .commands.run import cmd_run

    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    settings = default_approvers(_settings(args), serve=False, at_terminal=person_at_terminal())
    refuse_page_approver(settings, "run", connected=bool(getattr(args, "connect", None)))
    setup_logging(settings.log_level if args.log_level else "warning", settings.log_format)
    return cmd_run(args, settings)


def cmd_policy(args: argparse.Namespace) -> int:
    from .commands.policy import run_policy

    return run_policy(args, _settings(args))


def cmd_approvals(args: argparse.Namespace) -> int:
    from .commands.approvals import run_approvals

    return run_approvals(args, _settings(args))


def cmd_agent_run(args: argparse.Namespace) -> int:
    from .commands.agent import cmd_agent

    settings = default_approvers(_settings(args), serve=False, at_terminal=person_at_terminal())
    refuse_page_approver(settings, "agent", connected=bool(getattr(args, "connect", None)))
    setup_logging(settings.log_level if args.log_level else "warning", settings.log_format)
    return cmd_agent(args, settings)


def cmd_state(args: argparse.Namespace) -> int:
    from .commands.state import run_state

    return run_state(args, _settings(args))


def cmd_doctor_checks(args: argparse.Namespace) -> int:
    from .commands.doctor import cmd_doctor

    return cmd_doctor(args)


def build_parser(only: str | None = ALL) -> argparse.ArgumentParser:
    """egressd's parser; ``only``: the one subcommand whose arguments to make (ALL: every one, for the
    reference and the tests; None: none, for the top level's own --help and --version)."""

    def wanted(name: str) -> bool:
        return only == ALL or only == name

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
    add_common(serve)
    serve.set_defaults(func=cmd_serve)

    audit = sub.add_parser("audit", help="read and filter the audit log",
                           description="Print the audit log as a table (or JSON Lines), filtered; "
                           "--follow keeps printing new records.")
    audit.add_argument("--config", metavar="FILE", help="TOML config file (for audit_log)")
    audit.add_argument("--audit-log", dest="audit_log", default=None, metavar="PATH", help="the log to read")
    audit.add_argument("--run", metavar="ID", help="only this run")
    audit.add_argument("--decision", type=str.lower, choices=["allow", "deny"], help="only this decision (any case)")
    audit.add_argument("--host", metavar="HOST", help="only this host (*.example.com for subdomains)")
    audit.add_argument(
        "--since",
        metavar="WHEN",
        help="RFC 3339 time (2026-12-01T10:00:00Z, +01:00), a date (2026-12-01), today, yesterday "
        "(midnight UTC), or a duration ago: 90s, 15m, 2h, 1d, 1w",
    )
    audit.add_argument("--follow", "-f", action="store_true", help="keep printing new records")
    audit.add_argument("--json", action="store_true", help="print JSON Lines instead of a table")
    audit.set_defaults(func=cmd_audit)
    audit_sub = audit.add_subparsers(dest="audit_action", metavar="ACTION")
    verify = audit_sub.add_parser(
        "verify", help="check the audit log's hash chain",
        description="Check that every record's prev is the SHA-256 of the line before it, across the files "
        "given oldest first (default: the log and its rotated files PATH.N ... PATH.1 PATH); name the first "
        "record edited, removed or inserted, or a truncated tail. Exit 0 if intact, 1 if not, 2 if unreadable.")
    # SUPPRESS: given after `verify` these count too; given before, the audit parser's value stays.
    verify.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help="TOML config file (for audit_log)")
    verify.add_argument("--audit-log", dest="audit_log", default=argparse.SUPPRESS, metavar="PATH",
                        help="the log whose chain to check, with its rotated files")
    verify.add_argument("--head", metavar="HASH", type=str.lower,
                        help="a head egressd reported outside the log (its 'audit head' log line): the chain must "
                        "hold a record with that hash, or records were cut from its tail")
    verify.add_argument("files", nargs="*", metavar="FILE", help="log files, oldest first")
    verify.set_defaults(func=cmd_audit_verify)
    suggest = audit_sub.add_parser(
        "suggest", help="turn what a run did into allowlist entries (TOML for --allow-file)",
        description="Read the audit records of one run (default: the last one started) and print the allowlist "
        "that would have let it do what it did, as TOML for --allow-file: every host it reached (allowed by a rule, "
        "an approval or --learn), HOST:PORT for ports other than 80 and 443, and *.DOMAIN for 3 or more names under "
        "one registered domain (never across a public suffix). IP addresses and hosts that were refused (deny "
        "entries, private addresses, denials) are never suggested: a closing comment lists them. Review the "
        "output before you use it. Exit 0, 1 if there is no audit log, 2 for an unknown run or an unreadable file.",
        epilog="example: egressd serve --learn ...; then egressd audit suggest > ~/.config/egressd/allow.toml; "
        "egressd serve --allow-file ~/.config/egressd/allow.toml (never inside a sandbox's --workdir)")
    suggest.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help="TOML config file (for audit_log)")
    suggest.add_argument("--audit-log", dest="audit_log", default=argparse.SUPPRESS, metavar="PATH",
                         help="the log to read, with its rotated files")
    suggest.add_argument("--run", dest="suggest_run", metavar="ID",
                         help="the run whose records to use (default: the last run started in the records)")
    suggest.add_argument("--include-dns", action="store_true",
                         help="count names the sandbox only looked up (DNS answers), not only those it connected to")
    suggest.add_argument("files", nargs="*", metavar="FILE", help="log files, oldest first (default: the audit log)")
    suggest.set_defaults(func=cmd_audit_suggest)

    run = sub.add_parser(
        "run",
        help="run one command in a fresh sandbox whose only way out is egressd",
        description="Run COMMAND in a fresh bubblewrap sandbox in its own network namespace, pinned to an "
        "embedded egressd; exit with the command's status (124 timeout, 137 memory, 125 no sandbox).",
        allow_abbrev=False,  # --control is not --control-token, --dns-answer not --dns-answer6
    )
    if wanted("run"):
        from .commands.run import add_run_arguments

        add_common(run, service=False)
        add_run_arguments(run)
        run.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    run.set_defaults(func=cmd_run_sandbox)

    agent = sub.add_parser(
        "agent",
        help="let a model work on a task, every command it runs in one fresh sandbox",
        description="Drive a model (OpenAI-compatible, Anthropic, or a script) whose every shell command runs in a "
        "sandbox pinned to an embedded egressd; print progress on stderr and the final answer on stdout "
        "(exit 0 final answer, 1 step cap, 124 two timeouts in a row, 3 model failure, 125 no sandbox).",
        allow_abbrev=False,
    )
    if wanted("agent"):
        from .commands.agent import add_agent_arguments

        add_common(agent, service=False)
        add_agent_arguments(agent)
    agent.set_defaults(func=cmd_agent_run)

    _add_approval_commands(sub)

    policy = sub.add_parser(
        "policy", help="show or change a live run's allow and deny entries",
        description="Add and remove entries of a run of a running egressd (PATCH /runs/RUN_ID, with the global "
        "control token); they apply to the run's next request. Without a change, show the run's entries.")
    if wanted("policy"):
        from .commands.policy import add_policy_arguments

        _add_control_arguments(policy)
        add_policy_arguments(policy)
    policy.set_defaults(func=cmd_policy)

    state = sub.add_parser("state", help="a fleet's state database: migrate its schema, list its instances",
                           description="The PostgreSQL database a fleet of egressd instances shares (serve --state; "
                           "docs/fleet.md). migrate: apply the schema migrations it lacks (serve never does); "
                           "status: its schema version and the instances listed in it (exit 1 unless it is at this "
                           "egressd's version); denials: the denials shared with a task or group (--share-denials) "
                           "standing now; lift HOST...: lift them, for runs that start from now on.")
    state_sub = state.add_subparsers(dest="state_action", required=True, metavar="ACTION")
    for action, text in (("migrate", "apply the schema migrations the database lacks, one at a time across the fleet"),
                         ("status", "the schema version and the instances: serving, silent or stopped"),
                         ("denials", "the denials shared with a task or group (--share-denials) standing now"),
                         ("lift", "lift the shared denials of HOST (as it was denied), for every task and group: runs "
                          "that start from now on are asked again; a live run keeps its denial")):
        acting = state_sub.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        if action == "lift":
            acting.add_argument("hosts", nargs="+", metavar="HOST", help="a host as it was denied")
            acting.add_argument("--by", metavar="WHO", help="who lifts them (kept in the database)")
        acting.add_argument("--config", metavar="FILE", help="TOML config file (for state)")
        acting.add_argument("--state", dest="state", default=None, metavar="URI",
                            help=f"postgresql://USER@HOST/DATABASE {visible('state')}")
        acting.add_argument("--state-file", dest="state_file", default=None, metavar="FILE",
                            help="read the URI from FILE: a regular file of yours (or root's) that no one else "
                            "may read or write (mode 600)")
        acting.set_defaults(func=cmd_state)

    doctor = sub.add_parser("doctor", help="say which sandbox backends and features work here, and why not",
                            description="Try each feature egressd run needs (bubblewrap, network namespaces, nftables, "
                            "seccomp, cgroups, Docker) and report what works; exit 1 if a required one does not.")
    doctor.add_argument("--clean", action="store_true", help="first remove leftovers of runs whose egressd died")
    doctor.set_defaults(func=cmd_doctor_checks)
    for command in sub.choices.values():
        _short_usage(command)
    return parser


def _short_usage(parser: argparse.ArgumentParser) -> None:
    """One style of usage line for every command, its subcommands too: ``egressd CMD [options]``,
    then the options it requires and its arguments; --help lists every option under its section."""
    words = ["%(prog)s", "[options]"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words.append(f"[{action.metavar or 'ACTION'} ...]")
            for sub in action.choices.values():
                _short_usage(sub)
        elif action.required and action.option_strings:
            words.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
        elif not action.option_strings:
            metavar = str(action.metavar or action.dest.upper())
            if action.nargs == argparse.REMAINDER:
                words.append(f"-- {metavar.upper()} [ARG ...]")
            elif action.nargs in ("*", "?"):
                words.append(f"[{metavar} ...]" if action.nargs == "*" else f"[{metavar}]")
            else:
                words.append(metavar)
    parser.usage = " ".join(words)


def _add_control_arguments(parser: argparse.ArgumentParser) -> None:
    """How a command that asks a running egressd finds its control API and token."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file (for control and control_token)")
    parser.add_argument("--control", dest="control", default=None, metavar="HOST:PORT|unix:PATH",
                        help="the running egressd's control API (default 127.0.0.1:3129)")
    parser.add_argument("--control-token", dest="control_token", default=None, metavar="TOKEN",
                        help=f"bearer token (default: the token file egressd wrote) {visible('control_token')}")
    parser.add_argument("--control-token-file", dest="control_token_file", default=None, metavar="FILE",
                        help="read the bearer token from FILE: a regular file of yours (or root's) "
                        "that no one else may read or write (mode 600)")


def _add_approval_commands(sub: Any) -> None:
    """``egressd pending``, ``allow ID``, ``deny ID``: answer through a running egressd's control API."""
    pending = sub.add_parser("pending", help="list the approvals waiting for an answer",
                             description="List the requests a running egressd holds for an answer, oldest first.")
    allow = sub.add_parser("allow", help="allow a held request (--scope once|run|always; default run)",
                           description="Allow the held request APPROVAL_ID: with --scope run (the default) its "
                           "domain joins the run's allowlist until the run ends; once: only the request(s) held "
                           "on it go through; always: as run, and HOST:PORT is appended to the allow file "
                           "(only when egressd runs with --allow-file).")
    deny = sub.add_parser("deny", help="deny a held request (sticks for the run)",
                          description="Deny the held request APPROVAL_ID; the domain stays denied "
                          "for the rest of the run.")
    for parser, action in ((pending, "pending"), (allow, "allow"), (deny, "deny")):
        _add_control_arguments(parser)
        if action == "pending":
            parser.add_argument("--json", action="store_true", help="print the approvals as JSON")
        else:
            parser.add_argument("approval_id", metavar="APPROVAL_ID", help="the id `egressd pending` shows (a-…)")
            parser.add_argument("--by", metavar="NAME", help="who answers, for the audit log (default: your user name)")
        if action == "allow":
            parser.add_argument("--scope", choices=["once", "run", "always"], default="run",
                                help="once: this connection only; run: the rest of the run (default); "
                                "always: also appended to egressd's --allow-file")
        parser.set_defaults(func=cmd_approvals, approval_action=action)


def _audit_settings_fields(args: argparse.Namespace) -> None:
    # `audit` shares only --config/--audit-log with the common options; `run` and `agent` lack SERVICE_ONLY.
    for _, dest, _ in COMMON:
        if not hasattr(args, dest):
            setattr(args, dest, None)
    for dest in OWN_FLAGS:
        if not hasattr(args, dest):
            setattr(args, dest, None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(subcommand(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        refuse_unknown(parser, args, unknown)
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
