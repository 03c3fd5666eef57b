"""Every environment variable Blink reads, typed, in one place; read once at start-up."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


def _bool(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Env:
    """Values from the environment. Names and meanings are listed in the README."""

    log_level: str = "info"            # BLINK_LOG_LEVEL
    log_json: bool | None = None       # BLINK_LOG_JSON (default: JSON when stderr is not a terminal)
    run_dir: Path = Path("/tmp/blink")  # BLINK_RUN_DIR: Unix sockets of the services
    ring_name: str = "blink-ring"      # BLINK_RING_NAME
    api_key: str | None = None         # BLINK_API_KEY (same as --api-key)
    heartbeat_timeout_s: float = 2.0   # BLINK_HEARTBEAT_TIMEOUT_S: engine considered down after this
    sched_yield_all: bool = False      # BLINK_SCHED_YIELD_ALL: the persistent scheduler leaves its SM every step
    sched_plain_claim: bool = False    # BLINK_SCHED_PLAIN_CLAIM: claim slots by a store, not a PCIe CAS
    sched_full_scan: bool = False      # BLINK_SCHED_FULL_SCAN: read every slot's state word at each doorbell

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> Env:
        e = os.environ if environ is None else environ
        try:
            return cls(
                log_level=e.get("BLINK_LOG_LEVEL", "info").lower(),
                log_json=None if e.get("BLINK_LOG_JSON") in (None, "") else _bool(e.get("BLINK_LOG_JSON"), False),
                run_dir=Path(e.get("BLINK_RUN_DIR", f"/tmp/blink-{os.geteuid()}")),
                ring_name=e.get("BLINK_RING_NAME", "blink-ring"),
                api_key=e.get("BLINK_API_KEY") or None,
                heartbeat_timeout_s=float(e.get("BLINK_HEARTBEAT_TIMEOUT_S", "2.0")),
                sched_yield_all=_bool(e.get("BLINK_SCHED_YIELD_ALL"), False),
                sched_plain_claim=_bool(e.get("BLINK_SCHED_PLAIN_CLAIM"), False),
                sched_full_scan=_bool(e.get("BLINK_SCHED_FULL_SCAN"), False),
            )
        except ValueError as exc:
            raise SystemExit(f"bad environment variable: {exc}") from None


_ENV: Env | None = None


def env() -> Env:
    """The process's environment, read on first use and frozen afterwards."""
    global _ENV
    if _ENV is None:
        _ENV = Env.from_environ()
    return _ENV
