"""The packages live in top-level folders and install as ``egressd.*``.

In a checkout those folders are also on ``sys.path``, so a bare ``import
proxy`` would load a second copy of a module beside ``egressd.proxy`` (two
classes of one name, two registries): no file may import a bare name. And
every package folder must be listed in pyproject.toml, or the wheel and the
image would be built without it.
"""

from __future__ import annotations

import ast
import subprocess
import tomllib

from tests import REPO

ROOT = REPO


def _packages() -> list[str]:
    """Every folder with an __init__.py under the packages pyproject maps, as a dotted name."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {name.split(".")[1] for name in config["packages"]}
    found = []
    for top in sorted(tops):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            found.append(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_every_package_folder_is_installed_as_egressd() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in _packages():
        assert f"egressd.{package}" in config["packages"], package
        assert config["package-dir"].get(f"egressd.{package}") == package.replace(".", "/"), package


def test_no_module_imports_a_bare_package_name() -> None:
    bare = {package.split(".")[0] for package in _packages()}
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    offenders = []
    for name in tracked.stdout.split():
        path = ROOT / name
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            offenders += [f"{name}:{node.lineno} imports {top}" for top in tops if top in bare]
    assert offenders == []


def test_the_image_copies_every_package_folder() -> None:
    """docker/Dockerfile copies the folders one by one: a package it misses breaks the image's build."""
    copied = {line.split()[1].strip("/") for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and not line.startswith("COPY --from")}
    tops = {package.split(".")[0] for package in _packages()}
    assert tops <= copied, sorted(tops - copied)


def test_the_image_build_takes_every_package_folder() -> None:
    """docker/build.sh makes the image's context from EGRESSD_FOLDERS: one missing there is missing in the image."""
    line = next(line for line in (ROOT / "docker" / "build.sh").read_text().splitlines()
                if line.startswith("EGRESSD_FOLDERS="))
    listed = set(line.split("=", 1)[1].strip('"').split())
    assert listed == {package.split(".")[0] for package in _packages()}, line
