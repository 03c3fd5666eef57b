#!/bin/sh
# blink-service SERVICE [FLAGS]: run one Blink service in the foreground as PID 1 of its container.
# A container that was killed leaves its ready marker in the shared run dir; it is removed before the
# service starts, so the health check only passes once this instance has marked itself ready.
set -eu
RUN_DIR=${BLINK_RUN_DIR:-/run/blink}
RING=${BLINK_RING:-blink-ring}
service=${1:?usage: blink-service engine|tokenizer|reader|tracker|gateway [FLAGS]}
shift
case "$service" in
  engine)
    exec blink engine --ring "$RING" "$@" ;;
  gateway)
    # Two gateways overlap while one replaces the other (same port, so --reuse-port: SO_REUSEPORT), each pid 1
    # of its own container: the default name, of its ready marker, is made distinct by the PID namespace.
    name=${BLINK_GATEWAY_NAME:-gateway-$(stat -L -c %i /proc/self/ns/pid)}
    rm -f "$RUN_DIR/$name.ready"
    exec blink gateway --run-dir "$RUN_DIR" --ring "$RING" --name "$name" --reuse-port "$@" ;;
  tokenizer|reader|tracker)
    rm -f "$RUN_DIR/$service.ready"
    exec blink "$service" --run-dir "$RUN_DIR" --ring "$RING" "$@" ;;
  *)
    echo "blink-service: unknown service '$service' (engine, tokenizer, reader, tracker, gateway)" >&2
    exit 2 ;;
esac
