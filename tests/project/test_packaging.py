"""The usual Python routes install egressd with what it needs to run and nothing more: `pip install .`
into a fresh venv, a wheel built from the checkout, and pipx, of the wheel and of `.` (issue 29).

Offline: every install takes its packages from the wheelhouse scripts/test.sh downloads
(``EGRESSD_TEST_WHEELHOUSE``) with no index, so a test can only pass on what the checkout declares.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.harness import copy_checkout, require

pytestmark = pytest.mark.timeout(300)

TEST_TOOLS = {"pytest", "mypy", "ruff", "selenium", "hypothesis", "atheris", "import-linter", "pipx"}


@pytest.fixture(scope="module")
def wheelhouse() -> Path:
    path = os.environ.get("EGRESSD_TEST_WHEELHOUSE")
    require(bool(path) and Path(path or "/").joinpath(".complete").exists(),
            "no wheelhouse: scripts/test.sh downloads one (EGRESSD_TEST_WHEELHOUSE)")  # fmt: skip
    return Path(path or "")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout, copied: a build must not write into the repository."""
    return copy_checkout(tmp_path_factory.mktemp("checkout") / "egressd")


def _offline(wheelhouse: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EGRESSD_", "PIP_", "VIRTUAL_ENV", "PYTHON"))}
    return env | {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                  "HOME": str(home)}  # fmt: skip


def _fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(where)
    return where / "bin"


def _run(args: list[str | Path], env: dict[str, str], cwd: Path | None = None) -> str:
    done = subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done.stdout


def _works_and_holds_no_test_tool(bin_dir: Path, egressd: Path, env: dict[str, str]) -> None:
    assert _run([egressd, "--version"], env).startswith("egressd ")
    # The approvals page's script and style are package data: the page needs them from an installed copy.
    page = "import importlib.resources as r; print(sorted(p.name for p in r.files('egressd.approvals')" \
           ".joinpath('web-static').iterdir()))"  # fmt: skip
    assert ".js" in _run([bin_dir / "python", "-c", page], env)
    frozen = _run([bin_dir / "python", "-m", "pip", "list", "--format=freeze"], env)
    installed = {line.split("==")[0].lower().replace("_", "-") for line in frozen.splitlines()}
    assert "egressd" in installed and "aiohttp" in installed, installed
    assert not installed & TEST_TOOLS, installed & TEST_TOOLS


def test_pip_install_dot_into_a_fresh_venv_gives_a_working_egressd_and_no_test_tool(
    wheelhouse: Path, checkout: Path, tmp_path: Path
) -> None:
    env = _offline(wheelhouse, tmp_path)
    bin_dir = _fresh_venv(tmp_path / "venv")
    _run([bin_dir / "pip", "install", "--quiet", str(checkout)], env)
    _works_and_holds_no_test_tool(bin_dir, bin_dir / "egressd", env)


def test_a_wheel_built_from_the_checkout_installs_with_pip_and_with_pipx(
    wheelhouse: Path, checkout: Path, tmp_path: Path
) -> None:
    env = _offline(wheelhouse, tmp_path)
    builder = _fresh_venv(tmp_path / "builder")
    _run([builder / "pip", "wheel", "--quiet", "--no-deps", "-w", tmp_path / "dist", str(checkout)], env)
    (wheel,) = (tmp_path / "dist").glob("egressd-*.whl")
    bin_dir = _fresh_venv(tmp_path / "venv")
    _run([bin_dir / "pip", "install", "--quiet", wheel], env)
    _works_and_holds_no_test_tool(bin_dir, bin_dir / "egressd", env)
    # pipx: its own venv, its own link on PATH; pipx itself is a test tool of ours (the test extra).
    pipx = Path(sys.executable).parent / "pipx"
    pipx_env = env | {"PIPX_HOME": str(tmp_path / "pipx"), "PIPX_BIN_DIR": str(tmp_path / "bin")}
    _run([pipx, "install", wheel], pipx_env)
    app = tmp_path / "pipx" / "venvs" / "egressd" / "bin"
    _works_and_holds_no_test_tool(app, tmp_path / "bin" / "egressd", pipx_env)


def test_pipx_install_dot_from_the_checkout(wheelhouse: Path, checkout: Path, tmp_path: Path) -> None:
    """The README's pipx route as a user types it, in the checkout: ``pipx install .``."""
    env = _offline(wheelhouse, tmp_path)
    pipx = Path(sys.executable).parent / "pipx"
    pipx_env = env | {"PIPX_HOME": str(tmp_path / "pipx"), "PIPX_BIN_DIR": str(tmp_path / "bin")}
    _run([pipx, "install", "."], pipx_env, cwd=checkout)
    app = tmp_path / "pipx" / "venvs" / "egressd" / "bin"
    _works_and_holds_no_test_tool(app, tmp_path / "bin" / "egressd", pipx_env)
