"""``egressd run``: one command in a fresh sandbox pinned to an embedded egressd.

``egressd.cli.wiring.session.SandboxSession`` sets up and tears down the sandbox (network,
embedded egressd, run, bubblewrap), ``egressd.cli.wiring.docker_session.DockerSession`` its
Docker counterpart (``--backend docker``: networks, egressd's container or
``--connect``, the sandbox's containers); this module runs the one command in it,
printing each egress refusal to stderr as it happens, copies out what was
asked for, and maps signals and failures to exit statuses. The command's
output reaches a terminal of ours only through the session's
``TerminalOutput`` (escaped, held back while an approval prompt is shown).

Exit status: the command's own; 124 past --timeout; 137 killed for memory;
125 when the sandbox could not be created.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

from egressd.approvals.commandoutput import TerminalOutput
from egressd.audit.log import STDOUT
from egressd.audit.views import EgressSeen
from egressd.config.settings import SECRET_SETTINGS, Settings, SettingsError, config_path, token_path
from egressd.names.shown import logged
from egressd.proxy.core.decision import private_hint
from egressd.sandbox.backend import EXIT_CANNOT_START, FdOutput, Observation, OutputSink, SandboxError
from egressd.sandbox.copyout import CopyOutError, check_destination, check_pattern
from egressd.sandbox.docker.config import DEFAULT_DOCKER_RANGE
from egressd.sandbox.limits import Limits
from egressd.sandbox.network import DEFAULT_RANGE
from egressd.vocabulary.reasons import Reason, reason_message

from ..wiring.control_client import ControlError
from ..wiring.controltoken import UntrustedEndpoint, check_url
from ..wiring.docker_session import DEFAULT_EGRESSD_IMAGE, DEFAULT_IMAGE, DockerSession, copy_out
from ..wiring.service import StartupError, learn_notice
from ..wiring.session import SandboxSession, Session, SessionError


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", metavar="DIR", help="working directory, read-write at /work (default: a fresh temporary one)"
    )
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temporary working directory afterwards")
    parser.add_argument(
        "--timeout", type=float, metavar="S", help="wall-clock limit; past it the whole tree is killed (exit 124)"
    )
    parser.add_argument("--memory", type=int, metavar="MB", help="memory limit (exit 137 when exceeded)")
    parser.add_argument("--cpu", type=int, metavar="S", help="CPU-time limit per process")
    parser.add_argument("--max-pids", type=int, default=512, metavar="N", help="process limit (default 512)")
    add_copy_out_arguments(parser, when="")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="pass a variable into the sandbox (repeatable); nothing else from the host gets in. "
        "NAME alone takes the value from our environment; NAME=VALUE is visible to other "
        "local users in the process list",
    )
    add_backend_arguments(parser)
    parser.add_argument("--task", help="what the run is for (shown in approval messages)")


def add_copy_out_arguments(parser: argparse.ArgumentParser, *, when: str) -> None:
    """``--copy-out`` and ``--copy-out-dir``, as ``run`` and ``agent`` take them (``when``: " afterwards")."""
    parser.add_argument(
        "--copy-out",
        action="append",
        default=[],
        metavar="GLOB",
        help=f"copy matching files out of the working directory{when} (repeatable)",
    )
    parser.add_argument(
        "--copy-out-dir",
        default=".",
        metavar="DIR",
        help="where --copy-out puts files (default: the current directory); "
        "never a link, nor inside the working directory",
    )


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """The sandbox backend's options (``egressd run`` and ``egressd agent``); ``open_session`` reads them."""
    parser.add_argument(
        "--backend", choices=["bwrap", "docker"], default="bwrap", help="sandbox backend (default bwrap)"
    )
    parser.add_argument(
        "--net-range",
        default=DEFAULT_RANGE,
        metavar="CIDR",
        help=f"where per-run subnets come from (default {DEFAULT_RANGE}: /30s; "
        f"with --backend docker {DEFAULT_DOCKER_RANGE}: /28s)",
    )
    parser.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        metavar="IMAGE",
        help=f"--backend docker: the sandbox's toolchain image (default {DEFAULT_IMAGE})",
    )
    parser.add_argument(
        "--egressd-image",
        default=DEFAULT_EGRESSD_IMAGE,
        metavar="IMAGE",
        help=f"--backend docker: egressd's own image, run beside the sandbox (default {DEFAULT_EGRESSD_IMAGE})",
    )
    parser.add_argument(
        "--connect",
        metavar="URL",
        help="--backend docker: use the running egressd whose control API is at URL "
        "(its --control-token) instead of starting one",
    )


def open_session(args: argparse.Namespace, settings: Settings, **common: Any) -> Session:
    """The session of the backend ``add_backend_arguments`` chose (not entered yet).

    ``common`` is what both take: workdir, task, extra_env, keep_workdir, term.
    """
    if args.connect and args.backend != "docker":
        raise SettingsError("bad argument: --connect needs --backend docker")
    if args.connect:
        try:
            check_url(args.connect)  # before anything starts; ControlClient checks each connection again
        except UntrustedEndpoint as exc:
            raise SettingsError(f"bad argument: --connect: not sending the control token there: {exc}") from None
    if args.connect and settings.learn:
        # Learn mode is the deciding egressd's: a run registered with another one gets that one's mode.
        raise SettingsError("bad argument: --learn with --connect: start the egressd you connect to with --learn")
    if args.backend == "docker":
        if settings.learn:  # the sidecar's own stderr is not this terminal
            print(learn_notice(None), file=sys.stderr, flush=True)
        net_range = DEFAULT_DOCKER_RANGE if args.net_range == DEFAULT_RANGE else args.net_range
        session: Session = DockerSession(
            settings,
            image=args.image,
            egressd_image=args.egressd_image,
            connect=args.connect,
            net_range=net_range,
            **common,
        )
    else:
        session = SandboxSession(settings, net_range=args.net_range, **common)
    session.kind = getattr(args, "subcommand", None) or "run"  # run or agent, as the registry names it
    return session


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


def refusal_line(seen: EgressSeen) -> str | None:
    """The line that tells of one refusal of the run, or of an attempt learn mode let through instead (else None)."""
    target = logged(seen.target)
    kind = " (dns)" if seen.kind == "dns" else ""
    if not seen.denied:
        if seen.learned is None:
            return None
        return f"egressd: learned {target}{kind} (let through by --learn: {reason_message(seen.learned)})\n"
    if not seen.is_refusal or seen.reason is None:
        return None  # answered as designed (a query type egressd does not answer): the audit log has it
    said = reason_message(seen.reason)
    if seen.reason == Reason.PRIVATE_ADDRESS.value and seen.address:  # what to do about it, when it is yours
        said += f": {logged(seen.address)}, {private_hint(logged(seen.address))}"
    return f"egressd: blocked {target}{kind} ({said})\n"


def _on_tty(stream: TextIO | None) -> bool:
    return stream is not None and stream.isatty()


def refusal_printer(output: TerminalOutput) -> Callable[[EgressSeen], None]:
    """Print each refusal of the run, and each attempt --learn let through, to stderr as it happens."""

    def tell(seen: EgressSeen) -> None:
        line = refusal_line(seen)
        if line is None:
            return
        if _on_tty(sys.stderr):
            output.write(sys.stderr.fileno(), line.encode())
        else:
            print(line, end="", file=sys.stderr, flush=True)

    return tell


def relay_sinks(output: TerminalOutput) -> tuple[OutputSink, OutputSink] | None:
    """Where the command's stdout and stderr go: None (ours, inherited) unless one is a terminal.

    A terminal is not handed in: the command could read from it (a tty is
    opened read-write) or draw on it. It gets the output through ``output``:
    escaped, and held back while an approval prompt is shown. The other
    stream, a file or a pipe, gets the bytes as they are.
    """

    def sink(stream: TextIO | None) -> OutputSink:
        if stream is None:
            return FdOutput(-1)  # we have no such stream: what would go there is dropped
        return output.stream(stream.fileno()) if stream.isatty() else FdOutput(stream.fileno())

    if not (_on_tty(sys.stdout) or _on_tty(sys.stderr)):
        return None
    return sink(sys.stdout), sink(sys.stderr)


def check_copy_out(args: argparse.Namespace) -> None:
    """The --copy-out patterns and --copy-out-dir, before any sandbox exists (``egressd run`` and ``agent``).

    A destination inside the given working directory, or a link, is refused
    here: the command could plant links there (copy-out checks it again).
    """
    for pattern in args.copy_out:
        try:
            check_pattern(pattern)
        except CopyOutError as exc:
            raise SettingsError(f"bad setting copy_out: {exc}") from None
    if args.copy_out:
        try:
            check_destination(Path(args.copy_out_dir), Path(args.workdir) if args.workdir else None)
        except CopyOutError as exc:
            raise SettingsError(f"bad setting copy_out_dir: {exc}") from None


def _keep_out(setting: str, path: Path, workdir: Path, where: str = "") -> None:
    """SessionError (exit 125) if ``path`` (or a file made at it) would be inside ``workdir``: copy-out's rule.

    One walk, by device and inode: a link or bind mount leading into ``workdir`` is inside it too.
    """
    try:
        check_destination(path, workdir)
    except CopyOutError:
        raise SessionError(
            f"bad setting {setting}: {where or path} would be inside the working directory {workdir}, "
            "where the sandboxed command can read, rewrite and plant files: move it out of the working directory"
        ) from None


def _policy_and_secret_files(args: argparse.Namespace, settings: Settings) -> list[tuple[str, Path]]:
    """(setting, path) of every file egressd reads with authority for this run: config, allow file, secrets."""
    files: list[tuple[str, Path]] = []
    config = config_path(getattr(args, "config", None))
    if config is not None:
        files.append(("config", config))
    if settings.allow_file is not None:
        files.append(("allow_file", settings.allow_file))
    for name in SECRET_SETTINGS:
        path = getattr(settings, f"{name}_file")
        if path is not None:
            files.append((f"{name}_file", path))
    return files


def check_private_files(args: argparse.Namespace, settings: Settings) -> None:
    """Files the command must never reach, before any sandbox exists (``egressd run`` and ``agent``).

    DESIGN.md, "Policy" and "Secrets": files that shape policy or hold
    secrets are never inside a run's working directory, and are opened
    without following links (``egressd.config.trusted``, when they are read).

    1. the transcript (``agent``) and the audit log must not be links
       (they are opened without following one: refused here, before the run,
       SettingsError);
    2. none of these may be inside ``--workdir`` (a fresh working directory
       holds none of them), or the command could rewrite the policy of every
       later run, or read a secret: the config file, the allow file, every
       secret's file (``*_file``), the transcript, the audit log (the default
       one is in the state directory, so ``--workdir ~`` is refused), the
       run's control socket and token file (made in the temporary directory,
       with bubblewrap), and the token file ``--connect`` reads. Refused with
       SessionError: exit 125, nothing started.
    """
    if str(settings.audit_path) == STDOUT:
        raise SettingsError(
            "bad setting audit_log: - (standard output) is for egressd serve; run and agent print the command's "
            "output there: name a file"
        )
    files = [("audit_log", settings.audit_path, "audit log")]
    if getattr(args, "transcript", None):
        files.insert(0, ("transcript", Path(args.transcript), "transcript"))
    for setting, path, what in files:
        if path.is_symlink():
            raise SettingsError(f"bad setting {setting}: {path} is a link, and the {what} is never opened through one")
    if not args.workdir:
        return
    workdir = Path(args.workdir)
    for setting, path in [*_policy_and_secret_files(args, settings), *((s, p) for s, p, _ in files)]:
        _keep_out(setting, path, workdir)
    if args.backend == "bwrap":
        temp = Path(tempfile.gettempdir())
        # Where SandboxSession makes the run's private directory (control socket, token file).
        _keep_out(
            "workdir",
            temp / "egressd-run-",
            workdir,
            f"the run's control socket and token file (made in the temporary directory {temp}, TMPDIR)",
        )
    if args.connect and settings.control_token is None:
        _keep_out("control_token", token_path(settings), workdir, f"the control token file {token_path(settings)}")


async def run_in_sandbox(args: argparse.Namespace, settings: Settings) -> int:
    if not args.command:
        raise SettingsError("bad argument: no command given (egressd run [options] -- COMMAND ...)")
    check_copy_out(args)
    check_private_files(args, settings)
    command_text = shlex.join(args.command)
    common: dict[str, Any] = {
        "workdir": Path(args.workdir) if args.workdir else None,
        "task": args.task or command_text,
        "extra_env": parse_env(args.env),
        "keep_workdir": args.keep_workdir,
        "term": os.environ.get("TERM"),
    }
    session = open_session(args, settings, **common)
    async with session:
        session.set_command(command_text)
        session.observe(refusal_printer(session.terminal_output))
        control = getattr(session, "control_address", None)
        if settings.approver and control and hasattr(session, "on_held"):
            # Said once, when the first request is held: only then is there something to answer.
            said: list[bool] = []

            def other_terminal() -> None:
                if not said:
                    said.append(True)
                    print(f"egressd: answer this run's approvals from another terminal with "
                          f"egressd pending|allow ID|deny ID --control {control}", file=sys.stderr, flush=True)

            session.on_held(other_terminal)
        # A terminal on stdin stays ours (the approval prompt reads it); a pipe is passed in.
        stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.fileno()
        limits = Limits(timeout_s=args.timeout, memory_mb=args.memory, max_pids=args.max_pids, cpu_s=args.cpu)
        try:
            relay = relay_sinks(session.terminal_output)
            obs = await session.box.run(args.command, limits=limits, capture=False, stdin=stdin, relay=relay)
        except SandboxError as exc:
            raise SessionError(str(exc)) from None
        session.exit_status = obs.exit_code
        if obs.timed_out:
            print(f"egressd: the command ran past --timeout {args.timeout:g}s and was killed", file=sys.stderr)
        if obs.memory_exceeded:
            print(f"egressd: the command exceeded --memory {args.memory} MB and was killed", file=sys.stderr)
        for line in exit_explained(obs, args.cpu, args.max_pids):
            print(f"egressd: {line}", file=sys.stderr)
        if args.copy_out:
            report = await copy_out(session.box, args.copy_out, Path(args.copy_out_dir))
            for line in report.lines():
                print(f"egressd: copy-out: {line}", file=sys.stderr)
        if session.made_workdir and args.keep_workdir:
            print(f"egressd: working directory kept at {session.workdir}", file=sys.stderr)
        return obs.exit_code


def exit_explained(obs: Observation, cpu_s: int | None, max_pids: int) -> list[str]:
    """What else a limit did to the command, said after it ended (the time and memory limits say their own)."""
    said = []
    if cpu_s is not None and obs.exit_code == 128 + signal.SIGXCPU:
        said.append(f"the command used its --cpu {cpu_s}s of CPU time and was killed (SIGXCPU, exit {obs.exit_code})")
    if obs.pids_exhausted:
        said.append(f"the command reached --max-pids {max_pids}: a process it tried to start was refused")
    return said


def run_sandboxed(work: Callable[[], Awaitable[int]], say: Callable[[str], None]) -> int:
    """Run ``work`` (a sandboxed run) on the event loop, as ``egressd run`` and ``egressd agent`` do.

    SIGINT, SIGTERM and SIGHUP cancel it, so its sessions are torn down, and
    the exit status is 128 + the signal; a sandbox that could not be set up
    is exit 125, with the reason said once.
    """
    from ..wiring.loop import run_async

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
            return await work()
        except asyncio.CancelledError:
            if received:
                say("interrupted; the sandbox was destroyed")
                return 128 + received[0]
            raise
        except (SessionError, ControlError, StartupError) as exc:
            say(str(exc))
            return EXIT_CANNOT_START

    return run_async(main)


def _say(line: str) -> None:
    print(f"egressd: {line}", file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    return run_sandboxed(lambda: run_in_sandbox(args, settings), _say)
