"""Does Programmatic Dependent Launch (PDL) pay off for a decode-like chain of small Triton kernels in a CUDA graph,
and can a graph captured with PDL edges be instantiated for device launch and launched from the device?

The chain imitates a batch-1 decode step of a Llama-8B-shaped model, 8 kernels a layer, each reading the previous
one's output: qkv GEMV [6144, 4096], scale, o GEMV [4096, 4096], residual mean, gate_up GEMV [2F, 4096], sigmoid(g) * u,
down GEMV [4096, F], residual mean. F follows --mb-per-layer (416 MiB: F = 14336, the real layer); each layer has its
own bf16 weights, so 32 layers stream ~14 GB from HBM. Variants (one kernel source, constexpr flags): plain (no PDL);
pdl_wait_first (launch_pdl=True; gdc_wait() first, then gdc_launch_dependents()); pdl_prefetch (launch_pdl=True; the
GEMV triggers its dependents and loads its first weight tile before gdc_wait(), then reads x). Each is run with its
outputs poisoned (NaN), must equal plain bit for bit and a torch fp32 reference within 1e-3; its graph replay is timed
(median of --iters, CUDA events; GB/s of weights); the captured cudaGraph_t's edge kinds are counted; then it is
instantiated for device launch and launched from the host and from the device (blink_launch_once, as
scripts/diag_launch.py), checked against the replay; wall times per call include blink_launch_once's set-up.

    bash scripts/gpu_run.sh OUT build      # builds the scheduler library (blink_launch_once)
    python3 scripts/pdl_probe.py --out OUT/pdl_probe.json
    python3 scripts/pdl_probe.py --ptx-check   # no GPU: compile for sm_90 and look for griddepcontrol in the PTX
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts: device-launched graphs need it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # gpu_engine, when run as scripts/pdl_probe.py

import argparse  # noqa: E402
import ctypes as C  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

H, Q = 4096, 6144  # hidden size, qkv rows (Llama-3-8B)
BLOCK_N, BLOCK_K, BLOCK_E, SCALE = 16, 512, 1024, 0.5


@dataclass(frozen=True)
class Variant:
    name: str
    pdl: bool
    prefetch: bool


VARIANTS = (Variant("plain", False, False), Variant("pdl_wait_first", True, False), Variant("pdl_prefetch", True, True))


@triton.jit
def _linear(w_ptr, x_ptr, y_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
            PREFETCH: tl.constexpr):
    """y[rows] = W[rows, :] @ x, one program per BLOCK_N rows, fp32 accumulation; K % BLOCK_K == 0."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    if PREFETCH:  # the weights are nobody's output: load the first tile while the previous kernel finishes
        gdc_launch_dependents()
        w = tl.load(w_ptrs)
        gdc_wait()
    else:
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()
        w = tl.load(w_ptrs)
    acc = w.to(tl.float32) * tl.load(x_ptr + cols)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptrs + k0)
        acc += w.to(tl.float32) * tl.load(x_ptr + k0 + cols)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1))


@triton.jit
def _pointwise(a_ptr, r_ptr, out_ptr, n, scale, MODE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """MODE 0: out = a * scale; 1: out = (a + r) * scale; 2: out = sigmoid(a[:n]) * a[n:2n] (bounded: no value
    grows layer over layer, so 32 layers stay finite)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m)
    if MODE == 0:
        out = a * scale
    elif MODE == 1:
        out = (a + tl.load(r_ptr + offs, mask=m)) * scale
    else:
        out = tl.sigmoid(a) * tl.load(a_ptr + n + offs, mask=m)
    tl.store(out_ptr + offs, out, mask=m)


class Chain:
    """Weights, one fp32 arena (x0 first, then every kernel's output) and the op list over arena offsets."""

    def __init__(self, layers: int, mb_per_layer: float) -> None:
        f = round((mb_per_layer * 2**20 / (2 * H) - Q - H) / 3 / BLOCK_K) * BLOCK_K
        self.f = f = max(f, BLOCK_K)
        self.plan: list[tuple] = []
        self.weights: list[torch.Tensor] = []
        x, cursor, sizes = 0, H, (Q, H, H, H, 2 * f, f, H, H)
        for _ in range(layers):
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16).mul_(k**-0.5)
                  for n, k in ((Q, H), (H, H), (2 * f, H), (H, f))]
            self.weights += ws
            t0, t1, t2, x1, t3, t4, t5, xn = (cursor + sum(sizes[:i]) for i in range(len(sizes)))
            cursor += sum(sizes)
            self.plan += [("lin", ws[0], x, t0, Q, H), ("pw", 0, t0, t0, t1, H), ("lin", ws[1], t1, t2, H, H),
                          ("pw", 1, t2, x, x1, H), ("lin", ws[2], x1, t3, 2 * f, H), ("pw", 2, t3, t3, t4, f),
                          ("lin", ws[3], t4, t5, H, f), ("pw", 1, t5, x1, xn, H)]
            x = xn
        self.arena = torch.empty(cursor, device="cuda")
        self.arena[:H].normal_()
        self.weight_bytes = sum(w.numel() * w.element_size() for w in self.weights)

    def poison(self) -> None:
        self.arena[H:].fill_(float("nan"))

    def launch(self, var: Variant) -> None:
        a, kw = self.arena, ({"launch_pdl": True} if var.pdl else {})
        for op in self.plan:
            if op[0] == "lin":
                _, w, xi, yo, n, k = op
                _linear[(n // BLOCK_N,)](w, a[xi:], a[yo:], k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, USE_PDL=var.pdl,
                                         PREFETCH=var.prefetch, num_warps=4, **kw)
            else:
                _, mode, ai, ri, oi, n = op
                _pointwise[(triton.cdiv(n, BLOCK_E),)](a[ai:], a[ri:], a[oi:], n, SCALE, MODE=mode, BLOCK=BLOCK_E,
                                                       USE_PDL=var.pdl, num_warps=4, **kw)

    def reference(self) -> torch.Tensor:
        r = self.arena.clone()
        for op in self.plan:
            if op[0] == "lin":
                _, w, xi, yo, n, k = op
                r[yo:yo + n] = w.float() @ r[xi:xi + k]
            else:
                _, mode, ai, ri, oi, n = op
                a = r[ai:ai + n]
                r[oi:oi + n] = (a * SCALE if mode == 0 else (a + r[ri:ri + n]) * SCALE if mode == 1
                                else torch.sigmoid(a) * r[ai + n:ai + 2 * n])
        return r[-H:]


def edge_kinds(raw_graph: int) -> dict[str, int] | str:
    """How many edges of each kind (type/from_port) the captured graph has: PDL ones are type 1 (programmatic)."""
    try:
        from cuda.bindings import runtime as rt

        graph = rt.cudaGraph_t(init_value=raw_graph)
        err, *_, n = rt.cudaGraphGetEdges(graph, 0)
        err, _, _, data, n = rt.cudaGraphGetEdges(graph, n) if int(err) == 0 else (err, 0, 0, [], 0)
        if int(err) != 0:
            return f"cudaGraphGetEdges failed: {err}"
        return dict(Counter(f"type{int(getattr(d.type, 'value', d.type))}/port{int(d.from_port)}" for d in data[:n]))
    except Exception as exc:  # noqa: BLE001
        return f"unknown: {exc}"


def replay_phase(chain: Chain, var: Variant, iters: int, plain: torch.Tensor | None, ref: torch.Tensor,
                 res: dict[str, Any]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    chain.poison()
    chain.launch(var)  # eager: compiles, and raises here when launch_pdl is not accepted
    torch.cuda.synchronize()
    eager = chain.arena.clone()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        chain.launch(var)
    if hasattr(graph, "instantiate"):
        graph.instantiate()
    res["edges"] = edge_kinds(int(graph.raw_cuda_graph()))
    chain.poison()
    graph.replay()
    torch.cuda.synchronize()
    out = chain.arena.clone()
    err = float((out[-H:] - ref).abs().max())
    same = True if var.name == "plain" else None if plain is None else torch.equal(out, plain)
    res.update(replay_equals_eager=torch.equal(out, eager), equal_to_plain=same,
               max_abs_err=err if math.isfinite(err) else None,
               ref_ok=math.isfinite(err) and err <= 1e-3 * max(1.0, float(ref.abs().max())))
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)
    res.update(us_replay_p50=round(us, 1), gbps=round(chain.weight_bytes / us / 1e3, 1))
    return graph, out


def device_phase(chain: Chain, var: Variant, graph: torch.cuda.CUDAGraph, replay: torch.Tensor, lib: Any,
                 reps: int, res: dict[str, Any]) -> None:
    try:
        from cuda.bindings import runtime as rt

        from gpu_engine.gpu.graph_cache import instantiate_for_device_launch

        exec_h = instantiate_for_device_launch(int(graph.raw_cuda_graph()), torch.cuda.current_stream().cuda_stream)
    except Exception as exc:  # noqa: BLE001
        print(f"FAIL {var.name} instantiate: {exc}", flush=True)
        res["device_launch"] = res["host_launch_of_device_exec"] = f"FAIL: instantiate: {exc}"
        return
    for how, key in (("host", "host_launch_of_device_exec"), ("device", "device_launch")):
        walls: list[float] = []
        attempt = 1
        try:
            for attempt in range(1, reps + 1):  # noqa: B007  (named in the failure)
                chain.poison()
                torch.cuda.synchronize()
                err = C.c_int(0)
                t0 = time.perf_counter()
                lib.check(lib.lib.blink_launch_once(exec_h, int(how == "device"), C.byref(err)), how)
                walls.append((time.perf_counter() - t0) * 1e6)
                if err.value:
                    raise RuntimeError(f"device-side cudaGraphLaunch returned {err.value}")
                torch.cuda.synchronize()
                if not torch.equal(chain.arena, replay):
                    raise RuntimeError(f"result differs from the replay ({int(chain.arena.isnan().sum())} NaN)")
            res[key], res[f"us_{how}_launch_wall_p50"] = "ok", round(statistics.median(walls), 1)
        except Exception as exc:  # noqa: BLE001
            print(f"FAIL {var.name} {how}: launch {attempt}: {exc}", flush=True)
            res[key] = f"FAIL: launch {attempt}: {exc}"
    rt.cudaGraphExecDestroy(rt.cudaGraphExec_t(init_value=exec_h))


def ptx_check() -> dict[str, Any]:
    """Compile both kernels for sm_90 without a GPU; where griddepcontrol lands in the PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    found: dict[str, Any] = {}
    for var in VARIANTS:
        for name, fn, sig, consts in (
                ("linear", _linear, {"w_ptr": "*bf16", "x_ptr": "*fp32", "y_ptr": "*fp32", "K": "i32"},
                 {"BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "USE_PDL": var.pdl, "PREFETCH": var.prefetch}),
                ("pointwise", _pointwise, {"a_ptr": "*fp32", "r_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                                           "scale": "fp32"}, {"MODE": 1, "BLOCK": BLOCK_E, "USE_PDL": var.pdl})):
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # as a launch specializes them
            src = ASTSource(fn, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, attrs)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": var.pdl}).asm["ptx"]
            wait = ptx.find("griddepcontrol.wait")
            found[f"{var.name}/{name}"] = {"wait": wait >= 0, "launch_dependents": "griddepcontrol.launch_dependents"
                                           in ptx, "loads_before_wait": ptx[:max(wait, 0)].count("ld.global")}
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--mb-per-layer", type=float, default=416.0, help="MiB of bf16 weights per layer (416: Llama-8B)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device-reps", type=int, default=5, help="blink_launch_once calls per variant and mode")
    ap.add_argument("--out", help="write the JSON here (else it is printed)")
    ap.add_argument("--ptx-check", action="store_true", help="only compile for sm_90 and inspect the PTX (no GPU)")
    args = ap.parse_args()
    report: dict[str, Any] = {"triton": triton.__version__, "torch": torch.__version__}

    def emit(final: bool = True) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        elif final:
            print(json.dumps(report, indent=1), flush=True)

    if args.ptx_check:
        report["ptx"] = ptx_check()
        return emit()
    torch.manual_seed(0)
    chain = Chain(args.layers, args.mb_per_layer)
    report.update(device=torch.cuda.get_device_name(), layers=args.layers, ffn=chain.f, kernels=len(chain.plan),
                  weight_gb=round(chain.weight_bytes / 1e9, 2))
    ref = chain.reference()
    results: dict[str, dict[str, Any]] = {v.name: {} for v in VARIANTS}
    report["variants"] = results
    graphs: dict[str, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    for var in VARIANTS:
        res = results[var.name]
        try:
            plain = graphs["plain"][1] if "plain" in graphs else None
            graphs[var.name] = replay_phase(chain, var, args.iters, plain, ref, res)
        except Exception as exc:  # noqa: BLE001 (e.g. launch_pdl unrecognised: a KeyError from the launcher)
            print(f"FAIL {var.name} replay: {exc!r}", flush=True)
            res["error"] = f"{type(exc).__name__}: {exc}"
    for res in results.values():
        if results["plain"].get("us_replay_p50") and "us_replay_p50" in res:
            res["speedup_vs_plain"] = round(results["plain"]["us_replay_p50"] / res["us_replay_p50"], 3)
    emit(final=False)  # the replay numbers survive a device launch that hangs or faults
    lib, lib_error = None, ""
    try:
        from gpu_engine.gpu.persistent import library

        lib = library()
        lib.lib.blink_launch_once.argtypes = [C.c_uint64, C.c_int, C.POINTER(C.c_int)]
    except Exception as exc:  # noqa: BLE001
        lib_error = f"scheduler library: {exc}"
    for var in VARIANTS:
        res = results[var.name]
        why = "no graph" if var.name not in graphs else lib_error
        if why:
            print(f"FAIL {var.name} device launch: {why}", flush=True)
            res["device_launch"] = res["host_launch_of_device_exec"] = f"FAIL: {why}"
        else:
            device_phase(chain, var, *graphs[var.name], lib, args.device_reps, res)
    cols = ("us_replay_p50", "gbps", "speedup_vs_plain", "equal_to_plain", "ref_ok", "max_abs_err",
            "host_launch_of_device_exec", "device_launch", "us_host_launch_wall_p50", "us_device_launch_wall_p50")
    print("variant".ljust(16) + " ".join(c[:14].rjust(14) for c in cols) + "  edges (type 1: programmatic)")
    for name, res in results.items():
        print(name.ljust(16) + " ".join(str(res.get(c, "-"))[:14].rjust(14) for c in cols), res.get("edges", "-"))
    emit()


if __name__ == "__main__":
    main()
