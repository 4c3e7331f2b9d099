"""The performance boundary: speed tricks only in modules named hot, and those named in one place.

A hot module says so in its docstring with one phrase; docs/performance.md
("The hot path") lists the same modules. A comment about instruction counts,
Python calls or per-connection costs anywhere else is a trick out of bounds
(or an essay that belongs in docs/performance.md).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib

from tests import REPO

PHRASE = "Hot path: see docs/performance.md."
# Words that give a comment away as performance rationale.
RATIONALE = re.compile(
    r"instructions|a python call|a global's|\bin c\b|descriptor: a|costs? (?:ten|twice|four)|fast path|hot path",
    re.IGNORECASE,
)


def _modules() -> dict[str, str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {REPO / folder for folder in config["package-dir"].values()}
    return {str(path.relative_to(REPO)): path.read_text() for folder in folders for path in folder.glob("*.py")}


def _marked(source: str) -> bool:
    return PHRASE in (ast.get_docstring(ast.parse(source)) or "")


def _listed() -> set[str]:
    text = (REPO / "docs" / "performance.md").read_text()
    section = text.split("## The hot path", 1)[1].split("The tricks they use", 1)[0]
    return {path for path in re.findall(r"`([\w/]+\.py)`", section) if not path.startswith("tests/")}


def _rationale_comments(source: str) -> list[str]:
    return [
        token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and RATIONALE.search(token.string)
    ]


def test_the_hot_modules_are_marked_and_listed_alike() -> None:
    marked = {path for path, source in _modules().items() if _marked(source)}
    assert marked == _listed()
    assert len(marked) > 10


def test_no_performance_rationale_outside_the_hot_modules() -> None:
    strays = [
        f"{path}: {comment}"
        for path, source in sorted(_modules().items())
        if not _marked(source)
        for comment in _rationale_comments(source)
    ]
    assert strays == []


def test_the_check_sees_a_stray_trick() -> None:
    planted = '"""A cold module."""\n\n# A partial, not a lambda: a partial is called in C.\nx = 1\n'
    assert not _marked(planted) and _rationale_comments(planted)
    assert _marked('"""Hot.\n\nHot path: see docs/performance.md.\n"""\n')
