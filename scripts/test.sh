#!/usr/bin/env bash
# Install everything the tests need (system packages when root, the venv) and
# run the whole suite. CI runs exactly this through .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    need=()
    # chromium and its driver: the approvals page in a real browser (tests/integration/approvals/test_web.py);
    # systemd-analyze checks the systemd unit (tests/project/test_operator_files.py).
    for pkg_bin in bubblewrap:bwrap nftables:nft iproute2:ip curl:curl dnsutils:dig chromium:chromium \
                   chromium-driver:chromedriver systemd:systemd-analyze; do
        command -v "${pkg_bin#*:}" >/dev/null || need+=("${pkg_bin%%:*}")
    done
    # The system's pip: pip inside the sandbox downloads from an inspected package index
    # (tests/integration/sandbox/test_inspection_sandbox.py).
    /usr/bin/python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
    # PostgreSQL's server: the fleet tests start their own (initdb in a temporary directory, a unix
    # socket, no port) as the postgres user the package makes (tests/integration/fleet).
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
    # The Docker tests: debootstrap makes the images' base (docker/build.sh),
    # and the compose example needs a compose (the plugin or docker-compose).
    if command -v docker >/dev/null; then
        command -v debootstrap >/dev/null || need+=(debootstrap)
        if ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then
            need+=(docker-compose)
        fi
    fi
    if [ ${#need[@]} -gt 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi

bash scripts/install.sh --test
# A wheelhouse of what egressd needs to run (and pip, setuptools, wheel), downloaded once per
# set of dependencies: the packaging tests install egressd from it with no index, as `pip
# install .`, as a wheel and with pipx (tests/project/test_packaging.py), offline.
wheels=$(.venv/bin/python - <<'PY'
import hashlib, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = sorted(project["dependencies"] + project["optional-dependencies"]["speed"]) + ["pip", "setuptools>=77", "wheel"]
print("build/wheelhouse-" + hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16], *wanted, sep="\n")
PY
)
wheelhouse=$(head -1 <<<"$wheels")
if [ ! -f "$wheelhouse/.complete" ]; then
    mapfile -t wanted < <(tail -n +2 <<<"$wheels")
    .venv/bin/pip download --quiet --disable-pip-version-check --dest "$wheelhouse" "${wanted[@]}"
    touch "$wheelhouse/.complete"
fi
export EGRESSD_TEST_WHEELHOUSE=$PWD/$wheelhouse
.venv/bin/lint-imports --no-cache
.venv/bin/ruff check .
bash scripts/typecheck.sh
# egressd's images, built offline and cached (a second run rebuilds only what changed).
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    bash docker/build.sh
else
    echo "test.sh: no Docker Engine answers here: the Docker tests will say so" >&2
fi
# Every pass runs whatever the others say (a failure in one must not hide
# another's); the script fails if any did.
status=0
failed() { local rc=$1; [ "$status" -ne 0 ] || status=$rc; }
beside_log=$(mktemp)
trap 'rm -f "$beside_log"' EXIT
# A pass in the background, its output kept for after the foreground pass's (two pytest
# processes share the machine: each takes a loopback /24 of its own, tests/harness.py, and
# the sandbox tests spend most of their time waiting on bubblewrap and Docker).
beside() { "$@" >"$beside_log" 2>&1; }
shown_beside() {
    local rc=0
    wait "$1" || rc=$?
    echo "test.sh: the pass run beside it: $2 (exit $rc)" >&2
    cat "$beside_log"
    [ "$rc" -eq 0 ] || failed "$rc"
}
if [ $# -gt 0 ]; then
    .venv/bin/python -m pytest -q -p no:cacheprovider "$@" || failed $?
else
    beside .venv/bin/python -m pytest -q -p no:cacheprovider tests/integration/sandbox tests/conformance &
    sandboxes=$!
    .venv/bin/python -m pytest -q -p no:cacheprovider --ignore=tests/integration/sandbox \
        --ignore=tests/conformance || failed $?
    shown_beside "$sandboxes" "tests/integration/sandbox and tests/conformance"
    # The audit log's tests once more on the Python audit line (the first passes write with the
    # compiled one, which CI builds): the fallback a machine without cargo gets is tested too.
    beside env EGRESSD_NATIVE=0 .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_audit_*.py \
        tests/integration/audit tests/integration/proxy/test_write_ahead.py &
    python_line=$!
    # The proxy's tests once more on uvloop, the loop `egressd serve` runs on
    # (the two loops' transports buffer, pause and call back differently).
    proxy=tests/integration/proxy
    EGRESSD_TEST_LOOP=uvloop .venv/bin/python -m pytest -q -p no:cacheprovider \
        "$proxy"/test_{proxy,transparent,attacks,control,dnsserver,own_addresses,policy_edges,ech}.py \
        "$proxy"/test_{body_idle,run_tokens,write_ahead,faults,flood_attacks,abandoned,precision,socks,learn,live_policy,resolver}.py \
        "$proxy"/test_{inspection,inspection_ways,tlslayer,upload_budget,websocket,splice}.py \
        tests/integration/approvals/test_approvals_e2e.py tests/unit/test_exchange.py || failed $?
    shown_beside "$python_line" "the audit tests on the Python audit line"
fi
if [ "$status" -ne 0 ]; then
    echo "test.sh: a test pass failed (exit $status); every pass ran, see above" >&2
fi
exit "$status"
