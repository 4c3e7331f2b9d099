"""Write egressd's man page and shell completions from its own argument parser, so that they cannot drift:

    .venv/bin/python scripts/manpage.py            # writes docs/egressd.1, deploy/completions/{egressd.bash,_egressd}
    .venv/bin/python scripts/manpage.py --check    # exit 1 when a file is not what the parser gives (the tests run it)

argparse-manpage makes the page and shtab the completions (both in the test extra: generating is a
maintainer's step, egressd itself needs neither). Install: `man -l docs/egressd.1`, or copy it to
/usr/local/share/man/man1/; `source deploy/completions/egressd.bash`, or copy it to
/etc/bash_completion.d/egressd; `_egressd` goes into a directory on zsh's `fpath`.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version
from pathlib import Path

import shtab
from build_manpages.manpage import Manpage

from egressd.cli.main import build_parser

REPO = Path(__file__).resolve().parent.parent


def generated() -> dict[Path, str]:
    """Each file and the text the parser gives for it."""
    parser = build_parser()
    page = Manpage(parser, _data={
        "date": f"egressd {version('egressd')}",  # not today's date: the same parser gives the same page
        "project_name": "egressd",
        "manual_title": "egressd manual",
        "description": "egress control for AI-agent sandboxes",
        "url": "README.md in egressd's repository",
    })  # fmt: skip
    return {
        REPO / "docs" / "egressd.1": str(page),
        REPO / "deploy" / "completions" / "egressd.bash": shtab.complete(parser, shell="bash"),
        REPO / "deploy" / "completions" / "_egressd": shtab.complete(parser, shell="zsh"),
    }


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--check", action="store_true", help="say which file is stale instead of writing")
    args = options.parse_args()
    stale = []
    for path, text in generated().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(REPO))
        else:
            path.write_text(text)
    for path in stale:
        print(f"{path} is not what the parser gives: run .venv/bin/python scripts/manpage.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
