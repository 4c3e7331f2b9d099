"""``egressd serve`` takes its config and allow file only as files nobody else could have written.

DESIGN.md, "Policy": opened without following links and checked on the open
descriptor, at start and on every SIGHUP reload alike (the reload re-reads
both through the same checked open). A file that fails the check stops a
start (one line, exit 2, no listener) and is a refused reload (the old
policy kept, one ``policy.reloaded`` record with ``ok: false``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.harness import require
from tests.integration.cli.test_reload import EGRESSD, _records, _serve, _stop, _until

SPARE_UID = 54321  # a uid nobody on the test machine is: "another user"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return env


def test_serve_refuses_to_start_with_an_allow_file_others_may_change(tmp_path: Path) -> None:
    allow = tmp_path / "allow.toml"
    allow.write_text('allow = ["*.evil.test"]\n')
    allow.chmod(0o666)
    result = subprocess.run(
        [EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0", "--allow-file", str(allow),
         "--audit-log", str(tmp_path / "audit.jsonl")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=_env(tmp_path),
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"egressd: bad setting allow_file: allow file {allow} has mode 0666, so other users may " \
        f"change it: chmod go-w {allow}\n"
    assert "serving" not in result.stderr


async def test_a_reload_refuses_a_config_or_allow_file_that_others_could_have_written(
    tmp_path: Path, dns: Any
) -> None:
    require(os.geteuid() == 0, "chown to another uid needs root")
    audit, stderr_path = tmp_path / "audit.jsonl", tmp_path / "serve.stderr"
    config, allow = tmp_path / "egressd.toml", tmp_path / "allow.toml"
    config.write_text('deny = ["leak.test"]\n')
    allow.write_text('allow = ["a.test"]\n')
    args = ["--config", str(config), "--allow-file", str(allow), "--upstream-dns", f"127.0.0.1:{dns.address[1]}",
            "--audit-log", str(audit)]
    proc, _ = await _serve(args, _env(tmp_path), stderr_path)
    try:
        config.write_text('learn = true\nallow_private = ["0.0.0.0/0"]\n')
        config.chmod(0o664)  # the group could have written it
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: len(_records(audit, "policy.reloaded")) == 1, "policy.reloaded")
        [record] = _records(audit, "policy.reloaded")
        assert record["ok"] is False and "bad setting config" in record["error"] and "chmod go-w" in record["error"]
        config.chmod(0o644)
        os.chown(config, 0, 0)
        replaced = tmp_path / "allow.new"
        replaced.write_text('allow = ["*.evil.test"]\n')
        os.chown(replaced, SPARE_UID, SPARE_UID)  # another user's file, renamed over the name
        replaced.rename(allow)
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: len(_records(audit, "policy.reloaded")) == 2, "policy.reloaded")
        record = _records(audit, "policy.reloaded")[-1]
        assert record["ok"] is False and "bad setting allow_file" in record["error"]
        assert f"belongs to uid {SPARE_UID}" in record["error"]
        assert proc.returncode is None
    finally:
        await _stop(proc)
