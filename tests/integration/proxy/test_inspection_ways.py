"""HTTPS inspection on the ways in besides the explicit proxy's CONNECT: the transparent TLS listener and
SOCKS5; and plain HTTP to an inspected name, through the proxy and the transparent HTTP listener.

The transparent listener has read the client's ClientHello before it knew
the name: its handshake goes on from those bytes (``tlslayer``). SOCKS is
answered, then its TLS taken over as a CONNECT's is. Either way, each
request inside is decided on its method and path, as through the explicit
proxy (test_inspection.py). Attacks first: a write no rule covers, a Host
naming another host, a client that does not trust the run's CA; for each,
the refusal, the origin's count (nothing reached it) and the record.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession

from egressd.cli.wiring.service import EgressService
from egressd.proxy.core.modes import transparent_http, transparent_tls
from tests.conftest import HttpOrigin, HttpsOrigin, MakeEgressd
from tests.harness import have, require, wait_until

pytestmark = pytest.mark.timeout(60)

RULE = "GET origin.test:{port}/docs/**"


async def _egressd(make_egressd: MakeEgressd, origin: HttpsOrigin, way: str, **values: Any) -> EgressService:
    """An egressd inspecting origin.test (GET /docs/** only), listening for ``way`` ("tls" or "socks")."""
    listener = {"tls": "transparent_tls", "socks": "socks"}[way]
    svc = await make_egressd(
        allow=[RULE.format(port=origin.port)],
        inspect_origin_ca_file=str(origin.ca_file),
        **{listener: "127.0.0.1:0"},
        **values,
    )
    if way == "tls":
        svc.transparent_tls.mode = transparent_tls(origin.port)  # it decides and dials the origin's port
    return svc


async def _run_ca(svc: EgressService, tmp_path: Path) -> Path:
    async with ClientSession() as session, session.get(
        f"{svc.control_address}/runs/default/ca", headers={"Authorization": "Bearer test-token"}
    ) as response:
        assert response.status == 200, await response.text()
        path = tmp_path / "run-ca.pem"
        path.write_bytes(await response.read())
    return path


async def _curl(
    svc: EgressService, way: str, port: int, ca: Path, paths: str | list[str], *args: str
) -> tuple[int, str, str]:
    """curl to https://origin.test:PORT/PATH by ``way`` (several paths: one connection), trusting only ``ca``:
    (exit code, heads and bodies, stderr)."""
    require(have("curl"), "curl is not installed")
    if way == "tls":  # as a sandboxed program is sent there: the name resolves to the listener
        host, listener_port = svc.transparent_tls.address
        route = ["--connect-to", f"origin.test:{port}:{host}:{listener_port}"]
    else:
        route = ["--socks5-hostname", f"127.0.0.1:{svc.socks_address[1]}"]
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-i", "--max-time", "10", "--noproxy", "", *route, "--cacert", str(ca), *args,
        *(f"https://origin.test:{port}{path}" for path in ([paths] if isinstance(paths, str) else paths)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode("latin-1"), err.decode("latin-1")


def _records(svc: EgressService, kind: str) -> list[dict[str, Any]]:
    return [r for r in svc.audit_records if r.get("kind") == kind and r["event"] == "egress"]


WAYS = ["tls", "socks"]


@pytest.mark.parametrize("way", WAYS)
async def test_an_allowed_get_is_inspected_and_forwarded_with_its_normalised_path(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path, way: str
) -> None:
    svc = await _egressd(make_egressd, https_origin, way)
    ca = await _run_ca(svc, tmp_path)
    # Two requests on one connection: each is decided.
    code, out, err = await _curl(svc, way, https_origin.port, ca, ["/docs/a/./b?x=1", "/docs/c"], "--path-as-is")
    assert code == 0, err
    assert out.count("HTTP/1.1 200 OK") == 2, out
    assert [(m, p) for m, p, _ in https_origin.requests] == [("GET", "/docs/a/b?x=1"), ("GET", "/docs/c")]
    inside = _records(svc, "https")
    assert [(r["decision"], r["method"], r["path"]) for r in inside] == [
        ("allow", "GET", "/docs/a/b"), ("allow", "GET", "/docs/c")]
    # One connection carried both; it keeps its own record, of its own kind.
    (tunnel,) = _records(svc, way)
    assert (tunnel["decision"], tunnel["host"], tunnel["port"]) == ("allow", "origin.test", https_origin.port)


# Attacks inside the TLS: a write no rule covers; a Host naming another host than the tunnel's.
REFUSED = [
    (["-X", "POST", "--data-binary", "k=v"], "not_allowlisted", "POST"),
    (["-H", "Host: other.test"], "sni_mismatch", None),  # refused as it is read: before any method is judged
]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("args", "reason", "method"), REFUSED, ids=["write", "other-host"])
async def test_a_request_no_rule_allows_is_refused_inside_the_tls_and_reaches_nothing(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path, way: str,
    args: list[str], reason: str, method: str | None,
) -> None:
    svc = await _egressd(make_egressd, https_origin, way, ask=False)
    ca = await _run_ca(svc, tmp_path)
    code, out, err = await _curl(svc, way, https_origin.port, ca, "/docs/a", *args)
    assert code == 0, err
    assert out.startswith("HTTP/1.1 403 ") and f"X-Egress-Reason: {reason}" in out, out
    assert https_origin.requests == []
    (record,) = _records(svc, "https")
    assert (record["decision"], record["reason"], record.get("method")) == ("deny", reason, method)


@pytest.mark.parametrize("way", WAYS)
async def test_a_client_that_does_not_trust_the_runs_ca_fails_with_a_clear_record(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, way: str
) -> None:
    svc = await _egressd(make_egressd, https_origin, way)
    # A pinned client: it trusts the origin's own CA, not the run's.
    code, _, err = await _curl(svc, way, https_origin.port, https_origin.ca_file, "/docs/a")
    assert code != 0, err
    assert https_origin.requests == []
    (tunnel,) = _records(svc, way)
    await wait_until(
        lambda: any(r["event"] == "egress.end" and r["id"] == tunnel["id"] for r in svc.audit_records)
    )
    (end,) = [r for r in svc.audit_records if r["event"] == "egress.end" and r["id"] == tunnel["id"]]
    assert end["end"] == "tls_intercept_failed" and "TLS handshake with the client failed" in end["detail"], end


# -- plain HTTP to an inspected name: the same rules, nothing to take over -------------------------


@pytest.mark.parametrize("way", ["proxy", "transparent_http"])
async def test_plain_http_to_an_inspected_name_is_decided_on_its_method_and_path(
    make_egressd: MakeEgressd, http_origin: HttpOrigin, way: str
) -> None:
    require(have("curl"), "curl is not installed")
    port = http_origin.port
    svc = await make_egressd(allow=[RULE.format(port=port)], ask=False, transparent_http="127.0.0.1:0")
    if way == "proxy":
        route = ["-x", f"http://127.0.0.1:{svc.proxy_address[1]}"]
    else:
        svc.transparent_http.mode = transparent_http(port)
        route = ["--connect-to", f"origin.test:{port}:127.0.0.1:{svc.transparent_http.address[1]}"]
    url = f"http://origin.test:{port}"
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-i", "--max-time", "10", "--noproxy", "", *route, "--path-as-is", f"{url}/docs/./a",
        "-X", "GET", f"{url}/admin",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    text = out.decode("latin-1")
    assert "HTTP/1.1 200 OK" in text and "X-Egress-Reason: not_allowlisted" in text, text
    assert [(r["method"], r["path"]) for r in http_origin.requests] == [("GET", "/docs/a")]  # /admin did not go
    decided = [(r["decision"], r.get("method"), r.get("path")) for r in svc.audit_records
               if r["event"] == "egress" and r["kind"] == "http"]  # fmt: skip
    assert decided == [("allow", "GET", "/docs/a"), ("deny", "GET", "/admin")], decided
