"""The proxies egressd is measured against, installed and configured by the benchmark.

- squid and tinyproxy from Debian's packages (apt-get, when root);
- pproxy 2.7.9 with uvloop 0.21 (its release needs that uvloop) and proxy.py,
  from PyPI, in a venv of their own (``bench/.venv-peers``) so their pins
  never touch egressd's environment.

Each peer is configured to do what egressd does for a request (CONNECT to any
port, absolute-form HTTP forwarding, no cache) with its own defaults
otherwise, and to log no more than its default.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS_VENV = HERE / ".venv-peers"
APT_PACKAGES = {"squid": "squid", "tinyproxy": "tinyproxy", "dnsmasq": "dnsmasq", "wrk": "wrk"}
PIP_PACKAGES = ["pproxy==2.7.9", "uvloop==0.21.*", "proxy.py"]


def ensure_installed(names: list[str]) -> list[str]:
    """Install what is missing; return the peers that could not be had (with why on stderr)."""
    missing_apt = [APT_PACKAGES[n] for n in names if n in APT_PACKAGES and shutil.which(n) is None
                   and not Path(f"/usr/sbin/{n}").exists()]
    if missing_apt:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            subprocess.run(["apt-get", "update", "-qq"], check=False, stdout=subprocess.DEVNULL)
            subprocess.run(["apt-get", "install", "-y", "-qq", *missing_apt], check=False,
                           stdout=subprocess.DEVNULL, env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"})
            # Debian starts the daemons it installs; the benchmark runs its own.
            for service in ("squid", "tinyproxy", "dnsmasq"):
                subprocess.run(["systemctl", "stop", service], check=False, stderr=subprocess.DEVNULL)
                subprocess.run(
                    ["service", service, "stop"], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
    if any(n in ("pproxy", "proxy.py") for n in names) and not (PEERS_VENV / "bin" / "pproxy").exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run([str(PEERS_VENV / "bin" / "pip"), "install", "-q", *PIP_PACKAGES], check=True)
    unavailable = []
    for n in names:
        if n in ("squid", "tinyproxy") and shutil.which(n) is None and not Path(f"/usr/sbin/{n}").exists():
            unavailable.append(n)
    return unavailable


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def start_squid(port: int, workdir: Path) -> subprocess.Popen:  # type: ignore[type-arg]
    # squid drops to its own user after start; it must be able to write its logs.
    os.chmod(workdir, 0o777)
    conf = workdir / "squid.conf"
    conf.write_text(
        f"http_port 127.0.0.1:{port}\n"
        "acl all src all\n"
        "http_access allow all\n"
        "cache deny all\n"
        "cache_mem 8 MB\n"
        "max_filedescriptors 65536\n"
        f"pid_filename {workdir}/squid.pid\n"
        f"cache_log {workdir}/cache.log\n"
        f"access_log daemon:{workdir}/access.log\n"
        f"coredump_dir {workdir}\n"
        "shutdown_lifetime 1 seconds\n"
        "dns_v4_first on\n"
    )
    return subprocess.Popen(
        [_binary("squid"), "-N", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def start_tinyproxy(port: int, workdir: Path) -> subprocess.Popen:  # type: ignore[type-arg]
    os.chmod(workdir, 0o777)  # tinyproxy, too, runs as its own user
    conf = workdir / "tinyproxy.conf"
    conf.write_text(
        f"Port {port}\nListen 127.0.0.1\nTimeout 600\nMaxClients 4000\nLogLevel Warning\n"
        f"LogFile \"{workdir}/tinyproxy.log\"\nPidFile \"{workdir}/tinyproxy.pid\"\n"
    )
    return subprocess.Popen(
        [_binary("tinyproxy"), "-d", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def start_pproxy(port: int, workdir: Path) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen([str(PEERS_VENV / "bin" / "pproxy"), "-l", f"http://127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_proxypy(port: int, workdir: Path) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen([str(PEERS_VENV / "bin" / "proxy"), "--hostname", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir,
                            env=os.environ | {"HOME": str(workdir)})


PEERS = {
    "squid": start_squid,
    "tinyproxy": start_tinyproxy,
    "pproxy": start_pproxy,
    "proxy.py": start_proxypy,
}
