"""HTTPS inspection through the explicit proxy: real TLS both ways, curl and Python's ssl as clients.

A name with request rules (``GET origin.test:PORT/docs/**``) is inspected:
the CONNECT is answered, the client's TLS is taken over with the run's own
CA, each request is decided on its method and its normalised path, and an
allowed one goes on over TLS to the origin (verified against the test's
origin CA, ``inspect_origin_ca_file``). Attacks first: a write, path
spellings, a Host naming another host, a CONNECT inside, a pinned client;
for each, the refusal, the origin's count (nothing reached it) and the record.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest, ApprovalScope
from egressd.cli.wiring.service import EgressService
from egressd.proxy.core.inspectca import RunCA
from egressd.vocabulary.reasons import Answer
from tests.conftest import HttpsOrigin, MakeEgressd
from tests.harness import have, require, wait_until

pytestmark = pytest.mark.timeout(60)


async def _inspecting(make_egressd: MakeEgressd, origin: HttpsOrigin, *rules: str, **values: Any) -> EgressService:
    return await make_egressd(
        allow=[rule.replace("PORT", str(origin.port)) for rule in rules],
        inspect_origin_ca_file=str(origin.ca_file),
        **values,
    )


async def _run_ca(svc: EgressService, tmp_path: Path, token: str | None = "test-token") -> Path:
    """The default run's CA, fetched as a launcher would: the control API with the global token."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with ClientSession() as session, session.get(f"{svc.control_address}/runs/default/ca", headers=headers) as r:
        assert r.status == 200, await r.text()
        path = tmp_path / "run-ca.pem"
        path.write_bytes(await r.read())
    return path


async def _curl(svc: EgressService, ca: Path, url: str, *args: str) -> tuple[int, str, str]:
    """curl through the proxy trusting only ``ca``: (exit code, status and headers and body, stderr)."""
    require(have("curl"), "curl is not installed")
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-i", "--max-time", "10", "--noproxy", "", "-x", f"http://127.0.0.1:{svc.proxy_address[1]}",
        "--cacert", str(ca), *args, url,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode("latin-1"), err.decode("latin-1")


def _https(svc: EgressService) -> list[dict[str, Any]]:
    return [r for r in svc.audit_records if r.get("kind") == "https"]


async def test_an_allowed_get_goes_through_inspected_and_is_recorded_with_its_method_and_path(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**")
    ca = await _run_ca(svc, tmp_path)
    code, out, err = await _curl(svc, ca, f"https://origin.test:{https_origin.port}/docs/a%7Eb/./c?x=1&y=2")
    assert code == 0, err
    assert out.startswith("HTTP/1.1 200 Connection established") and "\r\n\r\nHTTP/1.1 200" in out, out
    # The normalised path went upstream, the query as sent.
    assert [(m, p) for m, p, _ in https_origin.requests] == [("GET", "/docs/a~b/c?x=1&y=2")]
    (record,) = _https(svc)
    assert (record["decision"], record["rule"], record["host"], record["port"]) == (
        "allow", f"GET origin.test:{https_origin.port}/docs/**", "origin.test", https_origin.port)
    # DESIGN.md "Audit log": an https record carries the method, the path without its query, the status.
    # (the status on its egress.end: known once the origin answered).
    assert (record["method"], record["path"]) == ("GET", "/docs/a~b/c"), record
    (end,) = [r for r in svc.audit_records if r["event"] == "egress.end" and r["id"] == record["id"]]
    assert end["status"] == 200 and end["bytes_down"] > 0, end
    # The tunnel keeps its own pair: its end comes when the connection closes, with what its requests moved.
    (tunnel,) = [r for r in svc.audit_records if r.get("kind") == "connect"]
    await wait_until(lambda: any(r["event"] == "egress.end" and r["id"] == tunnel["id"] for r in svc.audit_records))
    (tunnel_end,) = [r for r in svc.audit_records if r["event"] == "egress.end" and r["id"] == tunnel["id"]]
    assert (tunnel_end["end"], tunnel_end["bytes_up"], tunnel_end["bytes_down"]) == (
        "closed", end["bytes_up"], end["bytes_down"]), tunnel_end
    assert "x=1" not in json.dumps(svc.audit_records)


async def test_a_write_no_rule_covers_is_refused_and_never_reaches_the_origin(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**", ask=False)
    ca = await _run_ca(svc, tmp_path)
    code, out, err = await _curl(
        svc, ca, f"https://origin.test:{https_origin.port}/docs/a", "-X", "POST", "--data-binary", "secret=1"
    )
    assert code == 0, err
    assert "\r\n\r\nHTTP/1.1 403 " in out and "X-Egress-Reason: not_allowlisted" in out, out
    assert https_origin.requests == []
    (record,) = _https(svc)
    assert (record["decision"], record["reason"]) == ("deny", "not_allowlisted")


@pytest.mark.parametrize(
    "path",
    ["/docs/%2e%2e/admin", "/docs/..%2Fadmin", "/docs/%2fadmin", "/docs//a", "/docs/a;x=1", "/docs/%c0%ae%c0%ae/a",
     "/docs/%5cadmin", "/docs/%00"],
)  # fmt: skip
async def test_every_ambiguous_path_spelling_is_bad_request_and_reaches_nothing(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path, path: str
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**", ask=False)
    ca = await _run_ca(svc, tmp_path)
    code, out, err = await _curl(svc, ca, f"https://origin.test:{https_origin.port}{path}", "--path-as-is")
    assert code == 0, err
    assert "\r\n\r\nHTTP/1.1 400 " in out and "X-Egress-Reason: bad_request" in out, out
    assert https_origin.requests == []
    (record,) = _https(svc)
    assert (record["decision"], record["reason"]) == ("deny", "bad_request")


async def test_dot_segments_cannot_climb_out_of_the_allowed_prefix(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**", ask=False)
    ca = await _run_ca(svc, tmp_path)
    code, out, err = await _curl(svc, ca, f"https://origin.test:{https_origin.port}/docs/../admin", "--path-as-is")
    assert code == 0, err
    assert "\r\n\r\nHTTP/1.1 403 " in out and "X-Egress-Reason: not_allowlisted" in out, out
    assert https_origin.requests == []


async def test_a_method_override_header_is_judged_as_the_method_it_names(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**", ask=False)
    ca = await _run_ca(svc, tmp_path)
    code, out, err = await _curl(
        svc, ca, f"https://origin.test:{https_origin.port}/docs/a", "-H", "X-HTTP-Method-Override: DELETE"
    )
    assert code == 0, err
    assert "\r\n\r\nHTTP/1.1 403 " in out, out
    assert https_origin.requests == []


async def _raw_inside(svc: EgressService, ca: Path, port: int, data: bytes) -> bytes:
    """CONNECT origin.test, take the TLS with the run's CA trusted, send ``data`` inside, read to the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", svc.proxy_address[1])
    writer.write(f"CONNECT origin.test:{port} HTTP/1.1\r\nHost: origin.test:{port}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    context = ssl.create_default_context(cafile=str(ca))
    await writer.start_tls(context, server_hostname="origin.test")
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()


async def test_a_host_header_naming_another_host_inside_the_tunnel_is_refused(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**", ask=False)
    ca = await _run_ca(svc, tmp_path)
    got = await _raw_inside(svc, ca, https_origin.port, b"GET /docs/a HTTP/1.1\r\nHost: leak.test\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 403 ") and b"X-Egress-Reason: sni_mismatch" in got, got
    inner = f"CONNECT leak.test:443 HTTP/1.1\r\nHost: origin.test:{https_origin.port}\r\n\r\n"
    got = await _raw_inside(svc, ca, https_origin.port, inner.encode())
    assert got.startswith(b"HTTP/1.1 400 ") and b"X-Egress-Reason: bad_request" in got, got
    assert https_origin.requests == []


async def test_a_second_request_on_the_same_connection_is_decided_again(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**", ask=False)
    ca = await _run_ca(svc, tmp_path)
    host = f"origin.test:{https_origin.port}"
    got = await _raw_inside(
        svc, ca, https_origin.port,
        f"GET /docs/a HTTP/1.1\r\nHost: {host}\r\n\r\nGET /admin HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(),
    )  # fmt: skip
    await asyncio.sleep(0.2)
    assert [(m, p) for m, p, _ in https_origin.requests] == [("GET", "/docs/a")]
    decisions = [(r["decision"], r["reason"]) for r in _https(svc)]
    assert decisions == [("allow", None), ("deny", "not_allowlisted")], (decisions, got)


async def test_a_client_that_does_not_trust_the_runs_ca_fails_with_a_clear_record(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**")
    # A pinned client: it trusts the origin's own CA, not the run's.
    code, _, err = await _curl(svc, https_origin.ca_file, f"https://origin.test:{https_origin.port}/docs/a")
    assert code != 0, err
    assert https_origin.requests == []
    # The tunnel's record was written ahead (allowed); its end says why it was cut.
    (connect,) = [r for r in svc.audit_records if r.get("kind") == "connect"]
    for _ in range(50):
        ends = [r for r in svc.audit_records if r["event"] == "egress.end" and r["id"] == connect["id"]]
        if ends:
            break
        await asyncio.sleep(0.1)
    assert [r["end"] for r in ends] == ["tls_intercept_failed"], ends
    assert "TLS handshake with the client failed" in ends[0]["detail"]


async def test_an_origin_whose_certificate_does_not_verify_is_not_reached(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    # No origin CA given: the test origin's certificate verifies against nothing egressd trusts.
    svc = await make_egressd(allow=[f"GET origin.test:{https_origin.port}/docs/**"])
    ca = await _run_ca(svc, tmp_path)
    code, out, err = await _curl(svc, ca, f"https://origin.test:{https_origin.port}/docs/a")
    assert code == 0, err
    assert "\r\n\r\nHTTP/1.1 502 " in out and "X-Egress-Reason: upstream_unreachable" in out, out
    assert https_origin.requests == []


async def test_other_names_stay_opaque_tunnels(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    # origin.test has a plain entry and no rule: spliced, the origin's own certificate seen end to end.
    svc = await make_egressd(allow=[f"origin.test:{https_origin.port}"])
    code, out, err = await _curl(svc, https_origin.ca_file, f"https://origin.test:{https_origin.port}/anything")
    assert code == 0, err
    assert "\r\n\r\nHTTP/1.1 200" in out, out
    assert _https(svc) == []


async def test_the_runs_ca_certificate_is_handed_out_to_a_token_and_never_its_key(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**")
    pem = (await _run_ca(svc, tmp_path)).read_bytes()
    assert pem.startswith(b"-----BEGIN CERTIFICATE-----") and b"PRIVATE KEY" not in pem
    certificate = x509.load_pem_x509_certificate(pem)
    constraints = certificate.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical and [n.value for n in constraints.value.permitted_subtrees or []] == ["origin.test"]
    async with ClientSession() as session, session.get(f"{svc.control_address}/runs/default/ca") as r:
        assert r.status == 401
    excluded = {n.value for n in constraints.value.excluded_subtrees or []}
    assert excluded == {ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")}


class Scripted:
    """An approver that records what it is asked and answers each with the next of ``answers``."""

    def __init__(self, *answers: ApprovalOutcome) -> None:
        self.asked: list[ApprovalRequest] = []
        self.answers = list(answers)

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        self.asked.append(request)
        return self.answers.pop(0)


async def test_a_request_no_rule_covers_is_asked_about_showing_the_request_and_a_run_answer_covers_its_prefix(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    approver = Scripted(
        ApprovalOutcome(Answer.ALLOW, "a-1", "test", "alice", 0.1, ApprovalScope.RUN),
        ApprovalOutcome(Answer.DENY, "a-2", "test", "alice", 0.1),
    )
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**", approver=approver)
    ca = await _run_ca(svc, tmp_path)
    base = f"https://origin.test:{https_origin.port}"
    code, out, err = await _curl(svc, ca, f"{base}/repo/upload?name=x&token=SECRET", "--data-binary", "12345678")
    assert code == 0 and "\r\n\r\nHTTP/1.1 200" in out, (out, err)
    (asked,) = approver.asked
    shown = asked.request
    assert shown is not None
    assert (shown.method, shown.path, shown.prefix, shown.query_names) == ("POST", "/repo/upload", "/repo/upload",
                                                                          ("name", "token"))
    assert (shown.content_type, shown.length) == ("application/x-www-form-urlencoded", 8)
    assert asked.lasting == f"POST origin.test:{https_origin.port}/repo/upload/**"
    # The run's answer covers the method under the prefix: no second question.
    code, out, err = await _curl(svc, ca, f"{base}/repo/upload/2", "--data-binary", "x")
    assert code == 0 and "\r\n\r\nHTTP/1.1 200" in out, (out, err)
    assert len(approver.asked) == 1
    # Another prefix is asked about again, and a denial is final for it.
    code, out, err = await _curl(svc, ca, f"{base}/repo/delete", "-X", "DELETE")
    assert code == 0 and "\r\n\r\nHTTP/1.1 403" in out and "X-Egress-Reason: denied" in out, (out, err)
    assert [(m, p) for m, p, _ in https_origin.requests] == [
        ("POST", "/repo/upload?name=x&token=SECRET"), ("POST", "/repo/upload/2")]
    # The query's values never reach a record (the path there has no query at all).
    assert "SECRET" not in json.dumps(svc.audit_records)


def test_openssls_verifier_honours_the_name_constraints(tmp_path: Path) -> None:
    """A thief with the run CA's key mints a leaf for another name: OpenSSL rejects it (the constraint holds)."""
    require(have("openssl"), "openssl is not installed")
    now = dt.datetime.now(dt.UTC)
    ca = RunCA.create(["origin.test"], now, dt.timedelta(hours=1), run_id="r-1")
    (tmp_path / "ca.pem").write_bytes(ca.certificate_pem())
    (tmp_path / "good.pem").write_bytes(ca.leaf("origin.test").chain_pem.split(b"-----END CERTIFICATE-----")[0]
                                        + b"-----END CERTIFICATE-----\n")
    key = ec.generate_private_key(ec.SECP256R1())
    forged = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bank.test")]))
        .issuer_name(ca.certificate.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(minutes=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("bank.test")]), critical=False)
        .sign(ca._key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "forged.pem").write_bytes(forged.public_bytes(serialization.Encoding.PEM))

    def verify(leaf: str, name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"), "-verify_hostname", name, str(tmp_path / leaf)],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip

    assert verify("good.pem", "origin.test").returncode == 0
    rejected = verify("forged.pem", "bank.test")
    assert rejected.returncode != 0 and "permitted subtree violation" in rejected.stdout + rejected.stderr, rejected


async def test_a_declared_secret_goes_only_to_its_name_and_its_placeholder_elsewhere_is_refused(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, http_origin: Any, leak: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORIGIN_TOKEN", "real-secret-value")
    svc = await _inspecting(
        make_egressd, https_origin, "origin.test:PORT/**", f"origin.test:{http_origin.port}", f"leak.test:{leak.port}",
        secret=[f"ORIGIN_TOKEN@origin.test:{https_origin.port}"], ask=False,
    )  # fmt: skip
    assert svc.path is not None and svc.path.secrets is not None
    (secret,) = svc.path.secrets.declared
    mark = secret.placeholder
    ca = await _run_ca(svc, tmp_path)
    base = f"https://origin.test:{https_origin.port}"
    code, out, err = await _curl(svc, ca, f"{base}/api", "-H", f"Authorization: Bearer {mark}")
    assert code == 0 and "\r\n\r\nHTTP/1.1 200" in out, (out, err)
    assert https_origin.requests[-1][2]["Authorization"] == "Bearer real-secret-value"
    # The placeholder anywhere else: another header, the URL, plain HTTP to another name.
    for url, args in [
        (f"{base}/api", ["-H", f"X-Leak: {mark}"]),
        (f"{base}/api?t={mark}", []),
        (f"http://origin.test:{http_origin.port}/", ["-H", f"Authorization: Bearer {mark}"]),
        (f"http://leak.test:{leak.port}/", ["-H", f"Authorization: Bearer {mark}"]),
    ]:
        code, out, err = await _curl(svc, ca, url, *args)
        assert code == 0 and "X-Egress-Reason: secret_misdirected" in out, (url, out, err)
    assert len(https_origin.requests) == 1 and http_origin.requests == [] and leak.connections == 0
    refused = [r for r in svc.audit_records if r.get("reason") == "secret_misdirected"]
    assert len(refused) == 4 and all("ORIGIN_TOKEN" in r["detail"] for r in refused), refused
    assert "real-secret-value" not in json.dumps(svc.audit_records)


@pytest.mark.parametrize(
    ("inside", "what"),
    [
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "an h2 preface after HTTP/1.1 was negotiated"),
        (b"GET /docs/a HTTP/1.1\r\nHost: H\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
         b"GET /admin HTTP/1.1\r\nHost: H\r\n\r\n", "CL.TE smuggling"),
        (b"GET /docs/a HTTP/1.1\r\nHost: H\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n5c\r\n"
         b"GET /admin HTTP/1.1\r\nHost: H\r\n\r\n0\r\n\r\n", "TE.CL smuggling"),
        (b"GET https://leak.test/docs/a HTTP/1.1\r\nHost: H\r\n\r\n", "an absolute-form target naming another host"),
    ],
)  # fmt: skip
async def test_what_could_be_read_two_ways_inside_the_tunnel_reaches_nothing(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path, inside: bytes, what: str
) -> None:
    svc = await _inspecting(make_egressd, https_origin, "GET origin.test:PORT/docs/**", ask=False)
    ca = await _run_ca(svc, tmp_path)
    data = inside.replace(b"Host: H", f"Host: origin.test:{https_origin.port}".encode())
    got = await _raw_inside(svc, ca, https_origin.port, data)
    assert got.startswith(b"HTTP/1.1 ") and b"X-Egress-Decision: deny" in got, (what, got)
    assert https_origin.requests == [], what


async def test_trace_never_goes_through_even_where_a_rule_allows_every_method(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path
) -> None:
    """TRACE echoes the request back: with a secret put in, the sandbox would read it."""
    svc = await _inspecting(make_egressd, https_origin, "origin.test:PORT/**", ask=False)
    ca = await _run_ca(svc, tmp_path)
    inside = f"TRACE /docs/a HTTP/1.1\r\nHost: origin.test:{https_origin.port}\r\n\r\n".encode()
    got = await _raw_inside(svc, ca, https_origin.port, inside)
    assert got.startswith(b"HTTP/1.1 400 ") and b"X-Egress-Reason: bad_request" in got, got
    assert https_origin.requests == []


async def test_a_launcher_of_serve_gets_the_placeholders_with_its_run_and_never_a_value(
    make_egressd: MakeEgressd, https_origin: HttpsOrigin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORIGIN_TOKEN", "real-secret-value")
    svc = await _inspecting(make_egressd, https_origin, "origin.test:PORT/**",
                            secret=[f"ORIGIN_TOKEN@origin.test:{https_origin.port}"], ask=False)  # fmt: skip
    headers = {"Authorization": "Bearer test-token"}
    async with ClientSession() as session, session.post(
        f"{svc.control_address}/runs", json={"task": "t", "allow": [f"origin.test:{https_origin.port}/**"]},
        headers=headers,
    ) as r:
        created = await r.json()
    assert r.status == 201, created
    assert set(created["secrets"]) == {"ORIGIN_TOKEN"} and created["secrets"]["ORIGIN_TOKEN"].startswith(
        "egressd-secret-")
    assert "real-secret-value" not in json.dumps(created)
