"""``blink serve``: start the engines and the frontend services, watch them, stop them cleanly.

Start order: engine (``python -m gpu_engine.serve``, never imported here), then tokenizer,
reader, tracker and the gateways, all at once without waiting, so the port answers (503 "the model
is loading") while the engine loads; the gateways share ``RUN_DIR/metrics`` for one ``/metrics``
view (``PROMETHEUS_MULTIPROC_DIR``, in their environment only). ``serve`` reports ready once the
ring says READY and every service has written its ready marker. A service that dies is restarted (with a limit per
minute); a dead engine's ring is first marked FAILED and removed, so streams on it end at
once. SIGINT/SIGTERM: gateways drain first, then the services stop, then the engine is asked
to stop through the ring's shutdown flag; stragglers are killed, and the shared-memory
segment, sockets and markers are removed, so nothing is left behind.

``--data-parallel-size N`` starts N engines (``engine-0`` ...), each on its own ring
(``shared/data_parallel.py`` names them) and, on a GPU, with ``CUDA_VISIBLE_DEVICES`` set to one
device; the frontend services are told N and serve every ring. An engine that dies is restarted on
its own (its ring retired first, so only its requests fail); the others are not touched. An engine
that restarts too often is left stopped while another still serves.

The standby engine (on unless ``--no-standby-engine``): a spare engine process (``--standby``, started
once every engine has been READY and idle for ``STANDBY_IDLE_S``, or ``STANDBY_DEADLINE_S`` after READY) that
has done what needs neither a ring nor a GPU and waits on its stdin, a pipe from here. When an engine dies, the
spare gets the go (``shared.standby``: that engine's ring and its GPU) and becomes it, so the restart skips the
interpreter, the imports and, on the CPU, the weights; a new spare starts the same way once the engines are
READY again. Without a live spare the restart is a cold start. A spare that dies, or cannot be started, is
logged and replaced (given up after ``RESTARTS_PER_MINUTE`` in a minute); it dies with the supervisor like
every child (PR_SET_PDEATHSIG, and its pipe closing ends its wait).

``--frontend-only`` starts the frontend set alone (tokenizer, reader, tracker, gateways) for a ring whose engine
runs apart: ``blink engine`` on this host, or on another host with ``--rdma-listen``, the ring then named
``rdma://HOST:PORT/NAME`` (docs/RDMA.md, the DPU split). No engine and no spare are started, watched or stopped,
and the ring is neither retired nor removed: the services follow it, and its engine's liveness, through their
ring watches; ``ready`` needs their markers only (the gateway answers 503 until the engine serves). Services that
die are restarted as usual.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import multiprocess

from blink.locks import Owner, ServerLocks, ServerRunning
from shared import ipc
from shared import ring_layout as L
from shared.config import EngineConfig
from shared.data_parallel import DataParallelConfig, engine_devices
from shared.env import HEARTBEAT_TIMEOUT_S, env
from shared.frontend_flags import GATEWAY, SERVE, GatewayFlags, TrackerFlags, from_namespace, to_argv
from shared.log import get_logger
from shared.remote_ring import is_remote, parse_ring_address
from shared.ring import Liveness, attach_shm_ring
from shared.runwait import RunQueueWait
from shared.standby import Go, send_go
from shared.token_dfa import remove_store
from shared.transport import RingError, ShmTransport

log = get_logger("supervisor")
RESTARTS_PER_MINUTE = 5
# A spare starts once every serving engine has been READY with no request running or waiting for STANDBY_IDLE_S:
# on the CPU it loads the weights on a core for about 6 s, which a restarted engine facing its backlog, or a
# first request, needs. STANDBY_DEADLINE_S after READY it starts whatever the load, so a busy server gets one.
STANDBY_IDLE_S = 2.0
# An engine process seen stopped by a signal (state T: SIGSTOP; not a debugger's stop, t) this long is hung. A
# busy host slows a process but never stops it, so this needs none of the heartbeat timeout's margin for load.
STOPPED_S = 2.0
STANDBY_DEADLINE_S = 60.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True, slots=True)
class ServeConfig:
    run_dir: Path
    ring: str                         # the rings' base name (the one ring's name for one engine)
    host: str
    port: int
    gateways: int
    engine_args: tuple[tuple[str, ...], ...]  # each engine's command line: EngineConfig.to_argv()
    frontend_args: tuple[str, ...]    # flags shared by gateway and tokenizer
    gateway_args: tuple[str, ...]
    tracker_args: tuple[str, ...]
    engine_module: str = "gpu_engine.serve"
    drain_timeout_s: float = GATEWAY.drain_timeout
    startup_timeout_s: float = SERVE.startup_timeout
    api_key: str | None = dataclasses.field(default=None, repr=False)  # to the gateways' environment only
    engine_env: tuple[dict[str, str], ...] = ()  # each engine's extra environment (its GPU); () for none
    service_nice: int = SERVE.service_nice  # every child's nice value (Child.nice)
    standby_engine: bool = SERVE.standby_engine  # keep a spare engine for restarts (--no-standby-engine: cold)
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S  # a READY engine silent this long is hung: killed, replaced
    frontend_only: bool = False  # no engine here (--frontend-only): engine_args is empty, the ring's engine runs apart

    def __post_init__(self) -> None:
        if self.gateways < 1:
            raise ValueError(f"--gateways must be >= 1, got {self.gateways}")
        if not -20 <= self.service_nice <= 19:
            raise ValueError(f"--service-nice must be within -20..19, got {self.service_nice}")
        if self.engine_env and len(self.engine_env) != len(self.engine_args):
            raise ValueError("one environment per engine")
        if self.frontend_only and (self.engine_args or self.standby_engine):
            raise ValueError("a frontend-only server starts no engine")

    @property
    def data_parallel(self) -> DataParallelConfig:
        return DataParallelConfig(1 if self.frontend_only else len(self.engine_args), self.ring)

    @property
    def lock_names(self) -> tuple[str, ...]:
        """The names this server locks its rings under: a remote ring's file name (rdma-HOST-PORT-NAME)."""
        if is_remote(self.ring):
            return (parse_ring_address(self.ring).file_name,)
        return tuple(dict.fromkeys((self.ring, *self.data_parallel.ring_names)))

    @classmethod
    def from_args(cls, a: argparse.Namespace, engine: EngineConfig, frontend_only: bool = False) -> ServeConfig:
        """From ``blink serve``'s arguments and the engine config parsed out of them (with ``frontend_only``, its
        ring and model only)."""
        front = ["--model", engine.model] if engine.model else []
        front += ["--tokenizer", a.tokenizer] if a.tokenizer else []
        dp = DataParallelConfig(a.data_parallel_size, engine.ring_name)
        engines = () if frontend_only else engine_argvs(engine, dp)
        return cls(a.run_dir, engine.ring_name, a.host, a.port, a.gateways, engines, tuple(front),
                   tuple(gateway_argv(a)), tuple(to_argv(from_namespace(TrackerFlags, a))), a.engine_module,
                   a.drain_timeout,
                   a.startup_timeout, a.api_key, () if frontend_only else engine_envs(engine, dp), a.service_nice,
                   a.standby_engine and not frontend_only, env().heartbeat_timeout_s, frontend_only)


def engine_argvs(engine: EngineConfig, dp: DataParallelConfig) -> tuple[tuple[str, ...], ...]:
    """Each engine's flags: its own ring; N CPU engines left to choose their threads share the cores."""
    threads = engine.threads
    if dp.size > 1 and engine.backend == "cpu" and not threads:
        threads = max(1, (len(os.sched_getaffinity(0)) - 1) // dp.size)
    return tuple(tuple(dataclasses.replace(engine, ring_name=name, threads=threads).to_argv())
                 for name in dp.ring_names)


def engine_envs(engine: EngineConfig, dp: DataParallelConfig) -> tuple[dict[str, str], ...]:
    """Each engine's GPU (``CUDA_VISIBLE_DEVICES``) when there are several engines and they may use one."""
    if dp.size == 1 or engine.backend == "cpu":
        return tuple({} for _ in range(dp.size))
    devices = engine_devices(dp.size, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return tuple({"CUDA_VISIBLE_DEVICES": d} for d in devices)


def gateway_argv(a: argparse.Namespace) -> list[str]:
    """The gateway flags of ``blink serve``'s arguments: ``GatewayFlags`` not at their default (one source for
    every default), with SO_REUSEPORT where several gateways share the port, and the model's names and template."""
    flags = from_namespace(GatewayFlags, a)
    if a.gateways > 1:  # the gateways of one server share the port; others are refused
        flags = dataclasses.replace(flags, reuse_port=True)
    argv = to_argv(flags)
    if a.served_model_name:
        argv += ["--served-model-name", *a.served_model_name]
    if a.chat_template is not None:
        argv += ["--chat-template", a.chat_template]
    return argv


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the supervisor dies, and leave the terminal's group."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    os.setpgid(0, 0)


def _before_exec(nice: int) -> Callable[[], None]:
    """The child's set-up before exec: ``_die_with_parent``, then its nice value (every thread it starts
    inherits it). A value it may not take (below 0 without CAP_SYS_NICE) is left for ``Child.spawn`` to
    report: an exception here would fail the spawn."""

    def run() -> None:
        _die_with_parent()
        if nice:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, nice)

    return run


@dataclasses.dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None = dataclasses.field(default=None, repr=False)  # None: this process's
    ring: str | None = None           # an engine's ring
    retired: bool = False             # an engine left stopped after too many restarts
    proc: subprocess.Popen | None = None
    starts: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=16))
    nice: int = 0  # --service-nice: below 0 keeps the child's share of the cores beside CPU-bound neighbours
    go_pipe: bool = False  # a spare engine: its stdin is a pipe from the supervisor, for the go
    beats: tuple[int, Liveness] | None = None  # an engine: its pid and what the supervisor saw of its counter
    stopped_since: float | None = None  # an engine: since when its process was seen stopped (SIGSTOP)
    killed_pid: int | None = None  # an engine: the process the hung check killed (not killed again while it goes)

    def spawn(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_before_exec(self.nice),
                                     stdin=subprocess.PIPE if self.go_pipe else subprocess.DEVNULL)
        self.starts.append(time.monotonic())
        log.info("started", child=self.name, pid=self.proc.pid)
        if self.nice:
            with contextlib.suppress(OSError):  # an exited child: its exit is handled where it is seen
                got = os.getpriority(os.PRIO_PROCESS, self.proc.pid)
                if got != self.nice:
                    log.warning("nice value not taken", child=self.name, wanted=self.nice, got=got,
                                why="below 0 needs CAP_SYS_NICE (root, or the capability granted to the container)")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def too_many_restarts(self) -> bool:
        now = time.monotonic()
        return sum(1 for t in self.starts if now - t < 60) > RESTARTS_PER_MINUTE

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)


@dataclasses.dataclass(slots=True)
class SpareClock:
    """When a spare may start (``STANDBY_IDLE_S``, ``STANDBY_DEADLINE_S``), from what each look at the engines saw."""

    ready_since: float | None = None  # every serving engine READY since then
    idle_since: float | None = None   # ... and idle since then

    def due(self, now: float, ready: bool, idle: bool) -> bool:
        """One look: ``ready``, every serving engine READY; ``idle``, none with a request running or waiting."""
        if not ready:
            self.ready_since = self.idle_since = None
            return False
        if self.ready_since is None:
            self.ready_since = now
        if not idle:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        idle_long = self.idle_since is not None and now - self.idle_since >= STANDBY_IDLE_S
        return idle_long or now - self.ready_since >= STANDBY_DEADLINE_S


class Supervisor:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.stopping = False
        py = [sys.executable, "-m", "blink.cli"]
        dp = cfg.data_parallel
        common = ["--run-dir", str(cfg.run_dir), "--ring", cfg.ring]
        common += ["--data-parallel-size", str(dp.size)] if dp.size > 1 else []  # one engine: the argv as before
        # The API key never goes on a command line (any local user reads /proc/PID/cmdline): the gateways
        # get it in BLINK_API_KEY, which only their own user can read; the other children do not get it.
        keyless = {k: v for k, v in os.environ.items() if k != "BLINK_API_KEY"}
        keyed = {**keyless, "BLINK_API_KEY": cfg.api_key} if cfg.api_key else keyless
        keyed = {**keyed, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}  # one /metrics over every gateway
        envs = cfg.engine_env or tuple({} for _ in cfg.engine_args)
        self.engines = [Child(dp.engine_name(i), [sys.executable, "-m", cfg.engine_module, *argv],
                              {**keyless, **envs[i]}, ring=name)
                        for i, (argv, name) in enumerate(zip(cfg.engine_args, dp.ring_names, strict=True))
                        ] if not cfg.frontend_only else []
        self.engine_envs = {e.name: envs[i] for i, e in enumerate(self.engines)}  # what a spare learns at the go
        # The spare takes the first engine's flags: the engines differ only in their ring and GPU, told at the go.
        # With one engine its GPU is known at the spare's start, which may then make its CUDA context early.
        known = ["--standby-gpu-known"] if len(self.engines) == 1 else []
        self.standby = Child("standby-engine", [sys.executable, "-m", cfg.engine_module, *cfg.engine_args[0],
                                                "--standby", *known], {**keyless, **envs[0]} if known else keyless,
                             go_pipe=True) if cfg.standby_engine else None
        self.spare_clock = SpareClock()
        self.locks = ServerLocks(cfg.run_dir, cfg.lock_names, cfg.port)
        self.services = [
            Child("tokenizer", [*py, "tokenizer", *common, *cfg.frontend_args], keyless),
            Child("reader", [*py, "reader", *common], keyless),
            Child("tracker", [*py, "tracker", *common, *cfg.tracker_args], keyless),
        ]
        self.gateways = [
            Child(f"gateway-{i}", [*py, "gateway", *common, *cfg.frontend_args, *cfg.gateway_args,
                                   "--name", f"gateway-{i}"], keyed)
            for i in range(cfg.gateways)
        ]
        for child in [*self.children, *self.spares]:
            child.nice = cfg.service_nice

    @property
    def metrics_dir(self) -> Path:
        """Where the gateways' metrics files go, emptied at each start (the counters start at zero)."""
        return self.cfg.run_dir / "metrics"

    def _fresh_metrics_dir(self) -> None:
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        self.metrics_dir.mkdir(mode=0o700)

    @property
    def engine(self) -> Child:
        """The first engine (the only one without --data-parallel-size)."""
        return self.engines[0]

    @property
    def children(self) -> list[Child]:
        return [*self.engines, *self.services, *self.gateways]

    @property
    def spares(self) -> list[Child]:
        """The standby engine, when there is one."""
        return [self.standby] if self.standby is not None else []

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self.stopping:
            log.info("stopping", signal=signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        problem = self._claim()
        if problem is not None:
            log.error("not started", reason=problem)
            print(f"blink serve: {problem}", file=sys.stderr)
            return 2
        code = 0
        try:
            for child in self.children:
                child.spawn()
            if not self._wait_ready():
                code = 1
            else:
                where = {"engine": "apart", "ring": self.cfg.ring} if self.cfg.frontend_only else {}
                log.info("ready", url=f"http://{self.cfg.host}:{self.cfg.port}/v1", **where)
                code = self._watch()
        finally:
            self._stop_all()
            self.locks.release()
        return code

    def _claim(self) -> str | None:
        """Take the run dir, the rings and the port for this server (``blink.locks``) and prepare the run dir;
        why the server cannot start (another live server, a run dir it cannot write, no space), or None."""
        cfg = self.cfg
        try:
            ipc.ensure_run_dir(cfg.run_dir)
            self.locks.acquire(Owner(os.getpid(), str(cfg.run_dir), cfg.ring, cfg.port))
            self._fresh_metrics_dir()
            for child in self.children:
                ipc.clear_ready(cfg.run_dir, child.name)
        except (ServerRunning, ipc.RunDirError) as exc:
            return str(exc)
        except OSError as exc:
            self.locks.release()
            return (f"run dir {cfg.run_dir}: {exc.strerror or exc} (it must be writable, with room for the sockets "
                    "and the metrics files)")
        return None

    # ------------------------------------------------------------ readiness
    def _engine_ready(self, engine: Child) -> bool:
        return self._engine_status(engine)[0]

    def _engine_status(self, engine: Child) -> tuple[bool, bool]:
        """(READY as this engine's process, READY and idle: its stats show no request running or waiting)."""
        assert engine.ring is not None
        try:
            ring = attach_shm_ring(engine.ring)
        except (RingError, ValueError):
            return False, False
        try:
            header = ring.read_header()
        finally:
            ring.close()
        ready = (engine.proc is not None and int(header["engine_pid"]) == engine.proc.pid
                 and int(header["engine_state"]) == L.EngineState.READY)
        stats = header["stats"]
        return ready, ready and int(stats["running"]) == 0 and int(stats["waiting"]) == 0

    def _service_ready(self, child: Child) -> bool:
        path = ipc.ready_path(self.cfg.run_dir, child.name)
        try:
            pid = int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return False
        return child.proc is not None and pid == child.proc.pid

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not self.stopping and time.monotonic() < deadline:
            dead = [c.name for c in self.children if not c.alive()]
            if dead:
                log.error("failed_to_start", children=dead)
                return False
            waiting = [e.name for e in self.engines if not self._engine_ready(e)]
            waiting += [c.name for c in self.services + self.gateways if not self._service_ready(c)]
            if not waiting:
                return True
            time.sleep(0.1)
        if not self.stopping:
            log.error("startup_timeout", seconds=self.cfg.startup_timeout_s)
        return self.stopping

    # ------------------------------------------------------------ watching
    def _watch(self) -> int:
        while not self.stopping:
            self._kill_hung_engines()
            for child in self.children:
                if child.retired or child.alive():
                    continue
                if not self._restart(child):
                    return 1
            self._keep_standby()
            time.sleep(0.2)
        return 0

    def _kill_hung_engines(self) -> None:
        """SIGKILL each engine that is hung, then replaced like one that exited (its ring retired, the spare's
        go), the others untouched. Hung: its ring says READY (as its process) while its beat counter has been
        silent, on this process's clock, for the heartbeat timeout (a deadlock, a swap storm, a SIGSTOP); or its
        process has been stopped (SIGSTOP, a debugger) for ``STOPPED_S``, which a device that keeps beating on its
        own (the persistent scheduler) would not show in the counter. A process stopped for a debugger (state t)
        is left alone."""
        for engine in self.engines:
            if engine.retired or not engine.alive():
                continue
            assert engine.proc is not None
            if engine.killed_pid == engine.proc.pid:  # killed already, still leaving the driver
                continue
            silent = self._engine_silence(engine) or 0.0
            stopped = self._engine_stopped_s(engine)
            if silent < self.cfg.heartbeat_timeout_s and stopped < STOPPED_S:
                continue
            log.error("engine hung: killed, to be replaced", child=engine.name, pid=engine.proc.pid,
                      silent_s=round(silent, 2), stopped_s=round(stopped, 2), timeout_s=self.cfg.heartbeat_timeout_s)
            engine.signal(signal.SIGKILL)
            engine.killed_pid = engine.proc.pid
            # a process in the driver (state D) may take a while to go: the watch loop does not wait on it, the
            # exit path restarts it once it has gone (until then it is not alive() for this check)
            with contextlib.suppress(subprocess.TimeoutExpired):
                engine.proc.wait(timeout=1.0)

    @staticmethod
    def _engine_stopped_s(engine: Child) -> float:
        """Seconds the engine's process has been seen stopped by a signal (state T in /proc; not t, a debugger's
        stop), on this process's clock."""
        assert engine.proc is not None
        try:
            state = Path(f"/proc/{engine.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        now = time.monotonic()
        if state != "T":
            engine.stopped_since = None
            return 0.0
        if engine.stopped_since is None:
            engine.stopped_since = now
        return now - engine.stopped_since

    def _engine_silence(self, engine: Child) -> float | None:
        """Seconds since the supervisor last saw this engine's beat counter move, while its ring is READY and
        its own; None otherwise (loading, draining, no ring, another process's ring)."""
        assert engine.ring is not None and engine.proc is not None
        try:
            ring = attach_shm_ring(engine.ring)
        except (RingError, ValueError):
            return None
        try:
            pid, state = ring.header_load32("engine_pid"), ring.header_load32("engine_state")
            beat = ring.header_load64("heartbeat")
        finally:
            ring.close()
        if pid != engine.proc.pid or state != L.EngineState.READY:
            engine.beats = None
            return None
        if engine.beats is None or engine.beats[0] != pid:
            engine.beats = (pid, Liveness(waits=RunQueueWait(pid).advance))  # its own child: no pid to check
        return engine.beats[1].silent_s(beat)

    def _restart(self, child: Child) -> bool:
        """Start a child that exited again; False when serve must stop (it restarted too often)."""
        assert child.proc is not None
        log.warning("child_exited", child=child.name, code=child.proc.returncode)
        if child in self.engines:
            self._retire_dead_ring(child, child.proc.pid)
            self.spare_clock = SpareClock()  # the next spare waits for this engine READY (and idle) again
        if child in self.gateways:  # its counters stay in the totals; its live gauges go
            multiprocess.mark_process_dead(child.proc.pid, str(self.metrics_dir))
        if child.too_many_restarts():
            log.error("giving_up", child=child.name, restarts_per_minute=RESTARTS_PER_MINUTE)
            if child in self.engines and any(not e.retired and e is not child for e in self.engines):
                child.retired = True  # the other engines keep serving
                return True
            return False
        if not (child in self.engines and self._take_over(child)):
            child.spawn()
        return True

    def _take_over(self, engine: Child) -> bool:
        """The spare becomes the dead engine: it gets the go with that engine's ring and GPU. False when
        there is no live spare (the engine is then started cold)."""
        spare = self.standby
        if spare is None or not spare.alive():
            return False
        assert spare.proc is not None and spare.proc.stdin is not None and engine.ring is not None
        try:
            send_go(spare.proc.stdin, Go(engine.ring, self.engine_envs[engine.name]))
        except OSError:  # it died just now: seen by _keep_standby
            return False
        engine.proc, spare.proc = spare.proc, None
        engine.starts.append(time.monotonic())
        log.info("standby engine took over", child=engine.name, pid=engine.proc.pid, ring=engine.ring)
        return True

    def _keep_standby(self) -> None:
        """Start a spare where there is none, when ``SpareClock`` says (not beside a loading engine or a backlog,
        whose cores it would take). One that died or could not be started is logged and replaced; after too many
        in a minute, given up."""
        spare = self.standby
        if spare is None or spare.alive():
            return
        if spare.proc is not None:
            log.warning("standby engine exited", pid=spare.proc.pid, code=spare.proc.returncode)
            spare.proc = None
            if self._give_up_standby(spare):
                return
        looks = [self._engine_status(e) for e in self.engines if not e.retired]
        if not self.spare_clock.due(time.monotonic(), all(r for r, _ in looks), all(i for _, i in looks)):
            return
        # a replacement waits for the engines idle anew, or for the deadline counted from now
        self.spare_clock = SpareClock(ready_since=time.monotonic())
        try:
            spare.spawn()
        except (OSError, subprocess.SubprocessError) as exc:  # no process (EAGAIN, ENOMEM, the interpreter gone, a
            # failed preexec): counted as a spare that died
            log.error("standby engine not started", error=str(exc), errno=getattr(exc, "errno", None))
            spare.starts.append(time.monotonic())
            self._give_up_standby(spare)

    def _give_up_standby(self, spare: Child) -> bool:
        """After too many spares in a minute, keep none (engines restart cold); whether it was given up."""
        if not spare.too_many_restarts():
            return False
        log.error("standby engine given up: engines restart cold", restarts_per_minute=RESTARTS_PER_MINUTE)
        self.standby = None
        return True

    def _retire_dead_ring(self, engine: Child, dead_pid: int) -> None:
        """The engine died: mark its ring FAILED and remove the segment, so every service sees it gone
        at once (not a heartbeat timeout later) and the restarted engine starts on a fresh segment."""
        assert engine.ring is not None
        try:
            ring = attach_shm_ring(engine.ring)
        except (RingError, ValueError):
            return
        try:
            if ring.header_load32("engine_pid") != dead_pid:
                return  # not the dead engine's ring (nothing else creates it while none runs)
            ring.header_store32("engine_state", L.EngineState.FAILED)
        finally:
            ring.close()
        ShmTransport.unlink_name(engine.ring)
        log.warning("dead_engine_ring_removed", ring=engine.ring, pid=dead_pid)

    # ------------------------------------------------------------ stopping
    def _stop_all(self) -> None:
        self.stopping = True
        for gateway in self.gateways:  # their drain starts now (new requests refused), not after the spares'
            gateway.signal(signal.SIGTERM)
        self._stop(self.spares, signal.SIGTERM, 10)
        self._stop(self.gateways, signal.SIGTERM, self.cfg.drain_timeout_s + 10)
        self._stop(self.services, signal.SIGTERM, 10)
        for engine in self.engines:
            self._ask_engine_to_stop(engine)
        self._stop(self.engines, signal.SIGTERM, 30)
        self._clean_files()
        log.info("stopped")

    def _stop(self, children: list[Child], sig: int, timeout_s: float) -> None:
        for child in children:
            child.signal(sig)
        deadline = time.monotonic() + timeout_s
        for child in children:
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.alive():
                log.warning("killing", child=child.name)
                child.signal(signal.SIGKILL)
            if child.proc is not None:
                child.proc.wait()

    def _ask_engine_to_stop(self, engine: Child) -> None:
        assert engine.ring is not None
        try:
            ring = attach_shm_ring(engine.ring)
        except (RingError, ValueError):
            return
        try:
            ring.header_store32("shutdown", 1)
        finally:
            ring.close()

    def _clean_files(self) -> None:
        for engine in self.engines:
            self._remove_own_ring(engine)
        if not is_remote(self.cfg.ring):  # a remote ring has no store here (its gateways compile none)
            remove_store(self.cfg.ring)  # the grammars the gateways compiled for this ring (and its engines')
        for child in self.children:
            ipc.clear_ready(self.cfg.run_dir, child.name)
        for name in ipc.SOCKET_SERVICES:
            ipc.socket_path(self.cfg.run_dir, name).unlink(missing_ok=True)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _remove_own_ring(self, engine: Child) -> None:
        """Remove the engine's segment if its last process made it (never another server's)."""
        if engine.proc is None or engine.ring is None:
            return
        try:
            ring = attach_shm_ring(engine.ring)
            ours = ring.header_load32("engine_pid") == engine.proc.pid
            ring.close()
        except (RingError, ValueError):
            ours = False
        if ours:
            ShmTransport.unlink_name(engine.ring)
