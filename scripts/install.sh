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
#
# Where cargo (Rust) is, it also builds egressd's compiled audit line (native/,
# the egressd-native package); without it egressd writes the same lines in Python
# (`egressd doctor` says which). EGRESSD_NATIVE=0 skips the build.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="speed"
link=0
for arg in "$@"; do
    case "$arg" in
        --test) extras="speed,fleet,test" ;;
        --link) link=1 ;;
        -h|--help) sed -n '2,15s/^# \{0,1\}//p' "$0"; exit 0 ;;
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
# The compiled audit line: built again only when its sources change (a stamp in the venv names them).
if [ "${EGRESSD_NATIVE:-}" = 0 ]; then
    echo "install.sh: EGRESSD_NATIVE=0: the compiled audit line is not built; egressd writes its lines in Python"
elif command -v cargo >/dev/null || [ -x "$HOME/.cargo/bin/cargo" ]; then
    command -v cargo >/dev/null || PATH=$HOME/.cargo/bin:$PATH  # rustup's, outside a login shell's PATH
    stamp=.venv/egressd-native-$(cat native/Cargo.toml native/Cargo.lock native/pyproject.toml native/src/*.rs \
        | sha256sum | cut -c1-16)
    if [ ! -f "$stamp" ] || ! .venv/bin/python -c 'import egressd_native' 2>/dev/null; then
        if .venv/bin/pip install --quiet ./native; then
            rm -f .venv/egressd-native-*
            touch "$stamp"
        else
            echo "install.sh: the compiled audit line did not build (above); egressd writes its lines in Python" >&2
            .venv/bin/pip uninstall --quiet --yes egressd-native 2>/dev/null || true
        fi
    fi
else
    echo "install.sh: no cargo here: egressd writes its audit lines in Python (install Rust to compile them)"
fi
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
