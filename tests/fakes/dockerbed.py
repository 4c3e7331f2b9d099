"""The Docker test bed: origins and leak detectors as containers, host listeners, probes.

Addresses: every network here has a subnet we choose, from TEST_RANGE
(link-local, 169.254.128.0/20: never routed, clear of the default run range's
first pieces and of 169.254.169.0/24). A test takes a free /27 and hands it to
the session as its range, so the run's internal network is the first /28 and
its outgoing network the second — known before egressd starts, so
``allow_private`` can name exactly the outgoing /28, where the origin lives.

Containers made here carry ``egressd.test=1`` (and the run's labels when they
sit on a run's network, so the run's own clean-up removes them too). Nothing
here sends traffic anywhere but to those networks and to loopback.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import ipaddress
import json
import os
import random
import socket
import textwrap
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from egressd.sandbox.docker.config import LABEL_OWNER
from egressd.sandbox.docker.engine import DockerEngine

# The egressd image under test (another tag: one built from this tree while other trees build egressd:latest).
EGRESSD_IMAGE = os.environ.get("EGRESSD_TEST_IMAGE", "egressd:latest")
SANDBOX_IMAGE = "egressd-sandbox:latest"
TEST_RANGE = "169.254.128.0/20"
TEST_LABELS = {"egressd.test": "1"}
DOCKER_SOCKET = "/var/run/docker.sock"
ORIGIN_NAME = "origin.test"
ORIGIN_PORT = 8080  # and 80, for the transparent HTTP listener
LEAK_PORTS = (22, 53, 80, 443, 3128, 3129, 8080)

# The origin: answers every GET with what it was asked; runs as uid 1000.
ORIGIN_SCRIPT = textwrap.dedent("""
    import http.server, threading
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"hello from origin: {self.command} {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    class Server(http.server.ThreadingHTTPServer):
        def process_request(self, request, client_address):  # every connection, even one that sends nothing
            print("ARRIVAL", client_address[0], self.server_address[1], flush=True)
            super().process_request(request, client_address)
    servers = [Server(("0.0.0.0", port), Handler) for port in (80, 8080)]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    servers[0].serve_forever()
""")


def tls_origin_script(cert_pem: str, key_pem: str, files: dict[str, bytes] | None = None) -> str:
    """An HTTPS origin on port 443 with ``cert_pem`` and ``key_pem`` (in memory: the helper's root is read-only).

    It answers a GET of a path in ``files`` with that file, every other GET, POST and PUT with its method
    and path, and prints "ARRIVAL ..." per connection, "REQ <method> <path> <body bytes>" and
    "AUTH <Authorization header>" per request to its log, never to the client (a secret put in by egressd
    must not come back to the sandbox).
    """
    served = {path: base64.b64encode(data).decode() for path, data in (files or {}).items()}
    return f"CERT = {cert_pem!r}\nKEY = {key_pem!r}\nFILES = {served!r}\n" + textwrap.dedent("""
        import base64, http.server, os, ssl
        def pem_path(text):
            fd = os.memfd_create("pem")
            os.write(fd, text.encode())
            return f"/proc/self/fd/{fd}"
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                got = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                print("REQ", self.command, self.path, len(got), flush=True)
                print("AUTH", self.headers.get("Authorization"), flush=True)
                if self.command == "GET" and self.path in FILES:
                    body = base64.b64decode(FILES[self.path])
                else:
                    body = f"hello from tls origin: {self.command} {self.path}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                if self.path in FILES:  # an index page (pip reads text/html only), or a file
                    html = self.path.endswith("/")
                    self.send_header("Content-Type", "text/html" if html else "application/octet-stream")
                self.end_headers()
                self.wfile.write(body)
            do_POST = do_PUT = do_GET
            def log_message(self, *args):
                pass
        class Server(http.server.ThreadingHTTPServer):
            def process_request(self, request, client_address):
                print("ARRIVAL", client_address[0], self.server_address[1], flush=True)
                super().process_request(request, client_address)
        server = Server(("0.0.0.0", 443), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pem_path(CERT), pem_path(KEY))
        server.socket = context.wrap_socket(server.socket, server_side=True)
        print("ready", flush=True)
        server.serve_forever()
    """)


# The leak detector: counts every TCP connection and UDP datagram that reaches it.
LEAK_SCRIPT = textwrap.dedent("""
    import selectors, socket
    sel = selectors.DefaultSelector()
    for port in PORTS:
        t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        t.bind(("0.0.0.0", port)); t.listen(16); t.setblocking(False)
        sel.register(t, selectors.EVENT_READ, "tcp")
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", port)); u.setblocking(False)
        sel.register(u, selectors.EVENT_READ, "udp")
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "tcp":
                conn, addr = key.fileobj.accept(); conn.close()
                print("LEAK tcp", addr[0], key.fileobj.getsockname()[1], flush=True)
            else:
                data, addr = key.fileobj.recvfrom(2048)
                print("LEAK udp", addr[0], key.fileobj.getsockname()[1], flush=True)
""").replace("PORTS", repr(LEAK_PORTS))


def engine_answers() -> tuple[bool, str]:
    """Whether the Docker Engine answers and has both images (synchronous, for ``require``)."""
    try:
        for image in (EGRESSD_IMAGE, SANDBOX_IMAGE):
            conn = _UnixHttp(DOCKER_SOCKET)
            conn.request("GET", f"/images/{image}/json")
            status = conn.getresponse().status
            conn.close()
            if status != 200:
                return False, f"the image {image} is missing: run bash docker/build.sh"
    except OSError as exc:
        return False, f"no Docker Engine at {DOCKER_SOCKET}: {exc}"
    return True, ""


class _UnixHttp(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("docker", timeout=5)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(self._path)


async def free_test_range(engine: DockerEngine) -> ipaddress.IPv4Network:
    """A /27 of TEST_RANGE that overlaps no network of the engine or route of the host.

    Picked at random among the free ones, so test runs sharing the engine rarely race for one.
    """
    taken = [t for t in await engine.taken_subnets() if t.version == 4]
    free = [n for n in ipaddress.ip_network(TEST_RANGE).subnets(new_prefix=27) if not any(n.overlaps(t) for t in taken)]
    assert free, f"no free /27 left in {TEST_RANGE}"
    return random.choice(free)  # type: ignore[return-value]


def split_range(block: ipaddress.IPv4Network) -> tuple[ipaddress.IPv4Network, ipaddress.IPv4Network]:
    internal, outgoing = block.subnets(new_prefix=28)
    return internal, outgoing


@dataclass
class Helper:
    """A container of ours (origin or leak detector) on some network."""

    engine: DockerEngine
    id: str
    address: str

    async def logs(self) -> str:
        out = await self.engine.client.containers.container(self.id).log(stdout=True, stderr=True)
        return "".join(out)

    async def leaks(self) -> list[str]:
        return [line for line in (await self.logs()).splitlines() if line.startswith("LEAK")]

    async def arrivals(self) -> list[str]:
        """The origin's "ARRIVAL <peer address> <port>" lines: every connection it accepted."""
        return [line for line in (await self.logs()).splitlines() if line.startswith("ARRIVAL")]


async def start_helper(
    engine: DockerEngine,
    *,
    network: str,
    address: str,
    script: str,
    labels: Mapping[str, str],
    aliases: Sequence[str] = (),
) -> Helper:
    """Run ``script`` with python3 in the toolchain image on ``network`` at ``address``; wait for "ready"."""
    config: dict[str, Any] = {
        "Image": SANDBOX_IMAGE,
        "Entrypoint": [""],
        "Cmd": ["python3", "-u", "-c", script],
        "User": "1000:1000",
        "Labels": {**TEST_LABELS, **labels},
        "HostConfig": {
            "NetworkMode": network,
            "ReadonlyRootfs": True,
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges:true"],
            "Sysctls": {"net.ipv4.ip_unprivileged_port_start": "0"},
            "Memory": 128 * 1024 * 1024,
            "PidsLimit": 64,
        },
        "NetworkingConfig": {
            "EndpointsConfig": {network: {"IPAMConfig": {"IPv4Address": address}, "Aliases": list(aliases)}}
        },
    }
    container = await engine.client.containers.create(config)
    await container.start()
    helper = Helper(engine, container.id, address)
    for _ in range(100):  # 10 s at most
        if "ready" in await helper.logs():
            return helper
        await asyncio.sleep(0.1)
    raise AssertionError(f"helper container did not start: {await helper.logs()}")


@dataclass
class HostListeners:
    """TCP and UDP listeners on host addresses that count whatever reaches them."""

    tcp: int = 0
    udp: int = 0
    ports: dict[str, int] = field(default_factory=dict)  # address -> port (TCP and UDP alike)
    _closers: list[Any] = field(default_factory=list)


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, listeners: HostListeners) -> None:
        self.listeners = listeners

    def datagram_received(self, data: bytes, addr: tuple) -> None:  # type: ignore[type-arg]
        self.listeners.udp += 1


@contextlib.asynccontextmanager
async def host_listeners(addresses: list[str]) -> AsyncIterator[HostListeners]:
    listeners = HostListeners()
    loop = asyncio.get_running_loop()

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listeners.tcp += 1
        writer.close()

    try:
        for address in addresses:
            server = await asyncio.start_server(counted, address, 0)
            port = server.sockets[0].getsockname()[1]
            listeners._closers.append(server)
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Datagrams(listeners), local_addr=(address, port))
            listeners._closers.append(transport)
            listeners.ports[address] = port
        yield listeners
    finally:
        for closer in listeners._closers:
            closer.close()
            if isinstance(closer, asyncio.AbstractServer):
                await closer.wait_closed()


@contextlib.asynccontextmanager
async def hook_receiver(sock: socket.socket) -> AsyncIterator[list[dict[str, Any]]]:
    """A webhook endpoint on ``sock`` (bound and listening already) that takes every approval request and
    answers "later" (202)."""
    received: list[dict[str, Any]] = []

    async def hook(request: web.Request) -> web.Response:
        received.append(json.loads(await request.read()))
        return web.Response(status=202)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        yield received
    finally:
        await runner.cleanup()


async def leftovers(engine: DockerEngine, label: str, *, owner_pid: int | None = None) -> list[str]:
    """What still carries ``label`` (``key`` or ``key=value``), of one egressd process if ``owner_pid`` is given.

    Other test runs may share the engine: every check names its own run or process.
    """
    containers, networks, volumes = await engine.labelled(label)

    def mine(labels: Mapping[str, str] | None) -> bool:
        return owner_pid is None or f":{owner_pid}:" in (labels or {}).get(LABEL_OWNER, "")

    return ([f"container {c['Id'][:12]}" for c in containers if mine(c.get("Labels"))]
            + [f"network {n['Name']}" for n in networks if mine(n.get("Labels"))]
            + [f"volume {v['Name']}" for v in volumes if mine(v.get("Labels"))])


# Run inside the sandbox: every way out we can think of, as JSON results.
PROBE = textwrap.dedent("""
    import errno, json, socket, subprocess, sys
    targets = json.loads(sys.argv[1])
    results = {}
    def attempt(name, fn):
        try:
            fn()
            results[name] = "connected"
        except OSError as exc:
            results[name] = errno.errorcode.get(exc.errno, str(exc))
    def tcp(host, port, family=socket.AF_INET):
        s = socket.socket(family, socket.SOCK_STREAM); s.settimeout(2)
        try:
            s.connect((host, port))
            # Connected: say who answered (a failure must name the way out it found).
            s.sendall(b"GET /probe HTTP/1.0\\r\\n\\r\\n")
            try:
                reply = s.recv(200)
            except OSError as exc:
                reply = repr(exc).encode()
            results["detail " + host + ":" + str(port)] = [s.getsockname(), s.getpeername(), reply.decode("latin-1")]
        finally: s.close()
    def udp(host, port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for _ in range(3): s.sendto(b"x", (host, port))
        finally: s.close()
    for name, (host, port) in targets["tcp"].items():
        attempt("tcp " + name, lambda: tcp(host, port))
    for name, (host, port) in targets["udp"].items():
        attempt("udp " + name, lambda: udp(host, port))
    attempt("ipv6 loopback of the host", lambda: tcp("::1", 22, socket.AF_INET6))
    attempt("raw socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
    for name, server in targets["dns"].items():
        dig = subprocess.run(["dig", "+time=1", "+tries=1", "@" + server, "leak.test"], capture_output=True, text=True)
        results["dns " + name] = "answered" if "ANSWER SECTION" in dig.stdout else "no answer"
    for table in ("/proc/net/route", "/proc/net/arp"):
        try:
            results["table " + table] = open(table).read()
        except OSError as exc:
            results["table " + table] = str(exc)
    print(json.dumps(results))
""")


# Prints the errno of socket(AF_VSOCK), socket(AF_PACKET) and io_uring_setup (0 if one succeeded):
# "97 97 1" under egressd's profile (EAFNOSUPPORT twice, then EPERM).
SOCKET_FAMILY_PROBE = textwrap.dedent("""
    import ctypes, os, socket
    out = []
    for family in (40, 17):  # AF_VSOCK, AF_PACKET
        try:
            socket.socket(family, socket.SOCK_DGRAM if family == 17 else socket.SOCK_STREAM).close()
            out.append(0)
        except OSError as exc:
            out.append(exc.errno)
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    fd = libc.syscall(425, 4, params)  # io_uring_setup(4 entries, params)
    out.append(ctypes.get_errno() if fd < 0 else 0)
    print(*out)
""")
