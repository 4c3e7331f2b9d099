"""A fleet's shared denials (``--share-denials task|group``): a person's denial reaches beyond its run.

With ``group``, a denial given for one instance's run covers the host's
registered domain on every instance of the same ``--group``: its live runs
at once, a run created later when it starts; an instance of another group
still asks. With ``task``, it covers the runs with the same task on every
instance. ``egressd state lift`` lifts one for the runs that start after.
Nothing reaches the origin while a denial stands, and each refusal is an
``egress`` record with reason ``denied_earlier``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

from tests.conftest import Listener
from tests.fakes.dns import FakeDns
from tests.integration.fleet.instances import EGRESSD, Instance, connect, fleet, listed, serve, settled_everywhere
from tests.postgres import Postgres


async def _said(instance: Instance, text: str, timeout_s: float = 15.0) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if text in "".join(instance.said):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{instance.id} never said {text!r}: {''.join(instance.said)}")


async def _refused_at_once(instance: Instance, target: str, run: dict[str, object] | None = None) -> str:
    """A CONNECT nobody is asked about and that is refused: its reason."""
    code, headers, _, writer = await asyncio.wait_for(connect(instance.ports["proxy"], target, run), 10)
    writer.close()
    assert code == 403, (code, headers)
    return headers["x-egress-reason"]


async def _run(instance: Instance, task: str) -> dict[str, object]:
    status, run = await instance.control("POST", "/runs", {"task": task})
    assert status == 201, run
    return run


async def _asked_then_denied(holder: Instance, answerer: Instance, target: str,
                             run: dict[str, object] | None = None) -> None:  # fmt: skip
    """A request through ``holder`` is held for a person (listed on ``answerer``), who denies it."""
    await settled_everywhere(holder, answerer)  # the approval answered before is no longer listed
    held = asyncio.create_task(connect(holder.ports["proxy"], target, run))
    try:
        approval = await listed(answerer, holder=holder)
        status, body = await answerer.control("POST", f"/approvals/{approval['id']}/deny", {"by": "ops"})
        assert status == 200, body
        code, headers, _, writer = await held
        writer.close()
        assert code == 403 and headers["x-egress-reason"] == "denied", headers
    finally:
        if not held.done():
            held.cancel()  # its connection closes with it: nothing left open for the next test


async def test_a_denial_shared_with_the_group_covers_its_registered_domain_on_every_instance_of_the_group(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, dsn: str, postgres: Postgres, database: str
) -> None:
    port = echo_origin.port
    group = ("--share-denials", "group", "--group", "agents")
    others = ("--share-denials", "group", "--group", "others")
    async with fleet(tmp_path, dns, dsn, count=2, extra=group) as (a, b), \
            serve(tmp_path / "other", dns, dsn, others) as c:  # fmt: skip
        await _asked_then_denied(a, b, f"example.test:{port}")
        await _said(b, "fleet: example.test denied by ops (group agents")
        # B's live run, and a run B starts after: the registered domain is refused there, nobody asked.
        assert await _refused_at_once(b, f"sub.example.test:{port}") == "denied_earlier"
        later = await _run(b, "a later run")
        assert await _refused_at_once(b, f"example.test:{port}", later) == "denied_earlier"
        assert b.records("approval.requested") == []
        for _ in range(50):  # each written as its connection ends
            refusals = [r for r in b.records("egress") if r.get("reason") == "denied_earlier"]
            if len(refusals) == 2:
                break
            await asyncio.sleep(0.1)
        assert sorted(str(r["run"]) for r in refusals) == sorted(["default", str(later["id"])]), refusals
        # C is of another group: it asks.
        await _asked_then_denied(c, a, f"example.test:{port}")
        assert echo_origin.connections == 0

        # Lifted: a run that starts now is asked again; a live one keeps its denial.
        lifted = await asyncio.to_thread(
            subprocess.run, [EGRESSD, "state", "lift", "example.test", "--by", "lead"],
            capture_output=True, text=True, timeout=60, env=os.environ | {"EGRESSD_STATE": dsn},
        )  # fmt: skip
        assert lifted.returncode == 0 and "lifted: example.test (group 'agents'" in lifted.stdout, lifted
        assert "lifted: example.test (group 'others'" in lifted.stdout, lifted
        fresh = await _run(b, "after the lift")
        await _asked_then_denied(b, a, f"example.test:{port}", fresh)
        assert await _refused_at_once(b, f"example.test:{port}", later) == "denied_earlier"
    rows = postgres.psql("SELECT reach, key, host, lifted_by FROM egressd_denials ORDER BY denied_at", database)
    # Lifted for every group; denied again after.
    assert rows.splitlines() == ["group|agents|example.test|lead", "group|others|example.test|lead",
                                 "group|agents|example.test|"], rows  # fmt: skip


async def test_a_denial_shared_with_the_task_covers_the_runs_of_that_task_only(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, dsn: str
) -> None:
    port = echo_origin.port
    async with fleet(tmp_path, dns, dsn, count=2, extra=("--share-denials", "task")) as (a, b):
        docs_a, docs_b, other_b = await _run(a, "build the docs"), await _run(b, "build the docs"), \
            await _run(b, "fix the tests")  # fmt: skip
        await _asked_then_denied(a, b, f"example.test:{port}", docs_a)
        await _said(b, "fleet: example.test denied by ops (task build the docs")
        assert await _refused_at_once(b, f"sub.example.test:{port}", docs_b) == "denied_earlier"
        await _asked_then_denied(b, a, f"example.test:{port}", other_b)  # another task: asked
        # The default run has no task: a task's denial does not reach it.
        await _asked_then_denied(b, a, f"example.test:{port}")
        assert echo_origin.connections == 0
