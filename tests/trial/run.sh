#!/usr/bin/env bash
# The user trial (make trial): attnstore at its defaults, driven through the official openai and
# anthropic clients on every endpoint, as a user would before a release (docs/testing.md).
#
#   tests/trial/run.sh <auto|float32> [trial.py args, e.g. --only 2,5]
#
# Settings: the repository's settings.json with only what a trial must change: free loopback ports, an
# L2 folder of its own under $TRIAL_DIR, `local_runner.dtype` (auto or float32), an upstream (the fake of
# fake_upstream.py, serving `gpt-fake`) and a second served name of the same weights whose chat template
# renders tools (tests/templates/chatml_tools.jinja). The server runs in the repository's root, so it
# shares var/models (the converted weights, the built kernels) with `make run` and the tests.
# Starts the fake upstream and `attnstore serve`, waits for /healthz, runs trial.py (one line per
# check, a summary, exit 1 on any failure), stops what it started. Logs: $TRIAL_DIR (var/trial).
# Environment: TRIAL_DIR, STARTUP_TIMEOUT (seconds to wait for /healthz, 1800: a first start converts
# the GGUF and may build the exact kernels).
set -u
MODE="${1:-}"
case "$MODE" in auto | float32) ;; *) echo "usage: $0 <auto|float32> [trial.py args...]" >&2; exit 2 ;; esac
shift
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY="$REPO/.venv/bin/python"
[ -x "$PY" ] || { echo "run.sh: $PY missing (make install-dev builds it)" >&2; exit 2; }
DIR=$(mkdir -p "${TRIAL_DIR:-$REPO/var/trial}" && cd "${TRIAL_DIR:-$REPO/var/trial}" && pwd)
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-1800}"
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
PORT=$(free_port)
FAKE_PORT=$(free_port)
BASE="http://127.0.0.1:$PORT"
UPSTREAM="http://127.0.0.1:$FAKE_PORT"
SETTINGS="$DIR/settings-$MODE.json"
SERVER_LOG="$DIR/server-$MODE.log"
FAKE_LOG="$DIR/fake-upstream-$MODE.log"
rm -rf "$DIR/kv-$MODE"
"$PY" - "$REPO" "$SETTINGS" "$MODE" "$PORT" "$UPSTREAM/v1" "$DIR/kv-$MODE" <<'PYEOF'
import json, sys
repo, out, mode, port, upstream, kv = sys.argv[1:]
s = json.load(open(f"{repo}/settings.json"))
s["attention_store"]["tiering"]["l2_disk"]["path"] = kv
s["llm_endpoint"]["base_url"] = upstream
runner = s["local_runner"]
runner["dtype"] = mode
runner["models"]["smollm2-tools"] = runner["models"]["smollm2-135m-instruct"]
runner["chat_templates"] = {"smollm2-tools": f"{repo}/tests/templates/chatml_tools.jinja"}
s["proxy"]["port"] = int(port)
json.dump(s, open(out, "w"), indent=2)
PYEOF

SERVER_PID=""
FAKE_PID=""
stop_pid() {  # stop_pid PID: SIGTERM, up to 30 s, then SIGKILL
  [ -n "$1" ] && kill -0 "$1" 2>/dev/null || return 0
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || { wait "$1" 2>/dev/null; return 0; }; sleep 0.5; done
  echo "run.sh: $1 did not stop in 30 s: SIGKILL" >&2
  kill -KILL "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}
trap 'stop_pid "$SERVER_PID"; stop_pid "$FAKE_PID"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# Any HTTP answer counts (attnstore's /healthz says 503 `starting` while its local serving starts: the
# trial's first check sends turns then, as a user's first try would).
answers() { "$PY" -c "
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=3)
except urllib.error.HTTPError:
    pass" "$1" 2>/dev/null; }
wait_for() {  # wait_for URL PID LOG NAME
  local started
  started=$(date +%s)
  until answers "$1"; do
    kill -0 "$2" 2>/dev/null || { echo "run.sh: $4 exited before $1 answered; its log:" >&2; tail -40 "$3" >&2; exit 2; }
    [ $(($(date +%s) - started)) -lt "$STARTUP_TIMEOUT" ] || { echo "run.sh: $4 not up in ${STARTUP_TIMEOUT}s" >&2; tail -40 "$3" >&2; exit 2; }
    sleep 0.5
  done
  echo "run.sh: $4 on ${1%/*} after $(($(date +%s) - started)) s (log $3)"
}

PYTHONPATH="$REPO" "$PY" "$REPO/tests/trial/fake_upstream.py" --port "$FAKE_PORT" >"$FAKE_LOG" 2>&1 &
FAKE_PID=$!
wait_for "$UPSTREAM/_trial/requests" "$FAKE_PID" "$FAKE_LOG" "the fake upstream"
(cd "$REPO" && exec "$REPO/.venv/bin/attnstore" serve --settings "$SETTINGS") >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!
wait_for "$BASE/healthz" "$SERVER_PID" "$SERVER_LOG" "attnstore ($MODE)"
PYTHONPATH="$REPO" "$PY" "$REPO/tests/trial/trial.py" --base "$BASE" --upstream "$UPSTREAM" --label "$MODE" --log "$SERVER_LOG" "$@"
rc=$?
echo "run.sh: trial.py exited $rc"
exit "$rc"
