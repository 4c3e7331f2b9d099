"""No egressd module imports another only for type checking: that is how an import loop hides.

An ``if TYPE_CHECKING:`` block that imports an egressd module lets two
modules name each other while the import contracts (which see only real
imports) call the layers clean. Third-party imports there (aiohttp's types)
are fine: they load nothing of ours.
"""

from __future__ import annotations

import ast
import tomllib

from tests import REPO


def _modules() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {REPO / folder for folder in config["package-dir"].values()}
    return sorted({str(path.relative_to(REPO)) for folder in folders for path in folder.glob("*.py")})


def _type_checking_imports(source: str) -> list[str]:
    """The modules imported inside ``if TYPE_CHECKING:`` blocks of ``source`` (relative ones with their dots)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        test = node.test if isinstance(node, ast.If) else None
        named = isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
        attribute = isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        if not (named or attribute):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom):
                found.append("." * inner.level + (inner.module or ""))
            elif isinstance(inner, ast.Import):
                found.extend(alias.name for alias in inner.names)
    return found


def _ours(name: str) -> bool:
    return name.startswith((".", "egressd"))


def test_no_module_imports_one_of_ours_for_type_checking_only() -> None:
    hidden = [
        f"{path} imports {name} under TYPE_CHECKING"
        for path in _modules()
        for name in _type_checking_imports((REPO / path).read_text())
        if _ours(name)
    ]
    assert hidden == []


def test_the_check_sees_a_hidden_import() -> None:
    planted = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .message import ApprovalMessage\n"
    assert [name for name in _type_checking_imports(planted) if _ours(name)] == [".message"]
    assert _type_checking_imports("import typing\nif typing.TYPE_CHECKING:\n    import aiohttp\n") == ["aiohttp"]
