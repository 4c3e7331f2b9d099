"""The bubblewrap command line for one sandboxed command (pure).

What the sandbox sees (DESIGN.md, "The two boundaries"):

- ``/work``: the working directory, read-write (the only host path that is);
- ``/usr`` and the usual top-level links to it, read-only: the toolchain;
- ``/etc``: only generated files (resolv.conf pointing at egressd, hosts,
  passwd/group with the sandbox user, nsswitch.conf) plus, read-only, what
  programs need to run: CA certificates, ``/etc/alternatives``, the dynamic
  linker's cache;
- ``/proc`` of its own PID namespace, a minimal ``/dev``, an empty ``/tmp``
  that vanishes with it; nothing else (no home, no ~/.ssh, no egressd files).

Every namespace but the network one is unshared here; the network namespace
is egressd's, prepared by ``network`` and entered before bwrap starts. All
capabilities are dropped, the command runs in a new session (no TIOCSTI into
our terminal), and dies with its parent. bwrap sets no_new_privs before
loading the seccomp filter.

The environment (``environment_args``) is never on the command line: any
local user reads ``/proc/PID/cmdline``, and it holds the run's proxy
credentials and every ``--env`` value. bwrap reads ``--clearenv`` and one
``--setenv`` per variable from a descriptor (``--args FD``) and sets them
for the command alone; bwrap itself (and its init, pid 1 inside, which the
command can read) is started with an empty environment by the launcher.

Identity (``identity``): bwrap is started as the working directory's owner,
not as root, so the user namespace it makes maps the sandbox to that host
uid, never to host root; inside, the command has the same uid and gid
(``BwrapSpec.uid``/``gid``), named ``agent`` by the generated passwd. Every
bind bwrap makes is nosuid, and nodev unless it is a device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SANDBOX_WORKDIR = "/work"
# The owner of a fresh working directory, and so who a command runs as in it:
# an unprivileged pair, the sandbox image's ``agent`` (docker/sandbox.Dockerfile).
SANDBOX_UID = 1000
SANDBOX_GID = 1000
SANDBOX_USER = "agent"
SANDBOX_HOSTNAME = "sandbox"

# Top-level entries that are links into /usr on a merged-/usr system.
USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Read-only pieces of the host's /etc that programs need; absent ones are skipped.
# Of /etc/ssl only the certificates and OpenSSL's configuration: /etc/ssl/private
# holds the host's private keys.
ETC_READONLY = ("ssl/certs", "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf", "alternatives",
                "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "mime.types", "protocols", "services")


@dataclass(frozen=True)
class BwrapSpec:
    """Everything the command line depends on, as plain values."""

    workdir: str
    etc_dir: str  # a host directory holding the generated /etc files
    env: Mapping[str, str]  # the command's environment: never in the argv (``environment_args``, ``args_fd``)
    argv: Sequence[str]
    seccomp_fd: int | None = None
    usr_links: Mapping[str, str] = field(default_factory=dict)  # name -> link target, e.g. bin -> usr/bin
    usr_dirs: Sequence[str] = ()  # top-level names that are real directories to bind read-only
    etc_readonly: Sequence[str] = ()  # names under the host's /etc to bind read-only
    extra_readonly: Sequence[str] = ()  # other host paths the caller asked for, read-only
    uid: int = SANDBOX_UID  # who the command is inside: the working directory's owner
    gid: int = SANDBOX_GID
    args_fd: int | None = None  # a descriptor holding ``environment_args(env)``: the command's environment
    trusted: bool = False  # ``etc_dir`` holds ``TRUST_BUNDLE``: bound over ``SYSTEM_BUNDLE``


GENERATED_ETC = ("resolv.conf", "hosts", "passwd", "group", "nsswitch.conf", "hostname")

# A run that inspects names trusts its own CA besides the system's: one bundle, bound over the
# standard bundle path and named by every variable the usual clients read (DESIGN.md "Policy").
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
TRUST_BUNDLE = "ca-bundle.crt"  # in the generated /etc directory
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT",
                "GIT_SSL_CAINFO", "AWS_CA_BUNDLE")


def trust_bundle(system_pem: bytes, run_ca_pem: bytes) -> bytes:
    """The system's certificates, then the run's CA: what the sandbox's clients trust."""
    if system_pem and not system_pem.endswith(b"\n"):
        system_pem += b"\n"
    return system_pem + b"# egressd: this run's inspection CA\n" + run_ca_pem


def trust_environment() -> dict[str, str]:
    """Every variable a usual client reads for its CA bundle, naming the bundle's standard path."""
    return dict.fromkeys(CA_VARIABLES, SYSTEM_BUNDLE)


def bwrap_argv(spec: BwrapSpec, bwrap: str = "bwrap") -> list[str]:
    """The full argv, ending with ``--`` and the command; ``spec.env`` is not in it (``environment_args``)."""
    args = [bwrap]
    if spec.args_fd is not None:
        args += ["--args", str(spec.args_fd)]
    args += [
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--uid", str(spec.uid), "--gid", str(spec.gid),
        "--hostname", SANDBOX_HOSTNAME,
        "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        "--ro-bind", "/usr", "/usr",
    ]
    for name, target in sorted(spec.usr_links.items()):
        args += ["--symlink", target, f"/{name}"]
    for name in spec.usr_dirs:
        args += ["--ro-bind", f"/{name}", f"/{name}"]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    args += ["--dir", "/etc"]
    for name in spec.etc_readonly:
        args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for name in GENERATED_ETC:
        args += ["--ro-bind", os.path.join(spec.etc_dir, name), f"/etc/{name}"]
    if spec.trusted:
        args += ["--ro-bind", os.path.join(spec.etc_dir, TRUST_BUNDLE), SYSTEM_BUNDLE]
    for path in spec.extra_readonly:
        args += ["--ro-bind", path, path]
    args += ["--bind", spec.workdir, SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR]
    # The root bwrap builds is a tmpfs; once everything is mounted it becomes
    # read-only, so /etc and the top level cannot be written either.
    args += ["--remount-ro", "/"]
    if spec.seccomp_fd is not None:
        args += ["--seccomp", str(spec.seccomp_fd)]
    args.append("--")
    args.extend(spec.argv)
    return args


# What bubblewrap runs: a shell that looks the command up as execvp would (on
# the sandbox's PATH, or the path itself when it has a slash) and says so in
# one line, exit 127, when it is not there; else it becomes the command (exec:
# same process, nothing left in between). bwrap's own "execvp: No such file"
# exited 1. The command's name is an argument, never part of the script.
NOT_FOUND_SCRIPT = (
    'case $1 in */*) [ -e "$1" ] ;; *) command -v -- "$1" >/dev/null 2>&1 ;; esac || '
    "{ printf 'egressd: %s: command not found in the sandbox\\n' \"$1\" >&2; exit 127; }; "
    'exec "$@"'
)


def exec_or_not_found(argv: Sequence[str]) -> list[str]:
    """``argv`` run through ``NOT_FOUND_SCRIPT`` by /bin/sh."""
    return ["/bin/sh", "-c", NOT_FOUND_SCRIPT, "egressd", *argv]


def environment_args(env: Mapping[str, str]) -> bytes:
    """The command's whole environment as bwrap options for ``--args FD``: NUL-terminated, one per argument.

    ``--clearenv`` first, so nothing bwrap was started with reaches the
    command; then ``--setenv NAME VALUE`` for each variable. A NUL in a name
    or value would end the argument early: ValueError.
    """
    args = ["--clearenv"]
    for key, value in sorted(env.items()):
        args += ["--setenv", key, value]
    if any("\0" in arg for arg in args):
        raise ValueError("an environment variable's name or value contains a NUL character")
    return b"".join(os.fsencode(arg) + b"\0" for arg in args)


def generated_etc(*, nameserver: str, uid: int = SANDBOX_UID, gid: int = SANDBOX_GID) -> dict[str, str]:
    """The contents of the generated /etc files; ``agent`` is ``uid``:``gid``, who the command runs as."""
    nobody = "" if uid == 65534 else "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    nogroup = "" if gid == 65534 else "nogroup:x:65534:\n"
    return {
        "resolv.conf": f"nameserver {nameserver}\noptions attempts:2 timeout:2\n",
        "hosts": f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n127.0.1.1 {SANDBOX_HOSTNAME}\n",
        "passwd": (
            "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
            f"{SANDBOX_USER}:x:{uid}:{gid}:sandboxed agent:{SANDBOX_WORKDIR}:/bin/sh\n"
            f"{nobody}"
        ),
        "group": f"root:x:0:\n{SANDBOX_USER}:x:{gid}:\n{nogroup}",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
        "hostname": f"{SANDBOX_HOSTNAME}\n",
    }


def base_environment(
    *, term: str | None, proxy_url: str, socks_url: str | None = None, extra: Mapping[str, str] = {}
) -> dict[str, str]:
    """The environment, built from nothing: no host variable gets in unless named.

    ``socks_url`` (``socks5h://RUN:TOKEN@HOST:PORT``): ALL_PROXY names egressd's SOCKS5 listener, for
    tools that speak only SOCKS; HTTP(S)_PROXY name the HTTP proxy, which such tools take first.
    """
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
        "HOME": SANDBOX_WORKDIR,
        "USER": SANDBOX_USER,
        "LOGNAME": SANDBOX_USER,
        "LANG": "C.UTF-8",
        "TERM": term or "dumb",
        "TMPDIR": "/tmp",
        "NO_PROXY": "localhost,127.0.0.1,::1",
        "no_proxy": "localhost,127.0.0.1,::1",
        "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
    }
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env[name] = proxy_url
    if socks_url is not None:
        env["ALL_PROXY"] = env["all_proxy"] = socks_url
    env.update(extra)
    return env


def host_layout(root: str = "/") -> tuple[dict[str, str], list[str], list[str]]:
    """How this host lays out its toolchain: /usr links, real top-level dirs, /etc pieces."""
    links: dict[str, str] = {}
    dirs: list[str] = []
    for name in USR_LINKS:
        path = os.path.join(root, name)
        if os.path.islink(path):
            links[name] = os.readlink(path)
        elif os.path.isdir(path):
            dirs.append(name)
    etc = [name for name in ETC_READONLY if os.path.exists(os.path.join(root, "etc", name))]
    return links, dirs, etc
