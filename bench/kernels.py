"""Each decode-path kernel against its own floor: achieved GB/s beside the measured device-copy rate.

Every kernel is timed inside a captured CUDA graph of repeated launches (so launch gaps do not
count), at Llama-3-8B shapes in bf16 (the MoE experts at Qwen3-30B-A3B's; correctness is tests/gpu's).
Where an old path is kept for comparison (the sort-based filter, log-probs for every row, the unfused
QK-norm / RoPE / KV write, cuBLAS and a separate SiLU-and-multiply at M <= 8, the sorted MoE path at
small batches, the MoE align by torch's sort), it is timed beside the new one.
Usage: python -m bench.kernels [--out bench/results/kernels.json] [--only attention,moe,...] (`--only blas`:
cuBLAS against cuBLASLt; `--only prefill`: the prefill attention over tile shapes against the matmul peak;
`--only tiled`: the tiled linear's configurations against cuBLAS at 1-128 rows; `--only fused`: its fused forms
against the kernels they replace; `--only fp8`: the FP8-weight GEMV against the W8A8 product and bf16 cuBLAS at
1-128 rows; `--only moe_sorted`: the sorted MoE path's two GEMMs over tile configurations at 16-1,024 tokens,
gate_up with the SiLU-and-multiply in its epilogue, and the whole path with and without it; `--only moe_align`: its
align in one launch, in two (at three chunk sizes), by torch's sort and as served at 16-8,192 tokens; `--only
attention_fp8`: the decode and prefill attention over an FP8 cache with their products in bf16 or fp16, beside a
bf16 cache; none in the default sets)
`step_breakdown` gives the same per-component view of one decode step of a `GpuModelRunner`, and
`prefill_breakdown` of one dense prefill step (bench/roofline.py prints them for every decode and prefill row).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F


def graph_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Milliseconds per call of `fn`, from a CUDA graph holding `reps` calls, replayed 5 times."""
    from gpu_engine.gpu.graph_cache import warm_up

    warm_up(fn)  # compile / autotune outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * reps)


def eager_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Milliseconds per call of `fn`, called `iters` times from the host between two CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_gbps() -> float:
    """A 2 GiB device copy's GB/s, bytes read + written, timed outside a CUDA graph as `bench/roofline.py` times
    it. Captured in a graph, the same copy gave 2,771 GB/s on the H200 against 4,267 outside one, while the
    decode attention's own rows read 3,530: the graph's copy is not the HBM's ceiling."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (eager_ms(lambda: dst.copy_(src), 20) * 1e-3) / 1e9


def entry(ms: float, nbytes: float, gbps: float) -> dict:
    return {"ms": ms, "bytes": nbytes, "gbps": nbytes / (ms * 1e-3) / 1e9, "floor_ms": nbytes / (gbps * 1e9) * 1e3}


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _layer_inputs(runner, rows: int):
    """Random inputs of one layer of `runner` for `rows` tokens: (x, residual, the qkv product, its (q, k, v) views
    by head, an attention output like q)."""
    cfg, w = runner.config, runner.layers[0]
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = torch.randn(rows, cfg.hidden_size, device=runner.device, dtype=runner.dtype)
    qkv = F.linear(x, w.qkv)
    q, k, v = (qkv[:, : hq * d].view(rows, hq, d), qkv[:, hq * d: (hq + hk) * d].view(rows, hk, d),
               qkv[:, (hq + hk) * d:].view(rows, hk, d))
    return x, torch.randn_like(x), qkv, (q, k, v), torch.empty_like(q)


def step_breakdown(runner, batch: int, ctx: int, gbps: float) -> dict[str, dict]:
    """Per-component time of one decode step of `batch` rows at context `ctx`, as staged in `runner`; its linears
    as the runner's plan multiplies them (cuBLAS or the tiled linear; where the down projection goes through the
    tiled linear, the SiLU-and-multiply is timed inside `down_gemm` and there is no
    `silu_mul` part)."""
    from gpu_engine.kernels.attention import decode_attention
    from gpu_engine.kernels.moe import fused_moe
    from gpu_engine.kernels.qkv_prep import qkv_prep
    from gpu_engine.kernels.rmsnorm import rms_norm

    cfg, buf, w, L = runner.config, runner.buffers, runner.layers[0], len(runner.layers)
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x, res, qkv, (q, k, v), attn = _layer_inputs(runner, batch)
    kc, vc = runner.kv.k[0], runner.kv.v[0]
    row = batch * cfg.hidden_size * x.element_size()  # one [batch, hidden] activation
    eps = cfg.rms_norm_eps
    parts = {  # per layer: (launch, bytes it must move)
        "norms": (lambda: (rms_norm(x, w.attn_norm, eps, residual=res), rms_norm(x, w.mlp_norm, eps, residual=res)),
                  8 * row + 2 * _nbytes(w.attn_norm)),
        "qkv_gemm": (lambda: runner._linear(x, w.qkv), _nbytes(w.qkv, qkv) + row),
        "qkv_prep": (lambda: qkv_prep(q, k, v, buf.positions[:batch], runner.rope_cache, kc, vc,
                                      buf.slot_mapping[:batch], w.q_norm, w.k_norm), 2 * _nbytes(qkv)),
        "decode_attention": (lambda: decode_attention(q, kc, vc, buf.block_tables[:batch], buf.context_lens[:batch],
                                                      runner.scale, out=attn, **runner.decode_form(batch)),
                             batch * ctx * 2 * hk * d * kc.element_size() + 2 * _nbytes(q)),
        "o_gemm": (lambda: runner._linear(attn.view(batch, hq * d), w.o), _nbytes(w.o, attn) + row),
    }
    parts |= _mlp_parts(runner, w, x, batch, fused_moe)
    if runner.plan.fused and w.router is None:
        parts = _fused_parts(runner, w, parts, x, res, attn.view(batch, hq * d), row, runner.qkv_heads(0, w, batch))
    per_layer = {name: entry(graph_ms(fn), nbytes, gbps) for name, (fn, nbytes) in parts.items()}
    out = {name: {key: val * (L if key in ("ms", "bytes", "floor_ms") else 1) for key, val in e.items()}
           for name, e in per_layer.items()}
    head = runner._linear(x, runner.lm_head)
    out["lm_head"] = entry(graph_ms(lambda: runner._linear(x, runner.lm_head)), _nbytes(runner.lm_head, head), gbps)
    out["sampling"] = entry(graph_ms(lambda: runner._sample(batch)), _nbytes(buf.logits[:batch]), gbps)
    return out


def prefill_breakdown(runner, tokens: int, gbps: float, tflops: float) -> dict[str, dict]:
    """Per-component time of one dense prefill step of `tokens` query rows, as staged in `runner` (one sequence
    whose context is its query): the matmul-shaped parts against the matmul peak (`flops`, `tflops`), the rest
    against the copy rate (`bytes`, `gbps`)."""
    from gpu_engine.kernels.activation import silu_and_mul
    from gpu_engine.kernels.attention import prefill_attention
    from gpu_engine.kernels.qkv_prep import qkv_prep
    from gpu_engine.kernels.rmsnorm import rms_norm

    cfg, buf, w, L, T = runner.config, runner.buffers, runner.layers[0], len(runner.layers), tokens
    x, res, qkv, (q, k, v), attn = _layer_inputs(runner, T)
    kc, vc = runner.kv.k[0], runner.kv.v[0]
    hq, d = cfg.num_heads, cfg.head_dim
    gu = F.linear(x, w.gate_up)
    h = silu_and_mul(gu)
    row, eps = T * cfg.hidden_size * x.element_size(), cfg.rms_norm_eps

    def gemm(out: torch.Tensor, weight: torch.Tensor) -> float:
        return 2.0 * out.shape[0] * weight.shape[0] * weight.shape[1]

    def timed(fn, flops: float = 0.0, nbytes: float = 0.0) -> dict:
        ms = graph_ms(fn, reps=5)
        if flops:
            return {"ms": ms, "flops": flops, "tflops": flops / (ms * 1e-3) / 1e12,
                    "floor_ms": flops / (tflops * 1e12) * 1e3}
        return entry(ms, nbytes, gbps)

    per_layer = {
        "norms": timed(lambda: (rms_norm(x, w.attn_norm, eps, residual=res),
                                rms_norm(x, w.mlp_norm, eps, residual=res)), nbytes=8 * row),
        "qkv_gemm": timed(lambda: F.linear(x, w.qkv), gemm(x, w.qkv)),
        "qkv_prep": timed(lambda: qkv_prep(q, k, v, buf.positions[:T], runner.rope_cache, kc, vc, buf.slot_mapping[:T],
                                           w.q_norm, w.k_norm), nbytes=2 * _nbytes(qkv)),
        "prefill_attention": timed(lambda: prefill_attention(q, kc, vc, buf.block_tables[:1], buf.context_lens[:1],
                                                             buf.cu_chunks[:2], runner.scale, out=attn),
                                   4.0 * hq * d * T * (T + 1) / 2),
        "o_gemm": timed(lambda: F.linear(attn.view(T, hq * d), w.o), gemm(x, w.o)),
        "gate_up_gemm": timed(lambda: F.linear(x, w.gate_up), gemm(x, w.gate_up)),
        "silu_mul": timed(lambda: silu_and_mul(gu, out=h), nbytes=_nbytes(gu, h)),
        "down_gemm": timed(lambda: F.linear(h, w.down), gemm(x, w.down)),
    }
    return {name: {key: val * (L if key in ("ms", "bytes", "flops", "floor_ms") else 1) for key, val in e.items()}
            for name, e in per_layer.items()}


def _fused_parts(runner, w, parts: dict, x, res, attn, row: int, heads) -> dict:
    """A fused plan's dense layer: its four products as the runner launches them in a step
    where every add was fused before them (`_norm_linear`, `_add_linear`), each with the kernels it takes in or
    leaves apart (a norm the fusion does not take at this step size runs inside `norm_qkv` or `norm_gate_up`), in
    place of the norms, the products and the SiLU apart; with `heads` (`tiled_linear.Heads`, where the runner gives
    qkv its q/k/v preparation) `norm_qkv` takes the preparation too and there is no `qkv_prep` part."""
    rows, glu = x.shape[0], runner.fused_for(x.shape[0], w.gate_up) is not None
    h = torch.empty(rows, w.down.shape[1], device=x.device, dtype=x.dtype)  # silu(gate) * up, or gate_up whole
    gu = h if glu else runner._linear(x, w.gate_up)
    stream = res.clone()  # the o and down outputs are added into it, rep after rep (a copy back would be timed too)
    kept = {name: parts[name] for name in parts if name == "decode_attention" or name == "qkv_prep" and heads is None}
    return kept | {
        "norm_qkv": (lambda: runner._norm_linear(res, None, w.attn_norm, w.qkv, heads=heads),
                     _nbytes(w.qkv, w.attn_norm) + 2 * row),
        "o_add": (lambda: runner._add_linear(attn, w.o, stream), _nbytes(w.o, attn) + 2 * row),
        "norm_gate_up": (lambda: runner._norm_linear(res, None, w.mlp_norm, w.gate_up, act="glu" if glu else None),
                         _nbytes(w.gate_up, w.mlp_norm, gu) + row),
        "down_add": (lambda: runner._add_linear(gu, w.down, stream, silu_mul=not glu), _nbytes(w.down, gu) + 2 * row),
    }


def active_experts(cfg, batch: int) -> float:
    """Expected distinct experts per MoE layer for `batch` tokens under uniform routing (top-k of E)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** batch)


def _mlp_parts(runner, w, x, batch: int, fused_moe) -> dict:
    cfg = runner.config
    if w.router is not None:
        frac = active_experts(cfg, batch) / cfg.num_experts
        nbytes = (_nbytes(w.gate_up) + _nbytes(w.down)) * frac + _nbytes(w.router)
        return {"moe": (lambda: fused_moe(x, w.router, w.gate_up, w.down, cfg.num_experts_per_tok,
                                          cfg.norm_topk_prob), nbytes)}
    from gpu_engine.kernels.activation import silu_and_mul

    gu = runner._linear(x, w.gate_up)
    parts = {"gate_up_gemm": (lambda: runner._linear(x, w.gate_up), _nbytes(w.gate_up, gu, x))}
    if runner.matmul_for(batch, tuple(w.down.shape)) is not None:  # the SiLU inside the down projection's launcher
        return parts | {"down_gemm": (lambda: runner._linear(gu, w.down, silu_mul=True), _nbytes(w.down, gu, x))}
    h = silu_and_mul(gu)
    return parts | {"silu_mul": (lambda: silu_and_mul(gu, out=h), _nbytes(gu, h)),
                    "down_gemm": (lambda: runner._linear(h, w.down), _nbytes(w.down, h, x))}


def _col(B: int, value, dtype=torch.float32) -> torch.Tensor:
    return torch.full((B,), value, device="cuda", dtype=dtype)


def _sampling_batch(B: int, V: int, gbps: float) -> list[dict]:
    from gpu_engine.kernels.sampling import sample

    logits = (torch.randn(B, V, device="cuda") * 4).bfloat16().float()
    seeds, steps = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
    outs = (torch.empty(B, dtype=torch.int64, device="cuda"), torch.empty(B, device="cuda"),
            torch.empty(B, 5, dtype=torch.int64, device="cuda"), torch.empty(B, 5, device="cuda"))
    off, on = _col(B, 0, torch.int32), _col(B, 1, torch.int32)
    greedy, plain = _col(B, 0.0), _col(B, 1.0)
    cases = {  # (temperature, top_k, top_p, keywords)
        "greedy": (greedy, 0, 1.0, {"filtered": False, "want_logprobs": off}),
        "greedy+logprobs": (greedy, 0, 1.0, {"filtered": False, "want_logprobs": on}),
        "top_p0.9_sort_free": (plain, 0, 0.9, {"want_logprobs": off}),
        "top_p0.9_sort": (plain, 0, 0.9, {"want_logprobs": off, "sort_free": False}),
        "top_k50_sort_free": (plain, 50, 1.0, {"want_logprobs": off}),
        "top_k50_sort": (plain, 50, 1.0, {"want_logprobs": off, "sort_free": False}),
    }
    rows = []
    min_p = _col(B, 0.0)
    for name, (t, k, p, kw) in cases.items():
        top_k, top_p = _col(B, k, torch.int32), _col(B, p)
        ms = graph_ms(lambda t=t, k=top_k, p=top_p, kw=kw: sample(logits, t, k, p, min_p, seeds, steps, *outs, **kw))
        rows.append({"kernel": "sampling", "case": name, "batch": B, "vocab": V, **entry(ms, _nbytes(logits), gbps)})
    return rows


def sampling_rows(gbps: float, V: int = 128256) -> list[dict]:
    """The sampler per batch: greedy with and without log-probs, top-p / top-k sort-free and sorted."""
    return [r for B in (1, 8, 64, 128) for r in _sampling_batch(B, V, gbps)]


def prep_rows(gbps: float) -> list[dict]:
    """The fused QK-norm + RoPE + KV write against the unfused kernels, Llama-3-8B / Qwen3 head shapes."""
    from gpu_engine.kernels.kv_cache import write_kv
    from gpu_engine.kernels.qkv_prep import qkv_prep
    from gpu_engine.kernels.rmsnorm import rms_norm
    from gpu_engine.kernels.rope import apply_rope, build_rope_cache

    hq, hk, d = 32, 8, 128
    cache = build_rope_cache(d, 8192, 500000.0, device="cuda")
    kc = torch.zeros(4096, 16, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    qn, kn = torch.ones(d, device="cuda", dtype=torch.bfloat16), torch.ones(d, device="cuda", dtype=torch.bfloat16)
    rows = []
    for T in (1, 8, 64, 128):
        qkv = torch.randn(T, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (qkv[:, : hq * d].view(T, hq, d), qkv[:, hq * d: (hq + hk) * d].view(T, hk, d),
                   qkv[:, (hq + hk) * d:].view(T, hk, d))
        pos, slots = torch.arange(T, device="cuda"), torch.arange(T, device="cuda")

        def unfused(q=q, k=k, v=v, pos=pos, slots=slots):
            rms_norm(q, qn, 1e-6, out=q)
            rms_norm(k, kn, 1e-6, out=k)
            apply_rope(q, k, pos, cache)
            write_kv(k, v, kc, vc, slots)

        for name, fn in {"fused": lambda q=q, k=k, v=v, pos=pos, slots=slots: qkv_prep(
                q, k, v, pos, cache, kc, vc, slots, qn, kn, 1e-6), "unfused": unfused}.items():
            rows.append({"kernel": "qkv_prep", "case": name, "batch": T, **entry(graph_ms(fn), 2 * _nbytes(qkv), gbps)})
    return rows


ATTENTION_VARIANTS = {  # name: (split tokens, block_n, form, num_warps, num_stages); the first is the runner's
    "p256_bn128": (256, 128, "split", 4, None), "p256_bn128_last": (256, 128, "last", 4, None),
    "p256_bn64": (256, 64, "split", 4, None), "p128_bn128": (128, 128, "split", 4, None),
    "p256_bn128_s1": (256, 128, "split", 4, 1), "p256_bn128_s2": (256, 128, "split", 4, 2),
    "p256_bn128_w8": (256, 128, "split", 8, None), "p256_bn64_s1": (256, 64, "split", 4, 1),
    # 512-token splits: half the programs, each with 4 tiles in its loop (2 at 256) for the loads to pipeline over
    "p512_bn128": (512, 128, "split", 4, None), "p512_bn64": (512, 64, "split", 4, None),
    "p512_bn128_last": (512, 128, "last", 4, None)}


def attention_variant(name: str) -> dict:
    """`decode_attention`'s keywords for an `ATTENTION_VARIANTS` entry."""
    part, bn, form, warps, stages = ATTENTION_VARIANTS[name]
    return {"partition_size": part, "block_n": bn, "form": form, "num_warps": warps, "num_stages": stages}


def served_contexts(batch: int, seed: int = 0) -> list[int]:
    """Context lengths of `batch` running requests as the peer study's workload makes them: a log-normal prompt
    (mean about 1,019 tokens, at most 4,096) plus a uniform share of a log-normal output (mean about 463, at most
    2,048)."""
    g = torch.Generator().manual_seed(seed)
    prompt = (6.43 + torch.randn(batch, generator=g)).exp().clamp(1, 4096)
    output = (5.64 + torch.randn(batch, generator=g)).exp().clamp(1, 2048) * torch.rand(batch, generator=g)
    return [int(n) for n in (prompt + output).round().clamp(min=1)]


def _paged_cache(blocks: list[int], hkv: int, width: int | None = None, bs: int = 16, d: int = 128,
                 device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """A K and V cache of `dtype` holding each sequence's `blocks[b]` blocks one after another, and block tables
    `width` blocks wide (default: the longest sequence's), -1 past each sequence's blocks."""
    kc = torch.randn(sum(blocks), bs, hkv, d, device=device, dtype=dtype)
    tables = torch.full((len(blocks), width or max(blocks)), -1, device=device, dtype=torch.int32)
    for b, first in enumerate(itertools.accumulate([0] + blocks[:-1])):
        tables[b, : blocks[b]] = torch.arange(first, first + blocks[b], device=device, dtype=torch.int32)
    return kc, torch.randn_like(kc), tables


def attention_rows(gbps: float, width: int = 513) -> list[dict]:
    """Decode attention (bf16, 128-wide heads, 32 query heads over 8 KV heads, Llama-3-8B, and over 4 at batch 64 and
    128, Qwen3-30B-A3B) over split sizes and tiles, each row's splits computed by a program each and folded in a
    second launch (the runner's form), or by the last of them to finish (`_last`, the fused plan's at one row), and
    the split form's programs with their tiles staged 1 or 2 deep (`_s1`, `_s2`) or with 8 warps (`_w8`). Contexts
    equal (512 or 2,048) or as a
    served step's are (`served_contexts`, context -1 in the rows; `context_mean`). Block tables `width` blocks wide
    (8,208 tokens), as a runner's are, whatever the context."""
    from gpu_engine.kernels.attention import decode_attention

    rows = []
    shapes = ([([ctx] * B, 8) for ctx in (512, 2048) for B in (1, 8, 64, 128)] + [([512] * 64, 4), ([512] * 128, 4)]
              + [(served_contexts(B), 8) for B in (32, 64, 128)])
    for lens, hkv in shapes:
        B = len(lens)
        kc, vc, tables = _paged_cache([n // 16 + 1 for n in lens], hkv, width)
        ctx_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        counters = torch.zeros(B * hkv, device="cuda", dtype=torch.int32)  # the "last" form's, zero at rest
        nbytes = 2 * sum(lens) * hkv * 128 * 2 + 2 * _nbytes(q)
        equal = len(set(lens)) == 1
        for name in ATTENTION_VARIANTS:
            how = attention_variant(name)
            ms = graph_ms(lambda q=q, kc=kc, vc=vc, t=tables, n=ctx_lens, o=out, c=counters, how=how:
                          decode_attention(q, kc, vc, t, n, 128 ** -0.5, out=o,
                                           counters=c if how["form"] == "last" else None, **how))
            rows.append({"kernel": "decode_attention", "case": name, "batch": B, "context": lens[0] if equal else -1,
                         "context_mean": sum(lens) / B, "context_max": max(lens), "kv_heads": hkv,
                         **entry(ms, nbytes, gbps)})
    return rows


def _fp8_forms(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> dict[str, tuple[torch.Tensor, ...]]:
    """`attention_fp8_rows`' three forms of a step: name -> (queries, K, V, bytes a KV element). `fp8_f16`'s queries
    are `q` in fp16, converted outside the timed launches (in a kernel that took this form it is one conversion a
    query row, in registers)."""
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    return {"bf16_cache": (q, kc, vc, 2), "fp8_query": (q, k8, v8, 1), "fp8_f16": (q.to(torch.float16), k8, v8, 1)}


def _fp8_diffs(name: str, outs: dict[str, torch.Tensor]) -> dict[str, float]:
    """An FP8 form's largest differences from the bf16 cache's output (its quantization and its rounding) and, for
    `fp8_f16`, from `fp8_query`'s."""
    def diff(other: str) -> float:
        return float((outs[name].float() - outs[other].float()).abs().max())

    if name == "bf16_cache":
        return {}
    return {"max_abs_diff_vs_bf16_cache": diff("bf16_cache"),
            **({"max_abs_diff_vs_fp8_query": diff("fp8_query")} if name == "fp8_f16" else {})}


def attention_fp8_rows(gbps: float, width: int = 513, contexts: list[list[int]] | None = None, device: str = "cuda",
                       dtype: torch.dtype = torch.bfloat16,
                       prefill: dict[str, list[tuple[int, int]]] | None = None) -> list[dict]:
    """Decode attention over an FP8 cache (`--kv-cache-dtype fp8`, unit scales) at the runner's split form
    (`p256_bn128`), Llama-3-8B's heads, served contexts at 32-128 rows and 2,048 tokens at 64 and 128: the same
    cache in bf16 (`bf16_cache`), the FP8 codes widened to the bf16 queries (`fp8_query`, the engine's now) and, an
    experiment, the same kernel given the queries in fp16 (`fp8_f16`: the codes widen to fp16 natively and both
    products run in fp16, no f16 -> bf16 conversion; its output in fp16), each against its own bytes (one a KV
    element for FP8), each FP8 row with its largest differences (`_fp8_diffs`). Then the prefill attention the same
    three ways (`prefill_attention_fp8`, with its causal FLOPs and their rate): a 2,048-token prompt and the 896-token
    chunk of a saturated mixed step (`prefill_rows`' shapes). `contexts`, `prefill`, `device` and `dtype` (the
    queries' and the unquantized cache's): the check of these calls on tiny shapes in the CPU interpreter."""
    from gpu_engine.kernels.attention import decode_attention, prefill_attention

    rows = []
    how = attention_variant("p256_bn128")
    for lens in contexts or [served_contexts(B) for B in (32, 64, 128)] + [[2048] * 64, [2048] * 128]:
        B, hkv = len(lens), 8
        kc, vc, tables = _paged_cache([n // 16 + 1 for n in lens], hkv, width, device=device, dtype=dtype)
        ctx_lens = torch.tensor(lens, device=device, dtype=torch.int32)
        forms = _fp8_forms(torch.randn(B, 32, 128, device=device, dtype=dtype), kc, vc)
        outs = {name: torch.empty_like(f[0]) for name, f in forms.items()}
        equal = len(set(lens)) == 1
        for name, (q, k, v, width_b) in forms.items():
            ms = graph_ms(lambda q=q, k=k, v=v, o=outs[name], t=tables, n=ctx_lens:
                          decode_attention(q, k, v, t, n, 128 ** -0.5, out=o, **how))
            rows.append({"kernel": "decode_attention_fp8", "case": name, "batch": B,
                         "context": lens[0] if equal else -1, "context_mean": sum(lens) / B, "kv_heads": hkv,
                         **_fp8_diffs(name, outs),
                         **entry(ms, width_b * 2 * sum(lens) * hkv * 128 + 2 * _nbytes(q), gbps)})
    for case, seqs in (prefill or {"prompt_2048": [(2048, 2048)],
                                   "mixed_128_896": [(1, c) for c in served_contexts(128)] + [(896, 896)]}).items():
        q, kc, vc, tables, lens_t, cu, seqs = _prefill_step(case, seqs, 32, 8, 128, 16, device, dtype)
        forms = _fp8_forms(q, kc, vc)
        # zeros: a mixed step's decode rows are not the prefill's to write, and stay equal in the differences
        outs = {name: torch.zeros_like(f[0]) for name, f in forms.items()}
        flops = 4 * 32 * 128 * sum(n * (ctx - n) + n * (n + 1) // 2 for n, ctx in seqs)  # as `prefill_rows`
        for name, (qf, k, v, width_b) in forms.items():
            ms = graph_ms(lambda q=qf, k=k, v=v, o=outs[name], t=tables, n=lens_t, cu=cu:
                          prefill_attention(q, k, v, t, n, cu, 128 ** -0.5, out=o), reps=5)
            rows.append({"kernel": "prefill_attention_fp8", "case": name, "shape": case, "tokens": q.shape[0],
                         "flops": flops, "achieved_tflops": flops / (ms * 1e-3) / 1e12, **_fp8_diffs(name, outs),
                         **entry(ms, width_b * 2 * sum(c for n, c in seqs if n) * 8 * 128 + 2 * _nbytes(q), gbps)})
    return rows


PREFILL_VARIANTS = {  # name: keywords of prefill_attention; "default": the runner's (`prefill_block_m`)
    "default": {}, "packed_grid": {"grid": "packed"}, "seq_grid": {"grid": "seq"}, "unsplit": {"whole_tiles": False},
    "m64_n64_w4_s3": {"num_stages": 3},
    "m128_n64_w8_s2": {"block_m": 128, "num_stages": 2}, "m128_n128_w8_s2": {"block_m": 128, "block_n": 128}}


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * 8192**3 / (graph_ms(lambda: a @ b, 5) * 1e-3) / 1e12


def _prefill_step(case: str, seqs: list[tuple[int, int]], H: int, hkv: int, D: int, bs: int, device: str = "cuda",
                  dtype: torch.dtype = torch.bfloat16):
    """A prefill step of `seqs` (query rows, context) over a paged cache: (q, K cache, V cache, block tables,
    context lengths, the query rows' bounds, `seqs` as staged). A `mixed` case's leading one-row sequences are the
    decode rows, their bounds made empty as the runner stages them (`runner.split_rows`; their time is apart)."""
    kc, vc, tables = _paged_cache([-(-ctx // bs) for _, ctx in seqs], hkv, bs=bs, d=D, device=device, dtype=dtype)
    lens = torch.tensor([ctx for _, ctx in seqs], device=device, dtype=torch.int32)
    cu = torch.tensor([0, *itertools.accumulate(n for n, _ in seqs)], device=device, dtype=torch.int32)
    if case.startswith("mixed"):
        lead = sum(1 for _ in itertools.takewhile(lambda s: s[0] == 1, seqs))
        cu = cu.clamp(min=lead)
        seqs = [(0 if k < lead else n, ctx) for k, (n, ctx) in enumerate(seqs)]
    q = torch.randn(int(cu[-1]), H, D, device=device, dtype=dtype)
    return q, kc, vc, tables, lens, cu, seqs


def prefill_rows(gbps: float) -> list[dict]:
    """Prefill attention (bf16, Llama-3-8B heads: 32 over 8 KV heads of 128) over tile shapes, against the matmul
    peak measured in the same run (`floor_ms`: the causal product's FLOPs at that peak). Cases (name: sequences
    as (query rows, context)): one prompt of 2,048 and of 8,192 tokens, a 2,048-token chunk over a 6,144-token
    cached prefix, four prompts of 512 in one step, and a saturated mixed step's chunk attention (`mixed_128_896`:
    128 decode rows at served contexts, empty in the chunk bounds as the runner stages them, then an 896-token
    prompt, in a 1,024-row step; the decode rows' own attention is not in it), and the same chunk beside 8 and 32
    decode rows. `packed_grid` and `seq_grid`: the two grids (the default picks one by the step's sequences,
    `attention.prefill_grid`)."""
    from gpu_engine.kernels.attention import prefill_attention

    peak = matmul_tflops()
    H, hkv, D, bs = 32, 8, 128, 16
    cases = {"prompt_2048": [(2048, 2048)], "prompt_8192": [(8192, 8192)], "chunk_2048_at_8192": [(2048, 8192)],
             "4x_prompt_512": [(512, 512)] * 4,
             **{f"mixed_{n}_896": [(1, ctx) for ctx in served_contexts(n)] + [(896, 896)] for n in (8, 32, 128)}}
    rows = []
    for case, seqs in cases.items():
        q, kc, vc, tables, lens, cu, seqs = _prefill_step(case, seqs, H, hkv, D, bs)
        T = q.shape[0]
        out = torch.empty_like(q)
        seen = sum(n * (ctx - n) + n * (n + 1) // 2 for n, ctx in seqs)  # (query, key) pairs under the causal mask
        flops = 4 * H * D * seen
        nbytes = 2 * _nbytes(q) + 2 * sum(ctx for n, ctx in seqs if n) * hkv * D * 2
        for name, kw in PREFILL_VARIANTS.items():
            try:
                ms = graph_ms(lambda q=q, kc=kc, vc=vc, t=tables, n=lens, cu=cu, o=out, kw=kw:
                              prefill_attention(q, kc, vc, t, n, cu, 128 ** -0.5, out=o, **kw), reps=5)
            except Exception as exc:  # noqa: BLE001  (a shape the compiler refuses, e.g. out of shared memory)
                print(f"prefill_attention {name} {case}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            rows.append({"kernel": "prefill_attention", "case": name, "shape": case, "tokens": T,
                         **entry(ms, nbytes, gbps), "tflops": flops / (ms * 1e-3) / 1e12, "peak_tflops": peak,
                         "floor_ms": flops / (peak * 1e12) * 1e3})
    return rows


LLAMA_PROJECTIONS = (  # (name, N, K) of the Llama-3-8B linears
    ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LM_HEAD = ("lm_head", 128256, 4096)
MOE_ATTENTION = (("moe_qkv", 5120, 2048), ("moe_o", 2048, 4096))  # Qwen3-30B-A3B's attention linears


def _in_turn(ws: list[torch.Tensor], call: Callable[[torch.Tensor], object]) -> Callable[[], object]:
    """A call of `call(w)` that takes the weights `ws` in turn."""
    order = itertools.cycle(ws)
    return lambda: call(next(order))


def blas_rows(gbps: float, copies: int = 4) -> list[dict]:
    """cuBLAS against cuBLASLt (torch's preferred BLAS library) at the Llama-3-8B projections and decode batches;
    `copies` weights taken in turn, so a repeat does not find the last one's weight in L2."""
    rows = []
    default = torch.backends.cuda.preferred_blas_library()
    for name, N, K in LLAMA_PROJECTIONS:
        ws = [(torch.randn(N, K, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        for M in (1, 8, 64, 128):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                ms = graph_ms(_in_turn(ws, lambda w, x=x: F.linear(x, w)))
                rows.append({"kernel": f"blas_{name}", "case": lib, "batch": M, **entry(ms, _nbytes(ws[0], x), gbps)})
        del ws
    torch.backends.cuda.preferred_blas_library(default)
    return rows


def _against_cublas(gbps: float, kernel: str, shapes, batches, variants, copies: int = 4) -> list[dict]:
    """Rows `kernel`_NAME of each variant beside cuBLAS (F.linear; silu_and_mul first for down, whose x is the
    gate_up output) at each (NAME, N, K) of `shapes` and each M of `batches`. `variants(x, act, N, K)` gives
    {case: call(w)}; `copies` weights taken in turn, so a repeat does not find the last one's weight in L2."""
    from gpu_engine.kernels.activation import silu_and_mul

    rows = []
    for name, N, K in shapes:
        ws = [(torch.randn(N, K, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        act = "silu_mul" if name == "down" else None
        for M in batches:
            x = torch.randn(M, 2 * K if act else K, device="cuda", dtype=torch.bfloat16)
            cases = {"cublas": (lambda w, x=x: F.linear(silu_and_mul(x), w)) if act else
                     (lambda w, x=x: F.linear(x, w)), **variants(x, act, N, K)}
            for case, call in cases.items():
                rows.append({"kernel": f"{kernel}_{name}", "case": case, "batch": M,
                             **entry(graph_ms(_in_turn(ws, call)), _nbytes(ws[0], x), gbps)})
        del ws
    return rows


def tiled_rows(gbps: float) -> list[dict]:
    """The tiled linear's configurations (`kernels.tiled_linear.TILED_CONFIGS`: tiles, the split of K, warps,
    stages) against cuBLAS at the Llama-3-8B projections and Qwen3-30B-A3B's attention linears (`moe_qkv`,
    `moe_o`: their shapes are in no plan yet) and decode steps of 1-128 rows; the down projection with the
    SiLU-and-multiply fused (case NAME) and apart (NAME_apart: silu_and_mul, then the tiled linear)."""
    from gpu_engine.kernels.activation import silu_and_mul
    from gpu_engine.kernels.tiled_linear import TILED_CONFIGS, tiled_linear, tiled_scratch

    def variants(x, act, N, K):
        cases = {}
        for case, config in TILED_CONFIGS.items():
            keys = {**config._asdict(), "scratch": tiled_scratch([(N, K)], [config], "cuda")}
            cases[case] = functools.partial(tiled_linear, x, act=act, **keys)
            if act:
                cases[f"{case}_apart"] = lambda w, keys=keys: tiled_linear(silu_and_mul(x), w, **keys)
        return cases

    return _against_cublas(gbps, "tiled", (*LLAMA_PROJECTIONS, *MOE_ATTENTION), (1, 8, 16, 32, 64, 128), variants)


FUSED_CANDIDATES = ("n64_k128_s4", "n64_k128_s4_x2", "n128_k64_s4_w8", "n128_k128_s3_w8", "n256_k64_s4_w8")


def fused_rows(gbps: float, copies: int = 4, shapes=LLAMA_PROJECTIONS, heads=(32, 8, 128),
               batches=(1, 8, 16, 32, 64), device: str = "cuda", dtype=torch.bfloat16) -> list[dict]:
    """The tiled linear's fused forms (`kernels.tiled_linear`, `+fused`) against the kernels they replace, at the
    Llama-3-8B projections and decode steps of 1-64 rows, per configuration of `FUSED_CANDIDATES`:
    - `fused_qkv`: RMSNorm, the product and `qkv_prep` (case `apart_NAME`; `apart_cublas`) against the product with
      the norm and the preparation in it (case NAME);
    - `fused_gate_up`: RMSNorm, the product and the SiLU-and-multiply against the glu product with the norm;
    - `fused_o`, `fused_down`: the product (down's SiLU apart) against the same with its output added into a
      residual (`NAME_add`); the norm that would have done the add keeps running, without it.
    Weights taken in turn from `copies`, as `_against_cublas` does; bytes: the weight read. `shapes` and `heads`
    (query heads, KV heads, head size): the model's, the Llama-3-8B's by default (`device`, `dtype`: the check of
    these calls on tiny shapes in the CPU interpreter, tests/test_bench_kernels_fused.py)."""
    from gpu_engine.kernels.activation import silu_and_mul
    from gpu_engine.kernels.qkv_prep import qkv_prep
    from gpu_engine.kernels.rmsnorm import rms_norm
    from gpu_engine.kernels.rope import build_rope_cache
    from gpu_engine.kernels.tiled_linear import TILED_CONFIGS, Heads, tiled_linear, tiled_scratch

    (hq, hk, d), eps = heads, 1e-5
    rows = []
    for name, N, K in shapes:
        ws = [(torch.randn(N, K, device=device) * 0.02).to(dtype) for _ in range(copies)]
        nw = torch.ones(K, device=device, dtype=dtype)
        for M in batches:
            x = torch.randn(M, 2 * K if name == "down" else K, device=device, dtype=dtype)
            res = torch.randn(M, N, device=device, dtype=dtype)
            pos, slots = torch.arange(M, device=device), torch.arange(M, device=device)
            cache = build_rope_cache(d, 4096, 500000.0, device=device)
            kc, vc = (torch.zeros(max(1, M // 16 + 1), 16, hk, d, device=device, dtype=dtype) for _ in "kv")
            out_heads = Heads(hq, hk, pos, cache, kc, vc, slots)

            def prep(y, pos=pos, slots=slots, cache=cache, kc=kc, vc=vc, M=M):
                return qkv_prep(y[:, : hq * d].view(M, hq, d), y[:, hq * d: (hq + hk) * d].view(M, hk, d),
                                y[:, (hq + hk) * d:].view(M, hk, d), pos, cache, kc, vc, slots)

            cases = {}
            for case in FUSED_CANDIDATES:
                keys = {**TILED_CONFIGS[case]._asdict(), "scratch": tiled_scratch(
                    [(N, K)], [TILED_CONFIGS[case], TILED_CONFIGS[case]._replace(block_n=d)], device)}
                tiled = functools.partial(tiled_linear, **keys)
                if name == "qkv":
                    cases[f"apart_{case}"] = lambda w, t=tiled, x=x, nw=nw: prep(t(rms_norm(x, nw, eps), w))
                    cases[case] = lambda w, t=tiled, x=x, h=out_heads, nw=nw: t(x, w, norm=(nw, eps), heads=h)
                elif name == "gate_up":
                    cases[f"apart_{case}"] = lambda w, t=tiled, x=x, nw=nw: silu_and_mul(t(rms_norm(x, nw, eps), w))
                    cases[case] = lambda w, t=tiled, x=x, nw=nw: t(x, w, act="glu", norm=(nw, eps))
                else:
                    a = silu_and_mul(x) if name == "down" else x
                    cases[case] = lambda w, t=tiled, a=a: t(a, w)
                    cases[f"{case}_add"] = lambda w, t=tiled, a=a, r=res: t(a, w, residual=r)
            if name == "qkv":
                cases["apart_cublas"] = lambda w, x=x, nw=nw: prep(F.linear(rms_norm(x, nw, eps), w))
            elif name == "gate_up":
                cases["apart_cublas"] = lambda w, x=x, nw=nw: silu_and_mul(F.linear(rms_norm(x, nw, eps), w))
            else:
                a = silu_and_mul(x) if name == "down" else x
                cases["cublas"] = lambda w, a=a: F.linear(a, w)
            for case, call in cases.items():
                rows.append({"kernel": f"fused_{name}", "case": case, "batch": M,
                             **entry(graph_ms(_in_turn(ws, call)), _nbytes(ws[0]), gbps)})
        del ws
    return rows


def q8_rows(gbps: float) -> list[dict]:
    """The Q8_0 linear (int8 codes + fp16 scales, `kernels.q8_linear`) against cuBLAS on the same weights in bf16,
    at the Llama-3-8B projections: decode batches (bytes: the weight read) and prefill chunks."""
    from gpu_engine.kernels.q8_linear import q8_linear
    from gpu_engine.models.q8_weight import GROUP

    rows = []
    for name, N, K in (*LLAMA_PROJECTIONS, LM_HEAD):
        codes = torch.randint(-127, 128, (N, K), device="cuda", dtype=torch.int8)
        scales = (torch.rand(N, K // GROUP, device="cuda") * 1e-3).half()
        dense = (codes.float().view(N, -1, GROUP) * scales.float().unsqueeze(-1)).view(N, K).bfloat16()
        for M in (1, 8, 64, 256, 2048):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cases = {"q8_0": (lambda x=x, c=codes, s=scales: q8_linear(x, c, s), _nbytes(codes, scales, x)),
                     "cublas_bf16": (lambda x=x, w=dense: F.linear(x, w), _nbytes(dense, x))}
            for case, (fn, nbytes) in cases.items():
                ms = graph_ms(fn)
                rows.append({"kernel": f"linear_{name}", "case": case, "batch": M,
                             "tflops": round(2 * M * N * K / (ms * 1e-3) / 1e12, 1), **entry(ms, nbytes, gbps)})
        del codes, scales, dense
    return rows


FP8_BATCHES = (1, 8, 32, 64, 128)


def fp8_rows(gbps: float, copies: int = 4, shapes=LLAMA_PROJECTIONS, batches=FP8_BATCHES, device: str = "cuda",
             dtype=torch.bfloat16) -> list[dict]:
    """The FP8-weight GEMV (W8A16, `kernels.fp8_gemv`) at the Llama-3-8B projections and decode steps of 1-128 rows:
    each configuration of `FP8_CONFIGS` that takes the step (case NAME), the launcher's own pick (`gemv`) and, on
    gate_up, silu(gate) * up in the launch (`gemv_glu`) against the product then `silu_and_mul` (`gemv_then_silu`);
    beside the W8A8 product the runner takes now (`fp8_linear`: x to FP8 per token, then `torch._scaled_mm`) and
    cuBLAS on the same weight in bf16 (`cublas_bf16`). Bytes: the FP8 weight, its scales, x and the [M, N] out for
    every FP8 case (one floor for all, `fp8_floor_ms`); the bf16 weight, x and out for cuBLAS. A case the compiler
    refuses is printed and left out. Weights taken in turn from `copies`, as `_against_cublas` does; `device` and
    `dtype`: the check of these calls on tiny shapes in the CPU interpreter (tests/test_bench_kernels_fp8.py)."""
    from gpu_engine.kernels.fp8_gemv import FP8_CONFIGS, fp8_gemv_scratch
    from gpu_engine.models.fp8_weight import quantize_fp8

    rows = []
    for name, N, K in shapes:
        dense = [(torch.randn(N, K, device=device) * 0.02).to(dtype) for _ in range(copies)]
        fp8 = [quantize_fp8(w) for w in dense]
        scratch = fp8_gemv_scratch([(N, K)], FP8_CONFIGS.values(), device)
        for M in batches:
            x = torch.randn(M, K, device=device, dtype=dtype)
            out = torch.empty(M, N, device=device, dtype=dtype)
            floor = fp8[0].nbytes + _nbytes(x, out)
            for case, (ws, call) in _fp8_cases(x, out, scratch, dense, fp8, name == "gate_up").items():
                try:
                    ms = graph_ms(_in_turn(ws, call))
                except Exception as exc:  # noqa: BLE001  (a configuration the compiler refuses, e.g. out of resources)
                    print(f"fp8_{name} {case} batch={M}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                nbytes = _nbytes(ws[0], x, out) if ws is dense else floor
                rows.append({"kernel": f"fp8_{name}", "case": case, "batch": M, **entry(ms, nbytes, gbps),
                             "fp8_floor_ms": floor / (gbps * 1e9) * 1e3})
        del dense, fp8
    return rows


def _fp8_cases(x: torch.Tensor, out: torch.Tensor, scratch, dense: list, fp8: list, glu: bool) -> dict:
    """`fp8_rows`' cases for one step: {case: (the weights it takes in turn, call(w))}."""
    from gpu_engine.kernels.activation import silu_and_mul
    from gpu_engine.kernels.fp8_gemv import FMA_ROWS, FP8_CONFIGS, fp8_gemv
    from gpu_engine.kernels.fp8_linear import fp8_linear

    M = x.shape[0]
    cases: dict[str, tuple[list, Callable[[object], object]]] = {
        case: (fp8, lambda w, c=config: fp8_gemv(x, w, out=out, config=c, scratch=scratch))
        for case, config in FP8_CONFIGS.items() if config.form != "fma" or M <= FMA_ROWS}
    cases["gemv"] = (fp8, lambda w: fp8_gemv(x, w, out=out, scratch=scratch))
    if glu:
        half = out[:, : out.shape[1] // 2]
        cases["gemv_glu"] = (fp8, lambda w: fp8_gemv(x, w, act="glu", out=half, scratch=scratch))
        cases["gemv_then_silu"] = (fp8, lambda w: silu_and_mul(fp8_gemv(x, w, out=out, scratch=scratch)))
    cases["fp8_linear"] = (fp8, lambda w: fp8_linear(x, w))
    cases["cublas_bf16"] = (dense, lambda w: F.linear(x, w))
    return cases


def silu_rows(gbps: float) -> list[dict]:
    from gpu_engine.kernels.activation import silu_and_mul

    rows = []
    for T in (1, 8, 64, 128):
        x = torch.randn(T, 2 * 14336, device="cuda", dtype=torch.bfloat16)
        out = silu_and_mul(x)
        rows.append({"kernel": "silu_mul", "case": "triton", "batch": T,
                     **entry(graph_ms(lambda x=x, out=out: silu_and_mul(x, out=out)), _nbytes(x, out), gbps)})
    return rows


MOE_SHAPE = {"experts": 128, "hidden": 2048, "inter": 768, "top_k": 8}  # Qwen3-30B-A3B


def _moe_batch(B: int, gate_up: list[torch.Tensor], down: list[torch.Tensor], gbps: float) -> list[dict]:
    from gpu_engine.kernels import moe

    E, H, I, k = (MOE_SHAPE[n] for n in ("experts", "hidden", "inter", "top_k"))
    layers = len(gate_up)
    xs = [torch.randn(B, H, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    routes = [moe.moe_route(torch.randn(B, E, device="cuda"), k, True) for _ in range(layers)]
    active = sum(ids.unique().numel() for _, ids in routes) / layers
    acts = [torch.randn(B * k, I, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    outs = [torch.empty(B, H, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    expert_bytes = (2 * I * H + H * I) * 2
    cases: dict[str, tuple[Callable[[int], object], float]] = {
        "small": (lambda i: moe.moe_experts_small(xs[i], gate_up[i], down[i], *routes[i]), active * expert_bytes),
        "sorted": (lambda i: moe.moe_experts_sorted(xs[i], gate_up[i], down[i], *routes[i]), active * expert_bytes),
        "align_kernel": (lambda i: moe.moe_align(routes[i][1], E, 16), _nbytes(routes[0][1])),
        "align_torch_sort": (lambda i: moe.moe_align_ref(routes[i][1], E, 16), _nbytes(routes[0][1]))}
    # column tiles at the launchers' K steps (512 for gate_up, 256 for down), and the K step that takes a row whole
    # (2,048 and 1,024: every load of a program in flight at once, no loop) or half of it
    for bn, bk in ((2, 512), (4, 512), (8, 512), (16, 512), (2, 1024), (2, 2048), (4, 2048)):
        name = f"small_gate_up bn={bn}" + ("" if bk == 512 else f" bk={bk}")
        cases[name] = (lambda i, bn=bn, bk=bk: moe.moe_gate_up_silu(
            xs[i], gate_up[i], routes[i][1], out=acts[i], block_n=bn, block_k=bk), active * 2 * I * H * 2)
    # the down kernel's [8, bn, bk] fp32 sums: 8 columns at 4 warps spill (255 registers), at 8 warps not
    for bn, bk, warps in ((1, 256, 4), (2, 256, 4), (4, 256, 4), (8, 256, 4), (8, 256, 8), (1, 1024, 4),
                          (2, 1024, 4), (2, 1024, 8)):
        name = f"small_down bn={bn}" + ("" if bk == 256 else f" bk={bk}") + ("" if warps == 4 else f" w{warps}")
        cases[name] = (lambda i, bn=bn, bk=bk, warps=warps: moe.moe_down_sum(
            acts[i], down[i], routes[i][1], routes[i][0], out=outs[i], block_n=bn, block_k=bk, num_warps=warps),
            active * H * I * 2)
    cases["small_gate_up bn=4 bk=2048 w8"] = (lambda i: moe.moe_gate_up_silu(
        xs[i], gate_up[i], routes[i][1], out=acts[i], block_n=4, block_k=2048, num_warps=8), active * 2 * I * H * 2)
    if moe.small_path(B, k):
        cases.update(_moe_fused_cases(B, xs, gate_up, down, routes, acts, active))
    rows = []
    for name, (fn, nbytes) in cases.items():
        order = itertools.cycle(range(layers))
        ms = graph_ms(lambda fn=fn, order=order: fn(next(order)))
        rows.append({"kernel": "moe_experts", "case": name, "batch": B, "experts": round(active, 1),
                     "small_path": moe.small_path(B, k), **entry(ms, nbytes, gbps)})
    return rows


def _moe_fused_cases(B: int, xs, gate_up, down, routes, acts, active: float) -> dict:
    """A sort-free step's MLP half as the fused plan runs it beside the unfused kernels: the gate_up kernel with the
    RMSNorm on its x (`_norm`), the down kernel adding into the residual stream (`_add`), and the whole half
    (`layer_unfused`: the norm with the pending add, the router's cuBLAS product, the routing and the two expert
    kernels, five launches, whose output the next norm adds, as the runner runs it unfused; `layer_fused`:
    `fused_moe` with counters, norm and residual, three launches), against the active experts' weights (and the
    router's, for the halves)."""
    from gpu_engine.kernels import moe
    from gpu_engine.kernels.rmsnorm import rms_norm

    E, H, I, k = (MOE_SHAPE[n] for n in ("experts", "hidden", "inter", "top_k"))
    layers, eps = len(xs), 1e-6
    nw = torch.empty(H, device="cuda", dtype=torch.bfloat16).normal_(1.0, 0.1)
    routers = [torch.empty(E, H, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02) for _ in range(layers)]
    stream = [torch.randn(B, H, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    normed = [torch.empty(B, H, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    counters = torch.zeros(B, device="cuda", dtype=torch.int32)
    half = active * (2 * I * H + H * I) * 2 + E * H * 2

    def unfused(i: int) -> torch.Tensor:
        rms_norm(xs[i], nw, eps, residual=stream[i], out=normed[i])
        return moe.fused_moe(normed[i], routers[i], gate_up[i], down[i], k, True)

    return {
        "small_gate_up bn=4 norm": (lambda i: moe.moe_gate_up_silu(
            xs[i], gate_up[i], routes[i][1], out=acts[i], norm=(nw, eps)), active * 2 * I * H * 2),
        "small_down bn=2 add": (lambda i: moe.moe_down_sum(
            acts[i], down[i], routes[i][1], routes[i][0], residual=stream[i]), active * H * I * 2),
        "layer_unfused": (unfused, half),
        "layer_fused": (lambda i: moe.fused_moe(stream[i], routers[i], gate_up[i], down[i], k, True,
                                                residual=stream[i], counters=counters, norm=(nw, eps)), half),
    }


def moe_rows(gbps: float, layers: int = 4) -> list[dict]:
    """The Qwen3-30B-A3B experts in bf16: the sort-free path beside the sorted one at batch 1-64 (the
    runner takes the sort-free one up to `kernels.moe.SMALL_PAIRS` pairs, batch 8), and each sort-free
    kernel over a few column-tile widths and K steps, all against the weight bytes of the experts their routing
    activates (the floor). The repeats of a graph take `layers` weight sets in turn, so one repeat's
    experts are not in L2 for the next."""
    E, H, I = MOE_SHAPE["experts"], MOE_SHAPE["hidden"], MOE_SHAPE["inter"]
    gate_up = [torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02) for _ in range(layers)]
    down = [torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02) for _ in range(layers)]
    return [r for B in (1, 8, 16, 64, 128) for r in _moe_batch(B, gate_up, down, gbps)]


# The sorted path's grouped GEMM (`moe.moe_gemm`), configurations beside the launcher's (block_n 64, block_k 64, 4
# warps, Triton's default stages): (block_n, block_k, warps, stages), each at the block heights the path takes.
SORTED_TILES = ((64, 64, 4, None), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (32, 128, 4, 4),
                (64, 256, 4, 2), (128, 256, 8, 2), (64, 64, 4, 4), (64, 128, 8, 4), (256, 64, 8, 3))
# The experiment's gate_up GEMM with the SiLU-and-multiply in its epilogue (`bench.moe_glu`): two accumulators a
# tile, so narrower tiles too
GLU_TILES = ((64, 64, 4, None), (64, 64, 4, 3), (32, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 3))
SORTED_HEIGHTS = (16, 64)
TALL_HEIGHT, TALL_FROM = 128, 1024  # a taller block (most experts one block) at steps of this many tokens and more
SORTED_BATCHES = (16, 64, 128, 1024)  # decode steps past the sort-free path's 8 rows, and a mixed step's 1,024 tokens


def sorted_name(gemm: str, bm: int, tile: tuple[int, int, int, int | None]) -> str:
    bn, bk, warps, stages = tile
    return f"{gemm} bm={bm} bn={bn} bk={bk} w{warps}" + ("" if stages is None else f" s{stages}")


def _sorted_gemms(B: int, bm: int, gate_up, down, xs, routes, acts) -> dict:
    """The sorted path's two GEMMs of a step of `B` tokens at block height `bm`, per tile of SORTED_TILES: name ->
    (a function running layer i, layer i's output buffers). Layer i's pairs are sorted once, beforehand; the shapes
    are the weights' (down [E, H, I]) and the routes' (ids [B, k]). And the experiment's gate_up GEMM with the
    SiLU-and-multiply in its epilogue (`bench.moe_glu`) over GLU_TILES, beside the two launches it replaces."""
    from bench.moe_glu import glu_gemm
    from gpu_engine.kernels import moe
    from gpu_engine.kernels.activation import silu_and_mul

    (E, H, I), k = down[0].shape, routes[0][1].shape[1]
    aligned = [moe.moe_align(ids, E, bm) for _, ids in routes]
    flat = [w.reshape(-1) for w, _ in routes]
    layers = len(gate_up)
    inter = [torch.empty(B * k, 2 * I, device=xs[0].device, dtype=xs[0].dtype) for _ in range(layers)]
    y = [torch.empty(B * k, H, device=xs[0].device, dtype=xs[0].dtype) for _ in range(layers)]
    cases: dict[str, tuple[Callable[[int], object], torch.Tensor]] = {}
    for tile in SORTED_TILES:
        bn, bk, warps, stages = tile
        conf = {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}
        cases[sorted_name("gate_up", bm, tile)] = (lambda i, conf=conf: moe.moe_gemm(
            xs[i], gate_up[i], inter[i], *aligned[i], flat[i], a_div=k, block_m=bm, **conf), inter)
        cases[sorted_name("down", bm, tile)] = (lambda i, conf=conf: moe.moe_gemm(
            acts[i], down[i], y[i], *aligned[i], flat[i], a_div=1, block_m=bm, **conf), y)
    silu = [torch.empty(B * k, I, device=xs[0].device, dtype=xs[0].dtype) for _ in range(layers)]

    def unfused(i: int) -> None:  # what the glu form replaces: the launcher's gate_up, then the SiLU-and-multiply
        moe.moe_gemm(xs[i], gate_up[i], inter[i], *aligned[i], flat[i], a_div=k, block_m=bm)
        silu_and_mul(inter[i], out=silu[i])

    cases[f"gate_up+silu bm={bm}"] = (unfused, silu)
    glu = [torch.empty(B * k, I, device=xs[0].device, dtype=xs[0].dtype) for _ in range(layers)]
    for tile in GLU_TILES:
        bn, bk, warps, stages = tile
        conf = {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}
        cases[sorted_name("glu", bm, tile)] = (lambda i, conf=conf: glu_gemm(
            xs[i], gate_up[i], glu[i], *aligned[i], a_div=k, block_m=bm, **conf), glu)
    return cases


def _sorted_path(i: int, xs, gate_up, down, routes, glu: bool) -> torch.Tensor:
    """Layer i's sorted expert path: the engine's, or with the experiment's gate_up GEMM (`bench.moe_glu`)."""
    from bench.moe_glu import sorted_path_glu
    from gpu_engine.kernels import moe

    return (sorted_path_glu if glu else moe.moe_experts_sorted)(xs[i], gate_up[i], down[i], *routes[i])


def moe_sorted_rows(gbps: float, layers: int = 4) -> list[dict]:
    """The Qwen3-30B-A3B experts' sorted path, each GEMM alone over SORTED_TILES and SORTED_HEIGHTS at the step
    sizes that take it (SORTED_BATCHES), the gate_up GEMM with the SiLU-and-multiply epilogue over GLU_TILES beside
    the two launches it replaces (`gate_up+silu`), and the whole path in each form (`path`, `path glu`), against the
    weight bytes of the experts its routing activates; each GEMM row says whether its output is the launcher's
    configuration's bit for bit (a K step other than 64 sums in another order: its largest difference is given), a
    glu row the unfused activation's, `path glu` the unfused path's.
    Weight sets taken in turn, as `moe_rows`."""
    from gpu_engine.kernels import moe

    E, H, I, k = (MOE_SHAPE[n] for n in ("experts", "hidden", "inter", "top_k"))
    gate_up = [torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02) for _ in range(layers)]
    down = [torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02) for _ in range(layers)]
    rows = []
    for B in SORTED_BATCHES:
        xs = [torch.randn(B, H, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        routes = [moe.moe_route(torch.randn(B, E, device="cuda"), k, True) for _ in range(layers)]
        acts = [torch.randn(B * k, I, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        active = sum(ids.unique().numel() for _, ids in routes) / layers
        nbytes = {"gate_up": active * 2 * I * H * 2, "down": active * H * I * 2}
        nbytes["glu"] = nbytes["gate_up+silu"] = nbytes["gate_up"]
        paths = {}
        for glu in (False, True):  # the whole sorted path (align, GEMMs, SiLU-and-multiply, sum), each form
            order = itertools.cycle(range(layers))
            ms = graph_ms(lambda glu=glu, order=order, xs=xs, routes=routes: _sorted_path(
                next(order), xs, gate_up, down, routes, glu))
            paths[glu] = _sorted_path(0, xs, gate_up, down, routes, glu)
            diff = float((paths[glu].float() - paths[False].float()).abs().max())
            rows.append({"kernel": "moe_sorted", "case": "path glu" if glu else "path", "batch": B,
                         "experts": round(active, 1), "same_bits": bool(torch.equal(paths[glu], paths[False])),
                         "max_abs_diff": diff, **entry(ms, nbytes["gate_up"] + nbytes["down"], gbps)})
        for bm in SORTED_HEIGHTS + ((TALL_HEIGHT,) if B >= TALL_FROM else ()):
            cases = _sorted_gemms(B, bm, gate_up, down, xs, routes, acts)
            reference: dict[str, torch.Tensor] = {}
            for name, (fn, outs) in cases.items():
                gemm = name.split()[0]
                order = itertools.cycle(range(layers))
                try:
                    ms = graph_ms(lambda fn=fn, order=order: fn(next(order)))
                    fn(0)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses (shared memory): its row
                    rows.append({"kernel": "moe_sorted", "case": name, "batch": B, "block_m": bm, "error": repr(exc),
                                 **entry(float("nan"), nbytes[gemm], gbps)})
                    continue
                out = outs[0]
                # the launcher's tile comes first; the glu forms are compared with the unfused activation
                first = reference.setdefault("act" if gemm in ("glu", "gate_up+silu") else gemm, out.clone())
                diff = float((out.float() - first.float()).abs().max())
                rows.append({"kernel": "moe_sorted", "case": name, "batch": B, "experts": round(active, 1),
                             "block_m": bm, "taken": bm == moe.sorted_block_m(B * k, E),
                             "same_bits": bool(torch.equal(out, first)), "max_abs_diff": diff,
                             **entry(ms, nbytes[gemm], gbps)})
    return rows


# The align's step sizes: decode steps past the sort-free path (16-128 rows), mixed steps of the 1,024-token budget
# (272-1,024 tokens) and larger budgets' (2,048 and 8,192 tokens), at Qwen3-30B-A3B's 8 experts a token
ALIGN_TOKENS = (16, 64, 128, 272, 512, 1024, 2048, 8192)
ALIGN_CHUNKS = (64, 128, 256)


def moe_align_rows(gbps: float, layers: int = 4, tokens: tuple[int, ...] = ALIGN_TOKENS,
                   device: str = "cuda") -> list[dict]:
    """The sorted path's align (`moe.moe_align`) at ALIGN_TOKENS: torch's stable sort (`moe_align_ref`), the one
    launch where every program counts every pair (up to 8,192 pairs), the two launches (count each chunk's pairs,
    then place) at ALIGN_CHUNKS, and the form the engine takes (`served`); each row says whether its arrays are the
    sort's element for element. Routes taken in turn over `layers` draws, at the block height the path takes.
    `tokens` and `device`: the check of these calls in the CPU interpreter."""
    from gpu_engine.kernels import moe

    E, k = MOE_SHAPE["experts"], MOE_SHAPE["top_k"]
    rows = []
    for T in tokens:
        bm = moe.sorted_block_m(T * k, E)
        ids = [moe.moe_route(torch.randn(T, E, device=device), k, True)[1] for _ in range(layers)]
        cases: dict[str, Callable[[int], tuple[torch.Tensor, torch.Tensor]]] = {
            "torch_sort": lambda i, ids=ids, bm=bm: moe.moe_align_ref(ids[i], E, bm),
            "served": lambda i, ids=ids, bm=bm: moe.moe_align(ids[i], E, bm)}
        if T * k <= 8192:
            cases["one_launch c64"] = lambda i, ids=ids, bm=bm: moe.moe_align(ids[i], E, bm, one_launch=True,
                                                                              limit=1 << 30)
        for chunk in ALIGN_CHUNKS:
            cases[f"two_launch c{chunk}"] = lambda i, ids=ids, bm=bm, chunk=chunk: moe.moe_align(
                ids[i], E, bm, chunk=chunk, one_launch=False, limit=1 << 30)
        want = moe.moe_align_ref(ids[0], E, bm)
        for name, fn in cases.items():
            order = itertools.cycle(range(layers))
            ms = graph_ms(lambda fn=fn, order=order: fn(next(order)))
            got = fn(0)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            rows.append({"kernel": "moe_align", "case": name, "batch": T, "pairs": T * k, "block_m": bm,
                         "same_arrays": same, **entry(ms, _nbytes(ids[0]), gbps)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels.json"))
    parser.add_argument("--only", default="", help="comma-separated row sets (sampling, prep, attention, "
                        "tiled, fused, silu, moe, moe_sorted, moe_align, attention_fp8, q8, fp8, blas, prefill); "
                        "default: all but q8, fp8, blas, prefill, tiled, fused, moe_sorted, moe_align and "
                        "attention_fp8")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels needs a CUDA device")
    gbps = copy_gbps()
    print(f"device copy {gbps:.0f} GB/s", flush=True)
    rows = []
    sets = {"sampling": sampling_rows, "prep": prep_rows, "attention": attention_rows,
            "tiled": tiled_rows, "fused": fused_rows, "silu": silu_rows, "moe": moe_rows, "q8": q8_rows,
            "fp8": fp8_rows, "blas": blas_rows, "prefill": prefill_rows, "moe_sorted": moe_sorted_rows,
            "moe_align": moe_align_rows, "attention_fp8": attention_fp8_rows}
    chosen = [n for n in args.only.split(",") if n] or [n for n in sets if n not in ("q8", "fp8", "blas", "prefill",
                                                                                       "tiled", "fused", "moe_sorted",
                                                                                       "moe_align", "attention_fp8")]
    if set(chosen) - set(sets):
        raise SystemExit(f"--only: unknown row sets {sorted(set(chosen) - set(sets))} (known: {', '.join(sets)})")
    for fn in (sets[n] for n in chosen):
        for r in fn(gbps):
            rows.append(r)
            where = " ".join(f"{k}={r[k]}" for k in ("batch", "context", "kv_heads", "vocab", "experts", "shape")
                             if k in r)
            rate = (f"{r['tflops']:7.1f} TFLOP/s ({r['tflops'] / r['peak_tflops']:5.1%} of matmul)" if "tflops" in r
                    else f"{r['gbps']:7.0f} GB/s ({r['gbps'] / gbps:5.1%} of copy)")
            print(f"{r['kernel']:17} {r['case']:21} {where:26} {r['ms'] * 1e3:9.1f} us {rate}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": gbps, "rows": rows},
                                   indent=1))


if __name__ == "__main__":
    main()
