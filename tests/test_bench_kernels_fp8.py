"""bench.kernels' FP8 rows without a GPU: every case it would time runs on tiny shapes in the Triton interpreter and
gives the product it names (so that a broken case shows here, not in a GPU run)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bench.kernels as bk  # noqa: E402
from gpu_engine.kernels.fp8_gemv import FMA_ROWS, FP8_CONFIGS  # noqa: E402

TINY = (("o", 64, 64), ("gate_up", 96, 64))


def test_fp8_rows_time_each_case_and_each_gives_the_product(monkeypatch):
    calls = []

    def once(fn, *args, **kwargs):  # what graph_ms would capture and replay: one call of the step
        calls.append(fn().clone())
        return 1e-3

    monkeypatch.setattr(bk, "graph_ms", once)
    rows = bk.fp8_rows(1000.0, copies=1, shapes=TINY, batches=(1, 8), device="cpu", dtype=torch.float32)
    assert len(rows) == len(calls)
    for M in (1, 8):
        configs = {n for n, c in FP8_CONFIGS.items() if c.form != "fma" or M <= FMA_ROWS}
        for name, _, _ in TINY:
            got = {r["case"]: c for r, c in zip(rows, calls, strict=True) if r["kernel"] == f"fp8_{name}"
                   and r["batch"] == M}
            glu = {"gemv_glu", "gemv_then_silu"} if name == "gate_up" else set()
            assert set(got) == configs | {"gemv", "fp8_linear", "cublas_bf16"} | glu
            for case in configs | {"gemv"}:  # every FP8 case the same product, near fp8_linear's (x to FP8)
                torch.testing.assert_close(got[case], got["gemv"], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got["gemv"], got["fp8_linear"], rtol=0.1, atol=0.1 * got["gemv"].abs().max())
            if glu:
                torch.testing.assert_close(got["gemv_glu"], got["gemv_then_silu"], rtol=1e-4, atol=1e-4)
    fp8 = next(r for r in rows if r["case"] == "gemv" and r["kernel"] == "fp8_o" and r["batch"] == 8)
    dense = next(r for r in rows if r["case"] == "cublas_bf16" and r["kernel"] == "fp8_o" and r["batch"] == 8)
    assert fp8["bytes"] == 64 * 64 + 64 * 4 + 2 * 8 * 64 * 4  # codes, scales, x and out (fp32 here)
    assert dense["bytes"] == 64 * 64 * 4 + 2 * 8 * 64 * 4
    assert fp8["floor_ms"] == fp8["fp8_floor_ms"] == dense["fp8_floor_ms"]
