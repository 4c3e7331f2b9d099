"""The Docker backend: the launcher's sandbox as containers on a Docker Engine.

Six rooms, dependencies pointing one way (config ← engine ← fence ← networks ← sidecar;
commands uses config and engine; the contract: docs/architecture.md, "Layers"):

- ``config``: pure — addresses and subnets, labels, the container and network specifications
  (the Engine API's JSON), the sidecar's secrets archive, copy-out's member checks;
- ``engine``: every Engine API call (``DockerEngine``), errors mapped once
  (``engine_errors`` → ``DockerUnavailable``), owners and leftovers;
- ``fence``: the host's side of a run's internal bridge: an nftables table and ARP sysctls
  that keep the sandbox off every host address, and the check that the host holds none
  inside the network (``Fence``);
- ``networks``: a run's networks, picked, made and fenced (``DockerRunNetwork``,
  ``SharedEgressdNetwork``);
- ``sidecar``: egressd's own container (``start_egressd``);
- ``commands``: the sandbox (``DockerSandbox``, a ``backend.Sandbox``): a fresh container per command.

    async with DockerEngine.connect() as engine:
        await clean_leftovers(engine)                       # crashed runs, by label
        net = await DockerRunNetwork.create(engine)         # internal + outgoing networks
                                                            # (--connect: SharedEgressdNetwork, attach)
        ... start egressd on net.plan.egressd_ip (``start_egressd``), register a run
            for net.plan.sandbox_ip ...
        box = DockerSandbox(engine, network=net.internal_name, address=net.plan.sandbox_ip,
                            dns=net.plan.egressd_ip, image=..., workdir=..., proxy_url=...)
        obs = await box.run(["pip", "download", "requests"], limits=Limits(timeout_s=60))
        await box.copy_out(["dist/*.whl"], Path("out"))
        await box.destroy(); await net.destroy()

The network (DESIGN.md, "The two boundaries"): per run an ``internal``
bridge network whose only members are egressd and the sandbox. Internal means
Docker routes nothing off it, and ``inhibit_ipv4`` leaves the bridge without
an address on the host; the sandbox's default route points at a gateway
that does not exist. Should the host hold that address anyway (another
interface took it), the fence (``fence``) still drops whatever arrives on
the bridge for the host, and the bridge answers no ARP for it. egressd is
also on an outgoing network (its way out, and where its control API is
published on the host's loopback). Subnets are /28s taken from a configured
range: link-local by default (169.254.64.0/18: never routed, never a LAN's;
169.254.169.0/24, cloud metadata, is skipped).

A run of an egressd that is already running (``--connect``) gets an internal
network of its own all the same (``SharedEgressdNetwork``): that egressd's
container is attached to it for the run's lifetime and detached before it is
removed, so sandboxes of different runs never share a network and cannot
reach each other.

The sandbox: each command is a fresh container (like each bwrap invocation:
/tmp is per command, the working directory persists), with a read-only root
filesystem, every capability dropped, no-new-privileges, egressd's own seccomp
profile instead of Docker's default (``egressd.sandbox.seccomp``: the bwrap filter's
policy, so AF_VSOCK and io_uring are refused here too), the working
directory's owner as its uid and gid (``identity``: never root; 1000 for a
fresh one), /work mounted nosuid and nodev (through a bind mount of ours
whose flags the container's inherits, ``stage``), a private IPC namespace,
its own PID namespace with an init, tmpfs /tmp, IPv6 off, the run's DNS set
to egressd's address (Docker's resolver at 127.0.0.11 relays to it from the
sandbox's own address), and the limits as cgroup settings: memory with no
swap (OOM kill: exit 137, ``memory_exceeded``), a pids limit, CPU time as
RLIMIT_CPU and a CPU share. Past the timeout the container is killed,
which takes its whole PID namespace down (exit 124). gVisor's ``runsc`` is
used when the engine has it.

Everything created carries the label ``egressd.run=<key>`` and the owner's
identity (``egressd.owner``: boot id, pid, process start time), so leftovers of
a run whose egressd died are found and removed (``clean_leftovers``).

The sandbox package never imports the proxy: egressd's addresses and the
proxy URL arrive as plain values (docs/architecture.md, "Layers").
"""

