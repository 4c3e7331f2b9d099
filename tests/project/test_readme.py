"""The documentation is real: README.md, docs/*.md and bench/RESULTS.md.

Their config files load, the flags they give a command exist in that
command's --help, their links lead to files (and headings) of this
repository, and docs/settings.md is what ``python -m egressd.cli.reference`` makes
of the settings' own descriptions.
"""

from __future__ import annotations

import argparse
import re
from functools import cache
from pathlib import Path

import pytest

from egressd.cli.main import build_parser
from egressd.cli.reference import COMMAND, render_settings_reference, serve_flags
from egressd.cli.wiring.service import entries_from_settings
from egressd.config.settings import Settings, load_settings
from tests import REPO

ROOT = REPO
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]


# The command a guide's tables of options belong to: every `--flag` in a table row there is that
# command's. (Flags on a command line, `egressd CMD --flag`, are checked in every file.)
TABLE_COMMAND = {
    "serving.md": "serve",
    "allowlists.md": "serve",
    "approvals.md": "serve",
    "transparent-mode.md": "serve",
    "dns.md": "serve",
    "settings.md": "serve",
    "sandbox.md": "run",
    "agent.md": "agent",
}
SUBCOMMANDS = ("serve", "run", "agent", "audit", "pending", "allow", "deny", "doctor")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _text(path: Path) -> str:
    return path.read_text()


def _outside_fences(text: str) -> list[str]:
    """The lines of ``text`` that are not inside a fenced code block (fences themselves dropped)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _fenced_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M) if m.group(1) in languages]


# --- config examples -------------------------------------------------------------------------


# The first line of a TOML example that is an allowlist file, checked as one.
ALLOW_FILE_MARK = "# an allowlist file"
TOML_BLOCKS = [(_rel(path), block) for path in DOCS for block in _fenced_blocks(_text(path), ("toml",))]


@pytest.mark.parametrize(("where", "block"), TOML_BLOCKS, ids=[f"{w}:{i}" for i, (w, _) in enumerate(TOML_BLOCKS)])
def test_every_toml_example_is_a_valid_config(tmp_path: Path, where: str, block: str) -> None:
    config = tmp_path / "egressd.toml"
    # A block indented under a list item is indented as a whole.
    config.write_text("\n".join(line.strip() for line in block.splitlines()) + "\n")
    if block.startswith(ALLOW_FILE_MARK):  # an allowlist file (--allow-file), not a config file
        settings = load_settings({"allow_file": str(config)})
        assert entries_from_settings(settings)[0], "an allow file example that allows nothing"
        return
    settings = load_settings({}, config)
    entries_from_settings(settings)  # entries and presets are valid too


def test_the_docs_have_toml_examples() -> None:
    assert {"README.md", "docs/settings.md", "docs/approvals.md"} <= {where for where, _ in TOML_BLOCKS}


# --- flags -----------------------------------------------------------------------------------


@cache
def _help(command: str) -> str:
    """``egressd COMMAND --help`` (``audit verify`` too), from this checkout's parser."""
    parser = build_parser()
    for name in command.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser.format_help()


def _command_lines(text: str) -> list[str]:
    """Shell lines of the fenced sh blocks (continuations joined) and every inline code span."""
    lines = []
    for block in _fenced_blocks(text, ("sh", "")):
        lines += block.replace("\\\n", " ").splitlines()
    for line in _outside_fences(text):
        lines += re.findall(r"`([^`]+)`", line)
    return lines


def _flags_given(line: str) -> list[tuple[str, str]]:
    """(command, --flag) for each ``egressd CMD ... --flag`` on one shell line."""
    found = []
    for match in re.finditer(rf"\begressd\s+({'|'.join(SUBCOMMANDS)})\b(\s+verify\b)?", line):
        command = match.group(1) + (" verify" if match.group(2) else "")
        rest = re.split(r"\s(?:--|\||;|&&|#)(?:\s|$)|[|;`]|&&", line[match.end() :] + " ")[0]
        found += [(command, flag) for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)]
    return found


def _table_flags(path: Path) -> list[tuple[str, str]]:
    command = TABLE_COMMAND.get(path.name)
    if command is None:
        return []
    rows = [line for line in _outside_fences(_text(path)) if line.startswith("|")]
    return [(command, flag) for row in rows for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", row)]


def test_every_flag_the_docs_give_a_command_is_in_its_help() -> None:
    unknown, checked = [], 0
    for path in DOCS:
        text = _text(path)
        given = [f for line in _command_lines(text) for f in _flags_given(line)] + _table_flags(path)
        for command, flag in given:
            checked += 1
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", _help(command)):
                unknown.append(f"{_rel(path)}: egressd {command} has no {flag}")
    assert checked > 100, checked  # the parsing above found the flags at all
    assert not unknown, "\n".join(unknown)


def test_every_flag_of_the_settings_reference_is_a_serve_flag() -> None:
    table = _text(ROOT / "docs" / "settings.md")
    table = table[table.index("| setting (TOML key) |") :]
    table = table[: table.index("\n\n")]
    flags = set(re.findall(r"^\| `\w+` \| `(--[a-z0-9-]+)`", table, re.M))
    help_text = _help("serve")
    assert len(flags) > 40
    assert all(re.search(rf"{re.escape(flag)}(?![\w-])", help_text) for flag in flags), sorted(
        f for f in flags if f not in help_text
    )


# --- the generated settings reference ----------------------------------------------------------


def test_the_settings_reference_is_up_to_date() -> None:
    current = _text(ROOT / "docs" / "settings.md")
    assert current == render_settings_reference(), (
        f"docs/settings.md is not what the settings describe: regenerate it with `{COMMAND}`"
    )


def test_every_setting_is_described_and_listed() -> None:
    reference = render_settings_reference()
    assert not [name for name, field in Settings.model_fields.items() if not field.description]
    assert all(f"| `{name}` |" in reference for name in Settings.model_fields)
    # The flags are the parser's: a setting the command line lacks says so, none is invented.
    flags = serve_flags()
    assert flags["ask"] == "--no-ask" and "shutdown_grace_s" not in flags
    assert "| `shutdown_grace_s` | — |" in reference


# --- links -----------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    for line in _outside_fences(_text(path)):
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            base = slug = _slug(match.group(1))
            n = 0
            while slug in anchors:
                n += 1
                slug = f"{base}-{n}"
            anchors.add(slug)
    return anchors


def _links(path: Path) -> list[str]:
    """The targets of the Markdown links in ``path``, code left out."""
    targets = []
    for line in _outside_fences(_text(path)):
        line = re.sub(r"`[^`]*`", "", line)
        targets += re.findall(r"\]\(([^)\s]+)\)", line)
    return targets


def test_every_link_leads_to_a_file_and_heading_of_the_repository() -> None:
    broken, checked = [], 0
    for path in DOCS:
        for target in _links(path):
            checked += 1
            where = f"{_rel(path)}: ({target})"
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                if not target.startswith("https://"):
                    broken.append(f"{where}: only https links leave the repository")
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.is_relative_to(ROOT):
                broken.append(f"{where}: outside the repository")
                continue
            if not linked.exists():
                broken.append(f"{where}: no such file")
                continue
            if anchor and (linked.suffix != ".md" or anchor not in _anchors(linked)):
                broken.append(f"{where}: no heading #{anchor} in {_rel(linked)}")
    assert checked > 20, checked
    assert not broken, "\n".join(broken)


def test_the_link_check_catches_what_it_should(tmp_path: Path) -> None:
    assert _slug("Docker: the sidecar and `--backend docker`") == "docker-the-sidecar-and---backend-docker"
    assert _slug("`egressd pending`, `egressd allow ID`, `egressd deny ID`") == (
        "egressd-pending-egressd-allow-id-egressd-deny-id"
    )
    assert "security-model" in _anchors(ROOT / "README.md")
    assert not (ROOT / "README.md").parent.joinpath("../shared/DESIGN.md").resolve().is_relative_to(ROOT)


def test_every_test_the_guarantees_name_exists() -> None:
    """A promise points at its test: `tests/f.py::name`, `tests/f.py`, or a bare `::name` / `test_name` of the file
    named last before it (in the same section)."""
    text = (ROOT / "docs" / "guarantees.md").read_text()
    missing: list[str] = []
    named = 0
    for section in re.split(r"\n## ", text):
        current: Path | None = None
        for ref in re.findall(r"`([^`]+)`", section):
            file_part, _, name = ref.partition("::")
            if file_part.startswith("tests/") and file_part.endswith(".py"):
                current = ROOT / file_part
                if not current.exists():
                    missing.append(ref)
                    continue
            elif not (ref.startswith("::") or re.fullmatch(r"test_\w+", ref)):
                continue
            else:
                name = ref.removeprefix("::")
            if not name:
                continue
            named += 1
            if current is None or not re.search(rf"^(async )?def {re.escape(name)}\(", current.read_text(), re.M):
                missing.append(f"{ref} (in {current.name if current else 'no file named before it'})")
    assert named > 20, named
    assert not missing, missing

