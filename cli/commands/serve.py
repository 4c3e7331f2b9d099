"""``egressd serve``: the proxy, its listeners and the control API in the foreground until SIGINT or SIGTERM;
SIGHUP re-reads the config and allow files, SIGUSR1 reopens the audit log (logrotate's postrotate)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from egressd.audit import native
from egressd.config.settings import Settings, SettingsError, token_path

from ..wiring.errors import StartupError
from ..wiring.fleet import FleetPresence
from ..wiring.instances import register_quietly
from ..wiring.service import EgressService, ReloadError


def reload(service: EgressService, read: Callable[[], Settings]) -> None:
    """SIGHUP: read the settings again and hand them to the service; a bad one is refused, the old policy kept."""
    try:
        settings = read()
    except SettingsError as exc:
        service.refuse_reload(str(exc))
        return
    except Exception as exc:  # a signal handler is a task boundary: refused, recorded, egressd carries on
        service.refuse_reload(f"cannot read the settings: {exc}")
        return
    with contextlib.suppress(ReloadError):  # logged and recorded by the service
        service.reload(settings)


async def serve(settings: Settings, open_files: tuple[int, int], read: Callable[[], Settings]) -> int:
    fleet = await FleetPresence.open(settings)  # checked before anything listens
    service = EgressService(settings, workers=True, fleet_instance=fleet.id if fleet is not None else None)
    try:
        await service.start()
    except BaseException:
        if fleet is not None:
            await fleet.leave()
        raise
    # Said once started: a setting egressd refuses is the one line a bad start prints.
    logging.getLogger("egressd").info("open files: up to %d (hard limit %d)", *open_files)
    logging.getLogger("egressd").info("audit line: %s", native.DESCRIPTION)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, service.reopen_audit)  # logrotate's postrotate
    loop.add_signal_handler(signal.SIGHUP, reload, service, read)  # re-read the config and allow files
    # The ports actually bound (port 0 in a setting gets one from the kernel); "serving:" comes last,
    # so whoever waits for it has seen every listener's address.
    sandbox_facing = [
        f"{name} {server.address[0]}:{server.address[1]}"
        for name, server in (
            ("dns", service.dns),
            ("tls", service.transparent_tls),
            ("http", service.transparent_http),
            ("socks", service.socks),
        )
        if server is not None
    ]
    if sandbox_facing:  # "sandbox-facing", not "transparent": SOCKS is none of those
        logging.getLogger("egressd").info("sandbox-facing: %s", ", ".join(sandbox_facing))
    run = service.default_run
    host, port = service.proxy_address
    if fleet is not None:
        try:
            registry = service.runs
            fleet.runs = lambda: [run.describe() for run in registry or ()]
            instance = await fleet.join(f"proxy {host}:{port}, control {service.control_address}")
        except StartupError:
            await service.close()
            await fleet.leave()
            raise
        logging.getLogger("egressd").info("fleet: state database %s, this egressd listed as %s", fleet.shown,
                                          instance.id)  # fmt: skip
    logging.getLogger("egressd").info(
        "serving: proxy %s:%d, control %s, audit log %s, %s, %s%s",
        host, port, service.control_address,
        "standard output" if str(settings.audit_path) == "-" else settings.audit_path,
        "1 process" if service.processes == 1 else f"{service.processes} processes",
        f"default run allows {', '.join(e.text for e in run.allow) or 'nothing'}" if run else "runs need credentials",
        " (LEARN MODE: the allowlist is not enforced; deny entries, IP literals and private addresses still are)"
        if settings.learn else "",
    )
    # In the registry of running instances, for `egressd pending|allow|deny` to find.
    registration = register_quietly(kind="serve", control=service.control_address,
                                    token_file=None if settings.control_token is not None else token_path(settings))
    try:
        await stop.wait()
    finally:
        if registration is not None:
            registration.remove()
        logging.getLogger("egressd").info("shutting down (grace %.0fs)", settings.shutdown_grace_s)
        await service.close()
        if fleet is not None:
            await fleet.leave()
    return 0
