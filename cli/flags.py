"""The flags ``serve``, ``run`` and ``agent`` share (each a setting, with its EGRESSD_ variable and its --help
section), and what becomes of a word none of egressd's parsers knows: the subcommand's usage and the flag
most likely meant."""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from egressd.config.settings import SECRET_SETTINGS


def visible(name: str) -> str:
    """What the help of a secret's flag says: where else to give it, and why."""
    flag = "--" + name.replace("_", "-")
    return f"(visible to other local users in the process list: better {flag}-file or EGRESSD_{name.upper()})"


def secret_file_flags() -> list[tuple[str, str, dict[str, Any]]]:
    """``--NAME-file FILE`` for each secret setting: the secret kept off the command line."""
    return [
        ("--" + name.replace("_", "-") + "-file", f"{name}_file",
         {"metavar": "FILE", "help": f"read {name} from FILE: a regular file of yours (or root's) "
          "that no one else may read or write (mode 600)"})
        for name in SECRET_SETTINGS
    ]


# Flags shared by serve/run/agent, as (flag, settings field, argparse kwargs).
COMMON: list[tuple[str, str, dict[str, Any]]] = [
    ("--listen", "listen", {"metavar": "HOST:PORT", "help": "HTTP proxy address (default 127.0.0.1:3128)"}),
    ("--control", "control", {"metavar": "HOST:PORT|unix:PATH", "help": "control API (default 127.0.0.1:3129)"}),
    ("--control-token", "control_token",
     {"metavar": "TOKEN",
      "help": "control API bearer token (default: generated and written, mode 600, to "
              "~/.local/state/egressd/control.token, or to PATH.token for --control unix:PATH, where "
              f"egressd pending|allow|deny read it) {visible('control_token')}"}),
    ("--allow", "allow",
     {"action": "append", "metavar": "ENTRY",
      "help": "allow a destination: example.com, *.example.com, host:PORT, host:* (repeatable)"}),
    ("--deny", "deny",
     {"action": "append", "metavar": "ENTRY", "help": "deny a destination; wins over --allow (repeatable)"}),
    ("--preset", "preset",
     {"action": "append", "metavar": "NAME", "help": "add a named allowlist: python, node, github, ... (repeatable)"}),
    ("--allow-file", "allow_file",
     {"metavar": "FILE",
      "help": "an allowlist file (TOML: allow = [...], deny = [...]); its entries apply, and answers "
      "with scope 'always' are appended to it"}),
    ("--allow-private", "allow_private",
     {"action": "append", "metavar": "CIDR",
      "help": "let allowed names resolve into this private/special range (repeatable)"}),
    ("--secret", "secret",
     {"action": "append", "metavar": "NAME@HOST",
      "help": "a secret the sandbox never holds: NAME@HOST[|HOST...][ HEADER] (default header Authorization); "
      "its value is egressd's environment variable NAME, the sandbox gets a placeholder (repeatable)"}),
    ("--inspect-origin-ca-file", "inspect_origin_ca_file",
     {"metavar": "PATH",
      "help": "a CA file trusted for inspected origins besides the system's (names with request rules)"}),
    ("--approver", "approver",
     {"action": "append", "choices": ["terminal", "slack", "webhook", "web", "deny"],
      "help": "who answers requests for unknown domains (repeatable; default: the terminal when a person "
      "is at it, and for serve its approvals page too; none otherwise)"}),
    ("--approval-timeout", "approval_timeout",
     {"type": float, "metavar": "SECONDS", "help": "how long a request is held for an answer (default 600)"}),
    ("--max-pending-approvals", "max_pending_approvals",
     {"type": int, "metavar": "N",
      "help": "approvals one run may have waiting; past it: too_many_pending (default 5)"}),
    ("--max-approvals-per-run", "max_approvals_per_run",
     {"type": int, "metavar": "N",
      "help": "approval requests one run may make; past it the run stops asking: not_allowlisted (default 20)"}),
    ("--webhook-url", "webhook_url",
     {"metavar": "URL", "help": "webhook approver: where approval requests are POSTed"}),
    ("--webhook-secret", "webhook_secret",
     {"metavar": "WHSEC", "help": f"webhook approver: whsec_ key signing the requests {visible('webhook_secret')}"}),
    ("--webhook-callback-secret", "webhook_callback_secret",
     {"metavar": "WHSEC", "help": "webhook approver: a separate whsec_ key the callback must be signed with "
      + visible("webhook_callback_secret")}),
    ("--public-url", "public_url",
     {"metavar": "URL",
      "help": "base URL under which the control server is reachable (webhook callback, Slack interactivity)"}),
    ("--slack-bot-token", "slack_bot_token",
     {"metavar": "XOXB", "help": f"Slack approver: bot token {visible('slack_bot_token')}"}),
    ("--slack-app-token", "slack_app_token",
     {"metavar": "XAPP", "help": "Slack approver: app-level token for Socket Mode (no public URL needed) "
      + visible("slack_app_token")}),
    ("--slack-signing-secret", "slack_signing_secret",
     {"metavar": "SECRET", "help": "Slack approver: signing secret for the HTTP interactivity endpoint "
      + visible("slack_signing_secret")}),
    ("--slack-channel", "slack_channel",
     {"metavar": "CHANNEL_ID", "help": "Slack approver: the channel id approval messages go to"}),
    ("--slack-approvers", "slack_approvers",
     {"action": "append", "metavar": "ID",
      "help": "Slack approver: a user id (U…) or user-group id (S…) who may answer (repeatable)"}),
    ("--slack-relay", "slack_relay",
     {"action": "store_const", "const": True,
      "help": "in a fleet (--state): post to Slack, and answer through their holders, the approvals of the "
      "instances that have no Slack of their own (one instance of the fleet)"}),
    ("--slack-api-url", "slack_api_url",
     {"metavar": "URL", "help": "Slack Web API base URL (default https://slack.com/api/)"}),
    ("--upstream-dns", "upstream_dns",
     {"metavar": "HOST:PORT", "help": "DNS server egressd asks (default: the system resolver)"}),
    ("--dns-listen", "dns_listen",
     {"metavar": "HOST:PORT", "help": "sandbox-facing DNS server, UDP and TCP (default: off)"}),
    ("--dns-answer", "dns_answer",
     {"metavar": "ADDRESS",
      "help": "IPv4 address every A query is answered with (default: the transparent listeners' host)"}),
    ("--dns-answer6", "dns_answer6",
     {"metavar": "ADDRESS", "help": "IPv6 address AAAA queries are answered with (default: an empty answer)"}),
    ("--dns-strict", "dns_strict",
     {"action": "store_const", "const": True, "help": "answer NXDOMAIN for names the run could never reach"}),
    ("--transparent-tls", "transparent_tls",
     {"metavar": "HOST:PORT",
      "help": "transparent TLS listener: the SNI decides, destination port 443 (default: off)"}),
    ("--transparent-http", "transparent_http",
     {"metavar": "HOST:PORT",
      "help": "transparent HTTP listener: the Host header decides, destination port 80 (default: off)"}),
    ("--socks", "socks",
     {"metavar": "HOST:PORT",
      "help": "SOCKS5 listener: CONNECT under the same policy, username/password a run's id and token "
      "(default: off)"}),
    ("--audit-log", "audit_log",
     {"metavar": "PATH",
      "help": "audit log file (default ~/.local/state/egressd/audit.jsonl); - : standard output (serve only)"}),
    ("--audit-max-bytes", "audit_max_bytes",
     {"type": int, "metavar": "N",
      "help": "rotate the audit log before it would pass N bytes (default 0: never; SIGUSR1 reopens it)"}),
    ("--audit-keep", "audit_keep",
     {"type": int, "metavar": "N", "help": "rotated audit logs kept, PATH.1 ... PATH.N (default 5)"}),
    ("--max-head-bytes", "max_head_bytes",
     {"type": int, "metavar": "N", "help": "largest request head (default 65536)"}),
    ("--head-timeout-s", "head_timeout_s",
     {"type": float, "metavar": "S", "help": "time to send a request head (default 10)"}),
    ("--connect-timeout-s", "connect_timeout_s",
     {"type": float, "metavar": "S", "help": "time to connect upstream (default 10)"}),
    ("--upload-budget-mb", "upload_budget_mb",
     {"type": float, "metavar": "MIB",
      "help": "MiB a run may send to one registered domain before a person is asked to let it go on "
      "(default 0: no budget)"}),
    ("--request-body-cap-mb", "request_body_cap_mb",
     {"type": float, "metavar": "MIB",
      "help": "MiB one request's body may send to an inspected name before a person is asked to let it go on "
      "(default 0: no cap)"}),
    ("--idle-timeout-s", "idle_timeout_s",
     {"type": float, "metavar": "S", "help": "idle tunnel lifetime (default 300)"}),
    ("--workers", "workers",
     {"type": int, "metavar": "N",
      "help": "processes serving the proxy's listeners and DNS (SO_REUSEPORT); the first also holds the runs, "
      "approvals and the control API, and the connection caps are shared out among them "
      "(default 0: one per core; 1: a single process)"}),
    ("--max-connections", "max_connections",
     {"type": int, "metavar": "N", "help": "open client connections overall (default 10000)"}),
    ("--max-connections-per-run", "max_connections_per_run",
     {"type": int, "metavar": "N", "help": "open client connections per run (default 1000)"}),
    ("--max-refusal-records", "max_refusal_records",
     {"type": int, "metavar": "N",
      "help": "refusal records per run per interval; past it they are counted in one egress.suppressed "
      "record per interval (default 50)"}),
    ("--refusal-interval-s", "refusal_interval_s",
     {"type": float, "metavar": "S", "help": "the interval of --max-refusal-records (default 10)"}),
    ("--state", "state",
     {"metavar": "URI",
      "help": "postgresql://USER@HOST/DATABASE: share approvals and the list of instances with every egressd "
      "of a fleet through this database (migrate it first: egressd state migrate; docs/fleet.md) "
      f"{visible('state')}"}),
    ("--share-denials", "share_denials",
     {"choices": ["run", "task", "group"],
      "help": "in a fleet (--state), how far a person's denial reaches: run (default, as without a fleet), task "
      "(every run with the same task on every instance), group (every instance of the same --group); it covers "
      "the host's registered domain for 24 hours"}),
    ("--group", "group",
     {"metavar": "NAME", "help": "this egressd's policy group in its fleet, for --share-denials group "
      "(default: default)"}),
    ("--log-level", "log_level",
     {"choices": ["debug", "info", "warning", "error"], "help": "stderr log level (default info)"}),
    ("--log-format", "log_format",
     {"choices": ["text", "json"], "help": "stderr log format: text, or json for a log collector (default text)"}),
    *secret_file_flags(),
]


# Where egressd listens and who may use it: ``serve``'s to choose. ``run`` and
# ``agent`` fix them for their sandbox (a private socket, the run's own
# addresses, credentials required), so they do not offer these flags. A
# fleet's state database is everyone's: ``run`` joins the fleet with it
# (the bubblewrap backend; docs/fleet.md).
SERVICE_ONLY = frozenset(
    {"listen", "control", "dns_listen", "dns_answer", "transparent_tls", "transparent_http", "socks", "require_auth",
     "workers", "slack_relay"}
)


# --help's sections, by setting name: (heading, names or name prefixes); the rest are "policy".
_HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("secrets kept off the command line", ("*_file",)),
    ("listeners and control API",
     ("listen", "control", "control_token", "transparent_", "socks", "require_auth", "workers")),
    ("approvals", ("approver", "approval_", "max_pending_", "max_approvals_", "webhook_", "slack_", "public_url")),
    ("DNS", ("dns_", "upstream_dns")),
    ("a fleet's shared state", ("state", "share_denials", "group")),
    ("audit log", ("audit_", "max_refusal_", "refusal_")),
    ("limits and logging", ("max_", "head_", "connect_", "idle_", "splice", "log_level", "log_format")),
)


def help_group(dest: str) -> str:
    """The --help section of the flag that sets ``dest``."""
    for heading, names in _HELP_GROUPS:
        for name in names:
            if name == "*_file":
                if dest.endswith("_file") and dest != "allow_file":
                    return heading
            elif dest == name or (name.endswith("_") and dest.startswith(name)):
                return heading
    return "policy"


def env_help(dest: str, text: str) -> str:
    """An option's help naming its environment variable: the one place that spells it from the setting's name."""
    return f"{text} [env EGRESSD_{dest.upper()}]"


# The settings whose flags ``add_common`` makes itself (not from ``COMMON``'s table).
OWN_FLAGS = ("ask", "require_auth", "learn", "web_inbox", "splice")


def add_common(parser: argparse.ArgumentParser, *, service: bool = True) -> None:
    """The settings' flags in sections, each naming its variable; ``service=False`` (``run``, ``agent``)
    leaves out ``SERVICE_ONLY``."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file [env EGRESSD_CONFIG]")
    groups: dict[str, Any] = {}

    def add(flag: str, dest: str, **kwargs: Any) -> None:
        heading = help_group(dest)
        if heading not in groups:
            groups[heading] = parser.add_argument_group(heading)
        groups[heading].add_argument(flag, dest=dest, **kwargs | {"help": env_help(dest, kwargs.get("help", ""))})

    for flag, dest, kwargs in COMMON:
        if service or dest not in SERVICE_ONLY:
            add(flag, dest, default=None, **kwargs)
    add("--no-ask", "ask", action="store_const", const=False, default=None,
        help="refuse unknown domains without asking anyone (not_allowlisted; the variable: false)")
    if service:
        add("--require-auth", "require_auth", action="store_const", const=True, default=None,
            help="no default run: every client needs run credentials")
        add("--web-inbox", "web_inbox", action=argparse.BooleanOptionalAction, default=None,
            help="the approvals page as an inbox: a new domain is held up to the approval timeout while "
            "nobody has the page open (default: on when web is the only approver); --no-web-inbox: "
            "refused no_approver until someone has it open")
    add("--no-splice", "splice", action="store_const", const=False, default=None,
        help="copy every tunnel's bytes through egressd; by default a tunnel's bytes move in the kernel "
        "(splice(2)) once its TLS server name is checked, 64 KiB have moved and no upload budget counts them "
        "(the variable: false)")
    add("--learn", "learn", action="store_const", const=True, default=None,
        help="learn mode, for building an allowlist: nothing is held or refused for not being "
        "allowlisted; each such attempt goes out and is recorded with \"learned\" (deny entries, "
        "IP literals and private addresses are still refused). Then: egressd audit suggest")


def subcommand(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is no option (the top level takes none but
    --help and --version), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit 2 with the subcommand's usage and the option most likely meant (`--alow`: `--allow`)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices.get(args.subcommand, parser)
    options = [option for action in command._actions for option in action.option_strings]
    meant = [close[0] for word in unknown if word.startswith("--")
             for close in [difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.7)] if close]
    hint = f" (did you mean {', '.join(meant)}?)" if meant else ""
    command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
