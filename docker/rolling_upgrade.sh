#!/bin/sh
# Rolling upgrade of the containerised services under load (on demand; needs dockerd and the images of
# docker/build.sh):
#   docker/rolling_upgrade.sh [PREVIOUS_REV]
# Builds blink-frontend:next from HEAD and blink-frontend:prev from PREVIOUS_REV (default: the last
# commit of the previous schema minor, found in the history), brings the system up, then three rounds,
# each under its own steady streaming load (docker/loadgen.py, from the host) and each followed by a
# look at the ring at rest:
#   1. the gateway by :next (the new container beside the old on the shared port, then the old one
#      stopped: it drains), the tokenizer and the tracker by :prev (stopped, then started);
#   2. the reader by :next, then by :prev (each new one beside the old, then the old one stopped: it
#      hands its streams over);
#   3. the engine restarted.
# Prints each round's load, the ring at rest, and the report: requests, completed, failed by phase,
# the streams across each cut. Exits 1 when a failure the design does not allow happened or the ring
# did not come to rest. Files in BLINK_UPGRADE_OUT (default /var/tmp/blink-rolling).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-blink}  # the project, and its ring's name (compose.yaml)
COMPOSE="docker-compose -f $HERE/compose.yaml -p $COMPOSE_PROJECT_NAME"
PY=${PYTHON:-python3}
STEADY_S=${STEADY_S:-5}
OUT=${BLINK_UPGRADE_OUT:-/var/tmp/blink-rolling}
RESULTS=$OUT/results.jsonl PHASES=$OUT/phases.jsonl

minor_of() { git -C "$REPO" show "$1:shared/ring_layout.py" | sed -n 's/^SCHEMA_MINOR = //p'; }
MINOR=$(minor_of HEAD)
PREV=${1:-$(git -C "$REPO" log --format=%H -S"SCHEMA_MINOR = $MINOR" -- shared/ring_layout.py | tail -n1)^}
[ "$(minor_of "$PREV")" = $((MINOR - 1)) ] || {
  echo "rolling_upgrade.sh: $PREV is schema minor $(minor_of "$PREV"), not $((MINOR - 1))" >&2; exit 2; }

now() { date +%s.%N; }
ids() { $COMPOSE ps -q "$1"; }
wait_healthy() {  # wait_healthy CONTAINER_ID
  i=0
  until [ "$(docker inspect -f '{{.State.Health.Status}}' "$1" 2>/dev/null)" = healthy ]; do
    i=$((i + 1)); [ $i -lt 300 ] || { echo "container $1 not healthy after 300 s" >&2; exit 1; }; sleep 1
  done
}
phase() {  # phase NAME START END [CUT GONE]
  printf '{"name": "%s", "start": %s, "end": %s, "cut": %s, "gone": %s}\n' "$1" "$2" "$3" "${4:-0}" "${5:-0}" >> "$PHASES"
}
built() { docker exec "$1" cat /etc/blink-build; }

replace() {  # replace SERVICE TAG: stop the old container, start one from blink-frontend:TAG
  var=$(echo "BLINK_$1_TAG" | tr a-z A-Z); t0=$(now)
  echo "$(date +%T) replacing $1 by blink-frontend:$2 (stop, then start)"
  env "$var=$2" $COMPOSE up -d --no-deps --force-recreate "$1"
  new=$(ids "$1"); wait_healthy "$new"; phase "$1@$2" "$t0" "$(now)"
  echo "$(date +%T) $1 healthy: $(built "$new")"; export "$var=$2"; sleep "$STEADY_S"
}
replace_beside() {  # replace_beside SERVICE TAG: a container from blink-frontend:TAG beside the old, then the old stopped
  var=$(echo "BLINK_$1_TAG" | tr a-z A-Z); t0=$(now); old=$(ids "$1")
  echo "$(date +%T) replacing $1 by blink-frontend:$2 (the new one beside the old)"
  env "$var=$2" $COMPOSE up -d --no-deps --no-recreate --scale "$1=2" "$1"
  new=$(ids "$1" | grep -v "^$old\$"); wait_healthy "$new"
  cut=$(now); docker stop -t 30 "$old" > /dev/null; gone=$(now); docker rm "$old" > /dev/null
  phase "$1@$2" "$t0" "$(now)" "$cut" "$gone"
  echo "$(date +%T) $1 healthy: $(built "$new"); the old one stopped in $(awk "BEGIN { print $gone - $cut }") s"
  export "$var=$2"; sleep "$STEADY_S"
}
restart_engine() {
  t0=$(now); echo "$(date +%T) restarting the engine"
  $COMPOSE restart -t 30 engine; wait_healthy "$(ids engine)"; phase "engine@restart" "$t0" "$(now)"
  echo "$(date +%T) engine healthy"; sleep "$STEADY_S"
}
at_rest() {  # the ring once the load stopped: at rest as soon as it is, or as it is after 30 s
  i=0
  while :; do
    state=$(docker exec "$(ids engine)" blink-health --ring-state)
    echo "$state" | $PY -c 'import json, sys; s = json.load(sys.stdin)
sys.exit(not (s["busy_slots"] == 0 and s["running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] > 0))' && break
    i=$((i + 1)); [ $i -lt 60 ] || { echo "$1: not at rest: $state"; REST_OK=0; return; }; sleep 0.5
  done
  echo "$1: at rest: $state"
}
round() {  # round LABEL STEP...: the load runs while each step (a function call, quoted) runs in turn
  $PY "$HERE/loadgen.py" --seconds 900 --results "$RESULTS" > "$OUT/load-$1.json" &
  load=$!; sleep "$STEADY_S"; label=$1; shift
  for step in "$@"; do eval "$step"; done
  kill -TERM "$load"; wait "$load" || true; load=""
  echo "$(date +%T) load of round $label: $(cat "$OUT/load-$label.json")"; at_rest "$label"
}

mkdir -p "$OUT"; rm -f "$RESULTS" "$PHASES"; REST_OK=1 load=""
trap '[ -z "$load" ] || kill -TERM "$load" 2> /dev/null || :' EXIT
echo "$(date +%T) previous minor (1.$((MINOR - 1))): $(git -C "$REPO" rev-parse "$PREV")"
"$HERE/build.sh" --tag next frontend
"$HERE/build.sh" --commit "$PREV" --tag prev frontend
$COMPOSE up -d
for s in engine tokenizer reader tracker gateway; do wait_healthy "$(ids "$s")"; done
echo "$(date +%T) all healthy"
round gateway-tokenizer-tracker "replace_beside gateway next" "replace tokenizer prev" "replace tracker prev"
round reader "replace_beside reader next" "replace_beside reader prev"
round engine "restart_engine"
$PY "$HERE/loadgen.py" --results "$RESULTS" --report "$PHASES" && [ "$REST_OK" = 1 ]
