"""The one root ``Settings`` object.

Precedence, highest first: the command line (passed in as init values), then
``EGRESSD_<NAME>`` environment variables, then the TOML file named by
``--config``/``EGRESSD_CONFIG``, then the defaults below. ``load_settings`` is
the only way in: it turns every validation failure into one ``SettingsError``
whose message names the setting and what was wrong, so nothing starts
half-configured.

Values here are checked for shape (an address is ``HOST:PORT``, a CIDR is a
network, a number is in range). Whether an allowlist entry is meaningful is
the proxy's business; ``cli`` checks entries with ``egressd.proxy.core.policy`` and reports
them in the same form.

Secrets (``SECRET_SETTINGS``) can also be read from a file: ``NAME_file``
(``--NAME-file``, ``EGRESSD_NAME_FILE``), because a flag is on the command
line, which every local user can read. The file must be a regular file (not
a link) of ours or root's that no one else may read or write
(``read_secret_file``); giving both a secret and its file is an error.
``secret_variables`` names the environment variables that held secrets,
for ``cli`` to drop once the settings are read.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from egressd.config.trusted import UntrustedFile, read_trusted
from egressd.fleet import dsn
from egressd.names.addresses import unmapped
from egressd.names.authority import AuthorityError, Colons, parse_authority

Approver = Literal["terminal", "slack", "webhook", "web", "deny"]

# Lists read from the environment are comma-separated (EGRESSD_ALLOW=a.com,b.org),
# not JSON: NoDecode stops pydantic-settings from json-decoding them first.
CsvList = Annotated[list[str], NoDecode]


class SettingsError(Exception):
    """A setting is missing, malformed or out of range; the message names it."""


# The settings that hold secrets: each also has a NAME_file setting. Model keys
# are not settings (``egressd.agent.spec`` reads them from the environment).
SECRET_SETTINGS = (
    "control_token",
    "slack_bot_token",
    "slack_app_token",
    "slack_signing_secret",
    "webhook_secret",
    "webhook_callback_secret",
    "state",
)
# A token or key is a line; anything much longer is the wrong file.
MAX_SECRET_BYTES = 64 * 1024


def read_secret_file(path: Path, *, euid: int) -> str:
    """The secret ``path`` holds, without surrounding whitespace; ValueError saying why not.

    Opened and checked by ``egressd.config.trusted``: refused, a link at the
    name or on the way, anything but a regular file (a FIFO is opened without
    waiting for a writer), a file owned by anyone but ``euid`` or root, a file
    whose mode lets its group or others read or write it; then an empty one,
    one past MAX_SECRET_BYTES.
    """
    try:
        data = read_trusted(path, secret=True, limit=MAX_SECRET_BYTES, euid=euid)
    except FileNotFoundError as exc:
        raise ValueError(f"cannot open {path}: {exc.strerror}") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except UntrustedFile as exc:
        raise ValueError(str(exc)) from None
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not text:
        raise ValueError(f"{path} is empty")
    return text


# EGRESSD_* variables that are not settings: the config file's name, the audit line's choice (audit/native.py),
# and the scripts' and tests' own.
_NOT_SETTINGS = ("EGRESSD_CONFIG", "EGRESSD_TEST_", "EGRESSD_DOCKER_", "EGRESSD_LINK_DIR", "EGRESSD_NATIVE")


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``EGRESSD_*`` names in ``environ`` that no setting reads, each with the variable it most likely
    meant (None when none is close): a typo there is as silent as one in a config file is loud (pure)."""
    known = {f"EGRESSD_{name}".upper() for name in Settings.model_fields}
    known |= {f"EGRESSD_{name}_FILE".upper() for name in SECRET_SETTINGS}
    found = []
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith("EGRESSD_") and upper not in known and not upper.startswith(_NOT_SETTINGS):
            close = difflib.get_close_matches(upper, known, n=1, cutoff=0.8)
            found.append((name, close[0] if close else None))
    return found


def secret_variables(environ: Mapping[str, str]) -> list[str]:
    """The names in ``environ`` that hold a secret setting (``EGRESSD_<NAME>``, in any case) (pure)."""
    names = {f"EGRESSD_{name}".upper() for name in SECRET_SETTINGS}
    return [name for name in environ if name.upper() in names]


def default_state_dir() -> Path:
    """Where egressd keeps its audit log and control token when not told otherwise."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "egressd"


def parse_hostport(text: str, setting: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` to a tuple; ValueError naming the setting otherwise.

    An address to listen on: port 0 (any free port) is allowed, and an
    unbracketed IPv6 address takes the port after its last colon.
    """
    try:
        host, port = parse_authority(
            text, colons=Colons.LAST, port_zero=True, port_digits=None, port_unicode_digits=True, host=str
        )
    except AuthorityError:
        raise ValueError(f"{setting}: expected HOST:PORT, got {text!r}") from None
    if not host:
        raise ValueError(f"{setting}: expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ValueError(f"{setting}: {host!r} is not an IP address") from None
    return host, port


def protected_url(url: str) -> bool:
    """Whether nobody on the wire can read or forge what is exchanged with ``url``.

    True for https, and for plain http to a loopback address written as one
    (``127.0.0.0/8``, ``::1``): those packets never leave the machine. A name
    such as ``localhost`` is not enough: what it resolves to is the
    resolver's business (an /etc/hosts line, a container's DNS), and egressd
    cannot check it before it sends. A URL with user info is never trusted
    (``http://127.0.0.1@evil.example/`` goes to evil.example).
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return False
    if "@" in parts.netloc or "\\" in url or host is None:
        return False
    if parts.scheme == "https":
        return True
    if parts.scheme != "http":
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return unmapped(address).is_loopback


class Settings(BaseSettings):
    """Every option of ``serve``/``run``/``agent``. Field names are the flag
    names with dashes as underscores; units are in the descriptions and, for
    the limits that are not part of the design's command line, in the name."""

    model_config = SettingsConfigDict(
        env_prefix="EGRESSD_",
        extra="forbid",
        validate_default=True,
        case_sensitive=False,
    )

    # Listeners. Loopback by default: a proxy open to the network would let
    # anyone on it use this machine's allowlist.
    listen: str = Field("127.0.0.1:3128", description="HTTP proxy HOST:PORT")
    control: str = Field("127.0.0.1:3129", description="control API HOST:PORT or unix:PATH")
    control_token: SecretStr | None = Field(None, description="bearer token for the control API")
    control_token_file: Path | None = Field(None, description="a file holding control_token")

    # Policy.
    allow: CsvList = Field(default_factory=list, description="allowlist entries")
    deny: CsvList = Field(default_factory=list, description="denylist entries")
    preset: CsvList = Field(default_factory=list, description="named allowlists")
    allow_file: Path | None = Field(
        None, description="allowlist file (TOML): its entries apply, and approvals with scope always append to it"
    )
    allow_private: CsvList = Field(default_factory=list, description="CIDRs exempt from the private-address check")
    secret: CsvList = Field(
        default_factory=list,
        description="declared secrets, NAME@HOST[|HOST...][ HEADER]: the sandbox gets a placeholder as NAME, "
        "egressd puts the value of its own environment variable NAME into inspected requests to those hosts only",
    )
    inspect_origin_ca_file: Path | None = Field(
        None,
        description="a CA file trusted for inspected origins besides the system's (private origins, tests)",
    )
    ask: bool = Field(True, description="ask an approver about unknown domains (--no-ask: refuse them)")
    require_auth: bool = Field(False, description="no default run: every client needs run credentials")
    learn: bool = Field(
        False,
        description="learn mode: let through what the allowlist would refuse or hold, recording it as `learned` "
        "(deny entries, IP literals, private addresses and every other check still refuse)",
    )

    # Approvals (the config file may also group these under an [approvals] table).
    approver: Annotated[list[Approver], NoDecode] = Field(
        default_factory=list,
        description="who answers unknown domains: terminal, slack, webhook, web (approvals page), deny (repeatable)",
    )
    approval_timeout: float = Field(600.0, gt=0, le=86400, description="seconds a request is held")
    web_inbox: bool | None = Field(
        None,
        description="the approvals page as an inbox: a new domain is held up to approval_timeout while nobody has "
        "the page open (default: on when web is the only approver; false: refused until someone has it open)",
    )
    max_pending_approvals: int = Field(
        5, ge=1, le=10000, description="approvals one run may have waiting at once; past it: `too_many_pending`"
    )
    # Approval fatigue: a person asked twenty times in one run is being worn
    # down, not informed; past this the run stops asking (not_allowlisted).
    max_approvals_per_run: int = Field(
        20,
        ge=1,
        le=100_000,
        description="approval requests one run may make, timeouts included; past it the run stops asking "
        "(`not_allowlisted`) and every channel says so once",
    )
    # Weakens protection, hence the name: a plain http --webhook-url off loopback can be read
    # and answered by anyone on the path. With it, egressd ignores the answer in the
    # receiver's response (answers come only by the signed callback or the control API).
    # `egressd run --backend docker` sets it for its terminal relay on the Docker gateway.
    # Declared before webhook_url, whose check reads it.
    unsafe_webhook_http: bool = Field(
        False,
        description="allow a plain http `webhook_url` off loopback; an answer in the receiver's response is then "
        "ignored (only the signed callback or the control API decide). `egressd run --backend docker` sets it for "
        "its terminal relay",
    )
    webhook_url: str | None = Field(
        None,
        description="where approval requests are POSTed: https, or plain http only to a loopback address written "
        "as one (`127.0.0.1`, `[::1]`)",
    )
    state: SecretStr | None = Field(
        None,
        description="postgresql://USER@HOST/DATABASE: the database a fleet of egressd instances shares "
        "(docs/fleet.md); unset: this egressd keeps everything to itself",
    )
    state_file: Path | None = Field(None, description="a file holding state (a URI with its password)")
    share_denials: Literal["run", "task", "group"] = Field(
        "run",
        description="how far a person's denial reaches in a fleet (needs state): run (the run that asked, as "
        "without a fleet), task (every run with the same task on every instance), group (every run of every "
        "instance of the same group); it covers the host's registered domain for 24 hours (docs/fleet.md)",
    )
    group: str = Field(
        "default",
        description="this egressd's policy group in its fleet: with share_denials group, a denial given for one "
        "instance of the group covers them all",
    )
    webhook_secret: SecretStr | None = Field(None, description="whsec_ key signing outgoing webhooks")
    webhook_secret_file: Path | None = Field(None, description="a file holding webhook_secret")
    webhook_callback_secret: SecretStr | None = Field(None, description="whsec_ key the callback must be signed with")
    webhook_callback_secret_file: Path | None = Field(None, description="a file holding webhook_callback_secret")
    public_url: str | None = Field(
        None, description="base URL under which the control server is reachable (webhook callback, Slack interactivity)"
    )
    slack_bot_token: SecretStr | None = Field(None, description="xoxb- token")
    slack_bot_token_file: Path | None = Field(None, description="a file holding slack_bot_token")
    slack_app_token: SecretStr | None = Field(None, description="xapp- token for Socket Mode")
    slack_app_token_file: Path | None = Field(None, description="a file holding slack_app_token")
    slack_signing_secret: SecretStr | None = Field(None, description="verifies the HTTP interactivity endpoint")
    slack_signing_secret_file: Path | None = Field(None, description="a file holding slack_signing_secret")
    slack_channel: str | None = Field(None, description="channel id the approval messages go to")
    slack_approvers: CsvList = Field(
        default_factory=list, description="Slack user ids (U…) or user-group ids (S…) who may answer"
    )
    slack_api_url: str | None = Field(None, description="Slack Web API base URL (tests point it at a fake)")
    slack_relay: bool = Field(
        False,
        description="in a fleet (state): post to Slack, and answer through their holders, the approvals of the "
        "instances that have no Slack of their own; give it to one instance (docs/fleet.md)",
    )

    # The sandbox-facing DNS server and transparent listeners.
    dns_listen: str | None = Field(None, description="DNS server HOST:PORT (UDP and TCP)")
    dns_answer: str | None = Field(
        None,
        description="the IPv4 address every A query is answered with (default: the transparent listeners' host, "
        "then the DNS listener's own)",
    )
    dns_answer6: str | None = Field(
        None, description="the address AAAA queries are answered with (default: empty answer)"
    )
    dns_strict: bool = Field(False, description="NXDOMAIN for names the run could never reach")
    transparent_tls: str | None = Field(None, description="SNI listener HOST:PORT (destination port 443)")
    transparent_http: str | None = Field(None, description="Host-header listener HOST:PORT (destination port 80)")
    socks: str | None = Field(
        None, description="SOCKS5 listener HOST:PORT (CONNECT; username/password: a run's id and token)"
    )

    # Resolution.
    upstream_dns: str | None = Field(
        None, description="HOST:PORT of the DNS server egressd asks; default: the system resolver"
    )

    # Audit.
    audit_log: Path | None = Field(None, description="JSON Lines file; default: STATE_DIR/audit.jsonl")
    audit_fsync: bool = Field(False, description="fsync after every record (slower, survives power loss)")
    # Off by default: the log is evidence, and egressd deletes none of it unless told to. Operators who
    # rotate with logrotate keep this off and send SIGUSR1 after the move (rotating twice would drop files).
    audit_max_bytes: int = Field(
        0, ge=0, description="rotate the audit log before a record would take it past this many bytes; 0: never"
    )
    audit_keep: int = Field(
        5, ge=1, le=1000, description="rotated audit logs kept (PATH.1 newest ... PATH.N); older ones are deleted"
    )

    # Limits. Each default is what a well-behaved client never meets.
    max_head_bytes: int = Field(64 * 1024, ge=1024, le=1024 * 1024, description="request head size (431 past it)")
    head_timeout_s: float = Field(10.0, gt=0, le=600, description="time to receive a request head")
    connect_timeout_s: float = Field(10.0, gt=0, le=600, description="time to connect upstream")
    upload_budget_mb: float = Field(
        0.0,
        ge=0,
        le=1024 * 1024,
        description="MiB a run may send to one registered domain before a person is asked to let it go on "
        "(the connection paused meanwhile; 0: no budget)",
    )
    request_body_cap_mb: float = Field(
        0.0,
        ge=0,
        le=1024 * 1024,
        description="MiB one request's body may send to an inspected name before a person is asked to let it go "
        "on (the client no longer read meanwhile; 0: no cap)",
    )
    idle_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="a tunnel idle this long both ways, or a plain-HTTP body that moves no byte this long, is closed "
        "(`end: idle_timeout` in its record)",
    )
    splice: bool = Field(
        True,
        description="move a tunnel's bytes in the kernel (splice(2), Linux) once its TLS server name is checked, "
        "64 KiB have moved and no upload budget counts them (--no-splice: copy them through egressd)",
    )
    workers: int = Field(
        0,
        ge=0,
        le=64,
        description="processes serving the proxy's listeners and DNS (SO_REUSEPORT); the first also holds the runs, "
        "approvals, channels and the control API, and the connection caps are shared out among them "
        "(0: one per core this process may use, by its affinity and cgroup quota, at most 64)",
    )
    max_connections: int = Field(10000, ge=1, le=1_000_000, description="open client connections overall")
    max_connections_per_run: int = Field(1000, ge=1, le=1_000_000, description="open client connections per run")
    shutdown_grace_s: float = Field(10.0, ge=0, le=3600, description="time tunnels get to finish on shutdown")
    # Floods: a run refused thousands of times a second (random DNS labels, unknown hosts)
    # must not fill the disk. Past this many refusal records per interval, a run's further
    # refusals are still refused but counted into one egress.suppressed record per interval.
    max_refusal_records: int = Field(
        50, ge=1, le=1_000_000, description="refusal records per run per interval; past it they are counted"
    )
    refusal_interval_s: float = Field(
        10.0, ge=0.1, le=3600, description="the interval max_refusal_records counts over, in seconds"
    )

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="stderr log level: debug, info, warning, error"
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="stderr log format: text (TIME egressd MESSAGE) or json (one object per line)"
    )

    @field_validator("allow", "deny", "preset", "allow_private", "approver", "slack_approvers", "secret", mode="before")
    @classmethod
    def _split_csv(cls, value: Any) -> Any:
        # "a,b" from the environment, and ["a,b", "c"] from repeated flags, both split.
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [part.strip() for v in value for part in v.split(",") if part.strip()]
        return value

    @field_validator("listen", "dns_listen", "transparent_tls", "transparent_http", "socks")
    @classmethod
    def _check_hostport(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            parse_hostport(value, info.field_name or "address")
        return value

    @field_validator("dns_answer", "dns_answer6")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise ValueError(f"{value!r} is not an IP address") from None
        return value

    @field_validator("webhook_url", "public_url", "slack_api_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        scheme, sep, rest = value.partition("://")
        if (
            scheme not in ("http", "https")
            or not sep
            or not rest
            or rest.startswith("/")
            or any(c.isspace() for c in value)
        ):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    @field_validator("webhook_url")
    @classmethod
    def _check_webhook_transport(cls, value: str | None, info: ValidationInfo) -> str | None:
        # DESIGN.md "Channels": https; plain http only to a loopback address. Over
        # any other plain http, anyone on the path could forge the receiver's answer.
        if value is None or protected_url(value) or info.data.get("unsafe_webhook_http"):
            return value
        raise ValueError(
            f"{value!r} is not https, and plain http is allowed only to a loopback address "
            "(127.0.0.1 or [::1], written as an address), because anyone on the path could read "
            "the approval requests and forge the answers; use an https URL"
        )

    @field_validator("control")
    @classmethod
    def _check_control(cls, value: str) -> str:
        if value.startswith("unix:"):
            if len(value) == len("unix:"):
                raise ValueError("control: unix: needs a socket path")
            return value
        parse_hostport(value, "control")
        return value

    @field_validator("upstream_dns")
    @classmethod
    def _check_upstream_dns(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if ":" not in value.replace("::", ""):  # bare host: port 53
            value = f"{value}:53"
        parse_hostport(value, "upstream_dns")
        return value

    @field_validator("allow_private")
    @classmethod
    def _check_cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an IP network (CIDR)") from None
        return value

    @field_validator("approver")
    @classmethod
    def _dedupe_approvers(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _read_secret_files(self) -> Settings:
        # After every source is merged: a secret given one way (flag, variable, config
        # file) and its file another is as ambiguous as both given the same way.
        errors = []
        for name in SECRET_SETTINGS:
            path = getattr(self, f"{name}_file")
            if path is None:
                continue
            if getattr(self, name) is not None:
                errors.append(f"{name}_file: {name} is given too; give one of them")
                continue
            try:
                setattr(self, name, SecretStr(read_secret_file(path, euid=os.geteuid())))
            except ValueError as exc:
                errors.append(f"{name}_file: {exc}")
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @model_validator(mode="after")
    def _check_state(self) -> Settings:
        # After the file is read: the URI it holds is checked the same way (and never shown with its password).
        if self.state is not None:
            try:
                dsn.check(self.state.get_secret_value())
            except ValueError as exc:
                raise ValueError(f"state: {exc}") from None
            if self.slack_relay and "slack" not in self.approver:
                raise ValueError("slack_relay: it relays through this instance's Slack: it needs approver slack")
        elif self.slack_relay:
            raise ValueError("slack_relay: it relays the approvals of a fleet's other instances: it needs state")
        elif self.share_denials != "run":
            raise ValueError(f"share_denials: {self.share_denials} shares denials through a fleet's database: it "
                             "needs state")  # fmt: skip
        if not self.group or len(self.group) > 100 or not self.group.isprintable():
            raise ValueError("group: a name of 1 to 100 printable characters")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        file_values = getattr(settings_cls, "file_values", None)
        if not file_values:
            return (init_settings, env_settings)
        return (init_settings, env_settings, InitSettingsSource(settings_cls, init_kwargs=dict(file_values)))

    # Derived values, so callers never re-parse.
    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_hostport(self.listen, "listen")

    @property
    def audit_path(self) -> Path:
        return self.audit_log if self.audit_log is not None else default_state_dir() / "audit.jsonl"

    @property
    def allow_private_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(c, strict=False) for c in self.allow_private]


def _format_error(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        name = ".".join(str(p) for p in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        if not name:  # a check of several settings (``_read_secret_files``): it names them itself
            parts.append(msg)
            continue
        msg = msg.removeprefix(f"{name}: ")
        if item["type"] == "extra_forbidden":
            msg = "unknown setting"
        parts.append(f"{name}: {msg}")
    return "bad setting " + "; ".join(parts)


# Tables of the config file whose keys are settings of their own (DESIGN.md:
# the channel settings live in [approvals]).
_TABLES = ("approvals",)


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML file's settings, with the ``[approvals]`` table flattened.

    It shapes the policy, so it is opened and checked by ``egressd.config.trusted``
    (no link on the way, a regular file of ours or root's that nobody else may change).
    """
    try:
        data = tomllib.loads(read_trusted(path).decode("utf-8"))
    except FileNotFoundError:
        raise SettingsError(f"bad setting config: {path} does not exist") from None
    except UntrustedFile as exc:
        raise SettingsError(f"bad setting config: {exc}") from None
    except OSError as exc:
        raise SettingsError(f"bad setting config: {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"bad setting config: {path}: {exc}") from None
    for table in _TABLES:
        section = data.pop(table, None)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise SettingsError(f"bad setting {table}: expected a table")
        for key, value in section.items():
            if key in data:
                raise SettingsError(f"bad setting {key}: given both at the top level and in [{table}]")
            data[key] = value
    return data


def config_path(config_file: Path | str | None = None) -> Path | None:
    """The config file ``load_settings`` reads: ``config_file``, else ``EGRESSD_CONFIG``, else none."""
    path = config_file or os.environ.get("EGRESSD_CONFIG") or None
    return Path(path) if path is not None else None


def load_settings(cli_values: Mapping[str, Any], config_file: Path | str | None = None) -> Settings:
    """Build the settings from the command line, environment and config file.

    ``cli_values`` holds only the options given on the command line (None
    values are dropped). ``config_file`` falls back to ``EGRESSD_CONFIG``.
    Raises SettingsError with one message naming every bad setting.
    """
    path = config_path(config_file)
    file_values: dict[str, Any] = {}
    if path is not None:
        file_values = read_config_file(path)

    class BoundSettings(Settings):
        pass

    BoundSettings.file_values = file_values  # type: ignore[attr-defined]
    bound = BoundSettings
    values = {k: v for k, v in cli_values.items() if v is not None}
    try:
        return bound(**values)
    except ValidationError as exc:
        raise SettingsError(_format_error(exc)) from None


def token_path(settings: Settings) -> Path:
    """Where the control token is written for ``egressd pending|allow|deny`` (and the page's sign-in) to find."""
    if settings.control.startswith("unix:"):
        return Path(settings.control.removeprefix("unix:") + ".token")
    return default_state_dir() / "control.token"
