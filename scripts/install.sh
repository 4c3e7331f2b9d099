#!/usr/bin/env bash
# Set up egressd on a fresh machine: a venv of its own in .venv with egressd
# and what it needs to run, nothing more. Safe to run again; it only adds
# what is missing.
#
#   bash scripts/install.sh           egressd in .venv (.venv/bin/egressd)
#   bash scripts/install.sh --test    and the test tools (scripts/test.sh does this)
#   bash scripts/install.sh --link    and a link /usr/local/bin/egressd -> .venv/bin/egressd,
#                                     so that `sudo egressd ...` finds it (sudo's secure_path
#                                     has /usr/local/bin; needs root: sudo bash scripts/install.sh --link;
#                                     EGRESSD_LINK_DIR names another directory)
set -euo pipefail
cd "$(dirname "$0")/.."

extras="speed"
link=0
for arg in "$@"; do
    case "$arg" in
        --test) extras="speed,test" ;;
        --link) link=1 ;;
        -h|--help) sed -n '2,11s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $arg (--test, --link, --help)" >&2; exit 2 ;;
    esac
done
link_dir=${EGRESSD_LINK_DIR:-/usr/local/bin}
if [ "$link" = 1 ] && ! [ -w "$link_dir" ]; then
    echo "install.sh: --link writes $link_dir/egressd: run it as root (sudo bash scripts/install.sh --link)" >&2
    exit 1
fi

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
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/pip install --quiet -e ".[$extras]"
if [ "$link" = 1 ]; then
    target=$(pwd)/.venv/bin/egressd
    if { [ -e "$link_dir/egressd" ] || [ -L "$link_dir/egressd" ]; } && [ "$(readlink "$link_dir/egressd")" != "$target" ]; then
        echo "install.sh: $link_dir/egressd exists and is not a link to $target: left as it is" >&2
        exit 1
    fi
    ln -sfn "$target" "$link_dir/egressd"
    echo "install.sh: $link_dir/egressd links to $target (sudo egressd finds it)"
fi
what="egressd is installed"
[ "$extras" = "speed" ] || what="egressd and its test tools are installed"
echo "install.sh: $what in .venv (run .venv/bin/egressd --help)"
