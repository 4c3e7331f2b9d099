"""The README's examples are real: its config files load and its flags exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.service import entries_from_settings
from config.settings import load_settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
EGRESSD = str(Path(sys.executable).with_name("egressd"))


@pytest.mark.parametrize("block", re.findall(r"```toml\n(.*?)```", README, re.S))
def test_every_toml_example_in_the_readme_is_a_valid_config(tmp_path: Path, block: str) -> None:
    if "[approvals]" in block and "slack_bot_token" in block:
        pytest.skip("a channel example whose tokens are placeholders")
    config = tmp_path / "egressd.toml"
    config.write_text(block)
    settings = load_settings({}, config)
    entries_from_settings(settings)  # entries and presets are valid too


def test_every_flag_of_the_settings_table_is_a_serve_flag() -> None:
    table = README[README.index("| setting (TOML key) |"):]
    table = table[: table.index("\n\n")]
    flags = set(re.findall(r"`(--[a-z0-9-]+)`", table))
    help_text = subprocess.run([EGRESSD, "serve", "--help"], capture_output=True, text=True, timeout=30).stdout
    assert flags and all(flag in help_text for flag in flags), sorted(f for f in flags if f not in help_text)
