"""``egressd agent``: a model whose every shell command runs in one sandbox.

Wiring: the model client comes from ``egressd.agent.spec`` (checked, with its key,
before anything is created), ``egressd.cli.wiring.session.SandboxSession`` makes the
sandbox and its embedded egressd, ``SandboxExecutor`` below runs the model's
commands in it (setting the run's current command, collecting each
command's egress refusals), and ``egressd.agent.loop.run_agent`` drives the model.
Afterwards: copy-out, then the sandbox is destroyed (the session's exit,
whatever happened: model failure, Ctrl-C, SIGTERM), the transcript's last
line, the egress summary on stderr and the final answer on stdout.

Exit status: 0 the model gave a final answer; 1 it reached --max-steps; 124
two commands in a row ran past --timeout; 3 the model failed (bad key,
unknown model, endpoint down after retries); 125 the sandbox could not be
created or a command could not be started; 2 a bad option; 128+N when
egressd got signal N.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections import Counter
from pathlib import Path

from egressd.agent.endpoint import RetryPolicy
from egressd.agent.loop import DEFAULT_MAX_STEPS, AgentOutcome, ExecutorError, Step, Stop, run_agent
from egressd.agent.model import Conversation, Model
from egressd.agent.prompt import system_prompt
from egressd.agent.script import ScriptError
from egressd.agent.spec import KEY_VARIABLES, SpecError, open_model, parse_model_spec
from egressd.agent.transcript import TranscriptError, TranscriptWriter
from egressd.audit.views import EgressSeen, Refusal
from egressd.config.settings import Settings, SettingsError
from egressd.names.shown import printable
from egressd.sandbox.backend import EXIT_CANNOT_START, Observation, SandboxError
from egressd.sandbox.limits import DEFAULT_MAX_PIDS, Limits
from egressd.vocabulary.reasons import reason_message

from ..wiring.docker_session import copy_out
from ..wiring.service import StartupError, entries_from_settings
from ..wiring.session import Session
from .run import (
    add_backend_arguments,
    add_copy_out_arguments,
    check_copy_out,
    check_private_files,
    open_session,
    parse_env,
    run_sandboxed,
)

EXIT_MAX_STEPS = 1
EXIT_MODEL_FAILED = 3
EXIT_TIMEOUTS = 124
EXIT_FOR_STOP = {Stop.FINAL: 0, Stop.MAX_STEPS: EXIT_MAX_STEPS, Stop.TIMEOUTS: EXIT_TIMEOUTS}
# Per command. Long enough for a dependency install or a test suite, short
# enough that a hung command costs minutes, not the afternoon.
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MEMORY_MB = 2048
# Per stream, per command: what the model reads has to fit in its context.
DEFAULT_MAX_OUTPUT = 16 * 1024
# Refusal records are written when the proxy answers; give a connection that
# closed as the command exited this long to be recorded before we look.
SETTLE_S = 0.05
SHOWN_CHARS = 160


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", required=True, help="what the agent is to do (the prompt; approval messages show it)")
    parser.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        help="openai:MODEL, anthropic:MODEL, openai-compatible:URL:MODEL or script:FILE",
    )
    parser.add_argument("--model-url", metavar="URL", help="another base URL for openai:/anthropic: (a gateway)")
    parser.add_argument(
        "--model-timeout",
        type=float,
        default=RetryPolicy.timeout_s,
        metavar="S",
        help=f"time for one model request (default {RetryPolicy.timeout_s:g})",
    )
    parser.add_argument(
        "--model-retries",
        type=int,
        default=RetryPolicy.attempts - 1,
        metavar="N",
        help=f"retries on 429/5xx/connection errors (default {RetryPolicy.attempts - 1})",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=DEFAULT_MAX_STEPS,
        metavar="N",
        help=f"most commands the agent may run (default {DEFAULT_MAX_STEPS})",
    )
    parser.add_argument("--transcript", metavar="FILE", help="write every step and the final answer as JSON Lines")
    parser.add_argument(
        "--workdir", metavar="DIR", help="working directory, read-write at /work (default: a fresh temporary one)"
    )
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temporary working directory afterwards")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"time limit per command (default {DEFAULT_TIMEOUT_S:g}); two in a row past it end the run",
    )
    parser.add_argument(
        "--memory",
        type=int,
        default=DEFAULT_MEMORY_MB,
        metavar="MB",
        help=f"memory limit per command (default {DEFAULT_MEMORY_MB})",
    )
    parser.add_argument("--cpu", type=int, metavar="S", help="CPU-time limit per process")
    parser.add_argument(
        "--max-pids",
        type=int,
        default=DEFAULT_MAX_PIDS,
        metavar="N",
        help=f"process limit (default {DEFAULT_MAX_PIDS})",
    )
    parser.add_argument(
        "--max-output",
        type=int,
        default=DEFAULT_MAX_OUTPUT,
        metavar="BYTES",
        help=f"stdout and stderr kept per command, each (default {DEFAULT_MAX_OUTPUT})",
    )
    add_copy_out_arguments(parser, when=" afterwards")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="pass a variable into the sandbox (repeatable); never the model's API key",
    )
    add_backend_arguments(parser)


def _shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """One line a terminal can show safely: the first line, control characters escaped, cut."""
    first, _, rest = text.strip().partition("\n")
    line = printable(first)
    if len(line) > limit:
        line = line[:limit] + "…"
    return line + (" …" if rest.strip() else "")


def _answer_text(text: str) -> str:
    """The final answer for stdout: lines and tabs kept, other control characters escaped."""
    return printable(text, keep_layout=True)


def _target(refusal: Refusal) -> str:
    return _shown(refusal.target)


def shell_argv() -> list[str]:
    """bash when the toolchain has it (the sandbox sees the host's /usr), else /bin/sh."""
    for candidate in ("/usr/bin/bash", "/bin/bash"):
        if os.access(candidate, os.X_OK):
            return [candidate, "-c"]
    return ["/bin/sh", "-c"]


class SandboxExecutor:
    """``egressd.agent.loop.Executor`` on a session of either backend: one ``sh -c COMMAND`` per call."""

    def __init__(self, session: Session, *, limits: Limits, max_output: int, shell: list[str]) -> None:
        self.session = session
        self.limits = limits
        self.max_output = max_output
        self.shell = shell

    def set_command(self, command: str | None) -> None:
        self.session.set_command(command)

    async def run(self, command: str) -> Observation:
        cursor = self.session.cursor()
        try:
            obs = await self.session.box.run(
                [*self.shell, command], limits=self.limits, capture=True, max_output=self.max_output
            )
        except SandboxError as exc:
            raise ExecutorError(str(exc)) from None
        await asyncio.sleep(SETTLE_S)
        obs.egress_refusals = [
            Refusal(r.host, r.port, r.reason, message=r.reason and reason_message(r.reason))
            for r in self.session.refusals_since(cursor)
        ]
        return obs


class EgressTally:
    """Every connection attempt of the run, for the summary: allowed, approved, denied.

    DNS queries are not counted: the sandbox's resolver is egressd, which
    answers them itself, so nothing leaves the machine for them.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.destinations: dict[str, Counter[str]] = {"allowed": Counter(), "approved": Counter(), "denied": Counter()}
        self.approved_hosts: set[str] = set()

    def __call__(self, seen: EgressSeen) -> None:
        if seen.event != "egress" or seen.kind == "dns":
            return
        host, target = seen.host, seen.target
        if seen.denied:
            reason = seen.reason or ""
            self.counts["denied"] += 1
            self.destinations["denied"][f"{target} ({reason_message(reason)})"] += 1
            return
        if seen.approved:
            self.approved_hosts.add(str(host))
        kind = "approved" if host in self.approved_hosts else "allowed"
        self.counts[kind] += 1
        self.destinations[kind][target] += 1

    def lines(self) -> list[str]:
        counts = self.counts
        out = [f"egress: {counts['allowed']} allowed, {counts['approved']} approved, {counts['denied']} denied"]
        for kind in ("allowed", "approved", "denied"):
            for target, n in sorted(self.destinations[kind].items()):
                out.append(f"  {kind:<8} {_shown(target)}" + (f" ×{n}" if n > 1 else ""))
        return out


def _say(line: str) -> None:
    print(f"egressd: {line}", file=sys.stderr, flush=True)


class ProgressReporter:
    """Progress on stderr as the agent works, and the transcript's step lines."""

    def __init__(self, transcript: TranscriptWriter | None) -> None:
        self.transcript = transcript

    def model_said(self, text: str) -> None:
        _say(f"model: {_shown(text)}")

    def step_started(self, number: int, max_steps: int, command: str) -> None:
        _say(f"step {number}/{max_steps}: $ {_shown(command)}")

    def step_finished(self, step: Step, max_steps: int) -> None:
        obs = step.observation
        head = f"step {step.number}/{max_steps}:"
        if obs is None:
            _say(f"{head} {step.problem}")
        else:
            parts = [f"exit {obs.exit_code} in {obs.duration_s:.1f} s"]
            if obs.timed_out:
                parts.append("killed at the time limit")
            if obs.memory_exceeded:
                parts.append("killed at the memory limit")
            if obs.egress_refusals:
                parts.append(
                    "egress refused: "
                    + ", ".join(f"{_target(r)} ({r.message or r.reason})" for r in obs.egress_refusals)
                )
            _say(f"{head} " + "; ".join(parts))
        if self.transcript is not None:
            self.transcript.step(step.record())


def _check_options(args: argparse.Namespace) -> None:
    if args.max_steps < 1:
        raise SettingsError("bad setting max_steps: must be at least 1")
    for name in ("timeout", "model_timeout"):
        if getattr(args, name) <= 0:
            raise SettingsError(f"bad setting {name}: must be more than 0 seconds")
    if args.memory is not None and args.memory < 16:
        raise SettingsError("bad setting memory: at least 16 MB")
    if args.model_retries < 0:
        raise SettingsError("bad setting model_retries: must be 0 or more")
    if args.max_output < 1024:
        raise SettingsError("bad setting max_output: at least 1024 bytes")
    if not args.task.strip():
        raise SettingsError("bad setting task: empty")
    check_copy_out(args)


def _open_model(args: argparse.Namespace) -> tuple[Model, str | None]:
    """The model client and its key; then every model key variable is dropped from our environment.

    The client holds the key it uses; no other process we start (nsenter,
    ip, a shell of the user's) inherits any of them (DESIGN.md: model keys
    never reach a sandbox).
    """
    policy = RetryPolicy(attempts=args.model_retries + 1, timeout_s=args.model_timeout)
    try:
        spec = parse_model_spec(args.model, args.model_url)
        opened = open_model(spec, environ=os.environ, policy=policy, notify=lambda text: _say(f"model: {text}"))
    except (SpecError, ScriptError) as exc:
        raise SettingsError(f"bad setting model: {exc}") from None
    for name in {name for names in KEY_VARIABLES.values() for name in names}:
        os.environ.pop(name, None)
    return opened


def _exit_status(outcome: AgentOutcome) -> int:
    if outcome.stop is Stop.ERROR:
        return EXIT_CANNOT_START if outcome.error_in == "sandbox" else EXIT_MODEL_FAILED
    return EXIT_FOR_STOP[outcome.stop]


_STOP_WORDS = {
    Stop.FINAL: "the agent gave its final answer",
    Stop.MAX_STEPS: "stopped: the agent reached --max-steps {max_steps} without a final answer",
    Stop.TIMEOUTS: "stopped: two commands in a row ran past --timeout {timeout:g}s",
    Stop.ERROR: "stopped: {error}",
}


async def run_agent_in_sandbox(args: argparse.Namespace, settings: Settings) -> int:
    """Everything ``egressd agent`` does but signal handling."""
    _check_options(args)
    check_private_files(args, settings)
    try:
        allow, _ = entries_from_settings(settings)
    except StartupError as exc:
        raise SettingsError(str(exc)) from None
    extra_env = parse_env(args.env)
    model, key = _open_model(args)
    try:
        if key and any(key in value for value in extra_env.values()):
            raise SettingsError("bad setting env: it would pass the model's API key into the sandbox")
        transcript = None
        if args.transcript:
            try:
                transcript = TranscriptWriter(Path(args.transcript), secrets=[key] if key else [])
            except TranscriptError as exc:
                raise SettingsError(f"bad setting transcript: {exc}") from None
        try:
            return await _run(args, settings, model, [e.text for e in allow], extra_env, transcript)
        finally:
            if transcript is not None:
                transcript.final(None, Stop.ERROR)  # only when no outcome was written: interrupted, or no sandbox
                transcript.close()
    finally:
        await model.close()


async def _run(
    args: argparse.Namespace,
    settings: Settings,
    model: Model,
    allowed: list[str],
    extra_env: dict[str, str],
    transcript: TranscriptWriter | None,
) -> int:
    shell = shell_argv()
    limits = Limits(timeout_s=args.timeout, memory_mb=args.memory, max_pids=args.max_pids, cpu_s=args.cpu)
    conversation = Conversation(
        system=system_prompt(
            task=args.task,
            allowed=allowed,
            timeout_s=args.timeout,
            memory_mb=args.memory,
            max_steps=args.max_steps,
            shell=shell[0],
        ),
        task=args.task,
    )
    session = open_session(
        args,
        settings,
        workdir=Path(args.workdir) if args.workdir else None,
        task=args.task,
        extra_env=extra_env,
        keep_workdir=args.keep_workdir,
        term=None,
    )
    tally = EgressTally()
    try:
        async with session:
            session.observe(tally)
            assert session.run is not None
            _say(f"agent: {model.description}; sandbox ready (run {session.run.id}); up to {args.max_steps} steps")
            executor = SandboxExecutor(session, limits=limits, max_output=args.max_output, shell=shell)
            outcome = await run_agent(
                model,
                executor,
                conversation,
                max_steps=args.max_steps,
                timeout_s=args.timeout,
                memory_mb=args.memory,
                reporter=ProgressReporter(transcript),
            )
            if transcript is not None:
                transcript.final(outcome.final, outcome.stop)
            _say(_STOP_WORDS[outcome.stop].format(max_steps=args.max_steps, timeout=args.timeout, error=outcome.error))
            if args.copy_out:
                report = await copy_out(session.box, args.copy_out, Path(args.copy_out_dir))
                for line in report.lines():
                    _say(f"copy-out: {line}")
            if session.made_workdir and args.keep_workdir:
                _say(f"working directory kept at {session.workdir}")
    finally:
        if session.run is not None:  # the run existed: say what it sent out, however it ended
            for line in tally.lines():
                _say(line)
    if outcome.stop is Stop.FINAL and outcome.final is not None:
        print(_answer_text(outcome.final), flush=True)
    return _exit_status(outcome)


def cmd_agent(args: argparse.Namespace, settings: Settings) -> int:
    return run_sandboxed(lambda: run_agent_in_sandbox(args, settings), _say)
