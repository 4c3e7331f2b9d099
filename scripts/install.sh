#!/usr/bin/env bash
# Set up egressd on a fresh machine: a venv of its own in .venv with the
# project and its test tools. Safe to run again; it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "install.sh: egressd needs Python 3.11 or newer ($python is older or missing)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/pip install --quiet --upgrade pip
# setuptools says "Editable installation." with a warning about folders named
# like the package, for any layout whose folders are not named as the packages
# they install (ours: proxy/ is egressd.proxy); nothing here can be shadowed
# that way (no folder egressd/), so it is not shown.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/pip install --quiet -e '.[speed,test]'
echo "install.sh: egressd is installed in .venv (run .venv/bin/egressd --help)"
