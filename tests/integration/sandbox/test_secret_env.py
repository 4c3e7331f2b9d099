"""Nothing secret reaches a sandbox or a command line.

DESIGN.md: secrets (control token, Slack and webhook secrets, model keys, run
credentials) never reach a sandbox (not in any environment, command line or
file it can read) and never appear on a command line egressd starts.

The attacks: a sandboxed command reads ``/proc/*/environ`` and
``/proc/*/cmdline`` of every process it can see (bwrap's own init is one of
them), on both backends; a local user reads the command line of every
process ``egressd run`` started (any user can: ``/proc/PID/cmdline`` is
world-readable), looking for the run's proxy credentials, an ``--env`` value
or one of egressd's secrets; ``docker inspect`` of the sidecar shows its
configuration. egressd's secrets are given to it as unique markers in its
environment, the way the README recommends; none may turn up anywhere.

Secret settings can also come from files (``--slack-bot-token-file`` and the
like): a regular file of ours (or root's) that no one else may read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import signal
import stat
import sys
import tarfile
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from egressd.config.settings import SettingsError, load_settings
from tests.harness import have, require

EGRESSD = str(Path(sys.executable).with_name("egressd"))

# Run in the sandbox: every process it can see, its environment and its command line, as JSON.
SWEEP = textwrap.dedent("""
    import json, os
    seen = {}
    for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
        for part in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as fh:
                    seen[f"{pid}/{part}"] = fh.read().decode("latin-1")
            except OSError as exc:
                seen[f"{pid}/{part}"] = f"unreadable: {exc.strerror}"
    print(json.dumps(seen), flush=True)
""")


def secret_markers() -> dict[str, str]:
    """egressd's secrets as the README tells users to give them (environment variables), each a unique marker."""
    tag = uuid.uuid4().hex
    return {
        "EGRESSD_CONTROL_TOKEN": f"control-{tag}",
        "EGRESSD_SLACK_BOT_TOKEN": f"xoxb-{tag}",
        "EGRESSD_SLACK_APP_TOKEN": f"xapp-{tag}",
        "EGRESSD_SLACK_SIGNING_SECRET": f"signing-{tag}",
        "EGRESSD_WEBHOOK_SECRET": f"whsec_hook{tag}",
        "EGRESSD_WEBHOOK_CALLBACK_SECRET": f"whsec_callback{tag}",
        "OPENAI_API_KEY": f"sk-openai-{tag}",
        "ANTHROPIC_API_KEY": f"sk-ant-{tag}",
        "EGRESSD_OPENAI_API_KEY": f"sk-egressd-openai-{tag}",
        "EGRESSD_ANTHROPIC_API_KEY": f"sk-egressd-ant-{tag}",
        "EGRESSD_MODEL_API_KEY": f"model-{tag}",
    }


def found_markers(text: str, markers: dict[str, str]) -> list[str]:
    return [name for name, value in markers.items() if value in text]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def process_tree(root: int) -> list[tuple[int, str, str]]:
    """(pid, command line, environment) of every live descendant of ``root``, as root reads them."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat_text = _read(f"/proc/{entry}/stat").decode(errors="replace")
            with contextlib.suppress(IndexError, ValueError):
                parents[int(entry)] = int(stat_text.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid for pid, parent in parents.items() if parent == root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return [(pid, _read(f"/proc/{pid}/cmdline").decode("latin-1").replace("\0", " "),
             _read(f"/proc/{pid}/environ").decode("latin-1").replace("\0", "\n")) for pid in found]


# -- secret settings from files ----------------------------------------------------------------


def _secret_file(tmp_path: Path, text: str = "xoxb-from-a-file\n", mode: int = 0o600) -> Path:
    path = tmp_path / "slack-bot-token"
    path.write_text(text)
    path.chmod(mode)
    return path


def _refusal(values: dict[str, Any]) -> str:
    with pytest.raises(SettingsError) as caught:
        load_settings(values)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_secret_file_of_ours_that_no_one_else_can_read_is_accepted(tmp_path: Path) -> None:
    path = _secret_file(tmp_path)
    settings = load_settings({"slack_bot_token_file": str(path)})
    assert settings.slack_bot_token is not None
    assert settings.slack_bot_token.get_secret_value() == "xoxb-from-a-file"  # the newline `echo` adds is not part


def test_a_secret_file_named_in_the_environment_or_the_config_file_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _secret_file(tmp_path, "whsec_AAAA\n")
    monkeypatch.setenv("EGRESSD_WEBHOOK_SECRET_FILE", str(path))
    settings = load_settings({})
    assert settings.webhook_secret is not None and settings.webhook_secret.get_secret_value() == "whsec_AAAA"
    monkeypatch.delenv("EGRESSD_WEBHOOK_SECRET_FILE")
    config = tmp_path / "egressd.toml"
    config.write_text(f'[approvals]\nslack_app_token_file = "{path}"\n')
    settings = load_settings({}, config)
    assert settings.slack_app_token is not None and settings.slack_app_token.get_secret_value() == "whsec_AAAA"


def test_a_secret_file_others_may_read_or_write_is_refused(tmp_path: Path) -> None:
    for mode in (0o640, 0o604, 0o620, 0o602):
        path = _secret_file(tmp_path, mode=mode)
        message = _refusal({"slack_bot_token_file": str(path)})
        assert message.startswith("bad setting slack_bot_token_file: "), message
        assert oct(mode)[2:] in message and "chmod 600" in message, message


def test_a_link_to_a_secret_file_is_refused(tmp_path: Path) -> None:
    path = _secret_file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(path)
    message = _refusal({"control_token_file": str(link)})
    assert message.startswith("bad setting control_token_file: ") and "link" in message, message


def test_a_secret_file_that_is_no_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # opening it must not wait for a writer
    message = _refusal({"control_token_file": str(fifo)})
    assert message.startswith("bad setting control_token_file: ") and "not a regular file" in message, message
    message = _refusal({"control_token_file": str(tmp_path / "missing")})
    assert message.startswith("bad setting control_token_file: ") and "No such file" in message, message
    empty = _secret_file(tmp_path, "\n")
    assert "empty" in _refusal({"control_token_file": str(empty)})


def test_a_secret_file_of_another_user_is_refused(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "giving a file to another user needs root")
    path = _secret_file(tmp_path)
    os.chown(path, 1000, 1000)
    message = _refusal({"slack_signing_secret_file": str(path)})
    assert message.startswith("bad setting slack_signing_secret_file: ") and "uid 1000" in message, message


def test_a_secret_given_both_as_a_value_and_as_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from egressd.cli.main import main

    path = _secret_file(tmp_path)
    message = _refusal({"control_token": "t", "control_token_file": str(path)})
    assert message.startswith("bad setting control_token_file: "), message
    code = main(["serve", "--control-token", "t", "--control-token-file", str(path), "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("egressd: bad setting control_token_file: ") and err.count("\n") == 1, err


def test_every_secret_flag_warns_of_the_process_list_and_names_its_file_form() -> None:
    from egressd.cli.flags import SERVICE_ONLY
    from egressd.cli.main import build_parser
    from egressd.config.settings import SECRET_SETTINGS

    assert set(SECRET_SETTINGS) >= {"control_token", "slack_bot_token", "slack_app_token", "slack_signing_secret",
                                    "webhook_secret", "webhook_callback_secret"}
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command in ("serve", "run", "agent", "pending", "allow", "deny"):
        helps = {flag: action.help or "" for action in commands[command]._actions for flag in action.option_strings}
        # run and agent leave out serve's own settings (SERVICE_ONLY); the fleet's state database is theirs too.
        named = [n for n in SECRET_SETTINGS if command == "serve" or n not in SERVICE_ONLY]
        for name in named if command in ("serve", "run", "agent") else ("control_token",):
            flag = "--" + name.replace("_", "-")
            assert "process list" in helps[flag] and f"{flag}-file" in helps[flag], (command, flag, helps[flag])
            assert f"EGRESSD_{name.upper()}" in helps[flag], (command, flag, helps[flag])
            assert "no one else may read" in helps[f"{flag}-file"], (command, flag)


# -- egressd drops its secrets from its environment once read ----------------------------------


def test_egressd_drops_its_secret_variables_once_the_settings_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from egressd.cli.main import _audit_settings_fields, _settings, build_parser

    markers = {k: v for k, v in secret_markers().items() if k.startswith("EGRESSD_") and "API_KEY" not in k}
    for name, value in markers.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("egressd_slack_app_token", "lower-case-too")  # the settings read names case-insensitively
    monkeypatch.delenv("EGRESSD_SLACK_APP_TOKEN")
    args = build_parser().parse_args(["serve"])
    _audit_settings_fields(args)
    settings = _settings(args)
    assert settings.slack_bot_token is not None
    assert settings.slack_bot_token.get_secret_value() == markers["EGRESSD_SLACK_BOT_TOKEN"]
    assert settings.slack_app_token is not None and settings.slack_app_token.get_secret_value() == "lower-case-too"
    left = [name for name in os.environ if name.upper() in markers]
    assert left == []


async def test_egressd_agent_drops_the_model_keys_once_the_model_is_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    from egressd.cli.commands.agent import _open_model

    markers = {k: v for k, v in secret_markers().items() if "API_KEY" in k}
    for name, value in markers.items():
        monkeypatch.setenv(name, value)
    args = argparse.Namespace(model="openai:gpt-test", model_url=None, model_retries=0, model_timeout=5.0)
    model, key = _open_model(args)
    try:
        assert key == markers["EGRESSD_OPENAI_API_KEY"]  # it was read first
        assert [name for name in markers if name in os.environ] == []
    finally:
        await model.close()


# -- the bubblewrap backend, for real ----------------------------------------------------------


def _needs_bwrap() -> None:
    require(os.geteuid() == 0, "the sandbox tests need root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter"):
        require(have(tool), f"{tool} is not installed")


def test_the_bwrap_command_line_carries_no_environment_value() -> None:
    from egressd.sandbox.bwrap import BwrapSpec, bwrap_argv, environment_args

    env = {"HTTP_PROXY": "http://run:token-value@169.254.100.1:3128", "GH_TOKEN": "ghp_value"}
    argv = bwrap_argv(BwrapSpec(workdir="/w", etc_dir="/e", env=env, argv=["true"], args_fd=7))
    assert not [a for a in argv if "token-value" in a or "ghp_value" in a or a in ("--setenv", "--clearenv")]
    assert argv[argv.index("--args") + 1] == "7"
    data = environment_args(env).split(b"\0")
    assert data[0] == b"--clearenv" and data[-1] == b""
    assert b"ghp_value" in data and b"http://run:token-value@169.254.100.1:3128" in data


async def test_no_secret_of_egressd_is_visible_to_any_process_in_a_bwrap_sandbox(tmp_path: Path, dns) -> None:  # type: ignore[no-untyped-def]
    _needs_bwrap()
    from tests.integration.sandbox.test_sandbox import assert_no_leftovers, egressd_run

    markers = secret_markers()
    code, out, err = await egressd_run(tmp_path, dns, "--", "python3", "-c", SWEEP, env=markers)
    assert code == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert not seen["1/environ"].startswith("unreadable"), seen  # bwrap's own init: the reader
    assert any("HTTP_PROXY=http://" in text for text in seen.values()), seen  # the sweep read environments
    assert found_markers(out, markers) == [], seen
    await assert_no_leftovers()


async def test_no_command_line_egressd_run_starts_carries_a_secret_or_the_runs_credentials(tmp_path: Path) -> None:
    _needs_bwrap()
    from tests.integration.sandbox.test_sandbox import assert_no_leftovers

    markers = secret_markers()
    passed = f"ghp_{uuid.uuid4().hex}"  # --env GH_TOKEN: the value comes from our environment, not our command line
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | markers | {
        "GH_TOKEN": passed, "XDG_STATE_HOME": str(tmp_path / "s")}
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "run", "--audit-log", str(tmp_path / "a.jsonl"), "--env", "GH_TOKEN", "--",
        "sh", "-c", 'echo "$HTTP_PROXY"; exec sleep 60',
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
    )
    try:
        assert proc.stdout is not None
        proxy_url = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
        token = urlsplit(proxy_url).password
        assert token, proxy_url
        secrets = markers | {"run token": token, "GH_TOKEN": passed}
        tree = process_tree(proc.pid)
        assert any(cmdline.startswith(("bwrap ", "/usr/bin/bwrap ")) for _, cmdline, _ in tree), tree
        for pid, cmdline, environ in tree:
            assert found_markers(cmdline, secrets) == [], (pid, cmdline)
            if cmdline.startswith(("sleep ", "sh -c ")):  # the sandboxed command: its own environment, as asked
                assert f"HTTP_PROXY={proxy_url}" in environ and f"GH_TOKEN={passed}" in environ
            else:  # nsenter and bwrap: started with nothing of ours, nor anything the sandbox may name
                assert found_markers(environ, secrets) == [], (pid, cmdline, environ)
                assert "GH_TOKEN" not in environ and "LD_" not in environ, (pid, cmdline, environ)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 128 + signal.SIGTERM
    await assert_no_leftovers()


async def test_a_loader_variable_passed_with_env_reaches_the_command_alone(tmp_path: Path, dns) -> None:  # type: ignore[no-untyped-def]
    """nsenter starts as root and bwrap outside the sandbox: an --env LD_PRELOAD naming a file the
    sandbox can write must not load into them. The loader complains once per program it loads into."""
    _needs_bwrap()
    from tests.integration.sandbox.test_sandbox import egressd_run

    missing = f"/work/egressd-test-{uuid.uuid4().hex}.so"
    code, out, err = await egressd_run(tmp_path, dns, "--env", f"LD_PRELOAD={missing}", "--", "/usr/bin/true")
    assert code == 0, err
    # /bin/sh's (the sandbox's look-up of the command, which then becomes it) and /usr/bin/true's, no other.
    assert err.count(f"'{missing}' from LD_PRELOAD cannot be preloaded") == 2, err


# -- the Docker backend, for real --------------------------------------------------------------


def test_the_sidecar_gets_its_secrets_as_files_not_as_variables() -> None:
    from egressd.cli.wiring.docker_session import sidecar_environment, sidecar_secrets
    from egressd.sandbox.docker.config import SECRETS_DIR

    markers = secret_markers()
    settings = load_settings({
        "slack_bot_token": markers["EGRESSD_SLACK_BOT_TOKEN"], "slack_app_token": markers["EGRESSD_SLACK_APP_TOKEN"],
        "slack_signing_secret": markers["EGRESSD_SLACK_SIGNING_SECRET"],
        "webhook_secret": markers["EGRESSD_WEBHOOK_SECRET"],
        "webhook_callback_secret": markers["EGRESSD_WEBHOOK_CALLBACK_SECRET"],
        "control_token": markers["EGRESSD_CONTROL_TOKEN"],  # ours: the sidecar gets a token of its run
    })
    token = f"run-token-{uuid.uuid4().hex}"
    env = sidecar_environment(settings, egressd_ip="169.254.64.2", control_ip="169.254.64.18", token=token)
    files = sidecar_secrets(settings, token=token)
    assert found_markers(json.dumps(env), markers | {"token": token}) == []
    assert files == {"control_token": token, "slack_bot_token": markers["EGRESSD_SLACK_BOT_TOKEN"],
                     "slack_app_token": markers["EGRESSD_SLACK_APP_TOKEN"],
                     "slack_signing_secret": markers["EGRESSD_SLACK_SIGNING_SECRET"],
                     "webhook_secret": markers["EGRESSD_WEBHOOK_SECRET"],
                     "webhook_callback_secret": markers["EGRESSD_WEBHOOK_CALLBACK_SECRET"]}
    for name in files:
        assert env[f"EGRESSD_{name.upper()}_FILE"] == f"{SECRETS_DIR}/{name}"
        assert f"EGRESSD_{name.upper()}" not in env


def test_the_sidecars_secret_files_are_its_users_alone() -> None:
    from egressd.sandbox.docker.config import EGRESSD_STATE, SECRETS_DIR, SIDECAR_GID, SIDECAR_UID, secrets_archive

    data = secrets_archive({"control_token": "t0ken", "webhook_secret": "whsec_x"})
    assert SECRETS_DIR.startswith(EGRESSD_STATE + "/")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {"secrets", "secrets/control_token", "secrets/webhook_secret"}
        assert members["secrets"].isdir() and stat.S_IMODE(members["secrets"].mode) == 0o700
        for name in ("secrets/control_token", "secrets/webhook_secret"):
            assert members[name].isfile() and stat.S_IMODE(members[name].mode) == 0o400
        assert {(m.uid, m.gid) for m in members.values()} == {(SIDECAR_UID, SIDECAR_GID)}
        fh = tar.extractfile("secrets/control_token")
        assert fh is not None and fh.read() == b"t0ken"


@contextlib.asynccontextmanager
async def _engine() -> AsyncIterator[Any]:
    from egressd.sandbox.docker.engine import DockerEngine
    from tests.fakes import dockerbed

    ok, why = dockerbed.engine_answers()
    require(ok, why)
    async with DockerEngine.connect() as engine:
        yield engine


async def test_no_secret_of_egressd_is_visible_in_a_docker_sandbox_or_in_the_sidecars_configuration(
    tmp_path: Path,
) -> None:
    from tests.fakes.dockerbed import EGRESSD_IMAGE, leftovers

    async with _engine() as engine:
        markers = secret_markers()
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | markers | {
            "XDG_STATE_HOME": str(tmp_path / "s")}
        proc = await asyncio.create_subprocess_exec(
            EGRESSD, "run", "--backend", "docker", "--egressd-image", EGRESSD_IMAGE,
            "--audit-log", str(tmp_path / "audit.jsonl"), "--",
            "sh", "-c", 'python3 -c "$1"; exec sleep 60', "sh", SWEEP,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
        )
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            assert line, (await proc.stderr.read()).decode() if proc.stderr else ""
            seen = json.loads(line)
            assert any("HTTP_PROXY=http://" in text for text in seen.values()), seen
            assert found_markers(line, markers) == [], seen
            containers, _, _ = await engine.labelled("egressd.run")
            ours = {(c.get("Labels") or {}).get("egressd.role"): c["Id"] for c in containers
                    if f":{proc.pid}:" in (c.get("Labels") or {}).get("egressd.owner", "")}
            assert {"egressd", "command"} <= set(ours), ours
            for role in ("egressd", "command"):
                info = await engine.client.containers.container(ours[role]).show()
                config = json.dumps(info.get("Config"))
                assert found_markers(config, markers) == [], (role, info["Config"]["Env"])
            sidecar = engine.client.containers.container(ours["egressd"])
            execution = await sidecar.exec(["sh", "-c", 'cat "$EGRESSD_SLACK_BOT_TOKEN_FILE"'], stdout=True)
            output = []
            async with execution.start(detach=False) as stream:
                while (message := await stream.read_out()) is not None:
                    output.append(message.data.decode(errors="replace"))
            assert "".join(output).strip() == markers["EGRESSD_SLACK_BOT_TOKEN"]  # it got them, as a file
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 128 + signal.SIGTERM
        assert await leftovers(engine, "egressd.run", owner_pid=proc.pid) == []


def test_a_declared_secret_and_the_origins_ca_reach_the_sidecar_as_files_and_the_value_nowhere_else(
    tmp_path: Path,
) -> None:
    from egressd.cli.wiring.docker_session import sidecar_environment, sidecar_files, sidecar_secrets
    from egressd.cli.wiring.service import StartupError
    from egressd.sandbox.docker.config import SECRETS_DIR

    value = f"real-{uuid.uuid4().hex}"
    ca = tmp_path / "origin-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMII...\n-----END CERTIFICATE-----\n")
    settings = load_settings({"allow": ["api.example.test/**"], "secret": ["API_TOKEN@api.example.test"],
                              "inspect_origin_ca_file": str(ca)})
    files = sidecar_files(settings, {"API_TOKEN": value})
    assert files == {"declared.API_TOKEN": value, "inspect_origin_ca": ca.read_text()}
    env = sidecar_environment(settings, egressd_ip="169.254.64.2", control_ip="169.254.64.18", token="t", files=files)
    # The sidecar is told which secrets there are and where their values are; the values are files only.
    assert env["EGRESSD_SECRET"] == "API_TOKEN@api.example.test"
    assert env["API_TOKEN_FILE"] == f"{SECRETS_DIR}/declared.API_TOKEN"
    assert env["EGRESSD_INSPECT_ORIGIN_CA_FILE"] == f"{SECRETS_DIR}/inspect_origin_ca"
    assert value not in json.dumps(env)
    assert sidecar_secrets(settings, token="t", files=files)["declared.API_TOKEN"] == value
    # A declared secret with no value, or a name no rule inspects, stops the run before anything is made.
    with pytest.raises(StartupError, match="API_TOKEN"):
        sidecar_files(settings, {})
    plain = load_settings({"allow": ["api.example.test"], "secret": ["API_TOKEN@api.example.test"]})
    with pytest.raises(StartupError, match="no request rule"):
        sidecar_files(plain, {"API_TOKEN": value})
    unlisted = load_settings({"secret": ["API_TOKEN@api.example.test"]})  # no --allow at all
    with pytest.raises(StartupError, match="no request rule"):
        sidecar_files(unlisted, {"API_TOKEN": value})


def test_egressd_reads_a_declared_secrets_value_from_the_file_name_file_names(tmp_path: Path) -> None:
    from egressd.cli.wiring.declared import secrets_from_settings

    path = tmp_path / "value"
    path.write_text("from-a-file\n")
    path.chmod(0o400)
    settings = load_settings({"allow": ["api.example.test/**"], "secret": ["API_TOKEN@api.example.test"]})
    declared = secrets_from_settings(settings, None, {"API_TOKEN_FILE": str(path)})
    assert declared is not None and declared.declared[0].value == "from-a-file"
