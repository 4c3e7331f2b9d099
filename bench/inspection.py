"""Inspected HTTPS through egressd, side by side with mitmproxy, squid's ssl-bump and no proxy at all.

    .venv/bin/python bench/inspection.py [--handshakes 300] [--requests 2000] [--mitmdump PATH] [--squid PATH]

An HTTPS origin (HTTP/1.1 keep-alive, a 2-byte body, its own throwaway CA)
runs on 127.0.0.1 as ``localhost`` in a process of its own. Each proxy is
started fresh and inspects it: egressd with the rule ``GET localhost:PORT/**``
(every request decided on its method and path, the origin verified against
the throwaway CA, each request recorded to an audit log on disk), mitmproxy's
``mitmdump`` (quiet, verifying the origin the same way). The client (Python
asyncio, ssl) trusts the proxy's CA and measures, one after another:

- handshakes: N new connections, each CONNECT + a TLS handshake with the
  proxy (the leaf cache warm after the first) + one GET; per second and p99;
- requests: N GETs one after another on one kept-alive inspected connection;
  per second and p99.

"direct" is the same client straight to the origin (TLS, no proxy). Loads
are bounded in count and time; everything listens on loopback. mitmproxy is
not a dependency of egressd: ``pip install mitmproxy`` into a venv of its own
and pass ``--mitmdump``; without it, its rows are skipped and say so.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

HOST = "127.0.0.1"
NAME = "localhost"
MAX_S = 120.0  # each load stops here whatever its count


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a leaf for ``localhost`` it signed: (ca, cert, key) PEM files."""
    now = dt.datetime.now(dt.UTC)
    name = lambda text: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])  # noqa: E731
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("bench CA")).issuer_name(name("bench CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))  # fmt: skip
    leaf = (x509.CertificateBuilder().subject_name(name(NAME)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # fmt: skip
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


ORIGIN = '''
import asyncio, ssl, sys
async def serve(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\\r\\n\\r\\n")
            writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nContent-Type: text/plain\\r\\n\\r\\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()
async def main():
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(sys.argv[1], sys.argv[2])
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
'''


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


async def _connect(
    proxy: int | None, origin: int, trust: ssl.SSLContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if proxy is None:
        return await asyncio.open_connection(HOST, origin, ssl=trust, server_hostname=NAME)
    reader, writer = await asyncio.open_connection(HOST, proxy)
    writer.write(f"CONNECT {NAME}:{origin} HTTP/1.1\r\nHost: {NAME}:{origin}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200") and not head.startswith(b"HTTP/1.0 200"):
        raise RuntimeError(f"CONNECT refused: {head[:80]!r}")
    await writer.start_tls(trust, server_hostname=NAME)
    return reader, writer


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, origin: int) -> None:
    writer.write(f"GET /bench HTTP/1.1\r\nHost: {NAME}:{origin}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"refused: {head[:120]!r}")
    await reader.readexactly(2)


def _figures(times: list[float], spent: float) -> tuple[float, float]:
    """(operations per second, p99 in ms)."""
    times.sort()
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))] if times else float("nan")
    return (len(times) / spent if spent else 0.0), p99 * 1000


async def _timed(n: int, operation: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """Run ``operation`` up to ``n`` times (at most ``MAX_S`` seconds): (per second, p99 ms)."""
    times: list[float] = []
    started = time.perf_counter()
    for _ in range(n):
        if time.perf_counter() - started > MAX_S:
            break
        t = time.perf_counter()
        await operation()
        times.append(time.perf_counter() - t)
    return _figures(times, time.perf_counter() - started)


async def handshakes(proxy: int | None, origin: int, trust: ssl.SSLContext, n: int) -> tuple[float, float]:
    async def one() -> None:
        reader, writer = await _connect(proxy, origin, trust)
        await _get(reader, writer, origin)
        writer.close()

    return await _timed(n, one)


async def requests(proxy: int | None, origin: int, trust: ssl.SSLContext, n: int) -> tuple[float, float]:
    reader, writer = await _connect(proxy, origin, trust)
    await _get(reader, writer, origin)  # warm
    figures = await _timed(n, lambda: _get(reader, writer, origin))
    writer.close()
    return figures


async def _wait_listening(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.returncode}")
        try:
            _, writer = await asyncio.open_connection(HOST, port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{what} is not listening on {port}")


async def _egressd(
    egressd: str, origin: int, ca: Path, work: Path
) -> tuple[subprocess.Popen[bytes], int, ssl.SSLContext]:
    port, control = _free_port(), _free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is timed
        [egressd, "serve", "--listen", f"{HOST}:{port}", "--control", f"{HOST}:{control}", "--approver", "deny",
         "--allow", f"GET {NAME}:{origin}/**", "--allow-private", f"{HOST}/32", "--inspect-origin-ca-file", str(ca),
         "--audit-log", str(work / "audit.jsonl"), "--log-level", "warning", "--workers", "1"],  # as its peers
        env=os.environ | {"EGRESSD_CONTROL_TOKEN": "bench-token"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    await _wait_listening(port, proc, "egressd")
    reader, writer = await asyncio.open_connection(HOST, control)
    writer.write(b"GET /runs/default/ca HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer bench-token\r\n"
                 b"Connection: close\r\n\r\n")
    answer = await reader.read()
    writer.close()
    pem = answer.split(b"\r\n\r\n", 1)[1]
    if b"BEGIN CERTIFICATE" not in pem:
        raise RuntimeError(f"no CA from egressd: {answer[:200]!r}")
    return proc, port, ssl.create_default_context(cadata=pem.decode())


async def _mitmdump(mitmdump: str, ca: Path, work: Path) -> tuple[subprocess.Popen[bytes], int, ssl.SSLContext]:
    port = _free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is timed
        [mitmdump, "-q", "--listen-host", HOST, "--listen-port", str(port), "--set", f"confdir={work}",
         "--set", f"ssl_verify_upstream_trusted_ca={ca}", "--set", "http2=false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    await _wait_listening(port, proc, "mitmdump")
    return proc, port, ssl.create_default_context(cafile=str(work / "mitmproxy-ca-cert.pem"))


SQUID_CONF = """\
http_port {host}:{port} ssl-bump tls-cert={dir}/ca.pem tls-key={dir}/ca.key generate-host-certificates=on \
dynamic_cert_mem_cache_size=4MB
sslcrtd_program {certgen} -s {dir}/ssl_db -M 4MB
sslcrtd_children 4
acl step1 at_step SslBump1
ssl_bump peek step1
ssl_bump bump all
tls_outgoing_options cafile={origin_ca}
http_access allow localhost
http_access deny all
cache deny all
access_log stdio:{dir}/access.log
cache_log {dir}/cache.log
pid_filename {dir}/squid.pid
coredump_dir {dir}
visible_hostname bench
shutdown_lifetime 0 seconds
dns_v4_first on
"""


def _squid_config(ca: Path, work: Path, port: int) -> tuple[Path, str]:
    """squid's config in ``work`` and the PEM of the CA it mints leaves with: (config, CA)."""
    import pwd

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench squid CA")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))  # fmt: skip
    (work / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (work / "ca.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))  # fmt: skip
    (work / "origin-ca.pem").write_bytes(ca.read_bytes())
    certgen = "/usr/lib/squid/security_file_certgen"
    subprocess.run([certgen, "-c", "-s", str(work / "ssl_db"), "-M", "4MB"], check=True, capture_output=True)
    conf = work / "squid.conf"
    conf.write_text(SQUID_CONF.format(host=HOST, port=port, dir=work, certgen=certgen,
                                      origin_ca=work / "origin-ca.pem"))  # fmt: skip
    if os.geteuid() == 0:  # squid drops to its own user: the directory is made its
        proxy = pwd.getpwnam("proxy")
        for path in (work, *work.rglob("*")):
            os.chown(path, proxy.pw_uid, proxy.pw_gid)
        work.parent.chmod(0o711)
    return conf, cert.public_bytes(serialization.Encoding.PEM).decode()


async def _squid(squid: str, ca: Path, work: Path) -> tuple[subprocess.Popen[bytes], int, ssl.SSLContext]:
    """squid with ssl-bump (Debian's squid-openssl): a CA of its own for the leaves it mints, the origin
    verified against the bench's CA, an access log line per request as egressd writes an audit record."""
    port = _free_port()
    conf, ca_pem = _squid_config(ca, work, port)
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is timed
        [squid, "-N", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    await _wait_listening(port, proc, "squid")
    return proc, port, ssl.create_default_context(cadata=ca_pem)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handshakes", type=int, default=300)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--egressd", default=str(Path(sys.executable).with_name("egressd")))
    parser.add_argument("--mitmdump", default=shutil.which("mitmdump"))
    parser.add_argument("--squid", default=shutil.which("squid") or (shutil.which("squid", path="/usr/sbin")))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="egressd-bench-inspect-") as tmp:
        work = Path(tmp)
        ca, cert, key = _certificates(work)
        origin_proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is timed
            [sys.executable, "-c", ORIGIN, str(cert), str(key)], stdout=subprocess.PIPE
        )
        try:
            assert origin_proc.stdout is not None
            origin = int(origin_proc.stdout.readline())
            rows: list[tuple[str, tuple[float, float], tuple[float, float]]] = []
            direct = ssl.create_default_context(cafile=str(ca))
            rows.append(("direct", await handshakes(None, origin, direct, args.handshakes),
                         await requests(None, origin, direct, args.requests)))
            proc, port, trust = await _egressd(args.egressd, origin, ca, work)
            try:
                await handshakes(port, origin, trust, 5)  # the run's CA and the leaf made before timing
                rows.append(("egressd", await handshakes(port, origin, trust, args.handshakes),
                             await requests(port, origin, trust, args.requests)))
            finally:
                _stop(proc)
            if args.mitmdump:
                (work / "mitm").mkdir()
                proc, port, trust = await _mitmdump(args.mitmdump, ca, work / "mitm")
                try:
                    await handshakes(port, origin, trust, 5)
                    rows.append(("mitmproxy", await handshakes(port, origin, trust, args.handshakes),
                                 await requests(port, origin, trust, args.requests)))
                finally:
                    _stop(proc)
            else:
                print("mitmproxy: skipped (no mitmdump; pip install mitmproxy into a venv and pass --mitmdump)")
            if args.squid:
                (work / "squid").mkdir()
                proc, port, trust = await _squid(args.squid, ca, work / "squid")
                try:
                    await handshakes(port, origin, trust, 5)
                    rows.append(("squid", await handshakes(port, origin, trust, args.handshakes),
                                 await requests(port, origin, trust, args.requests)))
                finally:
                    _stop(proc)
            else:
                print("squid: skipped (no squid; Debian: apt install squid-openssl, which has ssl-bump)")
        finally:
            _stop(origin_proc)
    print(f"{'':10} {'handshakes/s':>13} {'p99 ms':>8} {'requests/s':>11} {'p99 ms':>8}")
    for name, (hs, hs99), (rq, rq99) in rows:
        print(f"{name:10} {hs:13.1f} {hs99:8.2f} {rq:11.1f} {rq99:8.2f}")
    by = {name: (hs, rq) for name, (hs, _), (rq, _) in rows}
    if "mitmproxy" in by:
        e, m = by["egressd"], by["mitmproxy"]
        print(f"egressd / mitmproxy: handshakes {e[0] / m[0]:.2f}x, requests {e[1] / m[1]:.2f}x")
    if "squid" in by:
        e, q = by["egressd"], by["squid"]
        print(f"egressd / squid:     handshakes {e[0] / q[0]:.2f}x, requests {e[1] / q[1]:.2f}x")
    e, d = by["egressd"], by["direct"]
    print(f"egressd / direct:    handshakes {e[0] / d[0]:.2f}x, requests {e[1] / d[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
