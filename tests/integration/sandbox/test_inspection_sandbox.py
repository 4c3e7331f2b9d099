"""Inspection inside `egressd run`'s sandbox: the command trusts the run's CA with no flags, and cannot read its key;
a program that ignores the proxy settings is inspected too; pip downloads from a TLS package index.

curl and Python's urllib, run as a user would, reach an inspected name
over HTTPS (the run's CA is in the bundle at the standard path and named
by the usual variables), a write no rule covers is refused, and nothing
of the CA's key is anywhere the command can look.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import textwrap
import zipfile
from pathlib import Path

import pytest
from aiohttp import web

from tests.conftest import HttpsOrigin
from tests.fakes.tls import TlsOrigin, make_pki
from tests.harness import ORIGIN, require
from tests.integration.sandbox.test_sandbox import _needs_root_and_tools, assert_no_leftovers, egressd_run

__all__ = ["_needs_root_and_tools"]  # the autouse fixture: root, bwrap, nft, ip, nsenter, curl


async def test_curl_and_python_in_the_sandbox_trust_the_runs_ca_and_a_write_is_refused(
    tmp_path: Path, dns, https_origin: HttpsOrigin  # type: ignore[no-untyped-def]
) -> None:
    base = f"https://origin.test:{https_origin.port}"
    fetch = f"import urllib.request as u; print(u.urlopen('{base}/docs/from-python', timeout=10).read().decode())"
    script = textwrap.dedent(f"""
        curl -sS -m 10 {base}/docs/from-curl; echo
        python3 -c "{fetch}"
        curl -sS -m 10 -o /dev/null -w 'post=%{{http_code}}\\n' -X POST --data-binary @/etc/hostname {base}/docs/upload
        echo "bundle=$(grep -c 'egressd: this run' /etc/ssl/certs/ca-certificates.crt)"
        echo "vars=$SSL_CERT_FILE $REQUESTS_CA_BUNDLE $NODE_EXTRA_CA_CERTS $PIP_CERT $GIT_SSL_CAINFO"
        echo "keys=$(cat /proc/self/environ /etc/ssl/certs/ca-certificates.crt 2>/dev/null | grep -c 'PRIVATE KEY')"
    """)
    code, out, err = await egressd_run(
        tmp_path, dns, "--allow", f"GET origin.test:{https_origin.port}/docs/**", "--no-ask",
        "--inspect-origin-ca-file", str(https_origin.ca_file), "--", "sh", "-c", script,
    )  # fmt: skip
    assert code == 0, err
    assert "origin: GET /docs/from-curl" in out and "origin: GET /docs/from-python" in out, (out, err)
    assert "post=403" in out and "bundle=1" in out and "keys=0" in out, out
    assert "vars=/etc/ssl/certs/ca-certificates.crt" in out, out
    assert [(m, p) for m, p, _ in https_origin.requests] == [("GET", "/docs/from-curl"), ("GET", "/docs/from-python")]
    await assert_no_leftovers()


async def test_a_declared_secret_never_enters_the_sandbox_and_still_reaches_its_name(
    tmp_path: Path, dns, https_origin: HttpsOrigin  # type: ignore[no-untyped-def]
) -> None:
    base = f"https://origin.test:{https_origin.port}"
    script = textwrap.dedent(f"""
        echo "placeholder=$ORIGIN_TOKEN"
        curl -sS -m 10 -H "Authorization: Bearer $ORIGIN_TOKEN" {base}/api; echo
        echo "found=$(cat /proc/self/environ /proc/1/environ 2>/dev/null | grep -c real-secret-value)"
    """)
    code, out, err = await egressd_run(
        tmp_path, dns, "--allow", f"origin.test:{https_origin.port}/**", "--no-ask",
        "--secret", f"ORIGIN_TOKEN@origin.test:{https_origin.port}",
        "--inspect-origin-ca-file", str(https_origin.ca_file), "--", "sh", "-c", script,
        env={"ORIGIN_TOKEN": "real-secret-value"},
    )  # fmt: skip
    assert code == 0, err
    assert "placeholder=egressd-secret-" in out and "found=0" in out and "real-secret-value" not in out, out
    assert "origin: GET /api" in out, out
    assert https_origin.requests[-1][2]["Authorization"] == "Bearer real-secret-value"
    await assert_no_leftovers()


@pytest.mark.parametrize("allow", [(), ("--allow", "origin.test")], ids=["no-allow", "plain-entry"])
async def test_a_secret_no_rule_can_put_in_stops_the_run_before_anything_is_made(  # type: ignore[no-untyped-def]
    tmp_path: Path, dns, allow: tuple[str, ...]
) -> None:
    """With no --allow at all, as with a plain entry, egressd could never put the secret in: say so, start nothing."""
    code, out, err = await egressd_run(
        tmp_path, dns, *allow, "--no-ask", "--secret", "ORIGIN_TOKEN@origin.test", "--", "true",
        env={"ORIGIN_TOKEN": "real-secret-value"},
    )  # fmt: skip
    assert code != 0 and "ORIGIN_TOKEN" in err and "no request rule" in err, (code, out, err)
    assert "real-secret-value" not in out + err
    await assert_no_leftovers()


async def test_a_program_that_ignores_the_proxy_is_inspected_all_the_same(tmp_path: Path, dns) -> None:  # type: ignore[no-untyped-def]
    """curl told to use no proxy lands on the transparent TLS listener, which inspects the name as CONNECT would."""
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki", ["origin.test"])
    origin = await TlsOrigin(pki, ORIGIN, 443).start()  # where the name really is, on the port the sandbox asks
    try:
        script = textwrap.dedent("""
            curl --noproxy '*' -sS -m 10 https://origin.test/docs/./direct; echo
            curl --noproxy '*' -sS -m 10 -o /dev/null -w 'post=%{http_code}\\n' -X POST -d k=v https://origin.test/docs/up
        """)
        code, out, err = await egressd_run(
            tmp_path, dns, "--allow", "GET origin.test/docs/**", "--no-ask",
            "--inspect-origin-ca-file", str(pki.ca_pem), "--", "sh", "-c", script,
        )  # fmt: skip
    finally:
        await origin.close()
    assert code == 0, err
    assert "hello from tls origin origin.test /docs/direct" in out and "post=403" in out, (out, err)
    assert origin.requests == ["/docs/direct"]  # the normalised path; the POST reached nothing
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    decided = [(r["kind"], r["decision"], r.get("method")) for r in records if r["event"] == "egress"]
    assert ("tls", "allow", None) in decided and ("https", "allow", "GET") in decided, decided
    assert ("https", "deny", "POST") in decided, decided
    await assert_no_leftovers()


# The pip of the system's python3, which the sandbox runs.
HAVE_SYSTEM_PIP = Path("/usr/lib/python3/dist-packages/pip").is_dir()


def _wheel(name: str, version: str) -> bytes:
    """A minimal, valid pure-Python wheel (PEP 427): one module, METADATA, WHEEL and RECORD."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = 1\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: egressd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for path, data in files.items()
    ) + f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in [*files.items(), (f"{dist}/RECORD", record.encode())]:
            archive.writestr(path, data)
    return buffer.getvalue()


async def test_pip_downloads_from_an_inspected_tls_package_index_trusting_the_runs_ca_with_no_flags(
    tmp_path: Path, dns  # type: ignore[no-untyped-def]
) -> None:
    """A PEP 503 index served over TLS by the test: pip inside the sandbox (PIP_CERT names the run's bundle)
    reads /simple/ and fetches the wheel, each request decided by its rule; an upload to the index is refused."""
    require(HAVE_SYSTEM_PIP, "the system's pip is not installed (Debian: python3-pip)")
    wheel = _wheel("egressd_demo", "1.0")
    filename = "egressd_demo-1.0-py3-none-any.whl"
    digest = hashlib.sha256(wheel).hexdigest()
    seen: list[tuple[str, str]] = []

    async def index(request: web.Request) -> web.Response:
        seen.append((request.method, request.path))
        if request.path == "/simple/egressd-demo/":
            link = f'<a href="/files/{filename}#sha256={digest}">{filename}</a>'
            return web.Response(text=f"<html><body>{link}</body></html>", content_type="text/html")
        if request.path == f"/files/{filename}":
            return web.Response(body=wheel, content_type="application/octet-stream")
        return web.Response(status=404)

    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki", ["origin.test"])
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", index)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ORIGIN, 0, ssl_context=pki.server_context()).start()
    port = runner.addresses[0][1]
    base = f"https://origin.test:{port}"
    script = textwrap.dedent(f"""
        python3 -m pip download --no-deps --disable-pip-version-check --no-cache-dir -d /tmp/got \\
            --index-url {base}/simple/ egressd-demo 2>&1 | tail -2
        ls /tmp/got
        curl -sS -m 10 -o /dev/null -w 'upload=%{{http_code}}\\n' -X POST --data-binary @/etc/hostname {base}/legacy/
    """)
    try:
        code, out, err = await egressd_run(
            tmp_path, dns, "--allow", f"GET origin.test:{port}/simple/**",
            "--allow", f"GET origin.test:{port}/files/**", "--no-ask",
            "--inspect-origin-ca-file", str(pki.ca_pem), "--", "sh", "-c", script,
        )  # fmt: skip
    finally:
        await runner.cleanup()
    assert code == 0, err
    assert filename in out and "upload=403" in out, (out, err)
    assert ("GET", "/simple/egressd-demo/") in seen and ("GET", f"/files/{filename}") in seen, seen
    assert all(method == "GET" for method, _ in seen), seen  # the upload reached nothing
    await assert_no_leftovers()
