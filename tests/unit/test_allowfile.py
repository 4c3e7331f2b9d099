"""Allowlist files (``--allow-file``): reading, appending an *always* answer, and start-up's use of them."""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

import pytest

from egressd.cli.wiring.service import StartupError, entries_from_settings
from egressd.config.allowfile import (
    AllowFileError,
    Approved,
    Revoked,
    append_approved,
    append_revoked,
    read_allow_file,
)
from egressd.config.settings import load_settings
from egressd.names.shown import toml_string

WRITTEN = """# the operator's own notes survive every append
allow = ["pypi.org", "*.pythonhosted.org"]  # python
deny = ["tracker.example"]
"""


def test_a_missing_file_holds_nothing(tmp_path: Path) -> None:
    held = read_allow_file(tmp_path / "absent.toml")
    assert (held.allow, held.deny, held.approved) == ((), (), ())


def test_allow_deny_and_approved_entries_are_read_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(WRITTEN + '\n[[approved]]\nentry = "api.github.com:443"\nat = "2026-12-01T00:00:00Z"\n')
    held = read_allow_file(path)
    assert held.allowed == ("pypi.org", "*.pythonhosted.org", "api.github.com:443")
    assert held.deny == ("tracker.example",)
    assert held.approved[0].at == "2026-12-01T00:00:00Z"


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("allow = [", "not TOML"),
        ('allow = "pypi.org"', "allow must be a list of strings"),
        ("deny = [1]", "deny must be a list of strings"),
        ('alow = ["pypi.org"]', "unknown key 'alow'"),
        ('[[approved]]\nentry = "a.example"\n', "needs entry and at"),
        ('[[approved]]\nentry = "a.example"\nat = "x"\nscope = "all"\n', "unknown key 'scope'"),
        ("approved = 3", "[[approved]] tables"),
    ],
)
def test_a_bad_file_is_refused_with_its_name_and_why(tmp_path: Path, text: str, complaint: str) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(text)
    with pytest.raises(AllowFileError) as caught:
        read_allow_file(path)
    assert str(path) in str(caught.value) and complaint in str(caught.value)


def test_an_append_keeps_the_file_as_written_and_adds_one_table(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(WRITTEN.rstrip("\n"))  # no final newline: the table must still start on its own line
    before = path.read_text()
    append_approved(
        path, Approved("api.github.com:443", "2026-12-01T22:10:00Z", "a-1", "alice", "slack", "r-1", "global token")
    )
    after = path.read_text()
    assert after.startswith(before)
    held = read_allow_file(path)
    assert held.allowed[-1] == "api.github.com:443"
    assert held.approved == (
        Approved("api.github.com:443", "2026-12-01T22:10:00Z", "a-1", "alice", "slack", "r-1", "global token"),
    )
    assert 'auth = "global token"' in after


def test_the_first_append_creates_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "new.toml"
    append_approved(path, Approved("a.example", "2026-12-01T00:00:00Z"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_allow_file(path).allowed == ("a.example",)


def test_hostile_text_from_an_approver_cannot_add_entries(tmp_path: Path) -> None:
    # A display name is chosen by whoever answered: it must stay one string, never a new key or table.
    path = tmp_path / "allow.toml"
    by = 'mallory"\nallow = ["evil.example"]\n[[approved]]\nentry = "*.evil.example" \x7f \U0001f600 \\'
    append_approved(path, Approved("a.example", "2026-12-01T00:00:00Z", by=by))
    held = read_allow_file(path)
    assert held.allowed == ("a.example",)
    assert held.approved[0].by == by


@pytest.mark.parametrize("text", ["", "plain", 'q"uote', "back\\slash", "tab\tnew\nline\r", "\x00\x1f\x7f", "ü 😀"])
def test_toml_string_round_trips(text: str) -> None:
    assert tomllib.loads(f"v = {toml_string(text)}")["v"] == text


def test_an_invalid_file_on_disk_is_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text("allow = [\n")
    with pytest.raises(AllowFileError, match="not TOML"):
        append_approved(path, Approved("a.example", "2026-12-01T00:00:00Z"))
    assert path.read_text() == "allow = [\n"


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "allow.toml"
    link.symlink_to(target)
    with pytest.raises(AllowFileError):
        append_approved(link, Approved("a.example", "2026-12-01T00:00:00Z"))
    assert target.read_text() == ""


def test_startup_adds_the_files_entries_to_the_policy(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(WRITTEN)
    append_approved(path, Approved("api.github.com:443", "2026-12-01T00:00:00Z"))
    settings = load_settings({"allow": ["example.org"], "allow_file": str(path)})
    allow, deny = entries_from_settings(settings)
    assert [e.text for e in allow] == ["example.org", "pypi.org", "*.pythonhosted.org", "api.github.com:443"]
    assert [e.text for e in deny] == ["tracker.example"]


def test_a_bad_entry_in_the_file_stops_startup_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text('allow = ["*.com"]\n')
    settings = load_settings({"allow_file": str(path)})
    with pytest.raises(StartupError) as caught:
        entries_from_settings(settings)
    assert "allow_file" in str(caught.value) and str(path) in str(caught.value)


def test_an_unreadable_file_stops_startup(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text("deny = 3\n")
    os.chmod(path, 0o600)
    with pytest.raises(StartupError, match="bad setting allow_file: allow file .*deny must be a list"):
        entries_from_settings(load_settings({"allow_file": str(path)}))


def test_a_revocation_takes_back_earlier_answers_only_and_keeps_them_on_record(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(WRITTEN)
    path.chmod(0o600)
    append_approved(path, Approved(entry="api.github.com:443", at="2026-12-01T10:00:00.000000Z", by="alice"))
    append_approved(path, Approved(entry="pypi.org:443", at="2026-12-01T10:00:01.000000Z"))
    after = append_revoked(path, Revoked(entry="api.github.com:443", at="2026-12-02T09:00:00.000000Z", by="bob"))
    assert [a.entry for a in after.standing] == ["pypi.org:443"]
    assert "api.github.com:443" not in after.allowed and len(after.approved) == 2
    assert path.read_text().startswith(WRITTEN)  # appended: the operator's file is never rewritten
    # An answer given after the revocation holds again.
    append_approved(path, Approved(entry="api.github.com:443", at="2026-12-03T00:00:00+01:00"))
    assert "api.github.com:443" in read_allow_file(path).allowed
    # Nothing stands for it: refused, nothing written.
    before = path.read_text()
    with pytest.raises(AllowFileError, match="no standing always answer"):
        append_revoked(path, Revoked(entry="absent.example:443", at="2026-12-04T00:00:00Z"))
    assert path.read_text() == before


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ('[[revoked]]\nentry = "a.example:443"\n', "needs entry and at"),
        ('[[revoked]]\nentry = "a.example:443"\nat = "yesterday"\n', "not an RFC 3339 time"),
        ('[[revoked]]\nentry = "a.example:443"\nat = "2026-12-01T00:00:00Z"\nrun = "r-1"\n', "unknown key"),
    ],
)
def test_a_bad_revoked_table_is_refused_by_name(tmp_path: Path, table: str, error: str) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(table)
    path.chmod(0o600)
    with pytest.raises(AllowFileError, match=error):
        read_allow_file(path)
