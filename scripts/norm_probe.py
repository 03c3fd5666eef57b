"""Where does the fused RMSNorm's cost in the tiled linear come from? A bisecting probe.

On the H200 the tiled linear with the RMSNorm fused into its x tiles (`tiled_linear(..., norm=...)`) measured 1.8x
the plain product at one row (gate_up of Llama-3-8B, n128_k64_s4_w8: 105.8 against 59.1 us), while the SiLU as its
output cost nothing. Compiled for sm_90 (Triton 3.6, as on the H200) the two main loops are pipelined alike (the
same stages of loads in flight) and differ by some 40 instructions a K step, which should not cost that much. This
probe times one loop in eight forms (a constexpr MODE of one kernel, else the same code):

    plain     acc += x @ w.T                                          (the plain product)
    weight    x times the norm's weight (rounded) before the dot      (half of the fused norm)
    squares   the rows' squares summed from the x tiles, 1 / RMS after (the other half)
    both      weight and squares: the fused norm as the engine has it
    prologue  1 / RMS from a loop over x before the main loop (x is small and stays in L2), the norm's weight folded
              into w beforehand (w * weight along K), then the plain loop: a design whose loop is the plain one's
    dotsq     the squares as the diagonal of x @ x.T, a second small dot on the same x tile (its fp32 sums of exact
              bf16 products), so that x never leaves the dot's operands
    both_dot  weight, with the squares as dotsq takes them
    fold_dot  the norm's weight folded into w (as prologue) and the squares as dotsq: the plain loop and one more dot

beside the engine's own `tiled_linear` plain and with `norm=` (the same configuration), at 1 and 8 rows. Each form is
checked against a float32 reference first (outputs poisoned with NaN), then timed in a CUDA graph that cycles through
enough copies of the weight to leave the 50 MB L2 cold; the median of --iters replays, us a call, and GB/s of the
weight against a device copy timed in the same run.

    python3 scripts/norm_probe.py --out OUT/norm_probe.json                 # the H200: gate_up's shape and plan
    python3 scripts/norm_probe.py --shape 6144,4096 --config n64_k128_s4    # qkv's
    TRITON_INTERPRET=1 python3 scripts/norm_probe.py --check-only --device cpu --dtype float32 --shape 64,256 \
        --config n32_k128_s4 --rows 1,3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # gpu_engine, when run as scripts/norm_probe.py

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MODES = ("plain", "weight", "squares", "both", "prologue", "dotsq", "both_dot", "fold_dot")
FOLDED = ("prologue", "fold_dot")  # the modes that take w with the norm's weight in it
EPS = 1e-5


@triton.jit
def _probe_kernel(x_ptr, w_ptr, nw_ptr, out_ptr, M, N, K, eps, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """out [M, N] = the MODE's product of x [M, K] and w [N, K] (module docstring); a program per BLOCK_N columns."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    rows = w_ptr + n[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    gram = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)  # dotsq, both_dot, fold_dot: x @ x.T, its diagonal the squares
    if MODE == 4:  # prologue: the rows' squares first, from x alone
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xf = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                         other=0.0).to(tl.float32)
            sq += xf * xf
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        if MODE == 2 or MODE == 3:
            xf = x.to(tl.float32)
            sq += xf * xf
        if MODE >= 5:
            gram += tl.dot(x, tl.trans(x), input_precision=PREC)
        if MODE == 1 or MODE == 3 or MODE == 6:
            nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * nw[None, :]).to(x_ptr.dtype.element_ty)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
    if MODE >= 5:
        sq = tl.where(m[:, None] == tl.arange(0, BLOCK_M)[None, :], gram, 0.0)
    if MODE >= 2:
        acc = acc * tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def probe(x: torch.Tensor, w: torch.Tensor, nw: torch.Tensor, out: torch.Tensor, mode: str, block_n: int,
          block_k: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """One launch of the probe kernel in `mode` (for the FOLDED modes, `w` is the weight with the norm's folded in)."""
    M, K = x.shape
    N = w.shape[0]
    block_m = max(16, triton.next_power_of_2(M))
    _probe_kernel[(triton.cdiv(N, block_n),)](x, w, nw, out, M, N, K, EPS, MODE=MODES.index(mode), BLOCK_M=block_m,
                                              BLOCK_N=block_n, BLOCK_K=block_k,
                                              PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
                                              num_stages=num_stages)
    return out


def reference(x: torch.Tensor, w: torch.Tensor, nw: torch.Tensor, mode: str) -> torch.Tensor:
    """The float32 result each mode should give (to bf16 rounding)."""
    xf, wf, nwf = x.float(), w.float(), nw.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + EPS)
    if mode == "plain":
        return xf @ wf.T
    if mode == "weight":
        return (xf * nwf) @ wf.T
    if mode in ("squares", "dotsq"):
        return xf @ wf.T * rstd
    return (xf * nwf) @ wf.T * rstd  # both, both_dot, prologue and fold_dot (w * nw folded: the same product)


def check(modes, x, w, w_folded, nw, cfg, device: str) -> dict[str, float]:
    """Each mode's largest error against its reference, relative to the reference's largest magnitude; raises past
    a bf16 bound (or where the poisoned output was not written)."""
    errs = {}
    for mode in modes:
        out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=device)
        probe(x, w_folded if mode in FOLDED else w, nw, out, mode, *cfg)
        want = reference(x, w, nw, mode)
        err = float((out.float() - want).abs().max() / want.abs().max())
        if not err < 1e-2:
            raise SystemExit(f"norm probe: {mode} off its reference by {err:.3g} (NaN: output not written)")
        errs[mode] = err
    return errs


def _time_us(fn, copies: int, iters: int) -> float:
    """Median us a call of fn(i) over `iters` replays of a graph that calls it once for each of `copies` inputs."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times)


def time_forms(x, ws, folded, nw, cfg, c, iters: int) -> dict[str, float]:
    """us a call of each probe form, and of the engine's tiled linear plain and with the norm (configuration `c`),
    each cycling through the weight copies `ws` (`folded`: the same with the norm's weight in them)."""
    from gpu_engine.kernels.tiled_linear import tiled_linear, tiled_scratch

    M, N, K = x.shape[0], ws[0].shape[0], x.shape[1]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    times = {}
    for mode in MODES:
        src = folded if mode in FOLDED else ws
        times[mode] = _time_us(lambda i, mode=mode, src=src: probe(x, src[i], nw, out, mode, *cfg), len(ws), iters)
    eng = dict(block_n=c.block_n, block_k=c.block_k, per_sm=c.per_sm, num_warps=c.num_warps, num_stages=c.num_stages,
               scratch=tiled_scratch([(N, K)], [c], x.device))
    times["engine_plain"] = _time_us(lambda i: tiled_linear(x, ws[i], out=out, **eng), len(ws), iters)
    times["engine_norm"] = _time_us(lambda i: tiled_linear(x, ws[i], out=out, norm=(nw, EPS), **eng), len(ws), iters)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="28672,4096", help="N,K of the weight (default: Llama-3-8B's gate_up)")
    ap.add_argument("--config", default="n128_k64_s4_w8", help="a kernels.tiled_linear.TILED_CONFIGS name")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="float32 for the interpreter, whose dot takes bf16 tiles wrongly")
    ap.add_argument("--check-only", action="store_true", help="check each form against its reference, no timing")
    ap.add_argument("--out", type=Path, help="the results as JSON")
    args = ap.parse_args()
    from gpu_engine.kernels.tiled_linear import TILED_CONFIGS, tiled_stages

    if args.config not in TILED_CONFIGS:
        raise SystemExit(f"--config: one of {', '.join(TILED_CONFIGS)}")
    c = TILED_CONFIGS[args.config]
    N, K = (int(v) for v in args.shape.split(","))
    dev, dt = args.device, getattr(torch, args.dtype)
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("norm probe: no CUDA device (--check-only --device cpu under TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    wsize = N * K * dt.itemsize
    copies = 1 if args.check_only else max(2, -(-(200 << 20) // wsize))  # >= 200 MB of weights: L2 stays cold
    ws = [(torch.randn(N, K, device=dev) * 0.02).to(dt) for _ in range(copies)]
    nw = (1.0 + 0.1 * torch.randn(K, device=dev)).to(dt)
    folded = [(w.float() * nw.float()).to(dt) for w in ws]
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "shape": [N, K], "dtype": args.dtype,
              "config": args.config, "triton": triton.__version__, "rows": []}
    if dev == "cuda" and not args.check_only:
        from bench.kernels import copy_gbps  # timed outside a graph: a captured copy is not the ceiling

        result["copy_gbps"] = copy_gbps()
    for M in (int(r) for r in args.rows.split(",")):
        x = torch.randn(M, K, device=dev).to(dt)
        block_m = max(16, triton.next_power_of_2(M))
        cfg = (c.block_n, c.block_k, c.num_warps,
               tiled_stages(c.num_stages, block_m, c.block_n, c.block_k, False, dt.itemsize))
        row = {"rows": M, "errors": check(MODES, x, ws[0], folded[0], nw, cfg, dev)}
        if not args.check_only:
            row.update(time_forms(x, ws, folded, nw, cfg, c, args.iters))
            row["floor_us"] = wsize / (result["copy_gbps"] * 1e9) * 1e6
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if not args.check_only:
        print(f"{'rows':>4} " + " ".join(f"{k:>13}" for k in (*MODES, "engine_plain", "engine_norm", "floor_us")))
        for row in result["rows"]:
            print(f"{row['rows']:>4} " + " ".join(f"{row[k]:>13.1f}" for k in
                                                   (*MODES, "engine_plain", "engine_norm", "floor_us")))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
