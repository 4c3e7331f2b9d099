"""Live policy changes in a running egressd: ``EgressService.reload`` and ``PATCH /runs/ID``, over real sockets.

The attacks: a run's own control token widening its own policy (403, nothing
changed); a bad entry or a bad allow file slipping half a policy in (refused
whole, the old one in force, and said so in the audit log). What a change
must do: apply to the next request at once, and leave an open tunnel alone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from egressd.cli.wiring.service import ReloadError
from egressd.config.settings import Settings, load_settings
from tests.harness import connect_via, wait_until

GLOBAL = "test-token"
EGRESSD = str(Path(sys.executable).with_name("egressd"))


async def call(svc: Any, method: str, path: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession(trust_env=False) as http:
        async with http.request(method, svc.control_address + path, json=body, headers=headers) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if resp.content_type == "application/json" else text


def again(svc: Any, **changes: Any) -> Settings:
    """The service's settings as a reload would read them, with ``changes``."""
    return load_settings({**svc.settings.model_dump(), **changes})


def proxy_auth(created: dict[str, Any]) -> str:
    """The Proxy-Authorization header line of a run ``POST /runs`` created."""
    creds = base64.b64encode(f"{created['id']}:{created['token']}".encode()).decode()
    return f"Proxy-Authorization: Basic {creds}\r\n"


def records(svc: Any, event: str) -> list[dict[str, Any]]:
    return [r for r in svc.audit_records if r.get("event") == event]


async def status_of(svc: Any, authority: str, extra: str = "") -> int:
    status, _, _, _, writer = await connect_via(svc, authority, extra)
    await close(writer)
    return status


async def close(writer: Any) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def echo(reader: Any, writer: Any, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return bytes(await reader.readexactly(len(data)))


async def test_a_reload_applies_the_allow_file_to_new_requests_and_records_it(
    make_egressd, echo_origin, tmp_path: Path
) -> None:
    allow_file = tmp_path / "allow.toml"
    allow_file.write_text('allow = ["other.test"]\n')
    svc = await make_egressd(allow_file=str(allow_file), ask=False)
    target = f"origin.test:{echo_origin.port}"
    assert await status_of(svc, target) == 403
    allow_file.write_text(f'allow = ["other.test", "{target}"]\n')
    change = svc.reload(again(svc))
    assert change.entries.allow_added == (target,) and change.needs_restart == ()
    assert await status_of(svc, target) == 200
    [record] = records(svc, "policy.reloaded")
    assert record["ok"] is True and record["error"] is None
    assert record["added"] == {"allow": [target], "deny": []} and record["removed"] == {"allow": [], "deny": []}


async def test_a_deny_added_by_a_reload_refuses_new_requests_but_leaves_an_open_tunnel_alone(
    make_egressd, echo_origin, tmp_path: Path
) -> None:
    target = f"origin.test:{echo_origin.port}"
    svc = await make_egressd(allow=[target], ask=False)
    status, _, _, reader, writer = await connect_via(svc, target)
    assert status == 200 and await echo(reader, writer, b"before") == b"before"
    connections = echo_origin.connections
    svc.reload(again(svc, deny=["origin.test"]))
    assert await status_of(svc, target) == 403
    assert echo_origin.connections == connections  # the refused one reached nothing
    assert await echo(reader, writer, b"still-open") == b"still-open"
    await close(writer)
    await wait_until(
        lambda: (
            [(r["reason"], r["rule"]) for r in records(svc, "egress") if r["decision"] == "deny"]
            == [("denylisted", "origin.test")]
        )
    )


async def test_a_bad_allow_file_keeps_the_old_policy_whole(make_egressd, echo_origin, tmp_path: Path, caplog) -> None:
    target = f"origin.test:{echo_origin.port}"
    allow_file = tmp_path / "allow.toml"
    allow_file.write_text(f'allow = ["{target}"]\n')
    svc = await make_egressd(allow_file=str(allow_file), ask=False)
    for broken in ('allow = ["ok.test", "*.com"]\n', "allow = [\n", 'allow = "x"\n'):
        allow_file.write_text(broken)
        caplog.clear()
        with pytest.raises(ReloadError, match="allow_file"):
            # Also a good new setting beside it: nothing is half applied.
            svc.reload(again(svc, deny=["origin.test"], allow_private=[]))
        [line] = [r.getMessage() for r in caplog.records if "reload" in r.getMessage()]
        assert "old policy stays in force" in line and str(allow_file) in line
        assert await status_of(svc, target) == 200
    assert svc.settings.deny == [] and svc.path.screen.allow_private != ()
    failed = records(svc, "policy.reloaded")
    assert len(failed) == 3 and all(r["ok"] is False and "allow_file" in r["error"] for r in failed)
    assert all(r["added"] is None for r in failed)


async def test_a_setting_that_needs_a_restart_is_named_and_kept(make_egressd, caplog) -> None:
    svc = await make_egressd(ask=False)
    listen = svc.settings.listen
    change = svc.reload(again(svc, listen="127.0.0.1:1", max_connections=5, allow=["new.test"]))
    assert change.needs_restart == ("listen", "max_connections")
    assert svc.settings.listen == listen and svc.settings.max_connections != 5
    assert svc.settings.allow == ["new.test"]
    assert any(
        "listen, max_connections" in r.getMessage() and "needs a restart" in r.getMessage() for r in caplog.records
    )
    assert records(svc, "policy.reloaded")[-1]["needs_restart"] == ["listen", "max_connections"]


async def test_allow_private_and_ask_change_live(make_egressd, echo_origin) -> None:
    target = f"origin.test:{echo_origin.port}"
    svc = await make_egressd(allow=[target], approver=None, ask=False)
    assert await status_of(svc, target) == 200
    change = svc.reload(again(svc, allow_private=[]))
    assert change.changed == ("allow_private",)
    connections = echo_origin.connections
    status, headers, _, _, writer = await connect_via(svc, target)
    await close(writer)
    assert status == 403 and headers.get("x-egress-reason") == "private_address"
    assert echo_origin.connections == connections
    assert svc.default_run.ask is False
    svc.reload(again(svc, ask=True))
    assert svc.default_run.ask is True and records(svc, "policy.reloaded")[-1]["changed"] == ["ask"]


async def test_a_reload_keeps_api_runs_entries_and_applies_the_operators_deny_to_them(
    make_egressd, echo_origin
) -> None:
    target = f"origin.test:{echo_origin.port}"
    svc = await make_egressd(require_auth=True, ask=False)
    status, created = await call(svc, "POST", "/runs", GLOBAL, {"allow": [target]})
    assert status == 201
    creds = proxy_auth(created)
    assert await status_of(svc, target, creds) == 200
    svc.reload(again(svc, allow=["unrelated.test"]))
    assert await status_of(svc, target, creds) == 200  # its own entries are its own
    svc.reload(again(svc, deny=["origin.test"]))
    assert await status_of(svc, target, creds) == 403
    status, described = await call(svc, "GET", f"/runs/{created['id']}", GLOBAL)
    assert described["allow"] == [target] and described["global_deny"] == ["origin.test"]


async def test_approvals_made_during_a_run_survive_a_reload(make_egressd, echo_origin) -> None:
    target = f"origin.test:{echo_origin.port}"
    svc = await make_egressd(ask=False)
    svc.default_run.approve("origin.test", echo_origin.port)
    svc.reload(again(svc, allow=["other.test"]))
    assert await status_of(svc, target) == 200


# PATCH /runs/ID


async def test_the_global_token_adds_an_entry_that_applies_at_once_and_is_recorded(make_egressd, echo_origin) -> None:
    target = f"origin.test:{echo_origin.port}"
    svc = await make_egressd(require_auth=True, ask=False)
    status, created = await call(svc, "POST", "/runs", GLOBAL, {"allow": ["other.test"]})
    creds = proxy_auth(created)
    assert await status_of(svc, target, creds) == 403
    status, described = await call(
        svc,
        "PATCH",
        f"/runs/{created['id']}",
        GLOBAL,
        {"allow": {"add": [target], "remove": ["other.test"]}},
    )
    assert status == 200 and described["allow"] == [target] and described["id"] == created["id"]
    assert (await call(svc, "GET", f"/runs/{created['id']}", GLOBAL))[1] == described
    assert await status_of(svc, target, creds) == 200
    status, described = await call(svc, "PATCH", f"/runs/{created['id']}", GLOBAL, {"deny": {"add": ["origin.test"]}})
    assert status == 200 and described["deny"] == ["origin.test"]
    assert await status_of(svc, target, creds) == 403
    changed = records(svc, "run.changed")
    assert [(r["run"], r["added"], r["removed"]) for r in changed] == [
        (created["id"], {"allow": [target], "deny": []}, {"allow": ["other.test"], "deny": []}),
        (created["id"], {"allow": [], "deny": ["origin.test"]}, {"allow": [], "deny": []}),
    ]


async def test_a_run_token_cannot_widen_its_own_policy(make_egressd, echo_origin) -> None:
    target = f"origin.test:{echo_origin.port}"
    svc = await make_egressd(require_auth=True, ask=False)
    status, created = await call(svc, "POST", "/runs", GLOBAL, {"allow": []})
    for body in ({"allow": {"add": [target]}}, {"deny": {"remove": ["x.test"]}}, {}):
        status, answer = await call(svc, "PATCH", f"/runs/{created['id']}", created["control_token"], body)
        assert status == 403 and "global control token" in answer["error"]
    creds = proxy_auth(created)
    connections = echo_origin.connections
    assert await status_of(svc, target, creds) == 403
    assert echo_origin.connections == connections
    assert svc.runs.get(created["id"]).allow == () and records(svc, "run.changed") == []


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"allow": {"add": ["good.test", "*.com"]}}, "*.com"),
        ({"allow": {"add": ["good.test"]}, "deny": {"add": ["bad host"]}}, "bad host"),
        ({"allow": {"add": ["good.test"], "remove": ["never.test"]}}, "never.test"),
        ({"allow": {"add": "good.test"}}, "list of strings"),
        ({"allow": ["good.test"]}, "must be an object"),
        ({"allow": {"add": ["good.test"]}, "ask": True}, "'ask'"),
        ({"allow": {"append": ["good.test"]}}, "'append'"),
    ],
)
async def test_a_bad_patch_is_a_400_naming_it_and_applies_nothing(make_egressd, body: Any, named: str) -> None:
    svc = await make_egressd(require_auth=True, ask=False)
    status, created = await call(svc, "POST", "/runs", GLOBAL, {"allow": ["kept.test"], "ask": False})
    before = (await call(svc, "GET", f"/runs/{created['id']}", GLOBAL))[1]
    status, answer = await call(svc, "PATCH", f"/runs/{created['id']}", GLOBAL, body)
    assert status == 400 and named in answer["error"]
    assert (await call(svc, "GET", f"/runs/{created['id']}", GLOBAL))[1] == before
    assert svc.runs.get(created["id"]).decide("good.test", 443).verdict.value == "deny"
    assert records(svc, "run.changed") == []


async def test_patching_an_unknown_run_is_a_404(make_egressd) -> None:
    svc = await make_egressd()
    assert (await call(svc, "PATCH", "/runs/r-nope", GLOBAL, {"allow": {"add": ["a.test"]}}))[0] == 404


async def egressd_policy(svc: Any, token: str, *args: str) -> tuple[int, str, str]:
    """``egressd policy ARGS`` against ``svc``, as a user runs it (the token from the environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["EGRESSD_CONTROL_TOKEN"] = token
    control = svc.control_address.removeprefix("http://")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "policy", *args, "--control", control, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_egressd_policy_changes_a_live_run_with_the_global_token_only(make_egressd, echo_origin) -> None:
    target = f"origin.test:{echo_origin.port}"
    svc = await make_egressd(require_auth=True, ask=False)
    status, created = await call(svc, "POST", "/runs", GLOBAL, {"allow": ["other.test"], "ask": False})
    code, out, err = await egressd_policy(svc, created["control_token"], created["id"], "--allow", target)
    assert code == 2 and "global control token" in err
    assert await status_of(svc, target, proxy_auth(created)) == 403
    code, out, err = await egressd_policy(
        svc, GLOBAL, created["id"], "--allow", target, "--remove-allow", "other.test", "--deny", "x.test"
    )
    assert code == 0, err
    assert f"allow:        {target}\n" in out and "deny:         x.test\n" in out
    assert await status_of(svc, target, proxy_auth(created)) == 200
    code, out, err = await egressd_policy(svc, GLOBAL, created["id"], "--allow", "*.com")
    assert code == 1 and "*.com" in err
    code, out, err = await egressd_policy(svc, GLOBAL, created["id"])
    assert code == 0 and target in out
    assert len(records(svc, "run.changed")) == 1


async def test_egressd_policy_revoke_takes_back_an_approval_from_the_runs_next_request(
    make_egressd, echo_origin
) -> None:
    """Issue 29: an approval for the run could not be taken back short of ending the run."""
    from egressd.approvals.interface import ApprovalOutcome
    from egressd.vocabulary.reasons import Answer

    target = f"origin.test:{echo_origin.port}"
    answers = [Answer.ALLOW, Answer.DENY]
    asked: list[str] = []

    class Reviewer:
        async def ask(self, request: Any) -> ApprovalOutcome:
            asked.append(f"{request.host}:{request.port}")
            return ApprovalOutcome(answers.pop(0), f"a-{len(asked)}", "test", "alice", 0.1)

    svc = await make_egressd(require_auth=True, approver=Reviewer())
    status, created = await call(svc, "POST", "/runs", GLOBAL, {"allow": ["other.test"]})
    assert await status_of(svc, target, proxy_auth(created)) == 200  # asked, allowed for the run
    assert await status_of(svc, target, proxy_auth(created)) == 200 and asked == [target]  # not asked again
    code, out, err = await egressd_policy(svc, GLOBAL, created["id"], "--revoke", "unknown.test")
    assert code == 1 and "no approval for it" in err, err  # a mistyped revoke does not pass for a narrowed policy
    code, out, err = await egressd_policy(svc, GLOBAL, created["id"], "--revoke", target)
    assert code == 0, (out, err)
    assert await status_of(svc, target, proxy_auth(created)) == 403  # asked again, and this time denied
    assert asked == [target, target]
    # The host alone takes back every port the approval gave (80 and 443 came with the other port).
    code, out, err = await egressd_policy(svc, GLOBAL, created["id"], "--revoke", "origin.test")
    assert code == 0 and "approved:     -" in out, (out, err)
    assert [r["revoked"] for r in records(svc, "run.changed")] == [[target], ["origin.test"]]


def _allow_file_with_always(tmp_path: Path, target: str) -> Path:
    """An allow file of the operator's (mode 0600) with an *always* answer for ``target``, given by alice."""
    allow_file = tmp_path / "allow.toml"
    allow_file.write_text(f'allow = ["other.test"]\n\n[[approved]]\nentry = "{target}"\nat = "2026-12-01T00:00:00Z"\n'
                          'by = "alice"\nchannel = "slack"\n')  # fmt: skip
    allow_file.chmod(0o600)
    return allow_file


async def test_egressd_policy_revoke_takes_back_an_always_entry_for_every_run(
    make_egressd, echo_origin, tmp_path: Path
) -> None:
    """Issue 29: an *always* answer lasted until someone edited the allow file by hand."""
    from egressd.config.allowfile import read_allow_file

    target = f"origin.test:{echo_origin.port}"
    allow_file = _allow_file_with_always(tmp_path, target)
    svc = await make_egressd(allow_file=str(allow_file), ask=False)
    assert await status_of(svc, target) == 200
    status, listed = await call(svc, "GET", "/always", GLOBAL)
    assert status == 200 and [(a["entry"], a["by"]) for a in listed["always"]] == [(target, "alice")]

    code, out, err = await egressd_policy(svc, GLOBAL, "default", "--revoke", target)
    assert code == 0, (out, err)
    assert await status_of(svc, target) == 403  # from the next request on: the entry left the running policy
    held = read_allow_file(allow_file)
    assert held.standing == () and [r.entry for r in held.revoked] == [target]  # appended, the answer kept
    assert "[[approved]]" in allow_file.read_text()
    [changed] = records(svc, "run.changed")
    assert changed["always_revoked"] == [target] and "revoked" not in changed
    status, listed = await call(svc, "GET", "/always", GLOBAL)
    assert listed["always"] == []
    # Nothing left to take back: said, not passed off as done.
    code, out, err = await egressd_policy(svc, GLOBAL, "default", "--revoke", target)
    assert code == 1 and "nor is there an always entry" in err, err
    # A run's own token cannot even list them.
    status, created = await call(svc, "POST", "/runs", GLOBAL, {"allow": ["other.test"]})
    status, _ = await call(svc, "GET", "/always", created["control_token"])
    assert status == 403


async def test_a_revoke_the_allow_file_refuses_records_what_was_done_and_says_what_was_not(
    make_egressd, echo_origin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing done unrecorded: a PATCH whose run edit took effect while the allow file refused the
    *always* revocation (a full disk) once answered 500 with no ``run.changed`` for the edit it had made."""
    from egressd.cli.wiring import lasting
    from egressd.config.allowfile import AllowFileError

    target = f"origin.test:{echo_origin.port}"
    allow_file = _allow_file_with_always(tmp_path, target)
    svc = await make_egressd(allow_file=str(allow_file), ask=False)

    def full_disk(path: Path, revoked: object) -> None:
        raise AllowFileError(f"allow file {path}: No space left on device")

    monkeypatch.setattr(lasting, "append_revoked", full_disk)
    status, body = await call(svc, "PATCH", "/runs/default", GLOBAL,
                              {"deny": {"add": ["narrowed.test"]}, "revoke": [target]})  # fmt: skip
    assert status == 500, body
    assert "not revoked" in body["error"] and "No space left" in body["error"], body
    assert "were made and recorded" in body["error"], body
    [changed] = records(svc, "run.changed")  # the edit that took effect is on record
    assert "narrowed.test" in json.dumps(changed) and not changed.get("always_revoked"), changed
    assert await status_of(svc, target) == 200  # the always entry still stands, as the answer says
    assert await status_of(svc, "narrowed.test:443") == 403
