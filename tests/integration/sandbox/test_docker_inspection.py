"""Inspection on the Docker backend, end to end through the sidecar: pip from an inspected TLS index,
a request no rule covers held and shown with its method, path and size, and the upload budget's question.

The same as the bubblewrap backend's (``test_inspection_sandbox.py``), from inside a real container: the
command trusts the run's CA with no flags, every request is decided by the sidecar, and what a person
answers through the control API is what happens. Needs the images from ``bash docker/build.sh``.
"""

# ruff: noqa: F811 - the fixtures imported from test_docker are named again as the tests' arguments

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from tests.fakes.dockerbed import start_helper, tls_origin_script
from tests.fakes.tls import make_pki
from tests.integration.sandbox.test_docker import SECURE_NAME, engine, make_bed  # noqa: F401 - fixtures
from tests.integration.sandbox.test_inspection_sandbox import _wheel

BUDGET = 64 * 1024


async def _secure_origin(bed: Any, tmp_path: Path, files: dict[str, bytes] | None = None) -> Any:
    """The HTTPS origin ``SECURE_NAME`` on the run's outgoing network (its CA: ``tmp_path/pki``)."""
    net = bed.session.resources
    return await start_helper(
        bed.engine, network=f"egressd-{net.run_key}-outgoing", address=str(bed.outgoing.network_address + 7),
        script=tls_origin_script((tmp_path / "pki" / "leaf.pem").read_text(),
                                 (tmp_path / "pki" / "leaf.key").read_text(), files),
        labels=net.labels_for("helper"), aliases=[SECURE_NAME],
    )  # fmt: skip


def _pki(tmp_path: Path) -> Path:
    """The test's PKI for ``SECURE_NAME``; the CA file egressd verifies the origin with."""
    (tmp_path / "pki").mkdir()
    return make_pki(tmp_path / "pki", [SECURE_NAME]).ca_pem


async def _one_approval(bed: Any, seen: int) -> dict[str, Any]:
    """The first approval not answered yet (``bed.answered``; ``seen`` answered before it), from the
    sidecar's control API (20 s at most)."""
    control = bed.session.control
    assert control is not None
    for _ in range(200):
        approvals = (await control.call("GET", "/approvals"))["approvals"]
        fresh = [a for a in approvals if a["id"] not in bed.answered]
        if fresh:
            return fresh[0]  # type: ignore[no-any-return]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no approval came after {seen}")


async def test_pip_downloads_from_an_inspected_tls_index_inside_a_container(make_bed: Any, tmp_path: Path) -> None:
    wheel = _wheel("egressd_demo", "1.0")
    filename = "egressd_demo-1.0-py3-none-any.whl"
    link = f'<a href="/files/{filename}#sha256={hashlib.sha256(wheel).hexdigest()}">{filename}</a>'
    files = {"/simple/egressd-demo/": f"<html><body>{link}</body></html>".encode(), f"/files/{filename}": wheel}
    ca = _pki(tmp_path)
    async with make_bed(allow=[f"GET {SECURE_NAME}/simple/**", f"GET {SECURE_NAME}/files/**"], ask=False,
                        inspect_origin_ca_file=str(ca)) as bed:  # fmt: skip
        index = await _secure_origin(bed, tmp_path, files)
        obs = await bed.sh(
            "python3 -m pip download --no-deps --disable-pip-version-check --no-cache-dir -d /tmp/got"
            f" --index-url https://{SECURE_NAME}/simple/ egressd-demo 2>&1 | tail -2; ls /tmp/got;"
            f" curl -sS -m 10 -o /dev/null -w 'upload=%{{http_code}}\\n' -X POST --data-binary @/etc/hostname"
            f" https://{SECURE_NAME}/legacy/"
        )
        logs = await index.logs()
    assert filename in obs.stdout and "upload=403" in obs.stdout, (obs.stdout, obs.stderr)
    requests = [line.split()[1:3] for line in logs.splitlines() if line.startswith("REQ")]
    assert ["GET", "/simple/egressd-demo/"] in requests and ["GET", f"/files/{filename}"] in requests, logs
    assert all(method == "GET" for method, _ in requests), logs  # the upload reached nothing
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert ("POST", "/legacy/", "deny") in {(r.get("method"), r.get("path"), r["decision"]) for r in records
                                            if r.get("event") == "egress"}  # fmt: skip


async def test_a_held_request_and_the_upload_budget_are_answered_through_the_sidecar(
    make_bed: Any, tmp_path: Path
) -> None:
    """A PUT no rule covers is held and shown with its path and size; allowed for the run, it goes through.
    A PUT past the run's upload budget is asked about before anything of it leaves; denied, nothing leaves."""
    ca = _pki(tmp_path)
    async with make_bed(allow=[f"GET {SECURE_NAME}/docs/**"], approver=["webhook"], upload_budget_mb=BUDGET / 2**20,
                        inspect_origin_ca_file=str(ca)) as bed:  # fmt: skip
        bed.answered = set()
        secure = await _secure_origin(bed, tmp_path)
        control = bed.session.control
        bed.session.set_command("curl -T notes")
        small = asyncio.ensure_future(bed.sh(
            "printf 'secret notes 12345' > /tmp/n.txt; curl -sS -m 60 -X PUT -H 'Content-Type: text/plain'"
            f" --data-binary @/tmp/n.txt https://{SECURE_NAME}/docs/up/n.txt"
        ))  # fmt: skip
        held = await _one_approval(bed, 0)
        shown = (held["host"], held["request"]["method"], held["request"]["path"])
        assert shown == (SECURE_NAME, "PUT", "/docs/up/n.txt"), held
        assert held["request"]["length"] == 18 and held["request"]["content_type"] == "text/plain", held
        assert "Request: PUT /docs/up/n.txt (text/plain; 18 bytes)" in held["message"], held["message"]
        bed.answered.add(held["id"])
        await control.call("POST", f"/approvals/{held['id']}/allow", {"by": "test", "scope": "run"})
        obs = await asyncio.wait_for(small, 60)
        assert "hello from tls origin: PUT /docs/up/n.txt" in obs.stdout, (obs.stdout, obs.stderr)

        big = asyncio.ensure_future(bed.sh(
            f"head -c {2 * BUDGET} /dev/zero > /tmp/big; curl -sS -m 60 -o /dev/null -w 'big=%{{http_code}}\\n'"
            f" -X PUT --data-binary @/tmp/big https://{SECURE_NAME}/docs/up/big"
        ))  # fmt: skip
        asked = await _one_approval(bed, 1)  # PUT under /docs/up is allowed for the run: only the budget asks
        assert asked["uploaded"] is not None and asked["uploaded"] < BUDGET, asked
        assert "past its upload budget: let it continue?" in asked["message"], asked["message"]
        bed.answered.add(asked["id"])
        await control.call("POST", f"/approvals/{asked['id']}/deny", {"by": "test"})
        obs = await asyncio.wait_for(big, 60)
        logs = await secure.logs()
    assert "big=403" in obs.stdout, (obs.stdout, obs.stderr)
    requests = [line.split()[1:3] for line in logs.splitlines() if line.startswith("REQ")]
    assert requests == [["PUT", "/docs/up/n.txt"]], logs  # nothing of the big PUT left
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    (refused,) = [r for r in records if r.get("event") == "egress" and r.get("path") == "/docs/up/big"]
    assert (refused["decision"], refused["reason"], refused["bytes_up"]) == ("deny", "denied", 0), refused
    assert "past the run's upload budget" in refused["detail"], refused
