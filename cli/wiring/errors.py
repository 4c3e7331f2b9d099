"""The error every command reports as ``egressd: MESSAGE`` (exit 2), in a module of its own: ``cli.main``
catches it without importing the service (and with it aiohttp) for commands that never start one."""

from __future__ import annotations


class StartupError(Exception):
    """egressd cannot start as configured; the message says which setting and why."""
