"""pip through egressd: a real `pip download` from a local package index, via `egressd serve`."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from aiohttp import web

from tests import REPO
from tests.harness import ORIGIN, ORIGIN_RANGE, aserve_ports

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def make_wheel(name: str, version: str) -> tuple[str, bytes]:
    """A minimal, valid pure-Python wheel (PEP 427)."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{name.replace('-', '_')}/__init__.py": b"VALUE = 42\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: egressd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record_lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record_lines.append(f"{path},sha256={digest},{len(data)}")
    record_lines.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record_lines) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return f"{dist}-py3-none-any.whl", buf.getvalue()


async def test_pip_download_through_egressd_serve(tmp_path: Path, dns) -> None:
    filename, wheel = make_wheel("demo-pkg", "1.0")
    sha = hashlib.sha256(wheel).hexdigest()

    async def simple(request: web.Request) -> web.Response:
        return web.Response(text=f'<html><body><a href="/files/{filename}#sha256={sha}">{filename}</a></body></html>',
                            content_type="text/html")

    async def files(request: web.Request) -> web.Response:
        return web.Response(body=wheel, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/simple/demo-pkg/", simple)
    app.router.add_get(f"/files/{filename}", files)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, ORIGIN, 0)
    await site.start()
    index_port = runner.addresses[0][1]

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and not k.startswith(("EGRESSD_", "PIP_"))
    }
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    serve = await asyncio.create_subprocess_exec(
        EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
        "--allow", f"index.test:{index_port}", "--allow-private", ORIGIN_RANGE,
        "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--audit-log", str(tmp_path / "audit.jsonl"),
        env=env, stderr=asyncio.subprocess.PIPE,
    )
    dns.set("index.test", [ORIGIN])
    try:
        assert serve.stderr is not None
        port = (await aserve_ports(serve.stderr))["proxy"]  # the port it bound, read from its report
        out_dir = tmp_path / "out"
        pip = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
            "--proxy", f"http://127.0.0.1:{port}", "--index-url", f"http://index.test:{index_port}/simple/",
            "--trusted-host", "index.test", "-d", str(out_dir), "demo-pkg",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(pip.communicate(), 120)
        assert pip.returncode == 0, output.decode()
        assert (out_dir / filename).read_bytes() == wheel
    finally:
        serve.terminate()
        await asyncio.wait_for(serve.wait(), 20)
        await runner.cleanup()
    audit = (tmp_path / "audit.jsonl").read_text()
    assert '"host":"index.test"' in audit and '"decision":"allow"' in audit


def test_nothing_generic_lands_in_site_packages() -> None:
    """The folders stay at the top of the checkout but install as egressd.*:
    outside the checkout, ``import proxy`` finds nothing of ours."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    for package in ("proxy", "control", "approvals", "config", "audit", "sandbox", "agent", "cli", "names"):
        assert "egressd" not in owners.get(package, []), (package, owners.get(package))
    probe = (
        "import importlib.util, egressd.proxy, egressd.cli\n"
        "print(egressd.proxy.__file__, egressd.cli.__file__)\n"
        "print([n for n in ('proxy', 'cli', 'config', 'audit', 'names') if importlib.util.find_spec(n)])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd="/", timeout=30)
    assert out.returncode == 0, out.stderr
    files, bare = out.stdout.splitlines()
    assert files.split() == [f"{REPO}/proxy/__init__.py", f"{REPO}/cli/__init__.py"], files
    assert bare == "[]", bare
