#!/opt/blink/bin/python
"""blink-health SERVICE: exit 0 when the service in this container says it serves, else 1 with the reason.

engine: the ring says READY and its beat counter moves; gateway: GET /health answers 200; tokenizer,
reader, tracker: the ready marker in the run dir names a live process of this container.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

HEARTBEAT_TIMEOUT_S = 5.0


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
        return None if ring.wait_for_beat(HEARTBEAT_TIMEOUT_S) else "the engine's beat counter did not move"
    finally:
        ring.close()


def gateway_problem(port: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as resp:
            return None if resp.status == 200 else f"/health answered {resp.status}"
    except OSError as exc:
        return f"/health: {exc}"


def marker_problem(run_dir: Path, name: str) -> str | None:
    marker = run_dir / f"{name}.ready"
    try:
        pid = int(marker.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError) as exc:
        return f"{marker}: {exc}"
    return None


def main(argv: list[str]) -> int:
    service = argv[0] if argv else ""
    run_dir = Path(os.environ.get("BLINK_RUN_DIR", "/run/blink"))
    if service == "engine":
        problem = engine_problem(os.environ.get("BLINK_RING", "blink-ring"))
    elif service == "gateway":
        problem = gateway_problem(os.environ.get("BLINK_PORT", "8000"))
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
