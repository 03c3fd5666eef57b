"""The persistent scheduler's library built here with nvcc (no GPU needed): its ctypes mirrors match
and it refuses configurations it cannot serve before touching the device."""

from __future__ import annotations

import ctypes as C
import shutil
from pathlib import Path

import pytest

from gpu_engine.gpu import persistent as pers

pytestmark = pytest.mark.skipif(
    not (shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()), reason="needs nvcc"
)


@pytest.fixture(scope="module")
def lib() -> pers.Library:
    return pers.library()  # checks the SchedConfig and SchedStats mirrors against the library


def create(lib: pers.Library, **fields: int) -> str:
    cfg = pers.SchedConfig(max_batch=16, copies=1, num_graphs=1, num_slots=64)
    for name, value in fields.items():
        setattr(cfg, name, value)
    handle, stats = pers.P(), C.POINTER(pers.SchedStats)()
    rc = lib.lib.blink_sched_create(C.byref(cfg), C.byref(handle), C.byref(stats))
    assert rc == -1, "a refused configuration must fail before any CUDA call"
    return lib.lib.blink_last_error().decode()


def test_flip_scan_covers_at_most_4096_slots(lib: pers.Library) -> None:
    assert "scan_flips" in create(lib, num_slots=4097, scan_flips=1)


def test_more_slots_than_the_scan_threads_hold_are_refused(lib: pers.Library) -> None:
    assert "slots 8193" in create(lib, num_slots=8193, scan_flips=0)


def test_phase_clocks_are_a_separate_build_with_the_same_structs() -> None:
    plain, clocks = pers.library_path(), pers.library_path(phase_clocks=True)
    assert plain != clocks and plain.parent == clocks.parent
    lib = pers.Library(pers.build_library(phase_clocks=True))  # the size checks of both mirrors again
    assert lib.lib.blink_sched_stats_size() == C.sizeof(pers.SchedStats)


def test_a_score_graph_without_its_buffers_or_launch_headroom_is_refused(lib: pers.Library) -> None:
    """Prompt log-probs need the score graph's executables and buffers, and room in every window for the score
    launches of the largest step (the device's 120 launches per execution)."""
    assert "score graph" in create(lib, score_rows=256, score_top=2, score_max_pieces=8, prompt_logprob_rows=64)
    parts = {name: 64 for name in ("score_exec", "score_counter", "score_index", "score_targets", "score_logprobs",
                                   "score_ranks", "score_top_ids", "score_top_logprobs")}
    assert "200 score launches" in create(lib, score_rows=16, score_top=2, score_max_pieces=200,
                                          prompt_logprob_rows=64, **parts)


def test_a_zero_batch_block_size_or_token_grain_is_refused(lib: pers.Library) -> None:
    """The device divides by each (rows a thread, tokens a block, the step's token grain)."""
    for zero in ("max_batch", "block_size", "token_grain"):
        fields = {"block_size": 16, "token_grain": 16, zero: 0}
        assert f"{zero} 0" in create(lib, **fields) and "(each >= 1)" in create(lib, **fields)
