"""``egressd run``: one command in a fresh sandbox pinned to an embedded egressd.

Order of work, and of undoing it (every step is undone whatever happens:
success, failure, timeout, Ctrl-C, SIGTERM):

1. remove leftovers of runs whose egressd died (namespaces, veths, cgroups);
2. create the run's network (namespace, veth, nftables fence);
3. start egressd on the host side of the veth: proxy, DNS, transparent TLS and
   HTTP, control API on a private unix socket; register the run (allowlist,
   source address, credentials);
4. run the command in bubblewrap inside that namespace, printing each egress
   refusal to stderr as it happens;
5. copy out what was asked for; destroy sandbox, egressd, network.

Exit status: the command's own; 124 past --timeout; 137 killed for memory;
125 when the sandbox could not be created.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from audit.records import run_record
from config.settings import Settings, SettingsError
from proxy.responses import REASON_MESSAGES
from proxy.runs import Run
from sandbox.copyout import CopyOutError, check_pattern
from sandbox.launcher import EXIT_CANNOT_START, Sandbox, SandboxError
from sandbox.limits import Limits, leftover_cgroups
from sandbox.network import DEFAULT_RANGE, EgressPorts, NetworkError, RunNetwork, clean_leftovers, owner_alive

from .service import EgressService, StartupError, entries_from_settings


class RunFailed(Exception):
    """The sandbox could not be set up; exit 125 with this message."""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", metavar="DIR", help="working directory, read-write at /work (default: a fresh temporary one)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temporary working directory afterwards")
    parser.add_argument("--timeout", type=float, metavar="S", help="wall-clock limit; past it the whole tree is killed (exit 124)")
    parser.add_argument("--memory", type=int, metavar="MB", help="memory limit (exit 137 when exceeded)")
    parser.add_argument("--cpu", type=int, metavar="S", help="CPU-time limit per process")
    parser.add_argument("--max-pids", type=int, default=512, metavar="N", help="process limit (default 512)")
    parser.add_argument("--copy-out", action="append", default=[], metavar="GLOB", help="copy matching files out of the working directory (repeatable)")
    parser.add_argument("--copy-out-dir", default=".", metavar="DIR", help="where --copy-out puts files (default: the current directory)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]", help="pass a variable into the sandbox (repeatable); nothing else from the host gets in")
    parser.add_argument("--backend", choices=["bwrap", "docker"], default="bwrap", help="sandbox backend (default bwrap)")
    parser.add_argument("--net-range", default=DEFAULT_RANGE, metavar="CIDR", help=f"where per-run /30 subnets come from (default {DEFAULT_RANGE})")
    parser.add_argument("--task", help="what the run is for (shown in approval messages)")


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise SettingsError(f"bad setting env: {item!r} is not NAME or NAME=VALUE")
        if not sep:
            if name not in os.environ:
                raise SettingsError(f"bad setting env: {name} is not set here")
            value = os.environ[name]
        env[name] = value
    return env


def refusal_printer(run_id: str) -> Any:
    def observe(record: dict[str, Any]) -> None:
        if record.get("run") != run_id or record.get("decision") != "deny":
            return
        host, port, reason = record.get("host"), record.get("port"), record.get("reason") or ""
        target = f"{host}:{port}" if port else f"{host}"
        if not target.isprintable():
            target = ascii(target)
        kind = f" ({record.get('kind')})" if record.get("kind") == "dns" else ""
        print(f"egressd: blocked {target}{kind} ({REASON_MESSAGES.get(reason, reason)})", file=sys.stderr, flush=True)

    return observe


async def clean_stale() -> list[str]:
    """Leftovers of dead runs: namespaces, veths, cgroups."""
    removed = await clean_leftovers()
    live = {p.name for p in Path("/run/egressd/runs").glob("*") if owner_alive(p.name)} if Path("/run/egressd/runs").is_dir() else set()
    for group in leftover_cgroups(live):
        with contextlib.suppress(OSError):
            group.rmdir()
            removed.append(str(group))
    return removed


async def run_in_sandbox(args: argparse.Namespace, settings: Settings) -> int:
    if not args.command:
        raise SettingsError("bad argument: no command given (egressd run [options] -- COMMAND ...)")
    if args.backend == "docker":
        raise RunFailed("the docker backend is not available in this version of egressd; use --backend bwrap")
    if os.geteuid() != 0:
        raise RunFailed("egressd run needs root to create network namespaces (see: egressd doctor)")
    for tool in ("bwrap", "nsenter", "ip", "nft"):
        if shutil.which(tool) is None:
            raise RunFailed(f"{tool} is not installed (see: egressd doctor)")
    for pattern in args.copy_out:
        try:
            check_pattern(pattern)
        except CopyOutError as exc:
            raise SettingsError(f"bad setting copy_out: {exc}") from None
    extra_env = parse_env(args.env)
    allow, deny = entries_from_settings(settings)

    await clean_stale()
    made_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="egressd-work-")) if made_workdir else Path(args.workdir)
    if not workdir.is_dir():
        raise RunFailed(f"working directory {workdir} does not exist")
    private = Path(tempfile.mkdtemp(prefix="egressd-run-"))
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, private, True)
        if made_workdir and not args.keep_workdir:
            stack.callback(shutil.rmtree, workdir, True)
        try:
            net = await RunNetwork.create(pool=args.net_range, ports=EgressPorts())
        except NetworkError as exc:
            raise RunFailed(f"cannot create the sandbox network: {exc}") from None
        stack.push_async_callback(net.destroy)
        host = str(net.plan.host_ip)
        ports = net.ports
        service_settings = settings.model_copy(
            update={
                "listen": f"{host}:{ports.proxy}",
                "dns_listen": f"{host}:{ports.dns}",
                "transparent_tls": f"{host}:{ports.tls}",
                "transparent_http": f"{host}:{ports.http}",
                "dns_answer": host,
                "control": f"unix:{private / 'control.sock'}",
                "require_auth": True,
            }
        )
        service = EgressService(service_settings)
        try:
            await service.start()
        except StartupError:
            raise
        stack.push_async_callback(service.close, 1.0)
        assert service.runs is not None and service.gate is not None
        command_text = shlex.join(args.command)
        run: Run = service.runs.create(
            task=args.task or command_text, allow=allow, deny=deny, ask=settings.ask, sources=[net.plan.sandbox_ip]
        )
        run.command = command_text
        service.gate.audit.write(
            run_record("run.start", ts=time.time(), run=run.id, task=run.task, allow=[e.text for e in allow],
                       deny=[e.text for e in deny], sources=[str(net.plan.sandbox_ip)], command=command_text)
        )
        stack.callback(lambda: _end_run(service, run))
        service.gate.observers.append(refusal_printer(run.id))
        try:
            box = Sandbox(
                network=net,
                workdir=workdir,
                proxy_url=f"http://{run.id}:{run.token}@{host}:{ports.proxy}",
                extra_env=extra_env,
                term=os.environ.get("TERM"),
            )
        except SandboxError as exc:
            raise RunFailed(str(exc)) from None
        stack.push_async_callback(box.destroy)
        stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.fileno()
        limits = Limits(timeout_s=args.timeout, memory_mb=args.memory, max_pids=args.max_pids, cpu_s=args.cpu)
        try:
            obs = await box.run(args.command, limits=limits, capture=False, stdin=stdin)
        except SandboxError as exc:
            raise RunFailed(str(exc)) from None
        if obs.timed_out:
            print(f"egressd: the command ran past --timeout {args.timeout:g}s and was killed", file=sys.stderr)
        if obs.memory_exceeded:
            print(f"egressd: the command exceeded --memory {args.memory} MB and was killed", file=sys.stderr)
        if args.copy_out:
            report = box.copy_out(args.copy_out, Path(args.copy_out_dir))
            for line in report.lines():
                print(f"egressd: copy-out: {line}", file=sys.stderr)
        if made_workdir and args.keep_workdir:
            print(f"egressd: working directory kept at {workdir}", file=sys.stderr)
        return obs.exit_code


def _end_run(service: EgressService, run: Run) -> None:
    if service.runs is not None and service.runs.get(run.id) is not None:
        service.runs.end(run.id)
    if service.gate is not None:
        with contextlib.suppress(Exception):
            service.gate.audit.write(run_record("run.end", ts=time.time(), run=run.id))


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from .main import run_async

    async def main() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        received: list[int] = []

        def stop(signum: int) -> None:
            received.append(signum)
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, stop, sig)
        try:
            return await run_in_sandbox(args, settings)
        except asyncio.CancelledError:
            if received:
                print("egressd: interrupted; the sandbox was destroyed", file=sys.stderr)
                return 128 + received[0]
            raise
        except RunFailed as exc:
            print(f"egressd: {exc}", file=sys.stderr)
            return EXIT_CANNOT_START
        except StartupError as exc:
            print(f"egressd: {exc}", file=sys.stderr)
            return EXIT_CANNOT_START

    return run_async(main)
