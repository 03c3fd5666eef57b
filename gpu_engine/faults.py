"""Device failures the engine recovers from, and the debug switch that injects them.

A step whose completion is not seen within its deadline is a ``DeviceHang``; a launch that fails is a
``LaunchFailure``. Either way ``gpu_engine.serve`` fails every request the ring holds for the engine with
``ENGINE_FAILURE``, removes the ring and exits with ``EXIT_ENGINE_FAILURE``; ``blink serve`` starts a new
engine. The CPU engine and the host-driven GPU mode meet these here (``poll_until``, ``FaultyRunner``); the
persistent scheduler meets them on the device (its bounded completion poll and launch) and reports them
through its exit reason (``gpu_engine/gpu/serve_gpu.py``).

``BLINK_FAULT`` injects them, for fault-injection runs: ``KIND@STEP[,KIND@STEP...]``, where ``hang`` makes
that step's completion never seen (the poll runs to its deadline) and ``launch`` makes that step's launch
fail (with an error that is not retried). ``STEP`` counts the engine's steps from 1. Without
``BLINK_FAULT_ONCE_DIR`` every engine arms the first entry; with it, an engine arms the first entry whose
marker file it creates there, so the engine started after a fault takes the next entry, and then none.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

from gpu_engine.policy import StepPlan
from gpu_engine.runner import Runner, StepOutput

EXIT_ENGINE_FAILURE = 3  # the engine's exit code after a device failure (0: stopped, 2: refused at start)
KINDS = ("hang", "launch")


class DeviceFailure(RuntimeError):
    """The device can no longer serve: the engine fails its requests and exits."""


class DeviceHang(DeviceFailure):
    """A step's completion was not seen within its deadline."""


class LaunchFailure(DeviceFailure):
    """A step could not be launched."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: ``kind`` at the engine's step ``at_step`` (from 1)."""

    kind: str
    at_step: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"BLINK_FAULT: unknown fault {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.at_step < 1:
            raise ValueError(f"BLINK_FAULT: the step of a fault counts from 1, got {self.at_step}")


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """``hang@200,launch@50`` -> (Fault('hang', 200), Fault('launch', 50)); ValueError on a bad entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, sep, step = entry.partition("@")
        if not sep or not step.strip().isdigit():
            raise ValueError(f"BLINK_FAULT: {entry!r} is not KIND@STEP (e.g. hang@200)")
        faults.append(Fault(kind.strip(), int(step)))
    return tuple(faults)


def arm(faults: tuple[Fault, ...], once_dir: Path | None) -> Fault | None:
    """The fault this engine injects: the first one, or with ``once_dir`` the first whose marker this
    engine creates there (exclusively, so two engines never arm the same entry)."""
    if once_dir is None:
        return faults[0] if faults else None
    once_dir.mkdir(parents=True, exist_ok=True)
    for k, fault in enumerate(faults):
        try:
            fd = os.open(once_dir / f"fault-{k}-{fault.kind}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return fault
    return None


def poll_until(done: Callable[[], bool], timeout_s: float, what: str, spin_s: float = 0.1) -> None:
    """Poll ``done`` until it is true; ``DeviceHang`` naming ``what`` once ``timeout_s`` have passed.
    The first ``spin_s`` spin (a step completes as soon as a stream synchronization would see it); after
    that the wait backs off to 1 ms between polls, so a long step costs little host CPU."""
    start = time.monotonic()
    pause = 50e-6
    while not done():
        now = time.monotonic()
        if now - start >= timeout_s:
            raise DeviceHang(f"{what} was not complete after {timeout_s:g} s")
        if now - start >= spin_s:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class FaultyRunner:
    """A runner that injects ``fault`` at its step (CPU engine and host-driven GPU mode); every other
    step is the wrapped runner's."""

    def __init__(self, runner: Runner, fault: Fault, step_timeout_s: float) -> None:
        self.runner, self.fault, self.step_timeout_s = runner, fault, step_timeout_s
        self.steps = 0

    def run(self, plan: StepPlan) -> StepOutput:
        self.steps += 1
        if self.steps == self.fault.at_step:
            if self.fault.kind == "launch":
                raise LaunchFailure(f"step {self.steps}: injected launch failure (BLINK_FAULT)")
            poll_until(lambda: False, self.step_timeout_s, f"step {self.steps} (injected hang, BLINK_FAULT)")
        return self.runner.run(plan)
