"""Declared secrets (the ``secret`` setting) with their values, made ready for the proxy (``proxy.core.secrets``).

A secret's value is egressd's own environment variable NAME, or the file
NAME_FILE names (read as the ``*_file`` settings are: the Docker backend's
sidecar gets its values so); the sandbox only ever gets the placeholder.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from egressd.config.settings import Settings, read_secret_file
from egressd.proxy.core.policy import Entry
from egressd.proxy.core.secrets import Secret, SecretError, Secrets, parse_secret, placeholder


class SecretSettingError(Exception):
    """The ``secret`` setting cannot be used as it is (the message says why)."""


def secrets_from_settings(
    settings: Settings, allow: Sequence[Entry] | None, environ: Mapping[str, str]
) -> Secrets | None:
    """The declared secrets with their values (egressd's environment, or the file NAME_FILE names) and
    fresh placeholders; SecretSettingError saying why not.

    Each secret's names must be inspected (a request rule in ``allow`` names them; an empty ``allow``
    names none): elsewhere egressd cannot put it in. ``allow`` None is for where runs bring their own
    lists (``serve --require-auth``; the Docker backend's sidecar, whose run's list its launcher
    checked): a secret to a name a run does not inspect is never put in, and its placeholder goes
    nowhere it could be read.
    """
    if not settings.secret:
        return None
    inspected = [entry for entry in allow or () if entry.request is not None]
    declared: list[Secret] = []
    for text in settings.secret:
        name = text.partition("@")[0].strip()
        value = environ.get(name, "")
        if not value and environ.get(f"{name}_FILE"):
            try:
                value = read_secret_file(Path(environ[f"{name}_FILE"]), euid=os.geteuid())
            except ValueError as exc:
                raise SecretSettingError(f"bad setting secret: {name}_FILE: {exc}") from None
        try:
            secret = parse_secret(text, value=value, placeholder=placeholder(secrets.token_hex(16)))
        except SecretError as exc:
            missing = f" (egressd's environment has no {name})" if name and not environ.get(name) else ""
            raise SecretSettingError(f"bad setting secret: {exc}{missing}") from None
        for entry in secret.hosts if allow is not None else ():
            if not any(rule.host == entry.host and rule.wildcard == entry.wildcard for rule in inspected):
                raise SecretSettingError(
                    f"bad setting secret: {secret.name}: {entry.text} has no request rule, so egressd cannot put the "
                    f"secret in (add one, e.g. '{entry.text}/**')"
                )
        declared.append(secret)
    return Secrets(declared)
