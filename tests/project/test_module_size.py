"""No module of egressd is over 700 lines (issue 27): past that a module holds more than one room.

Every ``.py`` file under the folders pyproject.toml installs as ``egressd.*``
is counted (tests/, bench/ and scripts/ are not egressd). A module over the
limit is split along a seam, one responsibility per module, never cut
anywhere to pass.
"""

from __future__ import annotations

import tomllib

from tests import REPO

MAX_LINES = 700


def _sizes() -> dict[str, int]:
    """Lines of every module of egressd, by its path in the checkout."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {REPO / folder for folder in config["package-dir"].values()}
    return {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for folder in folders
        for path in folder.glob("*.py")
    }


def test_no_module_of_egressd_is_over_700_lines() -> None:
    over = {path: lines for path, lines in _sizes().items() if lines > MAX_LINES}
    assert not over, "over 700 lines: " + ", ".join(f"{path} ({lines})" for path, lines in sorted(over.items()))



def test_the_count_sees_every_module() -> None:
    sizes = _sizes()
    assert "proxy/core/conversation.py" in sizes and "proxy/core/http1/heads.py" in sizes
    assert all(lines > 0 for lines in sizes.values())
