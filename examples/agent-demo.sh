#!/usr/bin/env bash
# egressd agent, end to end, with the scripted model of agent-demo.json.
#
# On a fresh machine (Debian/Ubuntu, as root) it installs what is missing:
# the sandbox's system tools (bubblewrap, nftables, iproute2, curl) and
# egressd in .venv. Then the "agent" computes a sum in the sandbox, tries to
# read your SSH key, to write /etc/x and to send its result to evil.example
# (the deny approver refuses it: nothing leaves the machine), writes
# report.txt, and gives its final answer. report.txt is copied out; the
# transcript and the audit log are kept beside it.
#
#   sudo bash examples/agent-demo.sh            # results in a fresh temporary directory
#   sudo DEMO_OUT=/tmp/demo bash examples/agent-demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "agent-demo.sh: run me as root (sudo): the sandbox needs network namespaces and nftables" >&2
    exit 1
fi
need=()
for pkg_bin in bubblewrap:bwrap nftables:nft iproute2:ip curl:curl util-linux:nsenter; do
    command -v "${pkg_bin#*:}" >/dev/null || need+=("${pkg_bin%%:*}")
done
if [ ${#need[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
        echo "agent-demo.sh: please install ${need[*]} (the sandbox needs them)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -x .venv/bin/egressd ] || bash scripts/install.sh

out=${DEMO_OUT:-$(mktemp -d /tmp/egressd-demo-XXXXXX)}
mkdir -p "$out"
echo "agent-demo.sh: running the scripted agent; results go to $out" >&2
set +e
.venv/bin/egressd agent \
    --model script:examples/agent-demo.json \
    --task "Compute the sum of 1..100 and write it to report.txt" \
    --approver deny \
    --timeout 60 --memory 512 --max-steps 10 \
    --copy-out report.txt --copy-out-dir "$out" \
    --transcript "$out/transcript.jsonl" \
    --audit-log "$out/audit.jsonl" >"$out/answer.txt"
status=$?
set -e

echo
echo "final answer (exit status $status):"
cat "$out/answer.txt"
echo
echo "steps (from $out/transcript.jsonl):"
.venv/bin/python - "$out/transcript.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    step = json.loads(line)
    if "step" in step:
        refused = ", ".join(f"{r['host']}:{r['port']} {r['reason']}" for r in step["egress_refusals"])
        print(f"  {step['step']}. $ {step['command'][:70]}")
        print(f"     exit {step['exit_code']}" + (f"; egress refused: {refused}" if refused else "")
              + (f"; {step['stderr'].strip().splitlines()[-1][:80]}" if step["stderr"].strip() else ""))
    else:
        print(f"  stop: {step['stop']}")
PY
echo
echo "copied out: $out/report.txt"
cat "$out/report.txt"
if [ -e /etc/x ]; then
    echo "agent-demo.sh: /etc/x exists on the host: this must never happen" >&2
    exit 1
fi
exit "$status"
