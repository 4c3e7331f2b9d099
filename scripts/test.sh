#!/usr/bin/env bash
# Install everything the tests need (system packages when root, the venv) and
# run the whole suite. CI runs exactly this through .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    need=()
    for pkg_bin in bubblewrap:bwrap nftables:nft iproute2:ip curl:curl dnsutils:dig; do
        command -v "${pkg_bin#*:}" >/dev/null || need+=("${pkg_bin%%:*}")
    done
    if [ ${#need[@]} -gt 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi

bash scripts/install.sh
.venv/bin/lint-imports --no-cache
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
