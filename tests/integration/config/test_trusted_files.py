"""The checked open of files egressd takes with authority (``egressd.config.trusted``), attacked.

Each planted thing (a link at the name, a link on the way, a FIFO nobody
writes, a file others may change, another user's file, a directory) is
refused with one message naming the path; a FIFO does not hang the open
(the test's timeout is the proof). The readers built on it (config file,
allow file, secret files, control token, audit log) refuse the same.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from egressd.audit.log import AuditError, JsonlAuditSink
from egressd.config.allowfile import AllowFileError, Approved, append_approved, read_allow_file
from egressd.config.settings import SettingsError, load_settings, read_config_file, read_secret_file
from egressd.config.trusted import UntrustedFile, open_trusted, read_trusted
from tests.harness import require

SPARE_UID = 54321  # a uid nobody on the test machine is: "another user"
GOOD = 'allow = ["pypi.org"]\n'


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "real" / "allow.toml"
    path.parent.mkdir()
    path.write_text(GOOD)
    path.chmod(0o644)
    return path


def _fifo(tmp_path: Path) -> Path:
    fifo = tmp_path / "allow.toml"
    os.mkfifo(fifo, 0o600)  # no writer ever comes: a blocking open would wait forever
    return fifo


def test_a_good_file_is_read(good: Path) -> None:
    assert read_trusted(good) == GOOD.encode()
    assert read_allow_file(good).allow == ("pypi.org",)


def test_a_relative_path_is_walked_from_the_current_directory(good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(good.parent.parent)
    assert read_trusted(Path("real/../real/allow.toml")) == GOOD.encode()


def test_a_link_at_the_name_is_refused(tmp_path: Path, good: Path) -> None:
    link = tmp_path / "link.toml"
    link.symlink_to(good)
    with pytest.raises(UntrustedFile, match=f"{link}: {link} is a link.*{good}"):
        read_trusted(link)


def test_a_link_on_the_way_is_refused_and_the_real_path_named(tmp_path: Path, good: Path) -> None:
    (tmp_path / "project").symlink_to(good.parent)
    via = tmp_path / "project" / "allow.toml"
    with pytest.raises(UntrustedFile, match=f"{via}: {tmp_path / 'project'} is a link.*real path \\({good}\\)"):
        read_trusted(via)
    with pytest.raises(AllowFileError, match="is a link"):
        read_allow_file(via)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path)
    with pytest.raises(UntrustedFile, match=f"{fifo} is a FIFO, not a regular file"):
        read_trusted(fifo)
    with pytest.raises(AllowFileError, match="FIFO"):
        read_allow_file(fifo)
    with pytest.raises(SettingsError, match="bad setting config: .*FIFO"):
        read_config_file(fifo)
    with pytest.raises(AuditError, match="FIFO"):
        JsonlAuditSink(fifo)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UntrustedFile, match="is a directory, not a regular file"):
        read_trusted(tmp_path)
    with pytest.raises(UntrustedFile, match="names a directory"):
        open_trusted(f"{tmp_path}/")


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_file_others_may_change_is_refused(good: Path, mode: int) -> None:
    good.chmod(mode)
    with pytest.raises(UntrustedFile, match=f"mode {mode:04o}, so other users may change it: chmod go-w {good}"):
        read_trusted(good)
    with pytest.raises(SettingsError, match="bad setting config: .*chmod go-w"):
        load_settings({}, good)  # `allow` is a setting too: the same text is a config file


def test_a_secret_others_may_read_is_refused(good: Path) -> None:
    good.chmod(0o640)
    assert read_trusted(good) == GOOD.encode()  # policy: readable is fine
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(good, euid=os.geteuid())


def test_another_users_file_is_refused_and_roots_and_ours_taken(good: Path) -> None:
    require(os.geteuid() == 0, "chown to another uid needs root")
    os.chown(good, SPARE_UID, SPARE_UID)
    with pytest.raises(UntrustedFile, match=f"belongs to uid {SPARE_UID}"):
        read_trusted(good)
    with pytest.raises(AllowFileError, match=f"belongs to uid {SPARE_UID}"):
        append_approved(good, Approved(entry="evil.test", at="2026-12-03T00:00:00Z"))
    assert good.read_text() == GOOD
    os.chown(good, 0, 0)
    assert read_trusted(good) == GOOD.encode()


def test_a_missing_allow_file_is_empty_and_made_private_by_the_first_answer(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    assert read_allow_file(path).allow == ()
    append_approved(path, Approved(entry="api.github.com:443", at="2026-12-03T00:00:00Z"))
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_allow_file(path).allowed == ("api.github.com:443",)


def test_an_answer_is_not_appended_through_a_link_on_the_way(tmp_path: Path, good: Path) -> None:
    (tmp_path / "project").symlink_to(good.parent)
    with pytest.raises(AllowFileError, match="is a link"):
        append_approved(tmp_path / "project" / "allow.toml", Approved(entry="evil.test", at="2026-12-03T00:00:00Z"))
    assert good.read_text() == GOOD


def test_an_audit_log_through_a_link_on_the_way_or_writable_by_others_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "logs"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    with pytest.raises(AuditError, match="is a link"):
        JsonlAuditSink(tmp_path / "via" / "audit.jsonl")
    assert list(real.iterdir()) == []
    shared = real / "audit.jsonl"
    shared.write_text("")
    shared.chmod(0o662)
    with pytest.raises(AuditError, match="chmod go-w"):
        JsonlAuditSink(shared)


def test_a_config_file_through_a_link_on_the_way_is_refused_by_egressd(tmp_path: Path) -> None:
    import subprocess
    import sys

    real = tmp_path / "etc"
    real.mkdir()
    (real / "egressd.toml").write_text('control = "127.0.0.1:1"\n')
    (tmp_path / "via").symlink_to(real)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("egressd")), "pending", "--config", str(tmp_path / "via" / "egressd.toml")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("egressd: bad setting config: ") and "is a link" in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_transcript_or_token_file_through_a_link_on_the_way_is_refused(tmp_path: Path) -> None:
    from egressd.agent.transcript import TranscriptError, TranscriptWriter
    from egressd.cli.wiring.controltoken import TokenFileError, read_token_file, write_token_file

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    with pytest.raises(TranscriptError, match="is a link"):
        TranscriptWriter(tmp_path / "via" / "t.jsonl")
    with pytest.raises(TokenFileError, match="is a link"):
        write_token_file(tmp_path / "via" / "control.token", "secret-token")
    assert list(real.iterdir()) == []  # nothing was made through the link
    write_token_file(real / "control.token", "secret-token")
    assert read_token_file(real / "control.token") == "secret-token"
    with pytest.raises(TokenFileError, match="is a link"):
        read_token_file(tmp_path / "via" / "control.token")


def test_a_directory_we_may_search_but_not_list_is_walked_through(tmp_path: Path) -> None:
    # /home/alice at 0711: the walk must need no more than the kernel's own lookup (O_PATH).
    import subprocess
    import sys

    require(os.geteuid() == 0, "running as another uid needs root")
    outer = Path(tempfile.mkdtemp(prefix="egressd-test-0711-"))
    try:
        outer.chmod(0o711)
        inner = outer / "inner"
        inner.mkdir()
        (inner / "allow.toml").write_text(GOOD)
        os.chown(inner, 1000, 1000)
        os.chown(inner / "allow.toml", 1000, 1000)
        code = "from pathlib import Path; from egressd.config.allowfile import read_allow_file as r; " \
            f"print(r(Path({str(inner / 'allow.toml')!r})).allow)"
        result = subprocess.run(
            ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0 and result.stdout == "('pypi.org',)\n", result.stderr
    finally:
        shutil.rmtree(outer)
