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
# Over the limit today, each being split on another branch of issue 27; an entry
# is taken out when its split lands (the second test fails once it is under).
BEING_SPLIT = {
    "audit/records.py": "the records split",
}


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
    over = {path: lines for path, lines in _sizes().items() if lines > MAX_LINES and path not in BEING_SPLIT}
    assert not over, "over 700 lines: " + ", ".join(f"{path} ({lines})" for path, lines in sorted(over.items()))


def test_a_module_being_split_is_still_over_the_limit() -> None:
    sizes = _sizes()
    done = [path for path in BEING_SPLIT if sizes.get(path, 0) <= MAX_LINES]
    assert not done, f"no longer over {MAX_LINES} lines (or gone): take out of BEING_SPLIT: {done}"
