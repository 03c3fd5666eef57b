"""Decode/prefill step time of random bf16 models through captured graphs, vs floors.

Shapes: Llama-3-8B (dense: decode and prefill) and Qwen3-30B-A3B (MoE: decode at batch 1, 8, 64,
128). Measures the device-copy bandwidth and the bf16 matmul rate in the same run, then times graph
replays. Floors: decode = (weight bytes read + KV bytes read) / bandwidth (the embedding table is
not read, only B rows of it; for MoE only the experts a step routes to, `active_experts`, the
expected count under uniform routing); prefill = FLOPs (linear layers + causal attention) / matmul
rate. Decode rows are greedy without log-probs, so `ms` is the unfiltered decode graph, the one such
steps run; `ms_filtered` the same step through the filtering variant (top-k / top-p / min-p),
`ms_logprobs` with every row asking for log-probs; `sample_ms` the sampler alone, timed in a graph as the step
runs it (until 2026-12-04 it was timed eagerly, launch overhead included: 0.45 ms at batch 1 where the graph
breakdown's sampling is 0.045). Dense decode rows of `context` -1 are steps of
`SERVED_BATCHES` rows whose contexts are uneven as a served step's are (`bench.kernels.served_contexts`;
`context_mean`), their floor counting each row's KV. `breakdown` is each component's time in one step
(each timed alone, in a captured graph of repeats) and `floor_ms` its own bytes / bandwidth (dense prefill rows:
the GEMMs' and attention's FLOPs / matmul rate, `tflops` achieved).
MoE rows name the expert path their steps take (`moe_path`: the sort-free one up to
`kernels.moe.SMALL_PAIRS` token-expert pairs, batch 8 at top-8, else the sorted one).
`mixed` (Llama-3-8B shape): the chunked-prefill steps the engines run under load, `decodes` running
requests at `context` tokens each plus one prompt chunk that fills the step's token budget, through
the mixed graphs the engines capture (`graph_grid.mixed_buckets`, the unfiltered variant); beside each,
the same decode rows alone and a prompt of the budget's tokens alone. Floor: the larger of the step's
bytes (weights + the decode rows' KV) over the bandwidth and its FLOPs over the matmul rate.
`mixed_saturated_rate`: the serving rate each budget would saturate at by a model of these steps
(`saturated_rate`), which ranks the budgets for the peer study's workload.
Both models' products are taken as the engine takes them on this GPU (`--plan auto`: `kernels.plan.resolve_plan`,
the H200's plan on an H200, cuBLAS elsewhere); `--plan` names another plan of `kernels.plan.PLANS`, or a
`tiled_linear.TILED_CONFIGS` configuration for every dense weight up to 128 rows (`+fused` after it: with the fused
forms), which the benchmark builds itself (`KernelPlan.every_weight`). The file's `plan` key (the MoE rows'
`moe_plan`) names the plan its rows ran with.
`--weights bf16,fp8` runs the dense rows once more with FP8 linears (`gpu_engine.kernels.fp8_linear`: the decoder
layers' projections quantized at load as `--quantization fp8` does, per-channel weight scales and per-token
activations; `fp8-tensor`: one scale each; `fp8-gemv`: per-channel weights through the weight-only GEMV,
`kernels.fp8_gemv`, at up to 128 rows), in the same process, beside the bf16 rows: model
`llama3-8b-shape-fp8` (`-fp8-tensor`, `-fp8-gemv`), its floor the FP8 weights' bytes (and their scales, the bf16
norms and LM head) plus the KV bytes over the copy rate, and its prefill floor the same FLOPs over the bf16 matmul
rate (the FP8 rate is about twice that: `x floor` below 1 is possible there); FP8 rows carry no breakdown.
`--kv-dtype bf16,fp8` runs each of those forms over a bf16 KV cache and over an FP8 one (float8_e4m3fn with a scale
of 1.0 a layer for keys and values, the cache `--kv-cache-dtype fp8` gives the engine): model suffix `-kvfp8`
(`llama3-8b-shape-kvfp8`, `llama3-8b-shape-fp8-kvfp8`), key `kv_dtype`, the floor's KV bytes at one byte an element;
these rows carry no breakdown either.
Decode rows whose KV cache does not fit the memory the weights leave, less `KV_MARGIN` for what is allocated after
the cache, are skipped rather than run out of memory (`fit_rows`): each is printed and recorded in the file's `skipped`
list with its cache's bytes and the free bytes (on an 80 GB card, the MoE shape's batch 128 at 2,048 tokens).
Usage: python bench/roofline.py [--out bench/results/decode_roofline.json] [--models dense,moe,mixed]
(rows of the models and phases run replace those rows in an existing `--out`, the others stay);
`--plot PNG` draws each decode row's time over its floor beside the issue's goals (`--plot-only`: from
an existing `--out`, no GPU needed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "max_position_embeddings": 8192}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                 "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "max_position_embeddings": 8192, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "norm_topk_prob": True}
BLOCK = 16
# The memory left free beside the KV cache for what is allocated after it: the runner's step buffers (tens of MiB),
# the captured graphs' shared pool (the largest step's activations: about 1 GiB at a dense 8,192-token prefill, less
# at the decode batches), the breakdowns' temporaries and cuBLAS's workspaces.
KV_MARGIN = 4 * 2**30
DECODE_BATCHES = (1, 8, 32, 64, 128)
MOE_BATCHES = (1, 8, 64, 128)


def shape_config(model: str, layers: int | None = None) -> dict:
    """The Hugging Face config of the "8b" (Llama-3-8B) or "moe" (Qwen3-30B-A3B) shape, cut to `layers` decoder
    layers where given (a benchmark's --layers: every layer is the same work)."""
    hf = {"8b": LLAMA3_8B, "moe": QWEN3_30B_A3B}[model]
    if layers is None:
        return dict(hf)
    if not 0 < layers <= hf["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: 1..{hf['num_hidden_layers']} for the {model} shape")
    return {**hf, "num_hidden_layers": layers}
CONTEXTS = (512, 2048)
SERVED_BATCHES = (32, 64, 128)  # dense decode rows also measured on served contexts (`bench.kernels.served_contexts`)
PREFILL_TOKENS = (512, 2048, 8192)
MIXED_BUDGETS = (512, 1024, 2048, 8192)  # a smaller budget, the default step budget, the earlier one and vLLM's
MIXED_DECODES = (32, 64, 128)
MIXED_CONTEXT = 1024  # the decode rows' context, about the peer study's mean prompt


def _time_ms(fn, iters: int, warmup: int = 3) -> float:
    from bench.kernels import eager_ms

    return eager_ms(fn, iters, warmup)


def measure_ceilings() -> tuple[float, float]:
    """(device-copy GB/s counting bytes read + written, bf16 matmul TFLOP/s at 8192^3)."""
    from bench.kernels import copy_gbps

    gbps = copy_gbps()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b, 20)
    return gbps, 2 * 8192**3 / (ms * 1e-3) / 1e12


def random_model(hf: dict):
    """(config, model) of a Hugging Face config's shape on the GPU, random bf16 weights (norms at 1)."""
    from gpu_engine.models.config import ModelConfig
    from gpu_engine.models.loader import build_empty

    cfg = ModelConfig.from_hf(hf)
    model = build_empty(cfg, torch.bfloat16, "cuda")
    torch.cuda.empty_cache()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return cfg, model


def build(hf: dict, max_ctx: int, batches, prefill, plan=None, served: tuple[list[int], ...] = (), fp8=None,
          kv_dtype: torch.dtype = torch.bfloat16):
    """The model, its KV cache and a runner with `plan` (a `KernelPlan`; cuBLAS where None); `served`:
    the uneven contexts of steps to be staged too (their longest row sets the block tables' width, their sum the
    cache's blocks where that is more); `fp8`: an `Fp8Scheme` for the decoder layers' projections (the model's
    `quantized` attribute holds them), else bf16; `kv_dtype`: the cache's elements (bf16, or float8_e4m3fn with the
    cache's unit scales, which the runner passes to every KV writer and reader)."""
    cfg, model = build_model(hf, fp8)
    blocks, limits = sizes(max_ctx, batches, prefill, served)
    return cfg, model, attach(cfg, model, blocks, limits, plan, kv_dtype)


def build_model(hf: dict, fp8=None):
    """(config, model) of `hf`'s shape with random weights (`random_model`), the decoder layers' projections
    quantized by `fp8` where given (the model's `quantized` attribute holds them); the allocator's cache emptied, so
    that the free memory is what the weights leave."""
    from gpu_engine.models.fp8_checkpoint import quantize_linears

    cfg, model = random_model(hf)
    quantized = {} if fp8 is None else quantize_linears(model, fp8)
    setattr(model, "quantized", quantized)  # noqa: B010 - what weight_bytes and layer_params count
    torch.cuda.empty_cache()
    return cfg, model


def attach(cfg, model, blocks: int, limits: tuple[int, int, int], plan=None,
           kv_dtype: torch.dtype = torch.bfloat16):
    """A runner of `model` with `plan` (cuBLAS where None) over a KV cache of `blocks` blocks of `kv_dtype`, its
    step buffers sized by `limits` (batch, tokens, blocks a sequence: `sizes`)."""
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
    from gpu_engine.kv_cache import KVCache

    kv = KVCache(cfg, blocks, BLOCK, dtype=kv_dtype, device="cuda")
    return GpuModelRunner(model, kv, RunnerLimits(*limits), quantized=getattr(model, "quantized", {}),
                          **({} if plan is None else {"plan": plan}))


def sizes(max_ctx: int, batches, prefill, served: tuple[list[int], ...] = ()) -> tuple[int, tuple[int, int, int]]:
    """(the KV cache's blocks, the runner's limits: batch, tokens, blocks a sequence) for decode steps of `batches`
    rows at up to `max_ctx` tokens each and at the `served` contexts, and one-sequence prefills of `prefill`
    tokens; every step's sequences lie in the cache one after another (`stage_step`)."""
    per_seq = max_ctx // BLOCK + 1
    widest = max((n // BLOCK + 1 for lens in served for n in lens), default=per_seq)
    most = max((sum(n // BLOCK + 1 for n in lens) for lens in served), default=0)
    tokens = max(prefill, default=max(batches))
    return (max(max(batches) * per_seq, most),
            (max(batches), max(tokens, max(batches)), max(tokens // BLOCK, per_seq, widest)))


def row_blocks(batch: int, ctx: int | list[int]) -> int:
    """The KV blocks a decode row of `batch` sequences takes as `sizes` counts them (a block past each context):
    `ctx` tokens each, or `ctx[b]` tokens the b-th (served contexts)."""
    lens = ctx if isinstance(ctx, list) else [ctx] * batch
    return sum(n // BLOCK + 1 for n in lens)


Row = tuple[int, int | list[int]]  # a decode row: (batch, context), the context a list where uneven (served)


def fit_rows(rows: list[Row], token_bytes: int, free: int, margin: int = KV_MARGIN) -> tuple[list[Row], list[dict]]:
    """The decode rows whose KV cache fits in `free` bytes less `margin`, in their order, and a record of each other
    one (its batch and context, -1 for served contexts; the cache's bytes, the free bytes, the margin and why). Every
    row is staged from the cache's first block (`stage_step`): a row fits by its own blocks (`row_blocks`) of
    `token_bytes` a token."""
    kept: list[Row] = []
    skipped: list[dict] = []
    for batch, ctx in rows:
        need = row_blocks(batch, ctx) * BLOCK * token_bytes
        if need <= free - margin:
            kept.append((batch, ctx))
            continue
        skipped.append({"phase": "decode", "batch": batch, "context": -1 if isinstance(ctx, list) else ctx,
                        "kv_bytes": need, "free_bytes": free, "margin_bytes": margin,
                        "reason": f"its KV cache ({need / 2**30:.2f} GiB) does not fit the {free / 2**30:.2f} GiB "
                                  f"free after the weights less a {margin / 2**30:g} GiB margin"})
    return kept, skipped


def fitted_sizes(max_ctx: int, batches, kept: list[Row], prefill) -> tuple[list[int], int, tuple[int, int, int]]:
    """For the `kept` decode rows of `batches` (`fit_rows`) and one-sequence prefills of `prefill` tokens: the batches
    that have a row kept, in their order, the KV cache's blocks (the largest kept row's, or a prefill's where that is
    more) and the runner's limits (`sizes`); with every row kept, the cache and the limits `sizes` gives for them."""
    batches = [b for b in batches if any(k == b for k, _ in kept)]
    blocks = max([row_blocks(b, ctx) for b, ctx in kept] + [t // BLOCK + 1 for t in prefill])
    _, limits = sizes(max_ctx, batches, prefill, tuple(ctx for _, ctx in kept if isinstance(ctx, list)))
    return batches, blocks, limits


def stage_step(runner, batch: int, ctx, new: int, logprobs: bool = False) -> None:
    """B sequences of `ctx` tokens after this step (or of `ctx[b]` tokens, a list), each adding `new` tokens,
    each sequence's blocks after the previous one's; greedy, with or without log-probs."""
    from gpu_engine.models.attention import build_metadata

    lens = ctx if isinstance(ctx, list) else [ctx] * batch
    blocks = [-(-n // BLOCK) for n in lens]
    firsts = itertools.accumulate([0] + blocks[:-1])
    seqs = [(n - new, new, list(range(first, first + nb))) for n, nb, first in zip(lens, blocks, firsts, strict=True)]
    meta = build_metadata(seqs, BLOCK, device="cuda")
    ids = torch.randint(0, runner.config.vocab_size, (batch * new,), device="cuda")
    runner.stage(ids, meta, {"want_logprobs": torch.full((batch,), int(logprobs), dtype=torch.int32)})


def weight_bytes(model, batch: int = 1) -> float:
    """Bytes a decode step of `batch` rows reads: every parameter except the embedding table (unless
    tied), and of the stacked experts only the active ones."""
    from bench.kernels import active_experts

    total = float(sum(w.nbytes for w in getattr(model, "quantized", {}).values()))  # FP8 linears and their scales
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith(("mlp.gate_up", "mlp.down")) and p.dim() == 3:
            size *= active_experts(model.config, batch) / p.shape[0]
        total += size
    if model.lm_head.weight is not model.embed.weight:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def layer_params(model) -> float:
    """The decoder layers' parameters a token is multiplied by: FP8 linears (their dense parameters empty) counted by
    their shapes, and of the stacked experts only the ones a token routes to (top-k of E)."""
    cfg = model.config
    kept = float(sum(w.shape[0] * w.shape[1] for w in getattr(model, "quantized", {}).values()))
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            experts = name.endswith(("mlp.gate_up", "mlp.down")) and p.dim() == 3
            kept += p.numel() * (cfg.num_experts_per_tok / p.shape[0] if experts else 1)
    return kept


def prefill_flops(cfg, model, tokens: int) -> float:
    attn = cfg.num_layers * cfg.num_heads * cfg.head_dim * 2 * 2 * tokens * (tokens + 1) / 2
    return 2.0 * tokens * layer_params(model) + attn + 2.0 * cfg.vocab_size * cfg.hidden_size


def capture(runner, batches, prefill):
    """Capture with device-launch executables; if instantiating those fails, say so and use host replay."""
    from gpu_engine.gpu.graph_cache import GraphCache

    buckets = [(1, t) for t in prefill]
    try:
        graphs = GraphCache(runner, list(batches), buckets)
        return graphs, graphs.capture(progress=True)
    except Exception as exc:  # noqa: BLE001  (reported, then the host-replay path still gets measured)
        print(f"DEVICE-LAUNCH CAPTURE FAILED: {exc!r}; recapturing for host replay only", flush=True)
        graphs.close()
        graphs = GraphCache(runner, list(batches), buckets, device_launch=False)
        return graphs, graphs.capture(progress=True)


def kv_token_bytes(cfg, kv_dtype: torch.dtype = torch.bfloat16) -> int:
    """A token's keys and values over every layer, in bytes, in a cache of `kv_dtype`."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize


def plain(model, runner) -> bool:
    """Whether a run is the bf16 one that the per-component breakdowns measure: no FP8 linears, a bf16 cache."""
    return not getattr(model, "quantized", None) and runner.kv.dtype == runner.dtype


def decode_row(name, cfg, model, runner, graphs, b: int, ctx, gbps: float, iters: int) -> dict:
    """One decode row: `ctx` tokens for every sequence, or a list of each sequence's (served contexts: the row's
    `context` is -1, `context_mean` their mean)."""
    from bench.kernels import active_experts, graph_ms, step_breakdown

    kv_per_token = kv_token_bytes(cfg, runner.kv.dtype)
    total = sum(ctx) if isinstance(ctx, list) else b * ctx
    stage_step(runner, b, ctx, 1, logprobs=True)
    ms_logprobs = _time_ms(lambda: graphs.replay((True, b, b), filtered=False), iters)
    stage_step(runner, b, ctx, 1)
    ms = _time_ms(lambda: graphs.replay((True, b, b), filtered=False), iters)
    ms_filtered = _time_ms(lambda: graphs.replay((True, b, b), filtered=True), iters)
    sample_ms = graph_ms(lambda: runner._sample(b))  # in a graph, as the step runs it (eager, it was launch-bound)
    floor = (weight_bytes(model, b) + total * kv_per_token) / (gbps * 1e9) * 1e3
    parts = step_breakdown(runner, b, round(total / b), gbps) if plain(model, runner) else {}
    row = {"model": name, "phase": "decode", "batch": b, "context": -1 if isinstance(ctx, list) else ctx,
           "context_mean": total / b, "tokens": b, "ms": ms, "floor_ms": floor, "sample_ms": sample_ms,
           "ms_filtered": ms_filtered, "ms_logprobs": ms_logprobs, "breakdown": parts}
    if cfg.num_experts:
        from gpu_engine.kernels.moe import small_path

        row["active_experts"] = active_experts(cfg, b)
        row["moe_path"] = "small" if small_path(b, cfg.num_experts_per_tok) else "sorted"
    return row


def run_model(name: str, hf: dict, batches, prefill, gbps: float, tflops: float, iters: int,
              plan=None, fp8=None, kv_dtype: torch.dtype = torch.bfloat16) -> tuple[list[dict], list[dict]]:
    """(the rows of a model, the records of its decode rows skipped: their KV cache does not fit, `fit_rows`)."""
    from bench.kernels import served_contexts

    # steps as served (dense only): uneven contexts (equal ones hid a form that waits on the longest row)
    served = [] if hf.get("num_experts") else [b for b in SERVED_BATCHES if b in batches]
    cfg, model = build_model(hf, fp8)
    wanted: list[Row] = [(b, ctx) for ctx in CONTEXTS for b in batches]
    wanted += [(b, served_contexts(b)) for b in served]
    kept, skipped = fit_rows(wanted, kv_token_bytes(cfg, kv_dtype), torch.cuda.mem_get_info()[0])
    skipped = [{"model": name, **s} for s in skipped]
    for s in skipped:
        print(f"{name}: skipping decode batch {s['batch']} at context {s['context']}: {s['reason']}", flush=True)
    if not kept:
        print(f"{name}: no decode row fits, nothing run", flush=True)
        return [], skipped
    batches, blocks, limits = fitted_sizes(max(CONTEXTS), batches, kept, prefill)
    runner = attach(cfg, model, blocks, limits, plan, kv_dtype)
    t0 = time.perf_counter()
    graphs, captured = capture(runner, batches, prefill)
    print(f"{name}: captured {len(captured)} graphs in {time.perf_counter() - t0:.1f} s, "
          f"{sum(g.memory_bytes for g in captured) / 2**20:.0f} MiB", flush=True)
    rows = [decode_row(name, cfg, model, runner, graphs, b, ctx, gbps, iters) for b, ctx in kept]
    tag_rows(rows, fp8, kv_dtype)
    for t in prefill:
        stage_step(runner, 1, t, t)
        ms = _time_ms(lambda t=t: graphs.replay((False, 1, t)), max(3, iters // 4))
        floor = prefill_flops(cfg, model, t) / (tflops * 1e12) * 1e3
        row = {"model": name, "phase": "prefill", "batch": 1, "context": t, "tokens": t, "ms": ms, "floor_ms": floor}
        if not cfg.num_experts and plain(model, runner):
            from bench.kernels import prefill_breakdown

            row["breakdown"] = prefill_breakdown(runner, t, gbps, tflops)
        rows.append(row)
    graphs.close()
    return rows, skipped


def tag_rows(rows: list[dict], fp8, kv_dtype: torch.dtype) -> None:
    """What a form's decode rows ran with, beside bf16: `fp8` (the weights' and activations' scales) for FP8 linears,
    `kv_dtype` for a cache of other than bf16."""
    for row in rows:
        if fp8 is not None:
            row["fp8"] = f"{fp8.weights}/{fp8.activations}"
        if kv_dtype != torch.bfloat16:
            row["kv_dtype"] = str(kv_dtype).removeprefix("torch.")


def mixed_seqs(decodes: int, ctx: int, chunk: int, cached: int = 0,
               block: int = BLOCK) -> list[tuple[int, int, list[int]]]:
    """One chunked-prefill step as (cached, new, block table) rows: `decodes` rows with `ctx` tokens after
    the step (one new each), then a prompt chunk of `chunk` tokens after `cached`; disjoint blocks."""
    per_row = -(-ctx // block)
    seqs = [(ctx - 1, 1, list(range(b * per_row, (b + 1) * per_row))) for b in range(decodes)]
    first = decodes * per_row
    return seqs + [(cached, chunk, list(range(first, first + -(-(cached + chunk) // block))))]


def stage_seqs(runner, seqs, device: str = "cuda", block: int = BLOCK) -> torch.Tensor:
    """Stage a step of the given rows with random token ids, greedy, no log-probs; returns the ids."""
    from gpu_engine.models.attention import build_metadata

    meta = build_metadata(seqs, block, device=device)
    ids = torch.randint(0, runner.config.vocab_size, (int(meta.positions.shape[0]),), device=device)
    runner.stage(ids, meta, {"want_logprobs": torch.zeros(len(seqs), dtype=torch.int32)})
    return ids


def mixed_floor_ms(cfg, model, decodes: int, ctx: int, chunk: int, gbps: float, tflops: float) -> float:
    kv_per_token = kv_token_bytes(cfg)
    layer_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    bytes_read = weight_bytes(model, decodes + 1) + decodes * ctx * kv_per_token
    flops = prefill_flops(cfg, model, chunk) + 2.0 * decodes * layer_params
    return max(bytes_read / (gbps * 1e9), flops / (tflops * 1e12)) * 1e3


def run_mixed(gbps: float, tflops: float, iters: int, plan=None) -> list[dict]:
    from gpu_engine.gpu.graph_cache import GraphCache
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
    from gpu_engine.kv_cache import KVCache

    name, top = "llama3-8b-shape", max(MIXED_BUDGETS)
    cfg, model = random_model(LLAMA3_8B)
    blocks = max(MIXED_DECODES) * -(-MIXED_CONTEXT // BLOCK) + -(-top // BLOCK)
    kv = KVCache(cfg, blocks, BLOCK, dtype=torch.bfloat16, device="cuda")
    limits = RunnerLimits(max(MIXED_DECODES) + 1, top, max(-(-MIXED_CONTEXT // BLOCK), -(-top // BLOCK)))
    runner = GpuModelRunner(model, kv, limits, **({} if plan is None else {"plan": plan}))
    buckets = [(d + 1, t) for t in MIXED_BUDGETS for d in MIXED_DECODES] + [(1, t) for t in MIXED_BUDGETS]
    graphs = GraphCache(runner, list(MIXED_DECODES), buckets, prefill_variants=True)
    t0 = time.perf_counter()
    captured = graphs.capture(progress=True)
    print(f"{name} mixed: captured {len(captured)} graphs in {time.perf_counter() - t0:.1f} s", flush=True)
    rows, reps = [], max(3, iters // 4)
    for t in MIXED_BUDGETS:
        stage_seqs(runner, [(0, t, list(range(-(-t // BLOCK))))])
        prompt_ms = _time_ms(lambda t=t: graphs.replay((False, 1, t), filtered=False), reps)
        for d in MIXED_DECODES:
            stage_seqs(runner, mixed_seqs(d, MIXED_CONTEXT, 1)[:d])
            decode_ms = _time_ms(lambda d=d: graphs.replay((True, d, d), filtered=False), iters)
            stage_seqs(runner, mixed_seqs(d, MIXED_CONTEXT, t - d))
            ms = _time_ms(lambda d=d, t=t: graphs.replay((False, d + 1, t), filtered=False), reps)
            rows.append({"model": name, "phase": "mixed", "batch": d + 1, "decodes": d, "context": MIXED_CONTEXT,
                         "tokens": t, "ms": ms, "floor_ms": mixed_floor_ms(cfg, model, d, MIXED_CONTEXT, t - d,
                                                                           gbps, tflops),
                         "decode_alone_ms": decode_ms, "prompt_alone_ms": prompt_ms})
    graphs.close()
    return rows


def saturated_rate(rows: list[dict], prompt: float = 1019.0, output: float = 463.0) -> dict[int, float]:
    """A model of the saturated serving rate (requests/s) at each token budget, from the mixed rows of the
    largest decode batch B: every step carries B decodes, so a second holds (requests x `output`) / B steps, of
    which (requests x `prompt`) / chunk carry a chunk of (budget - B) prompt tokens (the mixed step's time) and
    the rest decode alone (where the chunks need more steps than that, every step carries one and the prompts
    bound the rate). Means of the peer study's workload; its contexts are uneven where these are equal,
    so the figures rank the budgets rather than predict the peer study's rates."""
    mixed = [r for r in rows if r.get("phase") == "mixed"]
    if not mixed:
        return {}
    B = max(r["decodes"] for r in mixed)
    rates = {}
    for r in (r for r in mixed if r["decodes"] == B):
        chunk_steps = prompt / (r["tokens"] - B)
        decode_steps = max(0.0, output / B - chunk_steps)  # per request; none when prompts alone fill every step
        rates[r["tokens"]] = 1e3 / (chunk_steps * r["ms"] + decode_steps * r["decode_alone_ms"])
    return rates


WEIGHTS = ("bf16", "fp8", "fp8-tensor", "fp8-gemv")  # --weights: the dense rows' linears (`fp8_scheme`, `form_plan`)
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}  # --kv-dtype: the dense rows' KV cache
MODELS = {"dense": ("llama3-8b-shape", LLAMA3_8B, DECODE_BATCHES, PREFILL_TOKENS),
          "moe": ("qwen3-30b-a3b-shape", QWEN3_30B_A3B, MOE_BATCHES, ())}
KINDS = (*MODELS, "mixed")


def replaced(row: dict, kinds, batches: tuple[int, ...] = ()) -> bool:
    """Whether a row of an existing result is one that a run of `kinds` (of only these decode `batches`, where
    given) measures again."""
    if row.get("phase") == "mixed":
        return "mixed" in kinds
    if batches and (row.get("phase") != "decode" or row.get("batch") not in batches):
        return False
    return row.get("model") in {label(MODELS[k][0], w, kv) for k in kinds if k in MODELS for w in WEIGHTS
                                for kv in KV_DTYPES}


def label(name: str, weights: str = "bf16", kv: str = "bf16") -> str:
    """A run's model name: the shape's, `-<weights>` after it for FP8 linears, then `-kvfp8` for an FP8 KV cache."""
    return name + ("" if weights == "bf16" else f"-{weights}") + ("" if kv == "bf16" else f"-kv{kv}")


def forms(kind: str, weights: tuple[str, ...], kv: tuple[str, ...]) -> list[tuple[str, str]]:
    """The (weights, KV cache) runs of a kind of model: the dense one's every pairing of `--weights` and
    `--kv-dtype`, bf16 weights first; the MoE one's bf16 alone."""
    return list(itertools.product(weights, kv)) if kind == "dense" else [("bf16", "bf16")]


def parse_forms(text: str, known, flag: str) -> tuple[str, ...]:
    """A comma-separated list of `known` names, or SystemExit naming the flag and the choices."""
    got = tuple(w for w in text.split(",") if w)
    if not got or any(w not in known for w in got):
        raise SystemExit(f"{flag}: pick from {', '.join(known)}")
    return got


def fp8_scheme(weights: str):
    """The `Fp8Scheme` of a `--weights` entry (None: bf16)."""
    from gpu_engine.models.fp8_checkpoint import Fp8Scheme

    return {"bf16": None, "fp8": Fp8Scheme(), "fp8-tensor": Fp8Scheme("tensor", "tensor"),
            "fp8-gemv": Fp8Scheme()}[weights]


def form_plan(plan, weights: str):
    """The plan a `--weights` form runs under: fp8-gemv sends every decode-sized step's FP8 products to the
    weight-only GEMV (`KernelPlan.fp8_gemv_rows`), the other forms run `plan` as it is."""
    import dataclasses

    from gpu_engine.kernels.plan import PLANS
    from gpu_engine.kernels.tiled_linear import MAX_ROWS

    if weights != "fp8-gemv":
        return plan
    base = PLANS["cublas"] if plan is None else plan
    return dataclasses.replace(base, name=f"{base.name}+fp8gemv", fp8_gemv_rows=MAX_ROWS)


def run(out: Path, iters: int, models=("dense", "moe"), plan=None, batches: tuple[int, ...] = (),
        weights: tuple[str, ...] = ("bf16",), kv: tuple[str, ...] = ("bf16",)) -> dict:
    """`plan`: the runner's `KernelPlan` (cuBLAS where None). `batches`: only those decode batches of each model and
    no prefill rows (all where empty). `weights`, `kv`: the dense model's rows once per pairing of a form (`WEIGHTS`)
    and a KV cache (`KV_DTYPES`)."""
    gbps, tflops = measure_ceilings()
    print(f"device copy {gbps:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    old = json.loads(out.read_text()) if out.exists() else {"rows": []}
    rows = [r for r in old.get("rows", []) if not replaced(r, models, batches)]
    skipped = [s for s in old.get("skipped", []) if not replaced(s, models, batches)]
    for m in models:
        if m == "mixed":
            rows += run_mixed(gbps, tflops, iters, plan)
        else:
            name, hf, model_batches, prefill = MODELS[m]
            if batches:
                model_batches, prefill = tuple(b for b in model_batches if b in batches), ()
                if not model_batches:  # none of this model's batches asked for: its rows stay as they are
                    continue
            for form, kv_form in forms(m, weights, kv):
                got, missed = run_model(label(name, form, kv_form), hf, model_batches, prefill, gbps, tflops, iters,
                                        form_plan(plan, form), fp8_scheme(form), KV_DTYPES[kv_form])
                rows += got
                skipped += missed
                torch.cuda.empty_cache()
        torch.cuda.empty_cache()  # the model is gone with the run's frame
    ceilings = {"hbm_gbps_measured": gbps, "matmul_tflops_measured": tflops}
    result = {**old, "device": torch.cuda.get_device_name(), "rows": rows, "skipped": skipped}
    if "dense" in models or "hbm_gbps_measured" not in old:
        result.update(ceilings)
    for m in models:  # the ceilings of the run that measured each kind of row, beside the file's (the dense run's)
        if m != "dense":
            result[f"{m}_rows_measured"] = ceilings
    name = "cublas" if plan is None else plan.name
    result.update({"plan": name} if "dense" in models else {})
    result.update({"moe_plan": name} if "moe" in models else {})
    if "mixed" in models:
        result["mixed_saturated_rate"] = {str(t): v for t, v in saturated_rate(rows).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def bench_plan(setting: str, device_name: str):
    """The `KernelPlan` of a --plan setting: auto or a `kernels.plan.PLANS` name (`resolve_plan`), or a
    `TILED_CONFIGS` name for every dense weight, +fused for the fused forms (`KernelPlan.every_weight`)."""
    from gpu_engine.kernels.plan import PLANS, KernelPlan, resolve_plan
    from gpu_engine.kernels.tiled_linear import TILED_CONFIGS

    if setting == "auto" or setting in PLANS:
        return resolve_plan(setting, device_name)
    config, sep, rest = setting.partition("+")
    if config not in TILED_CONFIGS or sep and rest != "fused":
        raise SystemExit(f"--plan {setting!r}: auto, one of {sorted(PLANS)}, or a configuration of "
                         f"{sorted(TILED_CONFIGS)} with an optional +fused")
    return KernelPlan.every_weight(config, fused=bool(sep))


def _chunk_token_us(row: dict) -> float:
    """What a mixed step's prompt tokens add to its decode rows' step, a token."""
    return (row["ms"] - row["decode_alone_ms"]) / (row["tokens"] - row["decodes"]) * 1e3


def print_table(result: dict) -> None:
    print(f"{'model':32} {'phase':8} {'batch':>5} {'ctx':>5} {'tokens':>6} {'ms':>9} {'floor':>9} {'x floor':>7}")
    for r in result["rows"]:
        print(f"{r['model']:32} {r['phase']:8} {r['batch']:5d} {r['context']:5d} {r['tokens']:6d} {r['ms']:9.3f} "
              f"{r['floor_ms']:9.3f} {r['ms'] / r['floor_ms']:7.2f}"
              + (f"  (filtered {r['ms_filtered']:.3f} ms)" if "ms_filtered" in r else "")
              + (f"  (sampling {r['sample_ms']:.3f} ms)" if "sample_ms" in r else "")
              + (f"  (log-probs {r['ms_logprobs']:.3f} ms)" if "ms_logprobs" in r else "")
              + (f"  (MoE {r['moe_path']} path)" if "moe_path" in r else "")
              + (f"  ({r['decodes']} decodes alone {r['decode_alone_ms']:.3f} ms, a {r['tokens']}-token prompt alone "
                 f"{r['prompt_alone_ms']:.3f} ms; {_chunk_token_us(r):.1f} us a chunk token)"
                 if r.get("phase") == "mixed" else ""))
        for part, v in r.get("breakdown", {}).items():
            rate = f"{v['tflops']:7.1f} TFLOP/s" if "tflops" in v else f"{v['gbps']:7.0f} GB/s"
            print(f"{'':34}{part:24} {v['ms']:8.3f} ms  floor {v['floor_ms']:8.3f}  {rate}")
    for s in result.get("skipped", []):
        print(f"{s['model']:32} {s['phase']:8} {s['batch']:5d} {s['context']:5d} skipped: {s['reason']}")
    for budget, rate in result.get("mixed_saturated_rate", {}).items():
        print(f"budget {budget:>5} tokens: saturated about {rate:.1f} req/s (`saturated_rate`, a model)")


# The goals per (model, batch): dense <= 1.15x at batch 1, 1.2x at 8, 1.3x at 64 and 128; MoE <= 1.4x at 1 and 64.
GOALS = {("llama3-8b-shape", 1): 1.15, ("llama3-8b-shape", 8): 1.2, ("llama3-8b-shape", 64): 1.3,
         ("llama3-8b-shape", 128): 1.3, ("qwen3-30b-a3b-shape", 1): 1.4, ("qwen3-30b-a3b-shape", 64): 1.4}


def plot(result: dict, path: Path) -> None:
    """One panel per model: x floor of each decode row by batch, a bar per context, the goals as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in result["rows"] if r["phase"] == "decode"]
    models = sorted({r["model"] for r in decode})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in decode if r["model"] == model]
        batches = sorted({r["batch"] for r in rows})
        contexts = sorted({r["context"] for r in rows})
        width = 0.8 / len(contexts)
        for i, ctx in enumerate(contexts):
            ratio = {r["batch"]: r["ms"] / r["floor_ms"] for r in rows if r["context"] == ctx}
            xs = [j + (i - (len(contexts) - 1) / 2) * width for j in range(len(batches))]
            ax.bar(xs, [ratio.get(b, 0.0) for b in batches], width,
                   label="served contexts" if ctx == -1 else f"context {ctx}")
        for j, b in enumerate(batches):
            if (model, b) in GOALS:
                ax.hlines(GOALS[(model, b)], j - 0.45, j + 0.45, colors="black", linestyles="dashed")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel("step time / floor")
        ax.set_title(f"{model} decode (dashed: goal)")
        ax.set_ylim(0, 1.25 * max(r["ms"] / r["floor_ms"] for r in rows))
        ax.legend(loc="upper center", ncol=len(contexts))
    fig.suptitle(f"{result.get('device', '')}: copy {result.get('hbm_gbps_measured', 0):.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode_roofline.json"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--models", default="dense", help="comma-separated, of: " + ", ".join(KINDS))
    parser.add_argument("--plot", type=Path, help="a PNG of each decode row's time over its floor")
    parser.add_argument("--plot-only", action="store_true", help="draw --plot from --out as it is (no GPU)")
    parser.add_argument("--plan", default="auto", help="the kernel plan: auto (what the engine takes on this GPU), "
                        "a kernels.plan.PLANS name, or a kernels.tiled_linear.TILED_CONFIGS name for every dense "
                        "weight up to 128 rows (+fused for the fused forms; give such a run its own --out)")
    parser.add_argument("--batches", default="", help="comma-separated: only these decode batches of the models' "
                        "(" + ", ".join(f"{k}: {list(MODELS[k][2])}" for k in MODELS) + "), no prefill rows; the "
                        "rows not run stay as --out has them (so with settings other than its rows', give the run its "
                        "own --out)")
    parser.add_argument("--weights", default="bf16", help="comma-separated, the dense rows' linears, each a run of its "
                        "own in this process: bf16, fp8 (per-channel weights, per-token activations), fp8-tensor "
                        "(a scale each), fp8-gemv (per-channel weights, bf16 activations: the weight-only GEMV at "
                        "decode sizes); e.g. bf16,fp8,fp8-gemv")
    parser.add_argument("--kv-dtype", default="bf16", help="comma-separated, the dense rows' KV cache, each form of "
                        "--weights once over each: bf16, fp8 (float8_e4m3fn, unit scales, as --kv-cache-dtype fp8 "
                        "serves; rows named -kvfp8); e.g. bf16,fp8")
    args = parser.parse_args()
    weights = parse_forms(args.weights, WEIGHTS, "--weights")
    kv = parse_forms(args.kv_dtype, tuple(KV_DTYPES), "--kv-dtype")
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.plot or args.out.with_suffix(".png"))
        return
    models = tuple(m for m in args.models.split(",") if m)
    if not models or any(m not in KINDS for m in models):
        raise SystemExit(f"--models: pick from {', '.join(KINDS)}")
    try:
        batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    except ValueError:
        raise SystemExit(f"--batches: {args.batches!r}, expected comma-separated integers") from None
    known = {b for m in models if m in MODELS for b in MODELS[m][2]}
    if batches and not set(batches) & known:
        raise SystemExit(f"--batches: none of {list(batches)} is a decode batch of {', '.join(models)}")
    if not torch.cuda.is_available():
        raise SystemExit("roofline needs a CUDA device")
    plan = bench_plan(args.plan, torch.cuda.get_device_name())
    print(f"kernel plan: {plan.summary()}", flush=True)
    result = run(args.out, args.iters, models, plan=plan, batches=batches, weights=weights, kv=kv)
    print_table(result)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
