"""Run a whole Blink stack (``blink serve``) as real processes for frontend tests.

The engine is ``tests.helpers.fake_engine`` unless ``engine_module`` names another (the real one is
``gpu_engine.serve``). No standby engine unless a test asks for one (``standby_engine=True``): on the CPU a
spare loads the weights on a core, beside the tests sharing the machine.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

from harness.serve_proc import MODEL, ServeProc, http_get
from helpers.procfs import processes
from shared.transport import SHM_DIR

__all__ = ["MODEL", "Stack", "processes_of", "segment_exists", "sse_events", "start_stack", "stop_stack"]
FAKE_ENGINE = "tests.helpers.fake_engine"


@dataclasses.dataclass
class Stack(ServeProc):
    """A ``blink serve`` of the tests: ``harness.serve_proc.ServeProc`` plus the API key it was given."""

    api_key: str | None = None
    ring: str = dataclasses.field(default_factory=lambda: f"blink-test-{uuid.uuid4().hex[:10]}")

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.url + path)

    def metric(self, name: str) -> float:
        return self.metrics()[name]

    def engine_pid(self) -> int:
        from shared.ring import attach_shm_ring

        ring = attach_shm_ring(self.ring)
        try:
            return ring.header_load32("engine_pid")
        finally:
            ring.close()

    def log(self) -> str:
        return self.log_tail()


def start_stack(tmp: Path, *args: str, api_key: str | None = None, env: dict[str, str] | None = None,
                engine_module: str = FAKE_ENGINE, timeout_s: float = 90.0, standby_engine: bool = False) -> Stack:
    flags = ("--drain-timeout", "2", *(() if standby_engine else ("--no-standby-engine",)), *args,
             *(("--api-key", api_key) if api_key else ()))
    stack = Stack(flags, tmp, env=env or {}, engine_module=engine_module, api_key=api_key)
    stack.start(timeout_s)
    return stack


def stop_stack(stack: Stack, timeout_s: float = 60.0) -> int:
    return stack.stop(timeout_s)


def processes_of(stack: Stack) -> list[int]:
    """Pids of processes still running with this stack's ring or run dir on their command line."""
    return [p.pid for p in processes() if stack.ring in p.cmdline or str(stack.run_dir) in p.cmdline]


def segment_exists(stack: Stack) -> bool:
    return (SHM_DIR / stack.ring).exists()


def sse_events(raw: bytes) -> list[dict | str]:
    """Split an SSE body into decoded JSON events; ``[DONE]`` stays a string."""
    out: list[dict | str] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
