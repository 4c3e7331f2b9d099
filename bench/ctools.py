"""The tunnel-setup load from C: bench/c/tunnels.c (client) and bench/c/echo.c (echo server).

Python's asyncio client spends about as much CPU per tunnel as the proxy it
measures, and on 2 cores that hides part of any proxy's speed (issue 30's
study: about 0.2× of the gap to squid). These are built from source with the
system compiler (``cc``) into a temporary directory; without one the bench
falls back to bench/load.py and says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class CTools:
    """The built client and echo server, and the running echo server's port."""

    tunnels: Path
    echo: Path
    _dir: tempfile.TemporaryDirectory[str]
    server: subprocess.Popen[str] | None = None
    echo_port: int = 0

    def start_echo(self, host: str) -> int:
        """Start the echo server on ``host`` (a port from the kernel); its port."""
        self.server = subprocess.Popen([str(self.echo), host, "0"], stdout=subprocess.PIPE, text=True)
        assert self.server.stdout is not None
        line = self.server.stdout.readline().split()
        if len(line) != 2 or line[0] != "listening":
            raise RuntimeError(f"the C echo server did not start: {line}")
        self.echo_port = int(line[1])
        return self.echo_port

    def setup(self, host: str, count: int, concurrency: int, max_s: float, proxy_port: int | None) -> dict[str, float]:
        """``count`` tunnels to the echo server, ``concurrency`` at a time: bench/load.py setup's JSON, and cpu_s."""
        argv = [str(self.tunnels), host, str(self.echo_port), str(count), str(concurrency), str(max_s)]
        if proxy_port is not None:
            argv += ["127.0.0.1", str(proxy_port)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=max_s + 30)
        if out.returncode != 0:
            raise RuntimeError(f"tunnels failed: {out.stderr.strip()[-400:]}")
        result: dict[str, float] = json.loads(out.stdout)
        return result

    def close(self) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(timeout=10)
            self.server = None
        self._dir.cleanup()


def build() -> CTools | None:
    """Compile the client and the echo server (``cc -O2``); None, with a line on why, when that cannot be done."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("bench: no C compiler (apt-get install gcc): tunnel setup is driven from Python", flush=True)
        return None
    where = tempfile.TemporaryDirectory(prefix="bench-c-")
    built = {}
    for name in ("tunnels", "echo"):
        binary = Path(where.name) / name
        done = subprocess.run([cc, "-O2", "-Wall", "-o", str(binary), str(HERE / "c" / f"{name}.c")],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        if done.returncode != 0:
            print(f"bench: bench/c/{name}.c did not build: {done.stderr.strip()[-300:]}", flush=True)
            where.cleanup()
            return None
        built[name] = binary
    return CTools(built["tunnels"], built["echo"], where)
