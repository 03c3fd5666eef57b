"""Rolling upgrade, process mode: every service its own process, replaced one at a time under load.

The engine (CPU, the embedded model, a small ring) and each frontend service are started as plain
processes with the ``blink`` command, as an operator (or a container runtime) would, not through the
supervisor. A few streams run all along (``docker/loadgen.py``: a client retries only before its
200). Then: the gateway is replaced by a new build (the new one starts on the shared port before
the old one drains), the tokenizer and the tracker by the build of the previous schema minor (taken
from the repository's history), the token reader twice, each time the new one started beside the old
before the old is stopped (docs/DEPLOY.md): by this build, then by the previous minor's; then the
engine is restarted. Requests fail only where the design lets them: those in flight on the engine at
its restart, with the defined error. No stream is lost or changed when the reader is replaced: the
streams it carried at the moment it was stopped all complete, and every completed stream has the
same text (one greedy prompt), so a token lost or repeated shows. The ring's slots and KV blocks all
come back after each round. The counts are printed. CI runs the short form (a gateway, then the previous minor's
tracker and reader); the long one, every service and the engine, is marked ``slow``
(``python -m pytest -m slow tests/test_rolling_upgrade.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shared import ipc
from shared import ring_layout as L
from shared.ring import RingGeometry, attach_shm_ring, create_shm_ring
from shared.transport import RingError, ShmTransport

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ("--backend", "cpu", "--num-slots", "8", "--max-prompt-tokens", "128", "--max-output-tokens", "32",
                "--max-batch", "4", "--block-size", "16", "--kv-blocks", "64", "--threads", "1")
STEADY_S = 1.0
REST_TIMEOUT_S = 30.0  # for a busy host: the reader releases a finished slot within a poll, the engine its blocks


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


loadgen = _load_module("blink_docker_loadgen", ROOT / "docker" / "loadgen.py")


# ---------------------------------------------------------------------- processes
@dataclasses.dataclass(slots=True)
class Service:
    """One running process of a service, started from the code tree ``tree``."""

    name: str
    proc: subprocess.Popen
    tree: Path
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:]


@dataclasses.dataclass(slots=True)
class Deployment:
    run_dir: Path
    ring: str
    port: int
    logs: Path
    running: dict[str, Service] = dataclasses.field(default_factory=dict)

    def argv(self, service: str, name: str, tree: Path = ROOT) -> list[str]:
        if service == "engine":
            return [sys.executable, "-m", "gpu_engine.serve", "--ring", self.ring, *ENGINE_FLAGS]
        argv = [sys.executable, "-m", "blink.cli", service, "--run-dir", str(self.run_dir), "--ring", self.ring]
        if service == "gateway":
            argv += ["--port", str(self.port), "--name", name, "--drain-timeout", "20"]
            # the old and new gateways share the port while one replaces the other: asked for where the flag
            # exists (before it, a gateway always listened with SO_REUSEPORT)
            argv += ["--reuse-port"] if "reuse_port" in (tree / "blink" / "cli.py").read_text() else []
        return argv

    def start(self, service: str, tree: Path = ROOT, name: str | None = None) -> Service:
        name = name or service
        path = self.logs / f"{name}-{time.monotonic_ns()}.log"
        log = open(path, "wb")  # noqa: SIM115 - the child owns it
        env = {**os.environ, "PYTHONPATH": str(tree), "BLINK_LOG_LEVEL": "info"}
        proc = subprocess.Popen(self.argv(service, name, tree), cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        log.close()
        svc = Service(name, proc, tree, path)
        self.running[name] = svc
        return svc

    def stop(self, name: str, timeout_s: float = 30.0) -> None:
        stop_process(self.running.pop(name), timeout_s)

    def stop_all(self) -> None:
        for name in [n for n in self.running if n != "engine"] + (["engine"] if "engine" in self.running else []):
            with contextlib.suppress(AssertionError):
                self.stop(name)


def stop_process(svc: Service, timeout_s: float = 30.0) -> None:
    """SIGTERM, and wait for the exit."""
    name = svc.name
    svc.proc.send_signal(signal.SIGTERM)
    try:
        svc.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        svc.proc.kill()
        svc.proc.wait()
        raise AssertionError(f"{name} did not stop within {timeout_s}s of SIGTERM") from None


def wait_until(what: str, check, timeout_s: float = 60.0, procs: tuple[Service, ...] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for svc in procs:
            assert svc.proc.poll() is None, (
                f"{svc.name} exited with {svc.proc.returncode} while waiting for {what}:\n{svc.tail()}")
        if check():
            return
        time.sleep(0.05)
    logs = "".join(f"\n--- {svc.name}:\n{svc.tail()}" for svc in procs)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{logs}")


def marker_pid(run_dir: Path, name: str) -> int:
    try:
        return int(ipc.ready_path(run_dir, name).read_text().strip())
    except (FileNotFoundError, ValueError):
        return -1


def engine_ready(ring: str, pid: int) -> bool:
    try:
        r = attach_shm_ring(ring)
    except (RingError, ValueError):
        return False
    try:
        return r.header_load32("engine_pid") == pid and r.header_load32("engine_state") == L.EngineState.READY
    finally:
        r.close()


def wait_ready(dep: Deployment, svc: Service) -> None:
    """The engine: its ring says READY under its pid; a service: its ready marker holds its pid."""
    if svc.name == "engine":
        wait_until("the engine's ring READY", lambda: engine_ready(dep.ring, svc.proc.pid), 120, (svc,))
    else:
        wait_until(f"{svc.name}'s ready marker", lambda: marker_pid(dep.run_dir, svc.name) == svc.proc.pid, 120,
                   (svc,))


def start_ready(dep: Deployment, service: str, tree: Path = ROOT, name: str | None = None) -> Service:
    svc = dep.start(service, tree, name)
    wait_ready(dep, svc)
    return svc


# ---------------------------------------------------------------------- the previous schema minor
def layout_minor(commit: str) -> int | None:
    text = subprocess.run(["git", "show", f"{commit}:shared/ring_layout.py"], cwd=ROOT, capture_output=True,
                          text=True).stdout
    line = next((x for x in text.splitlines() if x.startswith("SCHEMA_MINOR = ")), None)
    return None if line is None else int(line.split("=")[1])


def previous_minor_commit() -> str | None:
    """The last commit before this schema minor came in: the parent of the oldest commit whose generated
    layout says this minor, provided that parent says the previous one."""
    if L.SCHEMA_MINOR == 0 or not (ROOT / ".git").exists():
        return None
    try:
        commits = subprocess.run(["git", "log", "--format=%H", "--", "shared/ring_layout.py"], cwd=ROOT,
                                 check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    ours = [c for c in commits if layout_minor(c) == L.SCHEMA_MINOR]
    if not ours:
        return None
    parent = subprocess.run(["git", "rev-parse", f"{ours[-1]}^"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return parent if parent and layout_minor(parent) == L.SCHEMA_MINOR - 1 else None


def build_tree(commit: str, dest: Path) -> Path:
    """``git archive`` of a commit, its C extensions built in place."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest, check=True,
                   capture_output=True)
    return dest


# ---------------------------------------------------------------------- ring checks
def ring_at_rest(ring: str) -> dict:
    """Slots not EMPTY and the engine's KV accounting, read from the header and the slots."""
    r = attach_shm_ring(ring)
    try:
        slots = r.read_slots()
        stats = r.read_header()["stats"]
        return {"busy_slots": int(np.count_nonzero(slots["state"] != L.SlotState.EMPTY)),
                "kv_blocks_free": int(stats["kv_blocks_free"]), "kv_blocks_total": int(stats["kv_blocks_total"]),
                "running": int(stats["running"]), "waiting": int(stats["waiting"])}
    finally:
        r.close()


def settled(s: dict) -> bool:
    return s["busy_slots"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] > 0 and s["running"] == 0


def rest_after(ring: str, timeout_s: float) -> dict:
    """The ring once the load stopped: at rest as soon as it is, or as it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not settled(state := ring_at_rest(ring)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return state


# ---------------------------------------------------------------------- the test
@pytest.fixture
def deployment(tmp_path_factory: pytest.TempPathFactory, ring_name: str) -> Iterator[Deployment]:
    from harness.serve_proc import free_port

    run_dir = Path(f"/tmp/blink-ru-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    dep = Deployment(run_dir, ring_name, free_port(), tmp_path_factory.mktemp("logs"))
    try:
        yield dep
    finally:
        dep.stop_all()
        shutil.rmtree(run_dir, ignore_errors=True)


async def replace(dep: Deployment, phases: list[loadgen.Phase], service: str, tree: Path) -> None:
    """Stop one service, start its replacement (a gateway: start the new one first, then drain the old)."""
    await asyncio.sleep(STEADY_S)
    phase = loadgen.Phase(f"{service}@{'this build' if tree == ROOT else tree.name}", time.monotonic())
    phases.append(phase)
    if service == "gateway":
        old = next(n for n in dep.running if n.startswith("gateway"))
        await asyncio.to_thread(start_ready, dep, "gateway", tree, f"gateway-{len(phases)}")
        await asyncio.to_thread(dep.stop, old)
    elif service == "reader":  # the new one beside the old (it takes the socket's name), then the old stops
        old_reader = dep.running.pop("reader")
        await asyncio.to_thread(start_ready, dep, "reader", tree)
        phase.cut = time.monotonic()
        await asyncio.to_thread(stop_process, old_reader)
        phase.gone = time.monotonic()
    else:
        await asyncio.to_thread(dep.stop, service)
        await asyncio.to_thread(start_ready, dep, service, tree)
    phase.end = time.monotonic()


async def under_load(dep: Deployment, phases: list[loadgen.Phase], steps: list[tuple[str, Path]]) -> list:
    """Run the load while the services in ``steps`` are replaced in turn; the results once it stopped."""
    load = loadgen.Load(loadgen.LoadConfig(f"http://127.0.0.1:{dep.port}", streams=3, max_tokens=8))
    load.start()
    try:
        for service, tree in steps:
            await replace(dep, phases, service, tree)
        await asyncio.sleep(STEADY_S)
    finally:
        await load.stop()
    return load.results


@dataclasses.dataclass(slots=True)
class Outcome:
    results: list = dataclasses.field(default_factory=list)
    phases: list[loadgen.Phase] = dataclasses.field(default_factory=list)
    rests: dict[str, dict] = dataclasses.field(default_factory=dict)


def rounds_of(old_tree: Path, long: bool) -> dict[str, list[tuple[str, Path]]]:
    """The long form: three rounds, the services but the reader, the reader (by this build, then by the previous
    minor's), the engine. The short one: a new gateway and the previous minor's tracker, then its reader."""
    if not long:
        return {"gateway, tracker": [("gateway", ROOT), ("tracker", old_tree)], "reader": [("reader", old_tree)]}
    return {"gateway, tokenizer, tracker": [("gateway", ROOT), ("tokenizer", old_tree), ("tracker", old_tree)],
            "reader": [("reader", ROOT), ("reader", old_tree)], "engine": [("engine", ROOT)]}


async def drive(dep: Deployment, rounds: dict[str, list[tuple[str, Path]]]) -> Outcome:
    """Rounds of load, the ring read at rest after each."""
    out = Outcome()
    for label, steps in rounds.items():
        out.results += await under_load(dep, out.phases, steps)
        out.rests[label] = await asyncio.to_thread(rest_after, dep.ring, REST_TIMEOUT_S)
    return out


@pytest.mark.parametrize("long", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["short", "long"])
def test_rolling_upgrade_under_load(deployment: Deployment, tmp_path: Path, long: bool) -> None:
    commit = previous_minor_commit()
    if commit is None:
        pytest.skip("no commit of the previous schema minor in this checkout's history (needs a git clone)")
    old_tree = build_tree(commit, tmp_path / f"minor{L.SCHEMA_MINOR - 1}")
    dep = deployment
    started = [dep.start(s) for s in ("engine", "tokenizer", "reader", "tracker")] + [dep.start("gateway", ROOT,
                                                                                             "gateway-0")]
    for svc in started:
        wait_ready(dep, svc)
    out = asyncio.run(drive(dep, rounds_of(old_tree, long)))
    counts = loadgen.summary(out.results)
    failed_by_phase, wrong = loadgen.classify_failures(out.results, out.phases)
    handed_over = loadgen.across_cuts(out.results, out.phases)
    print("\nrolling upgrade:", json.dumps({
        **counts, "failed_by_phase": failed_by_phase, "previous_minor_build": commit[:12],
        "streams_across_reader_replacement": {k: len(v) for k, v in handed_over.items()},
        "phases_s": {p.name: round(p.end - p.start, 2) for p in out.phases},
        "ring_at_rest": out.rests}))
    assert counts["completed"] >= 1, counts  # how many depends on the host's speed; that none went wrong does not
    assert not wrong, wrong
    for name, streams in handed_over.items():  # the reader's streams were handed over, not lost
        assert streams, f"{name}: no stream was in flight when the old reader stopped"
        assert all(r.ok for r in streams), [(r.error, r.finish) for r in streams if not r.ok]
    assert not (bad := loadgen.wrong_texts(out.results)), bad  # no token lost or repeated
    for label, rest in out.rests.items():
        assert settled(rest), (label, out.rests)


# ---------------------------------------------------------------------- another major
def test_ring_of_another_major_is_refused_naming_both_versions(ring_name: str) -> None:
    geometry = RingGeometry(num_slots=4, max_prompt_tokens=16, max_output_tokens=16, top_logprobs=0)
    ring = create_shm_ring(ring_name, geometry)
    try:
        ring.header_store32("engine_state", L.EngineState.READY)
        ring.transport.write(L.FIELD_OFFSETS["RingHeader"]["schema_major"],
                             np.array([L.SCHEMA_MAJOR + 1], np.uint16))
        with pytest.raises(RingError) as err:
            attach_shm_ring(ring_name)
        msg = str(err.value)
        assert f"{L.SCHEMA_MAJOR + 1}.{L.SCHEMA_MINOR}" in msg and f"{L.SCHEMA_MAJOR}.{L.SCHEMA_MINOR}" in msg, msg
        assert "major" in msg
    finally:
        ring.close()
        ShmTransport.unlink_name(ring_name)


# ---------------------------------------------------------------------- every service pid 1 of its container
def test_gateways_that_are_each_pid_1_of_their_container_get_distinct_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gateways overlap while one replaces the other: their request ids must not collide, and the
    reader keys its gateway links by this id."""
    from dpu_gateway import backend

    real_stat = os.stat
    ids = []
    monkeypatch.setattr(backend.os, "getpid", lambda: 1)
    for ns_inode in (4026532301, 4026532377):
        monkeypatch.setattr(backend.os, "stat", lambda path, ino=ns_inode: (
            os.stat_result((0, ino, 0, 0, 0, 0, 0, 0, 0, 0)) if path == "/proc/self/ns/pid" else real_stat(path)))
        ids.append(backend.default_gateway_id())
    assert ids[0] != ids[1], ids
    monkeypatch.setattr(backend.os, "stat", real_stat)
    pids = range(1, 5000)
    monkeypatch.setattr(backend.os, "getpid", iter(pids).__next__)
    assert len({backend.default_gateway_id() for _ in pids}) == len(pids)  # one namespace: one id per pid


def test_a_stopping_reader_leaves_the_marker_of_a_new_reader_with_the_same_pid(tmp_path: Path) -> None:
    """In containers the old and the new reader are both pid 1: the old one, stopping after the new one
    marked itself ready, must not remove the new one's marker (its container would turn unhealthy)."""
    from dpu_gateway.reader import clear_own_marker, marker_stamp

    ipc.mark_ready(tmp_path, "reader")
    old = marker_stamp(tmp_path)
    ipc.clear_ready(tmp_path, "reader")  # the new container's entrypoint clears the stale marker
    time.sleep(0.05)  # a new modification time even on a coarse file-system clock
    ipc.mark_ready(tmp_path, "reader")  # the new reader, same pid
    clear_own_marker(tmp_path, old)
    assert ipc.ready_path(tmp_path, "reader").exists()
    clear_own_marker(tmp_path, marker_stamp(tmp_path))
    assert not ipc.ready_path(tmp_path, "reader").exists()
