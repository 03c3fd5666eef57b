#!/opt/blink/bin/python
"""blink-health SERVICE: exit 0 when the service in this container says it serves, else 1 with the reason.

engine: the ring says READY and its beat counter moves; gateway: its own ready marker (it is linked to
the other services) and GET /health answers 200 (while two gateways share the port, the answer may
come from the other one: the marker is this container's); tokenizer, reader, tracker: the ready
marker in the run dir names a live process of this container.
``blink-health --ring-state`` prints the ring's busy slots and KV blocks as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path


def engine_problem(ring_name: str) -> str | None:
    from shared.ring import attach_shm_ring
    from shared.transport import RingError

    try:
        ring = attach_shm_ring(ring_name)
    except (RingError, ValueError) as exc:
        return str(exc)
    try:
        from shared import ring_layout as L

        if ring.header_load32("engine_state") != L.EngineState.READY:
            return "the ring is not READY"
        from shared.env import env

        wait_s = env().heartbeat_timeout_s  # BLINK_HEARTBEAT_TIMEOUT_S, as every service reads it
        return None if ring.wait_for_beat(wait_s) else f"the engine's beat counter did not move in {wait_s:g} s"
    finally:
        ring.close()


def gateway_problem(port: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as resp:
            return None if resp.status == 200 else f"/health answered {resp.status}"
    except OSError as exc:
        return f"/health: {exc}"


def gateway_name() -> str:
    """The gateway's name as the entrypoint gives it (distinct per container: its PID namespace)."""
    return os.environ.get("BLINK_GATEWAY_NAME") or f"gateway-{os.stat('/proc/self/ns/pid').st_ino}"


def marker_problem(run_dir: Path, name: str) -> str | None:
    marker = run_dir / f"{name}.ready"
    try:
        pid = int(marker.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError) as exc:
        return f"{marker}: {exc}"
    return None


def ring_state(ring_name: str) -> dict:
    """``blink-health --ring-state``: the slots not EMPTY and the engine's KV and queue counts (the
    rolling upgrade reads them at rest)."""
    from shared import ring_layout as L
    from shared.ring import attach_shm_ring

    ring = attach_shm_ring(ring_name)
    try:
        stats = ring.read_header()["stats"]
        busy = int((ring.read_slots()["state"] != L.SlotState.EMPTY).sum())
        return {"busy_slots": busy, "kv_blocks_free": int(stats["kv_blocks_free"]),
                "kv_blocks_total": int(stats["kv_blocks_total"]), "running": int(stats["running"]),
                "waiting": int(stats["waiting"])}
    finally:
        ring.close()


def main(argv: list[str]) -> int:
    service = argv[0] if argv else ""
    if service == "--ring-state":
        print(json.dumps(ring_state(os.environ.get("BLINK_RING", "blink-ring"))))
        return 0
    run_dir = Path(os.environ.get("BLINK_RUN_DIR", "/run/blink"))
    if service == "engine":
        problem = engine_problem(os.environ.get("BLINK_RING", "blink-ring"))
    elif service == "gateway":
        problem = (marker_problem(run_dir, gateway_name())
                   or gateway_problem(os.environ.get("BLINK_PORT", "8000")))
    elif service in ("tokenizer", "reader", "tracker"):
        problem = marker_problem(run_dir, service)
    else:
        problem = f"unknown service {service!r}"
    if problem:
        print(f"{service}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
