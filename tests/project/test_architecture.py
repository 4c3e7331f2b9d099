"""docs/architecture.md's "Layers" section is the one place that tells the layers; it must match the code.

Three things are read and compared, so the doc cannot drift from them:

- the code's imports (ast over every module of every package, relative imports
  resolved, ``TYPE_CHECKING`` ones included, as import-linter counts them):
  which other egressd packages each package imports;
- the import-linter contracts in pyproject.toml;
- the section's table (one row per package, top layer first: the package, the
  egressd packages it imports, what for) and its bullets (one per contract,
  quoting the contract's name and naming each of its modules).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from tests import REPO

DOC = REPO / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(\w+)` \|(.*?)\|(.*?)\|$")
BULLET = re.compile(r'^- \*\*"(.+?)"\*\* \((\w+)\):')


def _contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _packages() -> list[str]:
    """The top-level packages, top layer first, as the layers contract orders them."""
    layers = next(c for c in _contracts() if c["type"] == "layers" and "egressd.names" in c["layers"])
    return [layer.removeprefix("egressd.") for layer in layers["layers"]]


def _module_name(path: Path) -> list[str]:
    parts = ["egressd", *path.relative_to(REPO).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported(package: str) -> dict[str, set[str]]:
    """For each other egressd package ``package`` imports, the modules of it that are imported."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        name = _module_name(path)
        here = name if path.name == "__init__.py" else name[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                # `from egressd.audit import views` imports the module egressd.audit.views
                named = (f"{module}.{alias.name}" for alias in node.names)
                modules = [module, *(candidate for candidate in named if _is_module(candidate))]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "egressd" and len(parts) > 1 and parts[1] != package:
                    found.setdefault(parts[1], set()).add(".".join(parts[1:]))
    return found


def _layers_section() -> list[str]:
    text = DOC.read_text()
    start = text.index("\n## Layers\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)].splitlines()


def _table() -> dict[str, tuple[set[str], str]]:
    rows = {}
    for line in _layers_section():
        match = ROW.match(line)
        if match:
            package, imports, purpose = match.groups()
            rows[package] = (set(re.findall(r"`(\w+)`", imports)), purpose)
    return rows


def _bullets() -> dict[str, tuple[str, str]]:
    """Each contract bullet: its quoted name → (its type, its whole text, continuation lines included)."""
    bullets: dict[str, tuple[str, str]] = {}
    current = None
    for line in _layers_section():
        match = BULLET.match(line)
        if match:
            current = match.group(1)
            bullets[current] = (match.group(2), line)
        elif current and line.startswith("  "):
            kind, text = bullets[current]
            bullets[current] = (kind, f"{text} {line.strip()}")
        else:
            current = None
    return bullets


def test_the_table_lists_every_package_top_layer_first() -> None:
    assert list(_table()) == _packages()


def test_the_table_states_exactly_the_packages_each_package_imports() -> None:
    table = _table()
    drift = []
    for package in _packages():
        stated = table.get(package, (set(), ""))[0]
        actual = set(_imported(package))
        for missing in sorted(actual - stated):
            drift.append(f"{package} imports {missing}: {sorted(_imported(package)[missing])}; the doc does not say so")
        for false in sorted(stated - actual):
            drift.append(f"the doc says {package} imports {false}; it does not")
    assert not drift, "\n".join(drift)


def test_a_package_imports_only_packages_below_it_as_the_doc_says() -> None:
    order = _packages()
    upward = [f"{package} imports {other}, which sits above it"
              for package in order for other in _imported(package) if order.index(other) < order.index(package)]
    assert not upward, "\n".join(upward)
    assert "a package imports only packages below it" in " ".join(" ".join(_layers_section()).split())


def test_each_module_the_table_names_is_imported_by_that_package() -> None:
    """A row's "what for" may name modules (`audit.views`); each must be one the row's package imports."""
    false = []
    for package, (_, purpose) in _table().items():
        imports = _imported(package)
        imported = set(imports).union(*imports.values())  # a package named alone, or one of its modules
        for named in re.findall(r"`([\w.]+)`", purpose):
            if named.split(".")[0] in _packages() and named.split(".")[0] != package and named not in imported:
                false.append(f"{package}'s row names {named}, which {package} does not import")
    assert not false, "\n".join(false)


def test_every_contract_has_a_bullet_naming_its_modules() -> None:
    bullets = _bullets()
    drift = []
    for contract in _contracts():
        if contract["name"] not in bullets:
            drift.append(f"no bullet quotes the contract {contract['name']!r}")
            continue
        kind, text = bullets[contract["name"]]
        if kind != contract["type"]:
            drift.append(f"{contract['name']!r} is a {contract['type']} contract, the doc says {kind}")
        listed = [*contract.get("layers", []), *contract.get("modules", []),
                  *contract.get("source_modules", []), *contract.get("forbidden_modules", [])]
        for module in (part.strip() for entry in listed for part in entry.split("|")):
            if f"`{module}`" not in text and f"`{module.removeprefix('egressd.')}`" not in text:
                drift.append(f"{contract['name']!r}'s bullet does not name {module}")
    names = {contract["name"] for contract in _contracts()}
    drift += [f"the bullet {name!r} quotes no contract in pyproject.toml" for name in bullets if name not in names]
    assert not drift, "\n".join(drift)
