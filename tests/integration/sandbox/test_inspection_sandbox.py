"""Inspection inside `egressd run`'s sandbox: the command trusts the run's CA with no flags, and cannot read its key;
a program that ignores the proxy settings is inspected too.

curl and Python's urllib, run as a user would, reach an inspected name
over HTTPS (the run's CA is in the bundle at the standard path and named
by the usual variables), a write no rule covers is refused, and nothing
of the CA's key is anywhere the command can look.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.conftest import HttpsOrigin
from tests.fakes.tls import TlsOrigin, make_pki
from tests.harness import ORIGIN
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
