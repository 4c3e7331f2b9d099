"""The sandbox on Docker: each command a fresh, hardened container (``backend.Sandbox``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiodocker.exceptions import DockerError

from ..backend import (
    DEFAULT_MAX_OUTPUT,
    NO_LIMITS,
    BoundedOutput,
    FdOutput,
    Observation,
    OutputSink,
    SandboxError,
    not_found_line,
    observation,
    within_time_limit,
)
from ..bwrap import SANDBOX_WORKDIR, SYSTEM_BUNDLE, TRUST_BUNDLE, base_environment, trust_bundle, trust_environment
from ..copyout import MAX_BYTES, MAX_FILES, CopyDestination, CopyReport, check_pattern, unmatched_patterns
from ..limits import Limits
from ..stage import marker, stage, unstage
from .config import (
    API_TIMEOUT_S,
    COPY_TIMEOUT_S,
    DEFAULT_CPUS,
    WORKDIR_ROOT,
    CommandSpec,
    check_member,
    command_config,
    member_kind,
    sandbox_user,
    seccomp_option,
)
from .engine import DockerEngine, DockerUnavailable, boot_id, container_state, engine_errors, owner_alive, owner_token

# -- the sandbox -------------------------------------------------------------------------


@dataclass
class _Outcome:
    exit_code: int | None = None  # None: the engine never said (``backend.ended``: killed)
    oom: bool = False


# What the container's init (Docker's tini, ``"Init": true``) writes when the
# command is not there, before exiting 127: said instead in the line the
# bubblewrap backend prints (``backend.not_found_line``).
_INIT_NOT_FOUND = re.compile(rb"\[FATAL tini \(\d+\)\] exec .* failed: No such file or directory\r?\n?", re.DOTALL)


_INIT_PREFIX = b"[FATAL tini ("
_INIT_MAX = 4096  # held no further: its message names one command (argv[0] of up to a page)


def said_by_init(data: bytes, name: str) -> bytes:
    """The container's stderr ``data``, with init's message for a missing command ``name`` as our one line."""
    return not_found_line(name).encode() if _INIT_NOT_FOUND.fullmatch(data) else data


# What the run says when the engine would mount the bare stage directory at /work (exit 125).
WORKDIR_UNSEEN = (
    "the Docker Engine does not see the working directory egressd mounted for it (egressd runs in a mount "
    "namespace of its own: systemd PrivateTmp/ProtectSystem, a container, unshare -m): run egressd in the "
    "engine's mount namespace"
)


@dataclass
class StagedWorkdir:
    """The working directory staged nosuid,nodev for the engine (``stage``), and who runs in it."""

    workdir: Path
    path: Path  # what the engine mounts at /work
    user: tuple[int, int]

    @classmethod
    def make(cls, workdir: Path) -> StagedWorkdir:
        """Stage ``workdir``; ``SandboxError`` when it is missing, root's, or cannot be mounted."""
        workdir = workdir.resolve()
        if not workdir.is_dir():
            raise SandboxError(f"working directory {workdir} does not exist")
        boot = boot_id()
        try:
            path, user = stage(
                workdir, owner=owner_token(), alive=lambda token: owner_alive(token, boot_id=boot),
                identity=lambda uid, gid: sandbox_user(uid, gid, workdir=str(workdir)),
            )
        except OSError as exc:
            raise SandboxError(f"cannot mount the working directory nosuid,nodev for the sandbox (egressd needs "
                               f"root for that): {exc}") from None
        return cls(workdir, path, user)

    async def check_seen(self, engine: DockerEngine, image: str, labels: Mapping[str, str]) -> None:
        """Refuse (``SandboxError``, ``WORKDIR_UNSEEN``) unless the engine mounts the working directory at /work.

        A created, never started container with the stage at /work: the engine
        finds the marker there only when it sees the bare directory under our mount.
        """
        container_id = await _idle_container(engine, image, self.path, labels)
        try:
            with engine_errors("cannot ask the Docker Engine what it mounts at /work"):
                try:
                    async with asyncio.timeout(API_TIMEOUT_S):
                        async with engine.client._query(
                            f"containers/{container_id}/archive",
                            params={"path": f"{SANDBOX_WORKDIR}/{marker(self.path)}"},
                        ):
                            pass
                except DockerError as exc:
                    if exc.status == 404:
                        return  # no marker: the engine sees our mount
                    raise
            raise SandboxError(WORKDIR_UNSEEN)
        finally:
            await asyncio.shield(_remove_quietly(engine, container_id))

    def remove(self) -> None:
        unstage(self.path)


async def _idle_container(engine: DockerEngine, image: str, stage_path: Path, labels: Mapping[str, str]) -> str:
    """A created, never started container with ``stage_path`` at /work and no network; its id."""
    spec = CommandSpec(image=image, argv=["true"], env={}, workdir=str(stage_path), network="none",
                       address="", dns="", labels=labels)
    config = command_config(spec)
    config["HostConfig"]["NetworkMode"] = "none"
    for key in ("Dns", "DnsOptions"):
        config["HostConfig"].pop(key)
    config.pop("NetworkingConfig")
    with engine_errors("cannot read the working directory"):
        async with asyncio.timeout(API_TIMEOUT_S):
            container = await engine.client.containers.create(config)
    return str(container.id)


async def _remove_quietly(engine: DockerEngine, container_id: str) -> None:
    with contextlib.suppress(DockerUnavailable, TimeoutError):
        await engine.remove_container(container_id)


@dataclass
class DockerSandbox:
    """Run commands as containers on the run's internal network; the launcher's ``Sandbox`` API.

    ``run`` returns the same ``Observation``; ``copy_out`` and ``destroy``
    are coroutines here (the engine is across a socket).
    """

    engine: DockerEngine
    network: str
    address: str
    dns: str
    image: str
    workdir: Path
    proxy_url: str
    labels: Mapping[str, str]
    socks_url: str | None = None  # egressd's SOCKS5 listener with the run's credentials (ALL_PROXY), if it has one
    extra_env: Mapping[str, str] = field(default_factory=dict)
    term: str | None = None
    runtime: str | None = None
    cpus: float | None = DEFAULT_CPUS
    machine: str = "x86_64"  # the engine's architecture, for the seccomp profile
    staged: StagedWorkdir | None = None  # the working directory staged already (``StagedWorkdir.check_seen``)
    run_ca_pem: bytes | None = None  # the run's inspection CA (it inspects names): trusted besides the system's
    env: dict[str, str] = field(init=False)
    _trust: Path | None = field(default=None, init=False)  # a directory holding the bundle, removed with the box
    user: tuple[int, int] = field(init=False)
    _stage: Path = field(init=False)  # what the engine mounts at /work: the working directory, nosuid,nodev
    _current: str | None = field(default=None, init=False)
    _destroyed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.workdir = self.workdir.resolve()
        seccomp_option(self.machine)  # an engine the profile is not written for: refused here, not per command
        if self.staged is None:
            self.staged = StagedWorkdir.make(self.workdir)
        self._stage, self.user = self.staged.path, self.staged.user
        self.env = base_environment(
            term=self.term, proxy_url=self.proxy_url, socks_url=self.socks_url, extra=self.extra_env
        )
        if self.run_ca_pem is not None:
            # The host's bundle and the run's CA, bound read-only over the image's (nothing here is secret).
            self._trust = Path(tempfile.mkdtemp(prefix="egressd-trust-"))
            system = Path(SYSTEM_BUNDLE)
            bundle = self._trust / TRUST_BUNDLE
            bundle.write_bytes(trust_bundle(system.read_bytes() if system.is_file() else b"", self.run_ca_pem))
            bundle.chmod(0o644)
            self._trust.chmod(0o755)
            self.env.update(trust_environment())

    async def run(
        self,
        command: Sequence[str],
        *,
        limits: Limits = NO_LIMITS,
        capture: bool = True,
        max_output: int = DEFAULT_MAX_OUTPUT,
        stdin: int | None = None,
        relay: tuple[OutputSink, OutputSink] | None = None,
    ) -> Observation:
        """Run one command in a fresh container to completion (or its limits).

        ``capture=False`` passes stdout/stderr on as they come, to
        ``relay=(out_sink, err_sink)`` or else to ours as they are (the
        command never holds a descriptor of ours: its output crosses the
        engine's socket).
        ``stdin`` is a file descriptor whose contents the command reads
        (default: nothing, an empty stdin).
        """
        if self._destroyed:
            raise SandboxError("the sandbox was destroyed")
        spec = CommandSpec(image=self.image, argv=command, env=self.env, workdir=str(self._stage),
                           network=self.network, address=self.address, dns=self.dns, labels=self.labels,
                           limits=limits, user=self.user, cpus=self.cpus, runtime=self.runtime,
                           stdin=stdin is not None, machine=self.machine,
                           trust_bundle=str(self._trust / TRUST_BUNDLE) if self._trust is not None else None)
        started = time.monotonic()
        out, err = BoundedOutput(max_output), BoundedOutput(max_output)
        sinks = None if capture else (relay or (FdOutput(sys.stdout.fileno()), FdOutput(sys.stderr.fileno())))
        with engine_errors("cannot start the command's container"):
            async with asyncio.timeout(API_TIMEOUT_S):
                container = await self.engine.client.containers.create(command_config(spec))
        self._current = container.id
        timed_out = False
        outcome = _Outcome()
        try:
            with engine_errors("cannot attach to the command's container"):
                stream = container.attach(stdout=True, stderr=True, stdin=stdin is not None)
                async with asyncio.timeout(API_TIMEOUT_S):
                    await stream.__aenter__()  # attached before it starts: no output is missed
            try:
                with engine_errors("cannot start the command's container"):
                    async with asyncio.timeout(API_TIMEOUT_S):
                        await container.start()
                async with asyncio.TaskGroup() as tasks:
                    work = tasks.create_task(
                        self._follow(container, stream, out, err, sinks, stdin, outcome, name=command[0])
                    )
                    timed_out = await within_time_limit(
                        work, limits.timeout_s, lambda: self._kill(container.id), grace_s=10
                    )
            finally:
                await stream.close()
        finally:
            self._current = None
            # Removal must happen even when we are being cancelled (Ctrl-C).
            await asyncio.shield(self._remove(container.id))
        return observation(
            outcome.exit_code,
            timed_out=timed_out,
            oom_killed=outcome.oom,
            out=out,
            err=err,
            duration_s=time.monotonic() - started,
        )

    async def _follow(
        self,
        container: Any,
        stream: Any,
        out: BoundedOutput,
        err: BoundedOutput,
        sinks: tuple[OutputSink, OutputSink] | None,
        stdin: int | None,
        outcome: _Outcome,
        *,
        name: str,
    ) -> None:
        """Pump output (and stdin) until the container ends, then read its exit status."""
        init_said: bytes | None = b""  # stderr held while it may be init's message (None: it is not)
        async with asyncio.TaskGroup() as tasks:
            feeder = tasks.create_task(_feed_stdin(stream, stdin)) if stdin is not None else None
            while (message := await stream.read_out()) is not None:
                data = message.data
                if message.stream != 1 and init_said is not None:
                    # Init writes its message unbuffered, perhaps in pieces: held until its line ends.
                    init_said += data
                    if _INIT_PREFIX.startswith(init_said[: len(_INIT_PREFIX)]) and not init_said.endswith(b"\n"):
                        if len(init_said) < _INIT_MAX:
                            continue
                    data, init_said = said_by_init(init_said, name), None
                if sinks is None:
                    (out if message.stream == 1 else err).add(data)
                else:
                    (sinks[0] if message.stream == 1 else sinks[1]).add(data)
            if init_said:
                (sinks[1] if sinks is not None else err).add(said_by_init(init_said, name))
            for sink in sinks or ():
                sink.end()
            with engine_errors("cannot wait for the command's container"):
                await container.wait()
            state = await container_state(self.engine, container.id)
            code = state.get("ExitCode")
            outcome.exit_code = int(code) if isinstance(code, int) else None
            outcome.oom = bool(state.get("OOMKilled", False))
            if feeder is not None:  # stdin may still be open: the command is done with it
                feeder.cancel()

    async def _kill(self, container_id: str) -> None:
        # SIGKILL to the container's init takes its PID namespace, every process in it, down.
        with contextlib.suppress(DockerError, TimeoutError, OSError):
            async with asyncio.timeout(API_TIMEOUT_S):
                await self.engine.client.containers.container(container_id).kill(signal="SIGKILL")

    async def _remove(self, container_id: str) -> None:
        with contextlib.suppress(DockerUnavailable, TimeoutError):
            await self.engine.remove_container(container_id)

    async def copy_out(
        self,
        patterns: list[str],
        dest: Path,
        *,
        max_files: int = MAX_FILES,
        max_bytes: int = MAX_BYTES,
    ) -> CopyReport:
        """Copy matching regular files of the working directory to ``dest`` via the archive API.

        The same rules as ``copyout.copy_out``: on the source side
        ``check_member`` (safe relative names, no links, no devices, bounded
        count and bytes, every skipped match and every pattern that matched
        nothing reported); on the destination side the same ``CopyDestination``
        writer, opened before anything is fetched (CopyOutError: a link, or
        inside the working directory).
        """
        for pattern in patterns:
            check_pattern(pattern)
        report = CopyReport()
        out = await asyncio.to_thread(CopyDestination.open, dest, workdir=self.workdir)
        try:
            # A created, never started container with the same mount: the archive
            # API reads /work from it, whatever the engine's host looks like.
            container_id = await _idle_container(self.engine, self.image, self._stage, self.labels)
            try:
                async with asyncio.timeout(COPY_TIMEOUT_S):
                    with tempfile.TemporaryFile() as spool:
                        await self._fetch_archive(container_id, spool, max_bytes)
                        spool.seek(0)
                        await asyncio.to_thread(_extract, spool, patterns, out, report, max_files, max_bytes)
            except TimeoutError:
                raise SandboxError(f"copy-out took longer than {COPY_TIMEOUT_S:g}s") from None
            finally:
                await asyncio.shield(self._remove(container_id))
        finally:
            out.close()
        return report

    async def _fetch_archive(self, container_id: str, spool: Any, max_bytes: int) -> None:
        # The whole working directory is read (only the engine can walk it), but
        # at most a bounded amount beyond the copy-out limit is kept.
        limit = max_bytes * 4 + 64 * 1024 * 1024
        total = 0
        with engine_errors("cannot read the working directory"):
            async with self.engine.client._query(
                f"containers/{container_id}/archive", params={"path": SANDBOX_WORKDIR}
            ) as resp:
                async for chunk in resp.content.iter_chunked(1024 * 1024):
                    total += len(chunk)
                    if total > limit:
                        mib = limit // (1024 * 1024)
                        raise SandboxError(f"the working directory is over {mib} MiB; copy-out refused")
                    await asyncio.to_thread(spool.write, chunk)

    async def destroy(self) -> None:
        """Kill and remove a command's container still running (the network's owner removes the rest)."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._current is not None:
            await self._remove(self._current)
        unstage(self._stage)
        if self._trust is not None:
            shutil.rmtree(self._trust, ignore_errors=True)


def _extract(
    spool: Any, patterns: list[str], out: CopyDestination, report: CopyReport, max_files: int, max_bytes: int
) -> None:
    """Write the files ``check_member`` lets through with ``out`` (runs in a thread: plain file I/O)."""
    links: set[str] = set()
    matched: list[str] = []
    with tarfile.open(fileobj=spool, mode="r|") as tar:
        for member in tar:
            check = check_member(member.name, member_kind(member), member.size, root=WORKDIR_ROOT, patterns=patterns,
                                 links=links, report=report, max_files=max_files, max_bytes=max_bytes)
            if check.name is None:
                continue
            matched.append(check.name)
            if check.skip is not None:
                report.skipped.append((check.name, check.skip))
                continue
            source = tar.extractfile(member)
            if source is None:
                report.skipped.append((check.name, "not a regular file"))
                continue
            why = out.write(check.name, source, report=report, max_bytes=max_bytes)
            if why is not None:
                report.skipped.append((check.name, why))
    report.unmatched = unmatched_patterns(patterns, matched)


async def _feed_stdin(stream: Any, fd: int) -> None:
    """Copy ``fd`` into the container's stdin, then half-close it (EOF for the command)."""
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        # A file or a device such as /dev/null: a read never blocks for long (a
        # terminal is never passed in: it stays the approval prompt's).
        while chunk := await asyncio.to_thread(os.read, fd, 65536):
            await stream.write_in(chunk)
    else:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        pipe = os.fdopen(os.dup(fd), "rb")
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            while chunk := await reader.read(65536):
                await stream.write_in(chunk)
        finally:
            transport.close()
    # aiodocker's Stream.close() would close both directions; EOF on the write
    # side alone is what StdinOnce waits for.
    response = getattr(stream, "_resp", None)
    socket_end: Any = response.connection.transport if response is not None and response.connection else None
    if socket_end is not None and socket_end.can_write_eof():
        socket_end.write_eof()
