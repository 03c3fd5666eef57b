"""bench/overlap_probe: the arithmetic of two graphs' overlap (time both ran, from kernel intervals), the verdicts,
the splits it parses, its table and how a failing mode is recorded, on made-up numbers (the probe itself needs a
CUDA device)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import overlap_probe as probe


def test_splits_are_sorted_unique_and_leave_the_prefill_graph_and_the_scheduler_an_sm() -> None:
    assert probe.parse_splits("64, 32,32") == (32, 64)
    assert probe.parse_splits("130", total=132) == (130,)
    for bad in ("a,32", "0", "-8"):
        with pytest.raises(ValueError):
            probe.parse_splits(bad)
    with pytest.raises(ValueError, match="below 131"):
        probe.parse_splits("32,131", total=132)


def test_union_and_the_time_two_sets_run_at_once() -> None:
    assert probe.union([(5, 8), (0, 2), (1, 3), (8, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert probe.both_us([(0, 10), (20, 30)], [(5, 25)]) == 10.0
    assert probe.both_us([(0, 10)], [(10, 20)]) == 0.0
    assert probe.both_us([], [(0, 1)]) == 0.0
    assert probe.both_us([(0, 4), (2, 6)], [(1, 3), (5, 7)]) == 3.0  # each set's own overlaps count once


def test_time_two_or_more_intervals_run_at_once() -> None:
    assert probe.concurrent_us([(0, 10), (5, 15), (20, 30)]) == 5.0
    assert probe.concurrent_us([(0, 10), (2, 4), (3, 8)]) == 6.0  # three at once counts once
    assert probe.concurrent_us([(0, 5), (5, 10)]) == 0.0
    assert probe.concurrent_us([]) == 0.0


def test_overlap_by_stream_where_two_else_by_any_two_kernels() -> None:
    kernels = [("gemm", 0.0, 40.0, 7), ("norm", 40.0, 50.0, 7), ("_prefill_kernel", 30.0, 90.0, 9),
               ("launch_pair", 0.0, 100.0, 3)]  # the parent's kernel is not the steps' work
    got = probe.overlap(kernels, shorter_us=50.0)
    assert got["method"] == "streams" and got["streams"] == 2 and got["kernels"] == 3
    assert got["overlap_us"] == 20.0 and got["fraction"] == pytest.approx(0.4)
    one = probe.overlap([("a", 0.0, 10.0, 1), ("b", 5.0, 20.0, 1), ("c", 30.0, 40.0, 1)], shorter_us=10.0)
    assert one["method"] == "any two kernels" and one["fraction"] == pytest.approx(0.5)
    assert probe.overlap([("launch_child", 0.0, 5.0, 1)], 10.0)["fraction"] is None  # nothing recorded


def test_verdicts() -> None:
    assert probe.verdict(20.0, 30.0, 0.8).startswith("overlap yes: 1.50x vs sequential (20.00 vs 30.00 ms)")
    assert "together 80%" in probe.verdict(20.0, 30.0, 0.8)
    assert probe.verdict(30.0, 30.0, 0.2).startswith("overlap yes: 1.00x")  # kernels ran together, no gain
    assert probe.verdict(30.0, 30.0, 0.01).startswith("overlap no")
    assert probe.verdict(31.0, 30.0, None).startswith("overlap no") and "kernels not recorded" in probe.verdict(
        31.0, 30.0, None)


def test_a_mode_is_judged_against_its_baseline_only_where_both_exist() -> None:
    entry = {"launch": "host", "pair_ms": 25.0, "overlap": {"fraction": 0.5}}
    got = probe.judged(entry, 30.0)
    assert got["speedup"] == pytest.approx(1.2) and got["baseline_ms"] == 30.0
    assert got["verdict"].startswith("overlap yes")
    assert probe.judged(entry, None) == entry
    assert probe.judged({"error": "x"}, 30.0) == {"error": "x"}


def result_of() -> dict:
    host = probe.judged({"launch": "host", "partition": "none", "decode_ms": 11.0, "prefill_ms": 21.0,
                         "pair_ms": 26.0, "sequential_ms": 32.0, "overlap": {"fraction": 0.6},
                         "done_in_pair_ms": {"decode": 15.5, "prefill": 26.0}}, 32.0)
    return {"device": "made-up", "plan": "cublas", "sms": 132, "decodes": 128, "chunk": 896,
            "modes": {"host": host, "green 32/device": {"launch": "device", "error": "RuntimeError: refused"}}}


def test_table_rows_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = probe.table(result_of())
    assert lines[0].startswith("made-up, plan cublas, 132 SMs: 128 decodes and a 896-token prompt chunk")
    row = next(line for line in lines if line.startswith("host "))
    assert row.split() == ["host", "-/-", "11.00", "21.00", "26.00", "32.00", "1.23x", "60%"]
    assert any(line.strip().startswith("overlap yes: 1.23x") for line in lines)
    assert "    ERROR RuntimeError: refused" in lines
    assert "    in the pair, decode done at 15.50 ms, prefill at 26.00 ms" in lines
    path = tmp_path / "o.json"
    path.write_text(json.dumps(result_of()))
    probe.main(["--out", str(path), "--table-only"])
    assert "green 32/device" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="splits"):
        probe.main(["--out", str(path), "--table-only", "--splits", "x"])


def test_a_failing_mode_is_recorded_and_the_file_saved(capsys: pytest.CaptureFixture[str]) -> None:
    result: dict = {"modes": {}, "baseline": {"host": 32.0}}
    saved = []

    def broken() -> list[dict]:
        raise RuntimeError("capture failed")

    probe.guarded(result, ["cublas 32/host", "cublas 32/device"], broken, lambda: saved.append(1))
    assert saved and all(result["modes"][n]["error"] == "RuntimeError: capture failed" for n in result["modes"])
    entries = [{"launch": "host", "pair_ms": 16.0}, probe.attempt("device", lambda: {}["missing"])]
    probe.guarded(result, ["a/host", "a/device"], lambda: entries, lambda: None)
    assert result["modes"]["a/host"]["speedup"] == 2.0
    assert result["modes"]["a/device"]["error"] == "KeyError: 'missing'"
    assert "a/host, a/device: done" in capsys.readouterr().out
    probe.guarded(result, ["beside"], broken, lambda: None)  # a mode of one entry fails as one entry
    assert result["modes"]["beside"]["error"] == "RuntimeError: capture failed"


def test_a_timeout_ends_the_run_after_writing_what_was_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def stuck() -> list[dict]:
        raise TimeoutError("did not finish within 1.0 s")

    def leave(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(probe.os, "_exit", leave)
    result: dict = {"modes": {}}
    saved = []
    with pytest.raises(SystemExit) as exit_:
        probe.guarded(result, ["green 32/host", "green 32/device"], stuck, lambda: saved.append(dict(result)))
    assert exit_.value.code == 3 and saved
    assert result["aborted"].startswith("green 32/host") and "timeout" in result["modes"]["green 32/device"]["error"]
    with pytest.raises(TimeoutError):
        probe.attempt("host", stuck)


def test_each_graphs_finish_is_the_median_over_the_launches() -> None:
    samples = [[15.0, 30.0], [14.0, 33.0], [16.0, 31.0]]
    assert probe.finished(samples, ("decode", "prefill")) == {"decode": 15.0, "prefill": 31.0}


def test_decodes_beside_a_chunk_are_tabled_as_each_steps_own_time() -> None:
    entry = {"launch": "host", "decode_ms": 14.0, "prefill_ms": 22.0, "mixed_ms": 32.0,
             "beside": {"1": {"decode 1": 16.0, "chunk": 30.0},
                        "2": {"decode 1": 16.5, "decode 2": 35.0, "chunk": 31.0}}}
    lines = probe.beside_lines(entry)
    assert lines[0] == "    mixed step alone 32.00 ms"
    assert lines[1] == "    1 decode(s) beside the chunk: each 16.00 ms; chunk done at 30.00 ms"
    assert lines[2] == "    2 decode(s) beside the chunk: each 16.50, 18.50 ms; chunk done at 31.00 ms"
    assert probe.beside_lines({"decode_ms": 1.0}) == []
    table = "\n".join(probe.table({"modes": {"beside": entry}}))
    assert "each 16.50, 18.50 ms" in table


@pytest.mark.skipif(not (shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()), reason="needs nvcc")
def test_the_overlap_diagnostics_build_apart_and_answer_without_a_device() -> None:
    """bench/csrc/overlap_probe.cu builds as a library of its own (the engine's scheduler library exports none of
    its entry points); they bind, with no executables a pair launch times nothing on a GPU, and where there is none
    it, the green split and the launch priorities return a CUDA error with its message."""
    import ctypes as C

    from bench.overlap_probe import bind, probe_library
    from gpu_engine.gpu import persistent as pers

    assert not hasattr(pers.library().lib, "blink_launch_pair")
    with pytest.raises(pers.SchedulerError, match="host launch failed"):  # no executable (and here no device)
        pers.library().launch_once(0, device=False)
    f = bind(probe_library()).lib
    ms, err = (C.c_float * 2)(), (C.c_int * 2)(-7, -7)
    rc = f.blink_launch_pair(0, 0, 0, 2, 1.0, ms, err)
    assert list(err) == [0, 0]
    assert rc == 0 or "cuda" in f.blink_last_error().decode().lower()
    handle, streams, sms = C.c_void_p(), (C.c_uint64 * 2)(), (C.c_uint * 2)()
    rc = f.blink_green_split(0, 16, C.byref(handle), streams, sms)
    if rc == 0:
        assert sms[0] >= 16 and sms[1] > 0 and all(streams)
        assert f.blink_green_destroy(handle) == 0
    else:
        assert f.blink_last_error().decode()
    least, greatest = C.c_int(7), C.c_int(7)
    rc = f.blink_priority_range(C.byref(least), C.byref(greatest))
    if rc == 0:
        assert greatest.value <= least.value  # lower is more urgent
    else:
        assert "cudaDeviceGetStreamPriorityRange" in f.blink_last_error().decode()
    exec_, kernels = C.c_uint64(), C.c_int()
    if rc != 0:  # no device: the node walk fails with its CUDA error, never a crash
        assert f.blink_priority_exec(0, 0, 0, C.byref(exec_), C.byref(kernels)) != 0
        assert f.blink_last_error().decode()
