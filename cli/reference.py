"""docs/settings.md, generated from the settings themselves: ``python -m egressd.cli.reference > docs/settings.md``.

One row per field of ``egressd.config.settings.Settings``, in declaration order: the
TOML key is the field's name; the flag is the ``egressd serve`` option whose
destination is that field, read from the parser (a setting the command line
does not offer shows "—"); the environment variable is ``EGRESSD_`` and the
name in upper case (the model's ``env_prefix``); the default is the field's;
the meaning is the field's description, and a secret setting says so.

It lives in ``cli`` and not in ``config`` because the flags are ``cli``'s:
``config`` is the bottom layer of the import contracts and may not import
``cli``. ``tests/project/test_readme.py`` fails when docs/settings.md is not this
module's output.
"""

from __future__ import annotations

import argparse
from typing import Any

from egressd.config.settings import SECRET_SETTINGS, Settings

from .main import build_parser

COMMAND = "python -m egressd.cli.reference > docs/settings.md"

_HEADER = f"""\
# Settings

<!-- Generated: do not edit. Change the descriptions in config/settings.py (or the flags in cli/main.py),
     then run `{COMMAND}`. -->

This file is generated from the settings' own descriptions: after changing a
setting in `config/settings.py` (or a flag in `cli/main.py`), run
`{COMMAND}`.

Every option is a flag, an environment variable `EGRESSD_<NAME>` (lists
comma-separated: `EGRESSD_ALLOW=pypi.org,*.github.com`) and a key in the TOML
file given by `--config` or `EGRESSD_CONFIG`. The command line wins, then
the environment, then the file, then the defaults. A bad value stops start-up
with one line naming the setting:

```
$ egressd serve --allow '*.com'
egressd: bad setting allow: entry '*.com': 'com' is a public suffix, so the wildcard would cover domains owned by anyone
```

"""

_FOOTER = """
Secrets (`control_token`, `slack_bot_token`, `slack_app_token`,
`slack_signing_secret`, `webhook_secret`, `webhook_callback_secret`) also
come from files: `--control-token-file FILE`, `EGRESSD_CONTROL_TOKEN_FILE`,
or `control_token_file` in the config file, and so on for each. A flag on the
command line is visible to every local user in the process list, so prefer
the file or the environment. A secret file must be a regular file (not a
link) of yours or root's that no one else may read or write (0600 or 0400),
and giving a secret both ways is an error. egressd drops every secret
variable (and the model API keys of `egressd agent`) from its environment
once it has read them, so nothing it starts inherits them.

The config file, the allow file, the audit log and every secret file are
opened without following a link, at the name or on the way to it (name the
file by its real path), and must be regular files of yours or root's that no
one else may write (`chmod go-w`); a FIFO or a directory is refused. For
`egressd run` and `egressd agent` none of them may be inside `--workdir`:
keep them beside the project, not in it (`~/.config/egressd/`), or the
sandboxed command could rewrite the policy of every later run.

Example `egressd.toml`:

```toml
listen = "127.0.0.1:3128"
allow = ["pypi.org", "files.pythonhosted.org", "*.example.org"]
deny = ["secrets.example.org"]
preset = ["node"]
audit_log = "/var/log/egressd/audit.jsonl"
upstream_dns = "127.0.0.53:53"
```
"""


def serve_flags(parser: argparse.ArgumentParser | None = None) -> dict[str, str]:
    """The long option of ``egressd serve`` that sets each settings field, by field name."""
    parser = parser or build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags: dict[str, str] = {}
    for action in subcommands.choices["serve"]._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if long and action.dest not in flags:
            flags[action.dest] = long[0]
    return flags


def _default(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, list):
        return "[" + ", ".join(f"`{v}`" for v in value) + "]"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_settings_reference(flags: dict[str, str] | None = None) -> str:
    """The whole of docs/settings.md (pure given ``flags``, the field → serve flag map)."""
    flags = serve_flags() if flags is None else flags
    rows = [
        "| setting (TOML key) | flag | environment | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, field in Settings.model_fields.items():
        flag = f"`{flags[name]}`" if name in flags else "—"
        meaning = field.description or ""
        if name in SECRET_SETTINGS:
            meaning += " (a secret: see below)"
        default = _default(field.get_default(call_default_factory=True))
        rows.append(f"| `{name}` | {flag} | `EGRESSD_{name.upper()}` | {default} | {_cell(meaning)} |")
    return _HEADER + "\n".join(rows) + "\n" + _FOOTER


if __name__ == "__main__":
    print(render_settings_reference(), end="")
