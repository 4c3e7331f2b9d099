#!/usr/bin/env bash
# Learn, then lock: egressd's allowlist workflow end to end, on loopback only.
#
#   1. learn:   egressd serve --learn lets a job reach what it needs and
#               records each such connection as "learned"
#   2. suggest: egressd audit suggest turns that into an allow file
#   3. lock:    egressd serve --allow-file allows what the job used and holds
#               anything new for a person; here the answer is given with
#               `egressd allow ID --scope always`, which appends the host to
#               the allow file as an [[approved]] table
#   4. reload:  the allow file is edited and `kill -HUP` applies it to the
#               running egressd (a policy.reloaded audit record)
#
# The "job" is curl, and the destinations are two small HTTP servers on
# 127.0.0.1 named pkgs.test and docs.test (a small DNS server on 127.0.0.1
# answers those names; egressd asks it with --upstream-dns, and may dial
# 127.0.0.1 for them with --allow-private). Every port comes from the kernel;
# everything the script starts is stopped, and its temporary directory
# removed, when it ends.
# Needs curl and python3; no root, no network.
#
#   bash examples/learn-then-lock.sh
#   EGRESSD=/path/to/egressd bash examples/learn-then-lock.sh
#
# Prose for a real project: examples/learn-then-lock.md.
set -euo pipefail
cd "$(dirname "$0")/.."

EGRESSD=${EGRESSD:-$PWD/.venv/bin/egressd}
PY=${PYTHON:-python3}
WAIT_S=20 # the longest any step waits for something to happen

fail() {
    echo "learn-then-lock.sh: FAILED: $*" >&2
    exit 1
}
[ -x "$EGRESSD" ] || fail "no egressd at $EGRESSD (run: bash scripts/install.sh, or set EGRESSD)"
command -v curl >/dev/null || fail "curl is needed"
command -v "$PY" >/dev/null || fail "python3 is needed (or set PYTHON)"

# Only this script's settings: no config file, token or proxy from the environment.
while read -r name; do
    case $name in EGRESSD_*) unset "$name" ;; esac
done < <(compgen -e)
unset http_proxy HTTP_PROXY https_proxy HTTPS_PROXY all_proxy ALL_PROXY no_proxy NO_PROXY

DIR=$(mktemp -d "${TMPDIR:-/tmp}/egressd-learn-then-lock-XXXXXX")
export XDG_STATE_HOME=$DIR/state # where egressd writes its control token (and `egressd pending` reads it)
PIDS=()
cleanup() {
    local pid n
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || continue
        for ((n = 0; n < 50; n++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    if [ -n "${KEEP_DIR:-}" ]; then echo "learn-then-lock.sh: kept $DIR" >&2; else rm -rf "$DIR"; fi
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }
say() { printf '   %s\n' "$*"; }
# Print a command as a reader would type it: the temporary directory as $DIR, egressd by its name.
shown() {
    local text="$*"
    text=${text//"$DIR"/\$DIR}
    text=${text//"$EGRESSD"/egressd}
    printf '   $ %s\n' "$text"
}
run() {
    shown "$@"
    "$@"
}
indent() { sed 's/^/     /'; }
run_indented() { # a command, then its output indented beneath it
    shown "$@"
    "$@" | indent
}

# wait_for SECONDS DESCRIPTION COMMAND...: until COMMAND succeeds; fails the script after SECONDS.
wait_for() {
    local limit=$1 what=$2 end
    shift 2
    end=$((SECONDS + limit))
    while ((SECONDS <= end)); do
        "$@" && return 0
        sleep 0.1
    done
    fail "waited ${limit}s for $what"
}

# The small servers the walkthrough needs, each on 127.0.0.1 on a port from the kernel, printed first:
#   origin NAME  answers every GET with "hello from NAME"
#   hook         a webhook receiver: takes every POST with 202 ("I will answer later", so egressd keeps
#                the request held) and writes one line per event to its stderr
#   dns NAME...  a DNS server (UDP) answering A queries for these names with 127.0.0.1, AAAA with no
#                address, and anything else with NXDOMAIN: egressd's --upstream-dns
SERVER='
import http.server, json, socket, struct, sys
kind, names = sys.argv[1], sys.argv[2:]
if kind == "dns":
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    while True:
        query, client = sock.recvfrom(512)
        labels, at = [], 12
        while 0 < query[at] < 64:
            labels.append(query[at + 1 : at + 1 + query[at]].decode("ascii", "replace"))
            at += 1 + query[at]
        question = query[12 : at + 5]
        qtype = struct.unpack("!H", query[at + 1 : at + 3])[0]
        known = ".".join(labels).lower() in names
        answer = b""
        if known and qtype == 1:
            answer = struct.pack("!HHHIH", 0xC00C, 1, 1, 60, 4) + socket.inet_aton("127.0.0.1")
        flags = 0x8180 if known else 0x8183
        header = query[:2] + struct.pack("!HHHHH", flags, 1, 1 if answer else 0, 0, 0)
        sock.sendto(header + question + answer, client)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"hello from {names[0]}\n".encode()
        self.send_response(200 if kind == "origin" else 404)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        event = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        shown = {k: event[k] for k in ("type", "id", "host", "port", "decision", "channel", "by") if k in event}
        print(json.dumps(shown), file=sys.stderr, flush=True)
        self.send_response(202)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
'
has_port() { [ -s "$1" ]; }
start_server() { # KIND FILE-NAME [NAME...]: sets PORT
    local file=$2
    "$PY" -c "$SERVER" "$1" "${@:2}" >"$DIR/$file.port" 2>"$DIR/$file.log" &
    PIDS+=($!)
    wait_for "$WAIT_S" "the $file server to start" has_port "$DIR/$file.port"
    PORT=$(head -n1 "$DIR/$file.port")
}

# start_egressd NAME ARGS...: egressd serve on ports from the kernel, its stderr in $DIR/NAME.err;
# sets EGRESSD_PID, PROXY (HOST:PORT) and CONTROL (HOST:PORT) from its "serving:" line.
serving() {
    kill -0 "$EGRESSD_PID" 2>/dev/null || fail "egressd stopped at start: $(cat "$1")"
    grep -qs ' serving: ' "$1"
}
start_egressd() {
    local name=$1 line
    shift
    shown "$EGRESSD" serve --listen 127.0.0.1:0 --control 127.0.0.1:0 "$@" "&"
    "$EGRESSD" serve --listen 127.0.0.1:0 --control 127.0.0.1:0 "$@" 2>"$DIR/$name.err" &
    EGRESSD_PID=$!
    PIDS+=("$EGRESSD_PID")
    wait_for "$WAIT_S" "egressd to say it is serving" serving "$DIR/$name.err"
    line=$(grep ' serving: ' "$DIR/$name.err")
    PROXY=$(sed -n 's/.* serving: proxy \([0-9.]*:[0-9]*\),.*/\1/p' <<<"$line")
    CONTROL=$(sed -n 's/.*, control http:\/\/\([0-9.]*:[0-9]*\),.*/\1/p' <<<"$line")
    if [ -z "$PROXY" ] || [ -z "$CONTROL" ]; then fail "cannot read the ports from: $line"; fi
    say "egressd (pid $EGRESSD_PID) says:"
    grep -E ' serving: |LEARN MODE' "$DIR/$name.err" | indent
}
stopped() { ! kill -0 "$1" 2>/dev/null; }
forget() { # PID: it has been waited for; cleanup must not signal a pid that may be reused
    local kept=() pid
    for pid in "${PIDS[@]}"; do [ "$pid" = "$1" ] || kept+=("$pid"); done
    PIDS=("${kept[@]}")
}
stop_egressd() {
    shown kill -TERM "$EGRESSD_PID"
    kill -TERM "$EGRESSD_PID"
    wait_for "$WAIT_S" "egressd to stop" stopped "$EGRESSD_PID"
    wait "$EGRESSD_PID" || fail "egressd exited with status $? on SIGTERM"
    forget "$EGRESSD_PID"
}

# fetch URL: curl through egressd; sets STATUS (the HTTP status) and REASON (X-Egress-Reason, if any).
fetch() {
    shown curl -sS -x "http://$PROXY" "$1"
    STATUS=$(curl -sS --noproxy '' -m "$WAIT_S" -x "http://$PROXY" -D "$DIR/headers" -o "$DIR/body" \
        -w '%{http_code}' "$1") || fail "curl $1 through egressd failed"
    REASON=$(sed -n 's/^[Xx]-[Ee]gress-[Rr]eason: *\([^[:space:]]*\).*/\1/p' "$DIR/headers")
    say "-> HTTP $STATUS${REASON:+ (X-Egress-Reason: $REASON)}: $(head -n1 "$DIR/body" | cut -c1-100)"
}

# records LOG EVENT [KEY=VALUE...]: print the audit records of LOG with that event (and those values), one
# JSON object a line without the hash chain's "prev"; exit status 1 when there is none.
records() {
    "$PY" - "$@" <<'PY'
import json, sys
path, event, *wanted = sys.argv[1:]
want = dict(pair.split("=", 1) for pair in wanted)
found = 0
with open(path) as log:
    for line in log:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line while egressd writes
        if record.get("event") == event and all(str(record.get(k)) == v for k, v in want.items()):
            record.pop("prev", None)
            print(json.dumps(record))
            found += 1
sys.exit(0 if found else 1)
PY
}
has_record() { records "$@" >/dev/null; }

echo "egressd: learn, then lock (all on 127.0.0.1; files in $DIR)"
start_server origin pkgs pkgs.test
P1=$PORT
ONE=pkgs.test:$P1
start_server origin docs docs.test
P2=$PORT
TWO=docs.test:$P2
start_server dns dns pkgs.test docs.test
DNS=127.0.0.1:$PORT
start_server hook hook
HOOK=$PORT
say "origins: http://$ONE/ (what the job uses) and http://$TWO/ (what it will need later),"
say "both on 127.0.0.1: a DNS server at $DNS answers their names (egressd --upstream-dns $DNS);"
say "a webhook receiver at http://127.0.0.1:$HOOK/ takes every approval request with 202 (\"later\")"

# ------------------------------------------------------------------------------------------------
step "1. learn: run the job through egressd --learn"
start_egressd learn --learn --upstream-dns "$DNS" --allow-private 127.0.0.1/32 --audit-log "$DIR/learn.jsonl"
fetch "http://$ONE/"
[ "$STATUS" = 200 ] || fail "in learn mode $ONE should go through, got HTTP $STATUS ($REASON)"
stop_egressd
say "the audit log's egress record for it:"
records "$DIR/learn.jsonl" egress host=pkgs.test port="$P1" learned=not_allowlisted | indent ||
    fail "no egress record with learned=not_allowlisted for $ONE in $DIR/learn.jsonl"

# ------------------------------------------------------------------------------------------------
step "2. suggest: turn what the job did into an allow file"
shown "$EGRESSD" audit suggest "$DIR/learn.jsonl" ">" "$DIR/allow.toml"
"$EGRESSD" audit suggest "$DIR/learn.jsonl" >"$DIR/allow.toml" || fail "egressd audit suggest exited with $?"
run_indented cat "$DIR/allow.toml"
grep -qx "  \"$ONE\"," "$DIR/allow.toml" || fail "the suggestion does not allow $ONE"

# ------------------------------------------------------------------------------------------------
step "3. lock: only the allow file goes out; anything new is held for a person"
say "the webhook secret is passed in the environment (EGRESSD_WEBHOOK_SECRET), never on the command line"
EGRESSD_WEBHOOK_SECRET=whsec_$("$PY" -c 'import base64, os; print(base64.b64encode(os.urandom(32)).decode())')
export EGRESSD_WEBHOOK_SECRET
start_egressd lock --allow-file "$DIR/allow.toml" --upstream-dns "$DNS" --allow-private 127.0.0.1/32 --audit-log "$DIR/lock.jsonl" \
    --approver webhook --webhook-url "http://127.0.0.1:$HOOK/hook" --approval-timeout 60
fetch "http://$ONE/"
[ "$STATUS" = 200 ] || fail "$ONE is in the allow file but got HTTP $STATUS ($REASON)"
say "$ONE is allowed by the allow file."

say "the job now also wants $TWO (in the background: it is held)"
shown curl -sS -x "http://$PROXY" "http://$TWO/" "&"
curl -sS --noproxy '' -m 60 -x "http://$PROXY" -o "$DIR/held.body" -w '%{http_code}' \
    "http://$TWO/" >"$DIR/held.status" 2>"$DIR/held.err" &
CURL_PID=$!
PIDS+=("$CURL_PID")
pending_one() { "$EGRESSD" pending --control "$CONTROL" --json >"$DIR/pending.json" 2>/dev/null && grep -q '"a-' "$DIR/pending.json"; }
wait_for "$WAIT_S" "the request for $TWO to be pending" pending_one
wait_for "$WAIT_S" "the webhook receiver to get the request" grep -q approval.requested "$DIR/hook.log"
say "the webhook receiver got:"
head -n1 "$DIR/hook.log" | indent
run_indented "$EGRESSD" pending --control "$CONTROL"
ID=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[0]["id"])' "$DIR/pending.json") ||
    fail "cannot read the approval id from: $(cat "$DIR/pending.json")"
run_indented "$EGRESSD" allow "$ID" --scope always --by walkthrough --control "$CONTROL"
wait_for "$WAIT_S" "the held curl to finish" stopped "$CURL_PID"
wait "$CURL_PID" || fail "the held curl failed: $(cat "$DIR/held.err")"
forget "$CURL_PID"
[ "$(cat "$DIR/held.status")" = 200 ] || fail "the held request got HTTP $(cat "$DIR/held.status") after the allow"
say "-> the held curl finished: HTTP 200: $(tr -d '\n' <"$DIR/held.body")"
wait_for "$WAIT_S" "the webhook receiver to be told" grep -q approval.settled "$DIR/hook.log"
say "the webhook receiver was told:"
grep approval.settled "$DIR/hook.log" | indent
say "the audit log's approval.decided record:"
records "$DIR/lock.jsonl" approval.decided id="$ID" decision=allow scope=always | indent ||
    fail "no approval.decided record with scope always for $ID"
say "the allow file now:"
run_indented cat "$DIR/allow.toml"
grep -q '^\[\[approved\]\]' "$DIR/allow.toml" || fail "no [[approved]] table in the allow file"
grep -qx "entry = \"$TWO\"" "$DIR/allow.toml" || fail "the [[approved]] table is not for $TWO"

# ------------------------------------------------------------------------------------------------
step "4. reload: edit the allow file, then SIGHUP"
say "the job no longer uses pkgs.test, and nothing may reach it any more: move it from allow to deny"
"$PY" - "$DIR/allow.toml" "$ONE" pkgs.test <<'PY'
import sys
path, entry, host = sys.argv[1:]
text = open(path).read()
line = f'  "{entry}",\n'
if line not in text or "\nallow = [" not in text:
    sys.exit(f"{entry} is not in {path}")
# A top-level key goes before the first [[approved]] table: beside allow.
text = text.replace(line, "").replace("\nallow = [", f'\ndeny = ["{host}"]\nallow = [', 1)
with open(path, "w") as f:
    f.write(text)
PY
run_indented cat "$DIR/allow.toml"
run kill -HUP "$EGRESSD_PID"
wait_for "$WAIT_S" "a policy.reloaded record" has_record "$DIR/lock.jsonl" policy.reloaded
say "egressd says:"
grep -E 'policy reloaded|reload refused' "$DIR/lock.err" | indent || true
say "the audit log's policy.reloaded record:"
records "$DIR/lock.jsonl" policy.reloaded | indent
has_record "$DIR/lock.jsonl" policy.reloaded ok=True || fail "the reload was refused"
fetch "http://$ONE/"
[ "$STATUS" = 403 ] || fail "$ONE is denied now but got HTTP $STATUS"
fetch "http://$TWO/"
[ "$STATUS" = 200 ] || fail "$TWO was approved always but got HTTP $STATUS ($REASON)"
stop_egressd

# ------------------------------------------------------------------------------------------------
step "5. a fresh start: the approved entry is part of the policy"
start_egressd locked --allow-file "$DIR/allow.toml" --upstream-dns "$DNS" --allow-private 127.0.0.1/32 --audit-log "$DIR/lock.jsonl" \
    --no-ask
fetch "http://$TWO/"
[ "$STATUS" = 200 ] || fail "$TWO is in the allow file's [[approved]] but got HTTP $STATUS ($REASON)"
fetch "http://$ONE/"
[ "$STATUS" = 403 ] || fail "$ONE is denied by the allow file but got HTTP $STATUS"
stop_egressd

printf '\nlearn-then-lock.sh: walkthrough complete\n'
