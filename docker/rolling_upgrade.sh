#!/bin/sh
# Rolling upgrade of the containerised services under load (on demand; needs dockerd and built images):
#   docker/rolling_upgrade.sh [PREVIOUS_REV]
# Builds blink-frontend:next from HEAD and blink-frontend:prev from PREVIOUS_REV (default: the last
# commit of the previous schema minor), starts the load (docker/loadgen.py, from the host), replaces
# the gateway with :next, the tokenizer, tracker and reader with :prev one at a time (each waits for
# the new container's health check), restarts the engine, stops the load and prints its counts.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
COMPOSE="docker-compose -f $HERE/compose.yaml -p blink"
PY=${PYTHON:-python3}
PREV=${1:-$(git -C "$HERE/.." log --format=%H -S"SCHEMA_MINOR = 1" -- shared/ring_layout.py | tail -n1)^}
STEADY_S=${STEADY_S:-5}

healthy() {  # container of service $1 reports healthy
  id=$($COMPOSE ps -q "$1")
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$id" 2>/dev/null)" = healthy ]
}
wait_healthy() {
  i=0
  until healthy "$1"; do i=$((i + 1)); [ $i -lt 300 ] || { echo "$1 not healthy" >&2; exit 1; }; sleep 1; done
}
replace() {  # replace() SERVICE TAG: recreate that one container from blink-frontend:TAG
  var=$(echo "BLINK_$1_TAG" | tr a-z A-Z)
  echo "$(date +%T) replacing $1 with blink-frontend:$2"
  env "$var=$2" $COMPOSE up -d --no-deps --force-recreate "$1"
  wait_healthy "$1"
  echo "$(date +%T) $1 healthy: $(docker exec "$($COMPOSE ps -q "$1")" cat /etc/blink-build)"
  sleep "$STEADY_S"
}

"$HERE/build.sh" --tag next frontend
"$HERE/build.sh" --commit "$PREV" --tag prev frontend
$COMPOSE up -d
for s in engine tokenizer reader tracker gateway; do wait_healthy "$s"; done
$PY "$HERE/loadgen.py" --seconds 900 > /tmp/blink-rolling-load.json &
LOAD=$!
sleep "$STEADY_S"
replace gateway next
export BLINK_GATEWAY_TAG=next
replace tokenizer prev; export BLINK_TOKENIZER_TAG=prev
replace tracker prev; export BLINK_TRACKER_TAG=prev
replace reader prev; export BLINK_READER_TAG=prev
echo "$(date +%T) restarting the engine"
$COMPOSE restart engine
wait_healthy engine
sleep "$STEADY_S"
kill -TERM "$LOAD"; wait "$LOAD" || true
echo "load: $(cat /tmp/blink-rolling-load.json)"
