"""Run commands in a sandbox whose only way out is egressd.

    net = await RunNetwork.create()                    # namespace, veth, nftables
    ... start egressd on net.plan.host_ip, register a run for net.plan.sandbox_ip ...
    box = BwrapSandbox(network=net, workdir=..., proxy_url=...)
    obs = await box.run(["pip", "download", "requests"], limits=Limits(timeout_s=60))
    await box.copy_out(["dist/*.whl"], Path("out"))
    await box.destroy()                                # and net.destroy()

Each command is a fresh bubblewrap invocation entered into the run's network
namespace (so /tmp is per command; the working directory persists), inside a
cgroup of its own, bounded in time (the whole process tree is killed: exit
124), memory (exit 137), process count and CPU time. The sandbox package
never imports the proxy: it receives egressd's address as plain values.

Who it runs as (``identity``): the child joins its cgroup and sets its limits
as root, then ``nsenter`` enters the network namespace (that needs root),
drops every supplementary group and becomes the working directory's owner
before bwrap starts. bwrap is then an ordinary process of that user: the user
namespace it makes maps the sandbox to that uid, never to host root, and it
holds no capability over the host.

What they are started with (DESIGN.md: secrets never reach a sandbox nor a
command line): ``nsenter`` and bwrap get an empty environment
(``LAUNCH_ENVIRONMENT``), so nothing of ours (egressd's secrets, whatever
its caller had) is in bwrap's init, which the command can read as
``/proc/1/environ``. The command's own environment (the run's proxy
credentials, ``--env`` values) goes to bwrap through a descriptor
(``bwrap.environment_args``), never on a command line, which any local
user can read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .backend import (
    DEFAULT_MAX_OUTPUT,
    NO_LIMITS,
    BoundedOutput,
    Observation,
    OutputSink,
    SandboxError,
    observation,
    within_time_limit,
)
from .bwrap import (
    SYSTEM_BUNDLE,
    TRUST_BUNDLE,
    BwrapSpec,
    base_environment,
    bwrap_argv,
    environment_args,
    exec_or_not_found,
    generated_etc,
    host_layout,
    trust_bundle,
    trust_environment,
)
from .copyout import CopyReport, copy_out
from .identity import refusal, run_as
from .limits import Cgroup, Limits, rlimits_in_child
from .network import RunNetwork
from .seccomp import SeccompUnsupported, build_filter

# What nsenter and bwrap are started with: nothing. Not egressd's environment
# (its secrets would be in bwrap's init, readable inside), and not the
# sandbox's either: nsenter starts as root and bwrap runs outside the sandbox,
# so an --env LD_PRELOAD or LD_LIBRARY_PATH naming a file in the working
# directory would load the sandbox's code into them. Both are named by
# absolute path and need no variable; the command gets its environment from
# bwrap (``environment_args``).
LAUNCH_ENVIRONMENT: dict[str, str] = {}


class _Relay:
    """Passes a stream on to an ``OutputSink`` as it arrives (nothing is kept, nothing dropped)."""

    def __init__(self, sink: OutputSink) -> None:
        self.sink = sink
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        self.sink.add(chunk)

    def end(self) -> None:
        self.sink.end()


async def _pump(stream: asyncio.StreamReader | None, sink: BoundedOutput | _Relay) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        sink.add(chunk)
    if isinstance(sink, _Relay):
        sink.end()


async def owner_reaches(path: Path, uid: int, gid: int, nsenter: str = "nsenter") -> bool:
    """Whether ``uid``:``gid``, with no other group, can enter ``path``: bwrap, running as them, must.

    Asked of the kernel, with the same change of identity as ``BwrapSandbox.run``
    (so ACLs and every directory above count), not worked out from modes.
    """
    probe = await asyncio.create_subprocess_exec(
        shutil.which(nsenter) or nsenter, "--setgid", str(gid), "--setuid", str(uid), "--",
        shutil.which("test") or "/usr/bin/test", "-d", str(path), "-a", "-x", str(path),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env=LAUNCH_ENVIRONMENT,  # it runs as the owner, who may read its environment
    )
    return await probe.wait() == 0


class BwrapSandbox:
    """A working directory, an environment and a network, ready to run commands (``backend.Sandbox``)."""

    def __init__(
        self,
        *,
        network: RunNetwork,
        workdir: Path,
        proxy_url: str,
        socks_url: str | None = None,
        extra_env: Mapping[str, str] = {},
        extra_readonly: Sequence[str] = (),
        term: str | None = None,
        nsenter: str = "nsenter",
        bwrap: str = "bwrap",
        run_ca_pem: bytes | None = None,
    ) -> None:
        """``run_ca_pem``: the run's inspection CA (it inspects names), trusted besides the system's."""
        self.network = network
        self.workdir = workdir.resolve()
        if not self.workdir.is_dir():
            raise SandboxError(f"working directory {workdir} does not exist")
        try:
            self._seccomp = build_filter()
        except SeccompUnsupported as exc:  # never a sandbox without its filter
            raise SandboxError(str(exc)) from None
        info = self.workdir.stat()
        ids = run_as(info.st_uid, info.st_gid)
        if ids is None:
            raise SandboxError(refusal(str(workdir)))
        self.uid, self.gid = ids
        self.env = base_environment(term=term, proxy_url=proxy_url, socks_url=socks_url, extra=extra_env)
        self._trusted = run_ca_pem is not None
        if self._trusted:
            self.env.update(trust_environment())
        self.extra_readonly = list(extra_readonly)
        self._links, self._dirs, self._etc_ro = host_layout()
        self._nsenter = shutil.which(nsenter) or nsenter
        self._bwrap = shutil.which(bwrap) or bwrap
        # Last: whatever can still raise after it is in the try below, so a failed start leaves no directory.
        self._etc = Path(tempfile.mkdtemp(prefix=f"egressd-etc-{network.plan.run_key}-"))
        try:
            for name, content in generated_etc(
                nameserver=str(network.plan.host_ip), uid=self.uid, gid=self.gid
            ).items():
                (self._etc / name).write_text(content)
                (self._etc / name).chmod(0o644)
            if run_ca_pem is not None:
                system = Path(SYSTEM_BUNDLE)
                bundle = trust_bundle(system.read_bytes() if system.is_file() else b"", run_ca_pem)
                (self._etc / TRUST_BUNDLE).write_bytes(bundle)
                (self._etc / TRUST_BUNDLE).chmod(0o644)
            # bwrap runs as the owner and binds these files itself: it must reach them (nothing here is secret).
            self._etc.chmod(0o755)
        except BaseException:
            shutil.rmtree(self._etc, ignore_errors=True)  # no Sandbox, so no destroy() to remove it
            raise
        self._count = 0
        self._destroyed = False

    def argv(self, command: Sequence[str], seccomp_fd: int | None, args_fd: int | None = None) -> list[str]:
        """nsenter's argv; ``args_fd`` holds ``environment_args(self.env)``: without it, no environment."""
        spec = BwrapSpec(
            workdir=str(self.workdir),
            etc_dir=str(self._etc),
            env=self.env,
            argv=exec_or_not_found(command),  # exit 127 and one line for a command not there
            seccomp_fd=seccomp_fd,
            usr_links=self._links,
            usr_dirs=self._dirs,
            etc_readonly=self._etc_ro,
            extra_readonly=self.extra_readonly,
            uid=self.uid,
            gid=self.gid,
            args_fd=args_fd,
            trusted=self._trusted,
        )
        # nsenter joins the namespace as root, then drops the supplementary groups and
        # sets gid and uid, in that order, before it runs bwrap as the owner.
        return [self._nsenter, f"--net={self.network.plan.netns_path}", "--setgid", str(self.gid),
                "--setuid", str(self.uid), "--", *bwrap_argv(spec, self._bwrap)]

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
        """Run one command to completion (or its limits) and report what happened.

        ``capture=False`` passes stdout/stderr through instead of collecting
        them: with ``relay=(out_sink, err_sink)`` through pipes that we copy to
        those sinks (use it when ours are a terminal: a command handed the
        terminal itself could read what a person types at the approval
        prompt, and write to it raw), otherwise by inheriting ours. ``stdin`` is a file
        descriptor to give the command; default /dev/null.
        """
        if self._destroyed:
            raise SandboxError("the sandbox was destroyed")
        self._count += 1
        cgroup = Cgroup.create(f"{self.network.plan.run_key}-{self._count}", limits)
        read_fd, write_fd = os.pipe()
        os.write(write_fd, self._seccomp)  # small: fits the pipe buffer, bwrap reads it at start
        os.close(write_fd)
        # The environment can outgrow a pipe's buffer (--env values): a memory file holds
        # it whole, read by bwrap from the start; it is bwrap's to close, like the filter.
        try:
            args_fd = os.memfd_create("egressd-bwrap-env", os.MFD_CLOEXEC)
            os.write(args_fd, environment_args(self.env))
            os.lseek(args_fd, 0, os.SEEK_SET)
        except (OSError, ValueError) as exc:
            os.close(read_fd)
            if cgroup is not None:
                await cgroup.remove()
            raise SandboxError(f"cannot pass the sandbox its environment: {exc}") from exc

        def in_child() -> None:
            # Nothing of ours crosses into the sandbox but stdio and the filter:
            # not every event loop closes inherited descriptors before exec (and
            # closing them here would pull the rug from under its own set-up).
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                if fd > 2 and fd not in (read_fd, args_fd):
                    with contextlib.suppress(OSError):
                        os.set_inheritable(fd, False)
            # Still root here: joining the cgroup writes a root-owned file. The owner's
            # process then cannot move itself out of it (that needs write access above).
            if cgroup is not None:
                cgroup.join_self()
            rlimits_in_child(limits, memory_fallback=cgroup is None)
            # nsenter drops them too, but ignores a failure to: here a failure stops the start.
            os.setgroups([])

        started = time.monotonic()
        out: BoundedOutput | _Relay
        err: BoundedOutput | _Relay
        if capture or relay is None:
            out, err = BoundedOutput(max_output), BoundedOutput(max_output)
        else:
            out, err = _Relay(relay[0]), _Relay(relay[1])
        piped = capture or relay is not None
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(command, read_fd, args_fd),
                stdin=stdin if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if piped else None,
                stderr=asyncio.subprocess.PIPE if piped else None,
                pass_fds=(read_fd, args_fd),
                preexec_fn=in_child,
                env=LAUNCH_ENVIRONMENT,
            )
        except (OSError, subprocess.SubprocessError) as exc:  # the latter: in_child failed
            if cgroup is not None:
                await cgroup.remove()
            raise SandboxError(f"cannot start the sandbox: {exc}") from exc
        finally:
            os.close(read_fd)
            os.close(args_fd)

        async def kill() -> None:
            self._kill(proc, cgroup)

        try:
            pumps = asyncio.gather(_pump(proc.stdout, out), _pump(proc.stderr, err), proc.wait())
            timed_out = await within_time_limit(pumps, limits.timeout_s, kill, grace_s=5)
        except BaseException:
            self._kill(proc, cgroup)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5)
            raise
        finally:
            oom_killed = cgroup.oom_killed() if cgroup is not None else False
            pids_exhausted = cgroup.pids_exhausted() if cgroup is not None else False
            if cgroup is not None:
                await cgroup.remove()
        return observation(
            proc.returncode,
            timed_out=timed_out,
            oom_killed=oom_killed,
            out=out if isinstance(out, BoundedOutput) else None,
            err=err if isinstance(err, BoundedOutput) else None,
            duration_s=time.monotonic() - started,
            pids_exhausted=pids_exhausted,
        )

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process, cgroup: Cgroup | None) -> None:
        # bwrap's --die-with-parent takes the PID namespace down with it; the
        # cgroup kill catches anything that slipped out of the process tree.
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        if cgroup is not None:
            cgroup.kill_all()

    async def copy_out(self, patterns: list[str], dest: Path) -> CopyReport:
        # Plain file system work, kept off the event loop (egressd serves the run meanwhile).
        return await asyncio.to_thread(copy_out, self.workdir, patterns, dest)

    async def destroy(self) -> None:
        """Remove the sandbox's own files (the network is its creator's to destroy)."""
        if self._destroyed:
            return
        self._destroyed = True
        shutil.rmtree(self._etc, ignore_errors=True)
