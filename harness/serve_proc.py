"""A ``blink serve`` run as a child process, observed from outside: readiness, gauges, resident memory.

Used by the soak tool (``bench/soak.py``) and the reliability tests. Everything is read the way an
operator would read it: HTTP (``/health``, ``/metrics``) and ``/proc`` (the supervisor's children).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

from shared import ring_layout as L
from shared.data_parallel import DataParallelConfig
from shared.ipc import run_dir_problem
from shared.ring import attach_shm_ring
from shared.transport import RingError

ROOT = Path(__file__).resolve().parents[1]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model's served name, its Hugging Face id
SERVICE_ROLES = ("tokenizer", "reader", "tracker")
GAUGES = ("blink:slots_in_use", "blink:num_requests_running", "blink:kv_cache_usage_perc")
GAUGE_NAMES = tuple(g.split(":")[1] for g in GAUGES)  # how gauges() names them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {name: value}; labels are dropped (one model per server)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        out[name_part.split("{", 1)[0]] = float(value)
    return out


def role_of(cmdline: list[str]) -> str:
    """engine, tokenizer, reader, tracker, gateway-N or the argv[2] of anything else."""
    if "-m" in cmdline and cmdline[cmdline.index("-m") + 1] != "blink.cli":
        return "engine"
    if "--name" in cmdline:
        return cmdline[cmdline.index("--name") + 1]
    return next((r for r in SERVICE_ROLES if r in cmdline), " ".join(cmdline[1:3]))


def ring_engine(ring_name: str) -> tuple[int, int] | None:
    """The engine a ring's header names and its state (``EngineState``); None while there is no such ring."""
    try:
        ring = attach_shm_ring(ring_name)
    except (RingError, ValueError):
        return None
    try:
        return ring.header_load32("engine_pid"), ring.header_load32("engine_state")
    finally:
        ring.close()


def ring_engine_pid(ring_name: str) -> int | None:
    """The engine a ring's header names; None while there is no such ring."""
    seen = ring_engine(ring_name)
    return None if seen is None else seen[0]


def new_ready_engine(ring_name: str, old: int) -> int | None:
    """The pid a ring names its engine, once that is READY and not ``old`` (a restart's)."""
    seen = ring_engine(ring_name)
    return seen[0] if seen is not None and seen[0] != old and seen[1] == L.EngineState.READY else None


def started_for(argv: list[str], dp: DataParallelConfig) -> str:
    """The supervisor's name of a cold-started engine, from the ``--ring`` on its command line."""
    ring = argv[argv.index("--ring") + 1] if "--ring" in argv[:-1] else None
    return dp.engine_name(dp.ring_names.index(ring)) if ring in dp.ring_names else "engine"


def children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads), from ``/proc``; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds per minute of wall time of some processes (by role) and of this process, from
    ``begin`` to ``end``; ``pids`` names the processes when ``begin`` runs."""

    def __init__(self, pids: Callable[[], dict[str, int]]) -> None:
        self._pids = pids
        self.pids: dict[str, int] = {}
        self.start: dict[str, float] = {}
        self.wall0 = self.own0 = 0.0

    def begin(self) -> None:
        self.pids = self._pids()
        self.start = {role: t for role, pid in self.pids.items() if (t := cpu_seconds(pid)) is not None}
        self.wall0, self.own0 = time.monotonic(), time.process_time()

    def end(self) -> tuple[dict[str, float], float]:
        """(per role, this process): CPU seconds per minute since ``begin``; a process gone meanwhile is left out."""
        wall = max(1e-6, time.monotonic() - self.wall0)
        per_min = {}
        for role, t0 in self.start.items():
            t1 = cpu_seconds(self.pids[role])
            if t1 is not None:
                per_min[role] = round((t1 - t0) / wall * 60, 3)
        return per_min, round((time.process_time() - self.own0) / wall * 60, 3)


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo``, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclasses.dataclass
class ServeProc:
    """One ``blink serve``; ``start`` returns once it logged ``ready``."""

    args: tuple[str, ...]
    run_root: Path
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    engine_module: str = "gpu_engine.serve"
    port: int = dataclasses.field(default_factory=free_port)
    ring: str = dataclasses.field(default_factory=lambda: f"blink-soak-{uuid.uuid4().hex[:10]}")
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def run_dir(self) -> Path:
        """``RUN_ROOT/run``, or a short folder in /tmp where that is too long for the services' sockets."""
        natural = self.run_root / "run"
        return natural if run_dir_problem(natural) is None else Path("/tmp") / f"blink-run-{self.ring}"

    @property
    def log_path(self) -> Path:
        return self.run_root / "serve.log"

    def start(self, timeout_s: float = 300.0) -> ServeProc:
        """Start ``blink serve`` and return once it is ready and, unless ``--no-standby-engine``, its standby
        engine is too: a spare still loading its weights takes a core, and measurements taken meanwhile (the
        soak's saturation steps) would see a slower server than the one that runs afterwards."""
        self.run_root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "blink.cli", "serve", "--port", str(self.port), "--ring", self.ring,
               "--run-dir", str(self.run_dir), "--engine-module", self.engine_module, *self.args]
        env = {**os.environ, "BLINK_LOG_JSON": "1", **self.env}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"blink serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            text = self.log_path.read_bytes()
            if b'"event": "standby engine given up' in text:
                self.stop()
                raise RuntimeError(f"blink serve gave its standby engine up:\n{self.log_tail()}")
            if b'"event": "ready"' in text and ("--no-standby-engine" in self.args
                                                 or b'"event": "standby engine ready"' in text):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"blink serve not ready after {timeout_s} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if not self.run_dir.is_relative_to(self.run_root):  # the /tmp fallback: gone once emptied by the server
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()
        return code

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        status, body = http_get(self.url + "/metrics")
        return parse_metrics(body.decode()) if status == 200 else {}

    def gauges(self) -> dict[str, float | None]:
        """The slot, running-request and KV gauges by short name (None where /metrics lacks one)."""
        m = self.metrics()
        return {name: m.get(g) for name, g in zip(GAUGE_NAMES, GAUGES, strict=True)}

    def wait_gauges(self, target: dict[str, float | None], timeout_s: float) -> dict[str, float | None]:
        """Poll the gauges until those named in ``target`` equal it, at most ``timeout_s``; the last reading."""
        end = time.monotonic() + timeout_s
        while True:
            now = self.gauges()
            if all(now.get(k) == v for k, v in target.items()) or time.monotonic() > end:
                return now
            time.sleep(0.2)

    def pids(self) -> dict[str, int]:
        """{role: pid} of the supervisor and its children now."""
        assert self.proc is not None
        return {"supervisor": self.proc.pid, **self.children()}

    @property
    def data_parallel(self) -> DataParallelConfig:
        """The engines' number (``--data-parallel-size`` in ``args``) and rings."""
        ap = argparse.ArgumentParser(add_help=False)
        ap.add_argument("--data-parallel-size", "-dp", type=int, default=1)
        return DataParallelConfig(ap.parse_known_args(list(self.args))[0].data_parallel_size, self.ring)

    def children(self) -> dict[str, int]:
        """{role: pid} of the supervisor's children now. An engine has the supervisor's name for it (``engine``,
        ``engine-I`` with several): that of the ring whose header names it (a spare that took over keeps
        ``--standby`` on its command line), else that of the ring it was started for. A spare is
        ``standby-engine`` until a ring names it, so also from its go until it has created its ring."""
        assert self.proc is not None
        dp = self.data_parallel
        serving = {pid: dp.engine_name(i) for i, ring in enumerate(dp.ring_names)
                   if (pid := ring_engine_pid(ring)) is not None}
        out = {}
        for pid in children_of(self.proc.pid):
            try:
                argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
            except OSError:
                continue
            role = role_of(argv)
            if role == "engine":
                role = serving.get(pid) or ("standby-engine" if "--standby" in argv else started_for(argv, dp))
            out[role] = pid
        return out

    def rss(self, pids: dict[str, int] | None = None) -> dict[str, int]:
        """{role: VmRSS in KiB} of ``pids`` (default: the supervisor and its children now)."""
        pids = self.pids() if pids is None else pids
        return {role: kib for role, pid in pids.items() if (kib := rss_kib(pid)) is not None}
