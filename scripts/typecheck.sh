#!/usr/bin/env bash
# mypy over the packages under the names they install as (egressd.proxy, ...).
# mypy finds modules on disk, not through setuptools' editable finder, so it
# reads them through a tree of links with the installed shape, under build/.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck/egressd
rm -rf build/typecheck
mkdir -p "$tree"
for package in $(.venv/bin/python -c 'import tomllib; t = tomllib.load(open("pyproject.toml", "rb")); print(*sorted({p.split(".")[1] for p in t["tool"]["setuptools"]["packages"]}))'); do
    ln -s "../../../$package" "$tree/$package"
done
MYPYPATH=build/typecheck exec .venv/bin/mypy "$@"
