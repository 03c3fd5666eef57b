"""Run a whole Blink stack (``blink serve``) as real processes for frontend tests.

The engine is ``tests.helpers.fake_engine`` until the lead switches these tests to the real
one (``engine_module`` below).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from shared.transport import SHM_DIR

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
FAKE_ENGINE = "tests.helpers.fake_engine"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Stack:
    proc: subprocess.Popen
    port: int
    ring: str
    run_dir: Path
    log_path: Path
    api_key: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, b""

    def metric(self, name: str) -> float:
        _, body = self.get("/metrics")
        for line in body.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def engine_pid(self) -> int:
        from shared.ring import attach_shm_ring

        ring = attach_shm_ring(self.ring)
        try:
            return ring.header_load32("engine_pid")
        finally:
            ring.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def start_stack(tmp: Path, *args: str, api_key: str | None = None, env: dict[str, str] | None = None,
                engine_module: str = FAKE_ENGINE, timeout_s: float = 90.0) -> Stack:
    port, ring, run_dir = free_port(), f"blink-test-{uuid.uuid4().hex[:10]}", tmp / "run"
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--port", str(port), "--ring", ring, "--run-dir",
           str(run_dir), "--engine-module", engine_module, "--drain-timeout", "2", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    log_path = tmp / "serve.log"
    full_env = {**os.environ, "BLINK_LOG_JSON": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    stack = Stack(proc, port, ring, run_dir, log_path, api_key)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"blink serve exited with {proc.returncode}:\n{stack.log()}")
        if b'"event": "ready"' in log_path.read_bytes():
            return stack
        time.sleep(0.1)
    stop_stack(stack)
    raise RuntimeError(f"blink serve not ready after {timeout_s} s:\n{stack.log()}")


def stop_stack(stack: Stack, timeout_s: float = 60.0) -> int:
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGTERM)
    try:
        return stack.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stack.proc.kill()
        return stack.proc.wait()


def processes_of(stack: Stack) -> list[int]:
    """Pids of processes still running with this stack's ring or run dir on their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stack.ring in cmdline or str(stack.run_dir) in cmdline:
            found.append(int(entry.name))
    return found


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
