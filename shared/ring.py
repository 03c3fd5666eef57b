"""The ring: one segment holding the header, the slots and the token arenas.

``Ring`` gives typed, zero-copy numpy views where the transport maps the memory locally,
and offsets for everything (the GPU and RDMA peers use offsets, not Python objects). The
layout comes from ``shared/ring_layout.py``, generated from ``schema/ring.fbs``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import numpy as np

from shared import ring_layout as L
from shared.runwait import RunQueueWait, maps_segment, pid_namespace
from shared.transport import MemoryTransport, RingError, SegmentTaken, ShmTransport, Transport

MAGIC = int.from_bytes(b"BLINKRNG", "little")
ALIGN = 4096
MAX_STOP_IDS = 8
FLIP_SLOTS = L.RINGHEADER_DTYPE["pending_flips"].shape[0] * 64  # slots covered by the header's flip bits

HEADER_OFF = L.FIELD_OFFSETS["RingHeader"]
SLOT_OFF = L.FIELD_OFFSETS["Slot"]
STATS_OFF = HEADER_OFF["stats"]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# EngineStats.step_fill: upper bounds of tokens / budget of its first six counts; the seventh counts the
# steps that filled the budget exactly (tokens / budget == 1, so also within the last bound)
STEP_FILL_BOUNDS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0)


def step_fill_bucket(tokens: int, budget: int) -> int:
    """Which ``EngineStats.step_fill`` count a step of ``tokens`` under ``budget`` adds to (integer
    arithmetic, so the CUDA scheduler's ``step_fill_bucket`` gives the same answer)."""
    if tokens >= budget:
        return 6
    for k, (num, den) in enumerate(((1, 16), (1, 8), (1, 4), (1, 2), (3, 4))):
        if tokens * den <= budget * num:
            return k
    return 5


# The context served when neither --max-model-len nor --max-prompt-tokens is given (shared/config.py), the model's
# own if shorter. A prompt may take all of it but one token, as vLLM's prompt limit is max_model_len - 1, so the
# default prompt slot holds that many: 6,143 tokens cost a ring of 256 slots 6 MiB (4 bytes a token).
DEFAULT_MAX_MODEL_LEN = 6144


@dataclasses.dataclass(frozen=True, slots=True)
class RingGeometry:
    """How many slots and how many tokens each slot may hold."""

    # Each field is also an engine flag (``--num-slots``, ...): shared/config.py derives it with this help.
    num_slots: int = dataclasses.field(default=256, metadata={"help": "request slots in the ring"})
    max_prompt_tokens: int = dataclasses.field(default=DEFAULT_MAX_MODEL_LEN - 1,
                                               metadata={"help": "prompt tokens a slot holds"})
    max_output_tokens: int = dataclasses.field(default=2048, metadata={"help": "output tokens a slot holds"})
    top_logprobs: int = dataclasses.field(
        default=20, metadata={"help": "alternatives per token a slot can return (top_logprobs, 0..20)"})
    # Since schema minor 5: a slot's prompt-logprob rows; each position costs 8 * (1 + top_logprobs) bytes a slot.
    max_prompt_logprobs_tokens: int = dataclasses.field(default=1024, metadata={
        "help": "longest prompt (tokens) a slot can return prompt log-probs for (echo with logprobs, "
                "prompt_logprobs); 0: none"})

    def __post_init__(self) -> None:
        for field in ("num_slots", "max_prompt_tokens", "max_output_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"ring geometry: {field} must be >= 1, got {getattr(self, field)}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"ring geometry: top_logprobs must be in 0..20, got {self.top_logprobs}")
        if self.max_prompt_logprobs_tokens < 0:
            raise ValueError(f"ring geometry: max_prompt_logprobs_tokens must be >= 0, got "
                             f"{self.max_prompt_logprobs_tokens}")

    @property
    def prompt_logprob_rows(self) -> int:
        """Entries of a slot's prompt-logprob rows: no prompt is longer than ``max_prompt_tokens``."""
        return min(self.max_prompt_logprobs_tokens, self.max_prompt_tokens)

    @property
    def slots_offset(self) -> int:
        return _align(L.RINGHEADER_DTYPE.itemsize)

    @property
    def prompt_arena_offset(self) -> int:
        return _align(self.slots_offset + self.num_slots * L.SLOT_DTYPE.itemsize)

    @property
    def output_arena_offset(self) -> int:
        return _align(self.prompt_arena_offset + self.num_slots * self.max_prompt_tokens * 4)

    @property
    def logprob_arena_offset(self) -> int:
        return _align(self.output_arena_offset + self.num_slots * self.max_output_tokens * 4)

    @property
    def top_logprob_arena_offset(self) -> int:
        return _align(self.logprob_arena_offset + self.num_slots * self.max_output_tokens * 4)

    @property
    def total_bytes(self) -> int:
        """The end of the arenas of schema minor 4 (the header's ``total_bytes``, which every reader checks)."""
        per_slot = self.max_output_tokens * max(self.top_logprobs, 1) * L.TOPLOGPROB_DTYPE.itemsize
        return _align(self.top_logprob_arena_offset + self.num_slots * per_slot)

    @property
    def prompt_logprob_arena_offset(self) -> int:
        return self.total_bytes

    @property
    def prompt_top_logprob_arena_offset(self) -> int:
        rows = self.num_slots * self.prompt_logprob_rows * L.PROMPTLOGPROB_DTYPE.itemsize
        return _align(self.prompt_logprob_arena_offset + rows)

    @property
    def segment_bytes(self) -> int:
        """The whole segment: ``total_bytes`` plus the prompt-logprob arenas of minor 5."""
        per_slot = self.prompt_logprob_rows * max(self.top_logprobs, 1) * L.TOPLOGPROB_DTYPE.itemsize
        return _align(self.prompt_top_logprob_arena_offset + self.num_slots * per_slot)


MAX_LOOK_GAP_S = 2.0  # of a gap between an observer's looks, what counts as the engine's silence (`Liveness`)
# A silence this long (a few missed beats of the engine's 0.1 s) has the observer read whether the engine is runnable
STARVED_AFTER_S = 0.3
# Of one silence, at most this much is left out as the engine waiting for a CPU: an engine that is hung while a
# thread of it spins beside busy neighbours (waiting for a CPU too) is declared dead at most this much late
MAX_STARVED_S = 60.0
WAITS_EVERY_S = 0.1  # an observer that looks more often reads the engine's threads at most this often
WAITS_PRIME_S = 1.0  # while the engine beats, it is read this often: where a silence's first reading counts from
STALE_WATCH_S = 1.0  # an existing segment of another PID namespace's engine: how long its heartbeat is watched


@dataclasses.dataclass(slots=True)
class Liveness:
    """The engine's liveness as one process sees it, on one clock: that process's own.

    The engine bumps the header's ``heartbeat`` counter while it makes progress; an observer records
    when (on ``clock``, monotonic) it last saw the counter change. Nothing compares the engine's
    clock with the observer's: ``heartbeat_ns`` (the engine's time of its last beat) is for display
    only, so a wall-clock step or drift on either side, or a GPU timer, cannot make a live engine
    look dead or a hung one alive. The first observation counts as a move: an observer that attaches
    to a hung engine declares it dead ``timeout`` after attaching. Silence accrues only while the observer
    itself runs: of a gap between two of its looks, at most ``MAX_LOOK_GAP_S`` counts, so an observer that
    was frozen with the engine (``docker pause``, a stopped process tree, a suspended VM) does not take the
    freeze for the engine's silence at its first look after it. Every observer looks far more often.

    Nor does silence accrue while the engine waits for a CPU: with ``waits`` (``shared/runwait.py``: the time one of
    its threads spent runnable and not running since the previous call, read every ``WAITS_PRIME_S`` while the
    engine beats), once a silence passes ``STARVED_AFTER_S`` each look leaves out that time (at the silence's first
    reading, no more than the silence so far), up to ``MAX_STARVED_S`` a silence (``starved_s``). A busy host slows
    the engine's beats; it does not end its streams. A stopped, blocked or dead engine is not runnable, and its
    silence counts whole.
    """

    clock: Callable[[], float] = time.monotonic
    beat: int | None = None  # the counter when it last moved
    moved_at: float = 0.0
    moves: int = 0  # changes seen, the first look included: 2 or more means the counter was seen moving
    looked_at: float | None = None  # this observer's previous look
    waits: Callable[[], float | None] | None = None  # the engine's time waiting for a CPU since the previous call
    starved_s: float = 0.0  # of the current silence, what was left out as the engine waiting for a CPU
    _waits_at: float = float("-inf")  # when ``waits`` was last read

    def silent_s(self, beat: int) -> float:
        """Seconds, on ``clock``, since the counter was last seen to change (0 when it changed now), this
        observer's own pauses past ``MAX_LOOK_GAP_S`` and the engine's waits for a CPU left out."""
        now = self.clock()
        if self.looked_at is not None and now - self.looked_at > MAX_LOOK_GAP_S:
            self.moved_at += now - self.looked_at - MAX_LOOK_GAP_S
        self.looked_at = now
        if beat != self.beat:
            self.beat, self.moved_at, self.moves = beat, now, self.moves + 1
            self.starved_s = 0.0
            if self.waits is not None and now - self._waits_at >= WAITS_PRIME_S:
                self._waits_at = now
                self.waits()  # where the next reading counts from
        elif (self.waits is not None and now - self.moved_at >= STARVED_AFTER_S
              and now - self._waits_at >= WAITS_EVERY_S):
            self._waits_at = now
            # the wait since the previous reading, which may be from before this silence: no more than the silence
            waited = self.waits()
            if waited is not None:
                left_out = min(waited, now - self.moved_at, MAX_STARVED_S - self.starved_s)
                if left_out > 0:
                    self.moved_at += left_out
                    self.starved_s += left_out
        return now - self.moved_at

    @property
    def seen_moving(self) -> bool:
        """Whether this observer saw the counter change after its first look: a ring left by a crashed
        server (SIGKILLed, its counter frozen) never is, however fresh it looked at that first look."""
        return self.moves >= 2


class EngineWaits:
    """``Liveness.waits`` for a ring's engine: the wait for a CPU of the process its header names, once that process
    is seen to map the ring's segment (``shared/runwait.py``); None otherwise."""

    def __init__(self, ring: Ring, segment: str) -> None:
        self.ring, self.segment = ring, segment
        self.wait: RunQueueWait | None = None
        self.not_engine = 0  # a pid found not to be the engine (another PID namespace's): not checked again

    def __call__(self) -> float | None:
        pid = self.ring.header_load32("engine_pid")
        if self.wait is None or self.wait.pid != pid:
            self.wait = None
            if not pid or pid == self.not_engine or pid == os.getpid():  # this process runs: it cannot tell
                return None
            if not same_pid_namespace(self.ring.header_load32("engine_pid_ns")) or not maps_segment(pid, self.segment):
                self.not_engine = pid
                return None
            self.wait = RunQueueWait(pid)
        return self.wait.advance()


class Ring:
    """Typed access to a ring segment through a transport."""

    def __init__(self, transport: Transport, geometry: RingGeometry, name: str = "") -> None:
        self.transport = transport
        self.geometry = geometry
        self.name = name
        self.liveness = Liveness()  # what this process saw of the engine's beat counter
        if isinstance(transport, ShmTransport):  # an engine on this host: its waits for a CPU can be read
            self.liveness.waits = EngineWaits(self, transport.name)
        view = transport.local_view()
        self._local = view is not None
        if view is not None:
            self._map_views(view)

    def _map_views(self, view: memoryview) -> None:
        g = self.geometry
        n, p, o, k = g.num_slots, g.max_prompt_tokens, g.max_output_tokens, max(g.top_logprobs, 1)
        self.header = np.frombuffer(view, L.RINGHEADER_DTYPE, 1, 0)
        self.slots = np.frombuffer(view, L.SLOT_DTYPE, n, g.slots_offset)
        self.prompt_tokens = np.frombuffer(view, np.int32, n * p, g.prompt_arena_offset).reshape(n, p)
        self.output_tokens = np.frombuffer(view, np.int32, n * o, g.output_arena_offset).reshape(n, o)
        self.logprobs = np.frombuffer(view, np.float32, n * o, g.logprob_arena_offset).reshape(n, o)
        self.top_logprobs = np.frombuffer(
            view, L.TOPLOGPROB_DTYPE, n * o * k, g.top_logprob_arena_offset
        ).reshape(n, o, k)

    # ------------------------------------------------------------------ offsets
    def slot_offset(self, idx: int) -> int:
        return self.geometry.slots_offset + idx * L.SLOT_DTYPE.itemsize

    def slot_field(self, idx: int, field: str) -> int:
        return self.slot_offset(idx) + SLOT_OFF[field]

    def stop_token(self, idx: int) -> int:
        """The slot's stop_token (schema minor 6): the stop id that ended it, -1 where its engine wrote none."""
        word = self.transport.load32(self.slot_field(idx, "stop_token"))
        return word - (1 << 32) if word >= 1 << 31 else word

    def prompt_offset(self, idx: int) -> int:
        return self.geometry.prompt_arena_offset + idx * self.geometry.max_prompt_tokens * 4

    def output_offset(self, idx: int, pos: int = 0) -> int:
        return self.geometry.output_arena_offset + (idx * self.geometry.max_output_tokens + pos) * 4

    def logprob_offset(self, idx: int, pos: int = 0) -> int:
        return self.geometry.logprob_arena_offset + (idx * self.geometry.max_output_tokens + pos) * 4

    def top_logprob_offset(self, idx: int, pos: int = 0) -> int:
        k = max(self.geometry.top_logprobs, 1)
        return self.geometry.top_logprob_arena_offset + (idx * self.geometry.max_output_tokens + pos) * k * 8

    def prompt_logprob_offset(self, idx: int, pos: int = 0) -> int:
        g = self.geometry
        return g.prompt_logprob_arena_offset + (idx * g.prompt_logprob_rows + pos) * 8

    def prompt_top_logprob_offset(self, idx: int, pos: int = 0) -> int:
        g = self.geometry
        k = max(g.top_logprobs, 1)
        return g.prompt_top_logprob_arena_offset + (idx * g.prompt_logprob_rows + pos) * k * 8

    # ------------------------------------------------------------------ bulk reads
    def read_slots(self, out: np.ndarray | None = None) -> np.ndarray:
        """One bulk read of every slot's metadata (a copy: safe to inspect at leisure)."""
        if out is None:
            out = np.empty(self.geometry.num_slots, L.SLOT_DTYPE)
        self.transport.read_into(self.geometry.slots_offset, out)
        return out

    def read_header(self) -> np.void:
        out = np.empty(1, L.RINGHEADER_DTYPE)
        self.transport.read_into(0, out)
        return out[0]

    def flips_cover_slots(self) -> bool:
        """Whether the header's ``pending_flips`` name every published slot: the ring's writers keep them
        (schema minor >= 1) and every slot has a bit."""
        return int(self.read_header()["schema_minor"]) >= 1 and self.geometry.num_slots <= FLIP_SLOTS

    def read_output(self, idx: int, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, np.int32)
        self.transport.read_into(self.output_offset(idx, start), out)
        return out

    def read_logprobs(self, idx: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        lps = np.empty(stop - start, np.float32)
        self.transport.read_into(self.logprob_offset(idx, start), lps)
        tops = np.empty((stop - start, max(self.geometry.top_logprobs, 1)), L.TOPLOGPROB_DTYPE)
        self.transport.read_into(self.top_logprob_offset(idx, start), tops)
        return lps, tops

    def read_prompt_logprobs(self, idx: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Prompt positions ``[start, stop)`` of a slot: ``PromptLogprob`` entries and their alternatives."""
        entries = np.empty(stop - start, L.PROMPTLOGPROB_DTYPE)
        self.transport.read_into(self.prompt_logprob_offset(idx, start), entries)
        tops = np.empty((stop - start, max(self.geometry.top_logprobs, 1)), L.TOPLOGPROB_DTYPE)
        self.transport.read_into(self.prompt_top_logprob_offset(idx, start), tops)
        return entries, tops

    # ------------------------------------------------------------------ header words
    def header_load32(self, field: str) -> int:
        return self.transport.load32(HEADER_OFF[field])

    def header_load64(self, field: str) -> int:
        return self.transport.load64(HEADER_OFF[field])

    def header_store32(self, field: str, value: int) -> None:
        self.transport.store32(HEADER_OFF[field], value)

    def header_store64(self, field: str, value: int) -> None:
        self.transport.store64(HEADER_OFF[field], value)

    def stats_store(self, field: str, value: int, index: int = 0) -> None:
        """One engine-stats word (``index``: the element of an array field, such as ``step_fill``)."""
        fields = L.ENGINESTATS_DTYPE.fields
        assert fields is not None
        dtype = fields[field][0]
        size = dtype.base.itemsize
        if not 0 <= index < max(1, dtype.shape[0] if dtype.shape else 1):
            raise IndexError(f"EngineStats.{field}[{index}]")
        off = STATS_OFF + L.FIELD_OFFSETS["EngineStats"][field] + index * size
        (self.transport.store64 if size == 8 else self.transport.store32)(off, value & ((1 << (8 * size)) - 1))

    def engine_alive(self, timeout_s: float) -> bool:
        """True when the engine says READY and its beat counter moved within ``timeout_s`` of this
        process's monotonic clock (see ``Liveness``)."""
        silent = self.liveness.silent_s(self.header_load64("heartbeat"))
        return self.header_load32("engine_state") == L.EngineState.READY and silent < timeout_s

    def serving_problem(self, timeout_s: float) -> str | None:
        """Why this ring's engine does not serve (for admission and ``/health``), or None when it does:
        READY, its counter seen moving since this process attached, and silent for less than ``timeout_s``.
        The reason names the state or the observed silence, for the log line of a 503."""
        silent = self.liveness.silent_s(self.header_load64("heartbeat"))
        state = self.header_load32("engine_state")
        if state != L.EngineState.READY:
            return f"its state is {L.EngineState(state).name}" if state in set(L.EngineState) else "unknown state"
        if silent >= timeout_s:
            return f"its heartbeat is stale: silent {silent:.2f} s (timeout {timeout_s:g} s)"
        if not self.liveness.seen_moving:
            return "its heartbeat has not moved since this process attached"
        return None

    def engine_serving(self, timeout_s: float) -> bool:
        return self.serving_problem(timeout_s) is None

    def wait_for_beat(self, timeout_s: float, poll_s: float = 0.01) -> bool:
        """For a one-shot check (a health probe): wait up to ``timeout_s`` for the beat counter to move."""
        first, end = self.header_load64("heartbeat"), time.monotonic() + timeout_s
        while self.header_load64("heartbeat") == first:
            if time.monotonic() >= end:
                return False
            time.sleep(poll_s)
        return True

    def close(self) -> None:
        for attr in ("header", "slots", "prompt_tokens", "output_tokens", "logprobs", "top_logprobs"):
            self.__dict__.pop(attr, None)
        self.transport.close()


# ---------------------------------------------------------------------- create / attach

def _header_bytes(geometry: RingGeometry) -> bytes:
    h = np.zeros(1, L.RINGHEADER_DTYPE)
    g = geometry
    h["magic"] = MAGIC
    h["schema_major"], h["schema_minor"] = L.SCHEMA_MAJOR, L.SCHEMA_MINOR
    h["header_bytes"], h["slot_bytes"] = L.RINGHEADER_DTYPE.itemsize, L.SLOT_DTYPE.itemsize
    h["top_logprob_bytes"] = L.TOPLOGPROB_DTYPE.itemsize
    h["num_slots"], h["max_prompt_tokens"] = g.num_slots, g.max_prompt_tokens
    h["max_output_tokens"], h["top_logprobs"] = g.max_output_tokens, g.top_logprobs
    h["slots_offset"], h["prompt_arena_offset"] = g.slots_offset, g.prompt_arena_offset
    h["output_arena_offset"], h["logprob_arena_offset"] = g.output_arena_offset, g.logprob_arena_offset
    h["top_logprob_arena_offset"], h["total_bytes"] = g.top_logprob_arena_offset, g.total_bytes
    h["prompt_logprob_tokens"], h["prompt_logprob_bytes"] = g.prompt_logprob_rows, L.PROMPTLOGPROB_DTYPE.itemsize
    h["prompt_logprob_arena_offset"] = g.prompt_logprob_arena_offset
    h["prompt_top_logprob_arena_offset"], h["segment_bytes"] = g.prompt_top_logprob_arena_offset, g.segment_bytes
    h["engine_state"] = L.EngineState.STARTING
    h["engine_pid"], h["engine_pid_ns"] = os.getpid(), pid_namespace()
    h["created_ns"] = time.time_ns()
    h["creator_uid"] = os.geteuid()
    return h.tobytes()


def init_ring(transport: Transport, geometry: RingGeometry, name: str = "") -> Ring:
    """Write a fresh header into zeroed memory and return the ring (engine side)."""
    if transport.size < geometry.segment_bytes:
        raise RingError(f"ring {name}: segment of {transport.size} bytes < {geometry.segment_bytes} needed")
    transport.write(0, _header_bytes(geometry))
    transport.fence()
    return Ring(transport, geometry, name)


def validate_header(h: np.void, size: int, name: str) -> RingGeometry:
    """Check magic, version and geometry; return the geometry the header describes."""
    if int(h["magic"]) != MAGIC:
        raise RingError(
            f"ring {name}: bad magic 0x{int(h['magic']):016x} (expected 0x{MAGIC:016x}): "
            "not a Blink ring, or corrupted"
        )
    major, minor = int(h["schema_major"]), int(h["schema_minor"])
    if major != L.SCHEMA_MAJOR:
        raise RingError(
            f"ring {name}: schema version {major}.{minor} is incompatible with this program's "
            f"{L.SCHEMA_MAJOR}.{L.SCHEMA_MINOR} (major versions differ); upgrade the older side"
        )
    if int(h["slot_bytes"]) != L.SLOT_DTYPE.itemsize or int(h["header_bytes"]) != L.RINGHEADER_DTYPE.itemsize:
        raise RingError(
            f"ring {name}: corrupt header: slot_bytes={int(h['slot_bytes'])} header_bytes="
            f"{int(h['header_bytes'])}, expected {L.SLOT_DTYPE.itemsize} and {L.RINGHEADER_DTYPE.itemsize}"
        )
    # reserved (zero) before minor 5; a writer may have put the configured limit there, of which the rows
    # are the part a prompt can use (RingGeometry.prompt_logprob_rows): the same offsets
    prompt_rows = int(h["prompt_logprob_tokens"]) if minor >= 5 else 0
    try:
        g = RingGeometry(int(h["num_slots"]), int(h["max_prompt_tokens"]),
                         int(h["max_output_tokens"]), int(h["top_logprobs"]), prompt_rows)
    except ValueError as exc:
        raise RingError(f"ring {name}: corrupt header: {exc}") from None
    if g.total_bytes != int(h["total_bytes"]) or g.slots_offset != int(h["slots_offset"]):
        raise RingError(f"ring {name}: corrupt header: offsets do not match geometry")
    arenas = (g.prompt_logprob_arena_offset, g.prompt_top_logprob_arena_offset, g.segment_bytes,
              L.PROMPTLOGPROB_DTYPE.itemsize)
    found = tuple(int(h[f]) for f in ("prompt_logprob_arena_offset", "prompt_top_logprob_arena_offset", "segment_bytes",
                                      "prompt_logprob_bytes"))
    if minor >= 5 and found != arenas:
        raise RingError(f"ring {name}: corrupt header: the prompt-logprob arenas (offsets, end, entry size) are "
                        f"{found}, the geometry's {arenas}")
    if size < g.segment_bytes:
        raise RingError(f"ring {name}: segment is {size} bytes but its header says {g.segment_bytes}")
    return g


def attach_ring(transport: Transport, name: str = "") -> Ring:
    """Validate the header behind a transport and return the ring (service side)."""
    if transport.size < L.RINGHEADER_DTYPE.itemsize:
        raise RingError(f"ring {name}: segment is {transport.size} bytes, smaller than a header")
    h = np.frombuffer(transport.read(0, L.RINGHEADER_DTYPE.itemsize), L.RINGHEADER_DTYPE)[0]
    return Ring(transport, validate_header(h, transport.size, name), name)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def create_shm_ring(name: str, geometry: RingGeometry, *, replace_stale: bool = True) -> Ring:
    """Create the engine's segment; a segment left by a dead engine of this user is replaced, one of
    another user is refused (``SegmentTaken``: it is neither mapped nor removed)."""
    try:
        transport = ShmTransport.create(name, geometry.segment_bytes)
    except FileExistsError:
        if not replace_stale:
            raise RingError(f"ring {name}: segment already exists") from None
        remove_stale_segment(name)
        transport = ShmTransport.create(name, geometry.segment_bytes)
    return init_ring(transport, geometry, name)


def segment_problem(name: str) -> str | None:
    """Why an engine could not create its ring under ``name`` (another user holds the name), or None."""
    try:
        ShmTransport.attach(name).close()
    except SegmentTaken as exc:
        return str(exc)
    except RingError:
        return None
    return None


def same_pid_namespace(ns: int) -> bool:
    """Whether a ring's ``engine_pid_ns`` is this process's PID namespace (or either is not known: as if it were)."""
    here = pid_namespace()
    return not ns or not here or ns == here


def remove_stale_segment(name: str) -> None:
    """Unlink an existing segment unless a live engine owns it: one of this PID namespace whose pid runs, or one of
    another namespace (a container sharing /dev/shm) whose heartbeat moves."""
    try:
        old = ShmTransport.attach(name)  # SegmentTaken (never mapped nor removed) when another user holds it
    except SegmentTaken:
        raise
    except RingError:
        ShmTransport.unlink_name(name)
        return
    try:
        why = live_engine(old)
    finally:
        old.close()
    if why:
        raise RingError(f"ring {name}: already served by {why}")
    ShmTransport.unlink_name(name)


def live_engine(old: Transport) -> str | None:
    """What makes an existing segment's engine live (for the refusal), or None when the segment is stale."""
    if old.size < L.RINGHEADER_DTYPE.itemsize or old.load64(HEADER_OFF["magic"]) != MAGIC:
        return None
    pid, state = old.load32(HEADER_OFF["engine_pid"]), old.load32(HEADER_OFF["engine_state"])
    if state == L.EngineState.STOPPED:
        return None
    if same_pid_namespace(old.load32(HEADER_OFF["engine_pid_ns"])):  # this process is not its own segment's engine
        return f"live engine pid {pid}" if pid != os.getpid() and pid_alive(pid) else None
    # another PID namespace (a container restarted, or another one sharing /dev/shm): its pid means nothing here;
    # live while its heartbeat moves. One still loading (no beat yet) is taken for stale: a container that died
    # starting and was restarted must not be refused for good.
    beat = old.load64(HEADER_OFF["heartbeat"])
    end = time.monotonic() + STALE_WATCH_S
    while time.monotonic() < end:
        time.sleep(0.05)
        if old.load64(HEADER_OFF["heartbeat"]) != beat:
            return f"a live engine of another PID namespace (its pid {pid}), whose heartbeat moves"
    return None


def attach_shm_ring(name: str) -> Ring:
    transport = ShmTransport.attach(name)
    try:
        return attach_ring(transport, name)
    except BaseException:
        transport.close()
        raise


def local_ring(geometry: RingGeometry) -> Ring:
    """A ring in private memory (tests and in-process tools)."""
    return init_ring(MemoryTransport(bytearray(geometry.segment_bytes)), geometry, "local")
