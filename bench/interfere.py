"""CPU co-tenants for the interference study: busy processes pinned to chosen cores.

Three kinds, ``--per-core`` processes per core each (default one):

- ``compress``: compresses a mix of random and English text bytes in a loop, rotating zlib (level 6), bz2
  (level 9, the codec of pbzip2) and lzma (preset 1): a stand-in for a parallel ``pbzip2`` job;
- ``thrash``: random read-modify-write over a buffer larger than the last-level cache (numpy gather and
  scatter): a stand-in for the cache and memory traffic of a large compile such as an LLVM build;
- ``churn``: alternates a bz2 compression (level 9) of ``--block-kb`` KiB with an anonymous mapping of
  ``--churn-mb`` MiB that is touched page by page and unmapped: page faults, TLB shootdowns and last-level
  cache pollution, the host-side mechanism that slows a host-driven serving loop. One operation is one
  compression plus one map/touch/unmap cycle.

    blink bench interfere --cores 2-15 --duration-s 600
    blink bench interfere --all-but 2 --kinds compress          # every allowed core except the first two
    blink bench interfere --cores all --kinds churn --per-core 3 --block-kb 384   # the heavy co-tenant

From Python::

    with Interference(cores=parse_cores("all-but-2"), kinds=("compress", "thrash")) as co:
        ...  # run the benchmark
    print(co.report)

Cleanup: the workers share one process group, which ``stop`` (and the context manager's exit, and the CLI's
SIGINT/SIGTERM handling) signals as a whole: SIGTERM, then SIGKILL after a grace period. Each worker also asks
the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``) and polls its parent's pid between
work items, so none outlives a parent that was SIGKILLed. At exit each worker reports the work it achieved.

This module imports only the standard library at the top: workers run it as a plain script.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KINDS = ("compress", "thrash", "churn")
PAGE = 4096
PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------- cores
def allowed_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def parse_cores(spec: str) -> list[int]:
    """``"2-15"``, ``"0,2,4-7"``, ``"all"`` or ``"all-but-N"`` (every allowed core except the first N)."""
    spec = spec.strip().lower().replace(" ", "-")
    allowed = allowed_cores()
    if spec == "all":
        return allowed
    if spec.startswith("all-but-"):
        keep = int(spec.removeprefix("all-but-"))
        if keep >= len(allowed):
            raise ValueError(f"all-but-{keep} leaves no core of the {len(allowed)} allowed")
        return allowed[keep:]
    cores: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    missing = sorted(cores - set(allowed))
    if missing or not cores:
        raise ValueError(f"cores {missing or spec!r} are not among the allowed {allowed}")
    return sorted(cores)


def llc_bytes(core: int = 0) -> int:
    """Size of the largest cache level of ``core`` per sysfs (32 MiB when unknown)."""
    best = 0
    for index in Path(f"/sys/devices/system/cpu/cpu{core}/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
    return best or 32 << 20


# ---------------------------------------------------------------------- worker side
class Stopper:
    """When a worker must stop: a signal, its parent gone, or its deadline passed."""

    def __init__(self, parent_pid: int, duration_s: float | None) -> None:
        self.parent_pid = parent_pid
        self.deadline = time.monotonic() + duration_s if duration_s else None
        self.signalled = False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def __call__(self) -> bool:
        if self.signalled or os.getppid() != self.parent_pid:
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline


def text_bytes() -> bytes:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return b"the quick brown fox jumps over the lazy dog. " * 20000
    return "\n".join(topics[k] for k in sorted(topics)).encode()


def compress_loop(stop: Stopper, block_kb: int) -> float:
    """Compress blocks of half random, half text bytes until told to stop (one block at least, so that a worker
    stopped early still reports a rate); returns bytes compressed."""
    import bz2
    import lzma
    import zlib

    codecs = (lambda b: zlib.compress(b, 6), lambda b: bz2.compress(b, 9), lambda b: lzma.compress(b, preset=1))
    text = text_bytes()
    half = block_kb * 512
    done = 0.0
    turn = 0
    while not done or not stop():
        start = random.randrange(max(1, len(text) - half))
        block = os.urandom(half) + text[start:start + half]
        codecs[turn % len(codecs)](block)
        done += len(block)
        turn += 1
    return done


def thrash_loop(stop: Stopper, buffer_mb: int, seed: int) -> float:
    """Random read-modify-write over ``buffer_mb`` MiB until told to stop (one batch at least: a worker stopped
    while it was still building its buffer on a busy host reported 0 accesses); returns the accesses made."""
    import numpy as np

    buf = np.arange((buffer_mb << 20) // 8, dtype=np.int64)
    rng = np.random.default_rng(seed)
    batch = 1 << 18
    done = 0.0
    while not done or not stop():
        idx = rng.integers(0, buf.size, size=batch)
        buf[idx] += 1
        done += 2 * batch
    return done


def churn_loop(stop: Stopper, block_kb: int, map_mb: int) -> float:
    """Alternate a bz2 compression of ``block_kb`` KiB with mapping, touching (one write per page) and
    unmapping ``map_mb`` MiB of anonymous memory, until told to stop (one cycle at least); returns the operations
    done (one compression plus one mapping each)."""
    import bz2
    import mmap

    text = text_bytes()
    half = block_kb * 512
    size = max(1, map_mb) << 20
    done = 0.0
    while not done or not stop():
        start = random.randrange(max(1, len(text) - half))
        bz2.compress(os.urandom(half) + text[start:start + half], 9)
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for offset in range(0, size, PAGE):
            region[offset] = 1
        region.close()
        done += 1
    return done


def worker_main(args: argparse.Namespace) -> int:
    stop = Stopper(args.parent_pid, args.duration_s)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {args.core})
    start = time.monotonic()
    if args.worker == "compress":
        work, unit = compress_loop(stop, args.block_kb), "bytes"
    elif args.worker == "churn":
        work, unit = churn_loop(stop, args.block_kb, args.churn_mb), "operations"
    else:
        work, unit = thrash_loop(stop, args.thrash_mb, args.core), "accesses"
    elapsed = time.monotonic() - start
    print(json.dumps({"kind": args.worker, "core": args.core, "pid": os.getpid(), "elapsed_s": elapsed,
                      "work": work, "unit": unit}), flush=True)
    return 0


# ---------------------------------------------------------------------- parent side
class Interference:
    """Co-tenant processes on ``cores``: ``start``/``stop``, or use it as a context manager."""

    def __init__(self, cores: list[int] | None = None, kinds: tuple[str, ...] = ("compress", "thrash"),
                 duration_s: float | None = None, thrash_mb: int | None = None, block_kb: int = 256,
                 grace_s: float = 5.0, per_core: int = 1, churn_mb: int = 32) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise ValueError(f"kinds must be among {KINDS}, got {kinds}")
        if per_core < 1 or churn_mb < 1 or block_kb < 1:
            raise ValueError(f"per_core, churn_mb and block_kb must be >= 1, got {per_core}, {churn_mb}, {block_kb}")
        self.per_core = per_core
        self.churn_mb = churn_mb
        self.cores = list(cores) if cores is not None else allowed_cores()
        self.kinds = tuple(kinds)
        self.duration_s = duration_s
        self.thrash_mb = thrash_mb or min(1024, max(64, 2 * llc_bytes(self.cores[0]) >> 20))
        self.block_kb = block_kb
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pgid: int | None = None
        self.report: dict[str, Any] | None = None
        self.started = 0.0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _command(self, kind: str, core: int) -> list[str]:
        cmd = [sys.executable, "-I", str(Path(__file__).resolve()), "--worker", kind, "--core", str(core),
               "--parent-pid", str(os.getpid()), "--thrash-mb", str(self.thrash_mb), "--block-kb", str(self.block_kb),
               "--churn-mb", str(self.churn_mb)]
        if self.duration_s:
            cmd += ["--duration-s", str(self.duration_s)]
        return cmd

    def start(self) -> Interference:
        """Start ``per_core`` workers per (kind, core), all in one new process group, each pinned to its core."""
        self.started = time.monotonic()
        atexit.register(self.stop)
        for kind in self.kinds:
            for core in [c for c in self.cores for _ in range(self.per_core)]:
                proc = subprocess.Popen(self._command(kind, core), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        process_group=self.pgid or 0)
                if self.pgid is None:
                    self.pgid = proc.pid
                self.procs.append(proc)
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(proc.pid, {core})
        return self

    def _signal_group(self, sig: int) -> None:
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)

    def stop(self) -> dict[str, Any]:
        """Stop every worker (SIGTERM, SIGKILL after the grace period) and return the report."""
        if self.report is not None:
            return self.report
        atexit.unregister(self.stop)
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        lines: list[str] = []
        for proc in self.procs:
            try:
                out, _ = proc.communicate(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                out, _ = proc.communicate()
            lines.extend(line for line in out.decode(errors="replace").splitlines() if line.startswith("{"))
        self._signal_group(signal.SIGKILL)  # anything the workers themselves may have started
        self.report = summarize([json.loads(line) for line in lines], self, time.monotonic() - self.started)
        return self.report

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every worker has ended (their own deadline) or ``timeout_s`` passed."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(None if end is None else max(0.0, end - time.monotonic()))

    def __enter__(self) -> Interference:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def summarize(stats: list[dict[str, Any]], co: Interference, wall_s: float) -> dict[str, Any]:
    """Achieved work over all workers: MB compressed per second, random accesses per second, churn operations
    (one compression and one mapping cycle) per second."""
    def rate(kind: str) -> float:
        return sum(s["work"] / s["elapsed_s"] for s in stats if s["kind"] == kind and s["elapsed_s"] > 0)

    return {"cores": co.cores, "kinds": list(co.kinds), "per_core": co.per_core, "workers": len(co.procs),
            "reported": len(stats), "wall_s": wall_s,
            "thrash_buffer_mb": co.thrash_mb if "thrash" in co.kinds else None,
            "compress_mb_per_s": rate("compress") / 1e6 if "compress" in co.kinds else None,
            "thrash_accesses_per_s": rate("thrash") if "thrash" in co.kinds else None,
            "churn_block_kb": co.block_kb if "churn" in co.kinds else None,
            "churn_map_mb": co.churn_mb if "churn" in co.kinds else None,
            "churn_ops_per_s": rate("churn") if "churn" in co.kinds else None}


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blink bench interfere", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--cores", default=None, help="e.g. 2-15 or 0,4-7 or all-but-2 (default: all allowed)")
    where.add_argument("--all-but", type=int, default=None, metavar="N", help="all allowed cores but the first N")
    ap.add_argument("--kinds", default="compress,thrash")
    ap.add_argument("--duration-s", type=float, default=None, help="stop after this long (default: until signalled)")
    ap.add_argument("--thrash-mb", type=int, default=None, help="buffer per thrash worker (default: 2x the LLC)")
    ap.add_argument("--block-kb", type=int, default=256, help="compression block size (compress, churn)")
    ap.add_argument("--churn-mb", type=int, default=32, help="memory mapped, touched and unmapped per churn step")
    ap.add_argument("--per-core", type=int, default=1, help="workers of each kind per core")
    ap.add_argument("--json", type=Path, default=None, help="write the report here too")
    ap.add_argument("--worker", choices=KINDS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args)
    spec = f"all-but-{args.all_but}" if args.all_but is not None else (args.cores or "all")
    co = Interference(parse_cores(spec), tuple(args.kinds.split(",")), args.duration_s, args.thrash_mb, args.block_kb,
                      per_core=args.per_core, churn_mb=args.churn_mb)
    signal.signal(signal.SIGTERM, _raise_exit)
    print(f"interference: {len(co.kinds)} kind(s) x {co.per_core} x {len(co.cores)} core(s) {co.cores}",
          file=sys.stderr)
    try:
        with co:
            co.wait(args.duration_s + 5 if args.duration_s else None)
    except (KeyboardInterrupt, SystemExit):  # SIGINT, or SIGTERM through _raise_exit
        pass
    report = co.stop()
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
