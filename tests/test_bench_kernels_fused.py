"""bench.kernels' fused-form rows without a GPU: every case it would time runs, on tiny shapes in the Triton
interpreter, and does what its name says (so that a broken case shows here, not in a GPU run)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bench.kernels as bk  # noqa: E402

# the Llama-3-8B's four projections shrunk: 4 query and 2 KV heads of 16, hidden 64, intermediate 96
TINY = (("qkv", (4 + 2 * 2) * 16, 64), ("o", 64, 64), ("gate_up", 192, 64), ("down", 64, 96))


def test_fused_rows_time_each_form_against_what_it_replaces(monkeypatch):
    calls = []

    def once(fn, *args, **kwargs):  # what graph_ms would capture and replay: one call of the step
        calls.append(fn())
        return 1e-3

    monkeypatch.setattr(bk, "graph_ms", once)
    monkeypatch.setattr(bk, "entry", lambda ms, nbytes, gbps: {"ms": ms, "bytes": nbytes})
    rows = bk.fused_rows(1000.0, copies=2, shapes=TINY, heads=(4, 2, 16), batches=(1, 3), device="cpu",
                         dtype=torch.float32)
    cases = {(r["kernel"], r["case"]) for r in rows}
    for config in bk.FUSED_CANDIDATES:
        assert {("fused_qkv", config), ("fused_qkv", f"apart_{config}"), ("fused_gate_up", config),
                ("fused_gate_up", f"apart_{config}"), ("fused_o", f"{config}_add"),
                ("fused_down", f"{config}_add")} <= cases
    assert {("fused_qkv", "apart_cublas"), ("fused_gate_up", "apart_cublas"), ("fused_o", "cublas"),
            ("fused_down", "cublas")} <= cases
    assert len(rows) == len(calls) == 2 * (4 * (2 * len(bk.FUSED_CANDIDATES) + 1))
    # the glu case's output is the unfused case's (silu(gate) * up of the normalised x): [rows, 96]
    glu = [c for r, c in zip(rows, calls, strict=True) if r["kernel"] == "fused_gate_up" and r["batch"] == 3]
    assert all(tuple(c.shape) == (3, 96) for c in glu)
    torch.testing.assert_close(glu[0], glu[1], rtol=1e-4, atol=1e-4)
