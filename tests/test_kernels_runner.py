"""The GPU runner's forward (Triton kernels, interpreter on CPU) vs the reference CausalLM, all families."""

import functools
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_engine.gpu.graph_cache import GraphCache  # noqa: E402
from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits  # noqa: E402
from gpu_engine.kernels.plan import PLANS, KernelPlan  # noqa: E402
from gpu_engine.kv_cache import KVCache  # noqa: E402
from gpu_engine.models.attention import build_metadata  # noqa: E402
from gpu_engine.models.config import ModelConfig  # noqa: E402
from gpu_engine.models.loader import build_empty, init_random  # noqa: E402

BASE = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256}
FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "tie_word_embeddings": True},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16, "hidden_size": 32, "num_experts": 6,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5},
}


def _setup(family, plan=PLANS["cublas"], blocks=16, width=8):
    """A runner over a random model of the family, a cache of `blocks` 4-token blocks, tables `width` blocks wide,
    its products where `plan` says."""
    cfg = ModelConfig.from_hf({**BASE, **FAMILIES[family]})
    model = build_empty(cfg, torch.float32, "cpu")
    init_random(model, 0)
    runner = GpuModelRunner(model, KVCache(cfg, blocks, 4), RunnerLimits(4, 32, width), plan)
    return cfg, model, runner


def _at_rest(runner) -> bool:
    """Whether the runner's counts are all back at zero (the decode attention's, the MoE router's, the tiled
    linears' shared scratch's): a captured graph replays no memset."""
    scratches = [launch.args[0].keywords["scratch"][1] for launch in runner.tiled.values()]
    return not any(c.any() for c in (runner.attn_counters, runner.route_counters, *scratches))


# A plan over the llama test model's shapes: qkv [128, 64] tiled up to 32 rows in two configurations, o [64, 64] in
# two up to 32, gate_up [192, 64] up to 32, down [64, 96] up to 4 (past it, cuBLAS: its output pending when the next
# layer's qkv takes the fused forms); the LM head [97, 64] never.
MIXED_LINEARS = {(128, 64): ((4, "n64_k64_s6"), (32, "n32_k128_s4")),
                 (64, 64): ((16, "n32_k128_s4"), (32, "n64_k128_s4_x2")),
                 (192, 64): ((32, "n128_k64_s4_w8"),), (64, 96): ((4, "n64_k64_s6"),)}
MIXED = KernelPlan("mixed", MIXED_LINEARS)
MIXED_FUSED = KernelPlan("mixed+fused", MIXED_LINEARS, fused=True)
SLOW = pytest.mark.slow  # the MoE model on tiled linears: the longest cases; CI keeps its cublas one


@pytest.mark.parametrize(("family", "plan"), [(f, PLANS["cublas"]) for f in sorted(FAMILIES)]
                         + [("llama", KernelPlan.every_weight("n64_k64_s6")),
                            pytest.param("qwen3_moe", KernelPlan.every_weight("n128_k64_s4_w8"), marks=SLOW),
                            ("llama", MIXED), ("llama", MIXED_FUSED),
                            ("qwen3", KernelPlan.every_weight("n64_k64_s6", fused=True)),
                            pytest.param("qwen3_moe", KernelPlan.every_weight("n32_k128_s4", fused=True), marks=SLOW),
                            ("phi3", KernelPlan.every_weight("n128_k64_s4_w8", fused=True))],
                         ids=lambda v: v.name if isinstance(v, KernelPlan) else v)
def test_runner_matches_reference_model(family, plan):
    """Prefill, decode and mixed steps; with a plan of tiled linears, the products of every step of up to 128 rows
    (all of these) that it names go through the tiled linear (64-deep tiles: the down projection, 96 deep, in two
    slices through the runner's shared scratch); the rest through cuBLAS. `MIXED` takes cuBLAS and four
    configurations by weight shape and step size, sharing one scratch. Fused, the products the tiled linear takes
    carry the norm before them, gate_up's SiLU, q/k/v's preparation and the residual add after them, in whatever mix
    the plan and step give (a pending add meets a fused norm and q/k/v preparation, cuBLAS meets a fused add, the
    MoE layer after a fused o), the MoE layers route in their router's kernel and add into the stream, and the
    decode attention folds its splits in its own launch; every count is left at rest."""
    cfg, model, runner = _setup(family, plan)
    assert runner.plan is plan
    ref_kv = KVCache(cfg, 16, 4)
    g = torch.Generator().manual_seed(1)
    steps = [([(0, 5, [0, 1]), (0, 9, [2, 3, 4])], False, 32),  # prefill, padded to 4 seqs / 32 tokens
             ([(5, 1, [0, 1]), (9, 1, [2, 3, 4])], True, 4),  # decode, padded to batch 4
             ([(6, 3, [0, 1, 5]), (10, 1, [2, 3, 4])], False, 16)]  # mixed prefill + decode
    for seqs, decode, tokens in steps:
        meta = build_metadata(seqs, 4)
        ids = torch.randint(0, cfg.vocab_size, (meta.positions.shape[0],), generator=g)
        want = model(ids, meta, ref_kv)
        runner.buffers.logits.fill_(float("nan"))
        runner.stage(ids, meta)
        runner.forward(4, tokens, decode)
        torch.testing.assert_close(runner.buffers.logits[: len(seqs)], want, rtol=1e-4, atol=1e-4)
        assert torch.equal(runner.buffers.next_tokens[: len(seqs)], want.argmax(-1))
        if decode:  # the sort-free variant (greedy rows): the same step again, the same tokens
            runner.buffers.next_tokens.fill_(-1)
            runner.forward(4, tokens, decode, filtered=False)
            assert torch.equal(runner.buffers.next_tokens[: len(seqs)], want.argmax(-1))
        assert _at_rest(runner)


def test_kept_hidden_states_give_every_token_s_logits():
    """The host-driven backend's prompt log-probs: `forward(keep_hidden=True)` then `logits_at` over every token
    of a prefill step equals the reference model's logits of those tokens."""
    cfg, model, runner = _setup("llama")
    meta = build_metadata([(0, 5, [0, 1]), (0, 9, [2, 3, 4])], 4)
    ids = torch.randint(0, cfg.vocab_size, (14,), generator=torch.Generator().manual_seed(2))
    rows = torch.arange(14)
    want = model.logits_at(model.hidden_states(ids, meta, KVCache(cfg, 16, 4)), rows)
    runner.stage(ids, meta)
    runner.forward(2, 14, False, keep_hidden=True)
    torch.testing.assert_close(runner.logits_at(0, 14), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.buffers.logits[:2], want[[4, 13]], rtol=1e-4, atol=1e-4)


def test_graph_cache_lookup_table():
    _, _, runner = _setup("llama")
    gc = GraphCache(runner, decode_batches=[1, 2, 4], prefill_buckets=[(1, 16), (4, 32)])
    assert [tuple(s) for s in gc.shapes] == [(True, 1, 1, False), (True, 2, 2, False), (True, 4, 4, False),
                                             (True, 1, 1, True), (True, 2, 2, True), (True, 4, 4, True),
                                             (False, 1, 16, True), (False, 4, 32, True)]
    for filtered in (False, True):
        picked = [gc.shapes[gc.lookup(True, b, b, filtered)[0]] for b in (1, 2, 3, 4)]
        assert [s.batch for s in picked] == [1, 2, 4, 4]
        assert all(s.decode and s.filtered == filtered for s in picked)
        assert gc.lookup(True, 4, 4, filtered)[1]
        assert not gc.lookup(True, 5, 5, filtered)[1]  # past the largest: its own variant's largest
        assert gc.shapes[gc.lookup(True, 5, 5, filtered)[0]] == (True, 4, 4, filtered)
    assert gc.lookup(True, 3, 3) == gc.lookup(True, 3, 3, True)  # filtering by default
    # (2, max_batch + 1), row 0 unfiltered, row 1 filtering; a flat row-major read for the scheduler
    table = gc.scheduler_view()["decode_table"]
    assert table.dtype == np.int32 and table.shape == (2, 5) and table.flags.c_contiguous
    assert table.reshape(-1).tolist() == [0, 0, 1, 2, 2, 3, 3, 4, 5, 5]
    idx, fits = gc.lookup(False, 1, 12)
    assert gc.shapes[idx] == (False, 1, 16, True) and fits
    assert gc.lookup(False, 1, 12, filtered=False) == (idx, fits)  # a prefill graph always filters
    idx, fits = gc.lookup(False, 2, 12)
    assert gc.shapes[idx] == (False, 4, 32, True) and fits
    assert gc.lookup(False, 1, 17)[0] == gc.lookup(False, 4, 32)[0]
    with pytest.raises(ValueError, match="disagrees"):
        gc.replay(gc.shapes[0], filtered=True)
    with pytest.raises(RuntimeError, match="not captured"):
        gc.replay(gc.shapes[0], filtered=False)
    with pytest.raises(ValueError):
        GraphCache(runner, decode_batches=[8], prefill_buckets=[])


def test_the_roofline_s_mixed_step_is_a_valid_step():
    """`bench/roofline.py`'s mixed rows: decode rows over a cached context plus a prompt chunk, staged by
    `stage_seqs` and run at the mixed graph's shape (rows + 1, the budget), give the reference model's
    logits for every row (its decode rows' and the chunk's last token)."""
    from bench.roofline import mixed_seqs, stage_seqs
    from gpu_engine.models.attention import build_metadata

    cfg = ModelConfig.from_hf({**BASE, **FAMILIES["llama"]})
    model = build_empty(cfg, torch.float32, "cpu")
    init_random(model, 0)
    runner = GpuModelRunner(model, KVCache(cfg, 16, 16), RunnerLimits(4, 32, 8))
    seqs = mixed_seqs(3, 20, 13, block=16)  # 3 decode rows + 13 prompt tokens = 16 tokens, 4 rows
    assert [(c, n) for c, n, _ in seqs] == [(19, 1)] * 3 + [(0, 13)]
    assert len({b for _, _, table in seqs for b in table}) == sum(len(t) for _, _, t in seqs) == 7
    torch.manual_seed(3)
    ids = stage_seqs(runner, seqs, device="cpu", block=16)
    want = model(ids, build_metadata(seqs, 16), KVCache(cfg, 16, 16))
    runner.buffers.logits.fill_(float("nan"))
    runner.forward(4, 16, False, False)
    torch.testing.assert_close(runner.buffers.logits[:4], want, rtol=1e-4, atol=1e-4)


def test_a_tiled_plan_picks_each_weights_launcher_by_shape_and_step_size():
    """A plan's launchers by weight shape: qkv in two configurations up to 32 rows, o in two up to 32 rows, the LM
    head (a shape the plan does not name) never; one launcher a configuration, whatever the shapes that take it;
    `KernelPlan.every_weight` takes every shape up to 128 rows; the cuBLAS plan binds none."""
    from gpu_engine.kernels.tiled_linear import MAX_ROWS, TILED_CONFIGS

    runner = _setup("llama", MIXED)[2]
    qkv, o, head = tuple(runner.layers[0].qkv.shape), tuple(runner.layers[0].o.shape), tuple(runner.lm_head.shape)
    assert (qkv, o, head) == ((128, 64), (64, 64), (97, 64))

    def config(rows, shape):
        launch = runner.matmul_for(rows, shape)
        if launch is None:
            assert runner.plan.config_for(rows, shape) is None
            return None
        bound = launch.args[0].keywords
        assert launch is runner.tiled[runner.plan.config_for(rows, shape)]
        return bound["block_n"], bound["per_sm"], bound["num_warps"]

    def named(name):
        return TILED_CONFIGS[name].block_n, TILED_CONFIGS[name].per_sm, TILED_CONFIGS[name].num_warps

    assert config(1, qkv) == config(4, qkv) == named("n64_k64_s6")
    assert config(5, qkv) == config(32, qkv) == named("n32_k128_s4") and config(33, qkv) is None
    assert config(16, o) == named("n32_k128_s4") and config(17, o) == named("n64_k128_s4_x2")
    assert config(32, o) == named("n64_k128_s4_x2") and config(33, o) is None
    assert config(5, (64, 96)) is None
    assert config(1, head) is None
    assert runner.matmul_for(16, o) is runner.matmul_for(5, qkv)  # n32_k128_s4 bound once
    assert set(runner.tiled) == {TILED_CONFIGS[n] for n in ("n64_k64_s6", "n32_k128_s4", "n64_k128_s4_x2",
                                                             "n128_k64_s4_w8")}
    one = _setup("llama", KernelPlan.every_weight("n64_k64_s6"))[2]
    assert one.matmul_for(MAX_ROWS, head) is not None and one.matmul_for(MAX_ROWS + 1, head) is None
    assert all(one.fused_for(1, w) is None for w in (one.layers[0].qkv, one.lm_head))  # not a fused plan
    cublas = _setup("llama")[2]
    assert cublas.plan is PLANS["cublas"] and cublas.tiled == {} and cublas.matmul_for(1, qkv) is None
    assert cublas.attn_counters.numel() == cublas.route_counters.numel() == 0


def test_decode_form_and_fusions_follow_the_plan():
    """The decode attention folds in its split launch only for a fused plan's one-row steps (`LAST_FOLD_ROWS`),
    through the runner's counts; its split size is the same for every batch and plan. The norm goes into the
    products only for a fused plan, and not for an fp16 model; q/k/v's preparation into qkv only where the fused
    plan gives qkv to the tiled linear at that step size."""
    from gpu_engine.kernels.attention import LAST_FOLD_ROWS, decode_partition

    fused = _setup("llama", MIXED_FUSED)[2]
    plain = _setup("llama", MIXED)[2]
    cublas = _setup("llama")[2]
    size = decode_partition(1, 2)
    for batch in (1, LAST_FOLD_ROWS + 1, 4):
        folds = batch <= LAST_FOLD_ROWS
        assert fused.decode_form(batch) == {"partition_size": size, "form": "last" if folds else "split",
                                            "counters": fused.attn_counters if folds else None}
        for runner in (plain, cublas):
            assert runner.decode_form(batch) == {"partition_size": size, "form": "split", "counters": None}
    assert fused.attn_counters.numel() == 4 * 2  # a count a row and KV head
    assert fused._norm_fuses() and not plain._norm_fuses() and not cublas._norm_fuses()
    w = fused.layers[0]
    assert fused.qkv_heads(0, w, 32) is not None and fused.qkv_heads(0, w, 33) is None
    assert plain.qkv_heads(0, w, 1) is None and cublas.qkv_heads(0, w, 1) is None
    assert fused.fused_for(4, w.down) is fused.matmul_for(4, tuple(w.down.shape)) and fused.fused_for(5, w.down) is None
    cfg = ModelConfig.from_hf({**BASE, **FAMILIES["llama"]})
    half = build_empty(cfg, torch.float16, "cpu")
    init_random(half, 0)
    runner = GpuModelRunner(half, KVCache(cfg, 16, 4, dtype=torch.float16), RunnerLimits(4, 32, 8), MIXED_FUSED)
    assert not runner._norm_fuses() and runner.fused_for(1, runner.layers[0].o) is not None


def _counted(calls: dict, name: str, fn):
    """`fn`, counting its calls in calls[name]."""
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper


MLP_O = {(64, 64): ((4, "n32_k128_s4"),), (192, 64): ((4, "n128_k64_s4_w8"),)}  # o and gate_up only


@pytest.mark.parametrize(("plan", "norms", "silus", "preps"), [
    (KernelPlan.every_weight("n64_k64_s6"), 5, 2, 2), (KernelPlan.every_weight("n64_k64_s6", fused=True), 1, 0, 0),
    (KernelPlan("mlp_o", MLP_O, fused=True), 3, 0, 2)], ids=lambda v: v.name if isinstance(v, KernelPlan) else v)
def test_fused_tiled_linears_take_the_layers_norms_silu_and_adds(plan, norms, silus, preps, monkeypatch):
    """A 4-row decode step of the 2-layer llama: unfused, 2 norms a layer and the final one, a SiLU and a q/k/v
    preparation a layer; fused, the tiled linear takes every layer norm (the final one stays, before the LM head,
    which the tiled linear does not take here), every SiLU and every preparation; with a plan of o and gate_up only
    (qkv and down to cuBLAS), the norm before qkv runs apart (with the down output's add from layer 1), and so does
    the preparation, the one before gate_up fuses (o added its output). The decode attention's fold is counted by its
    launcher's form: the fold's own launch at 4 rows, fused or not (the last program's is for one-row steps:
    `attention.LAST_FOLD_ROWS`; `test_a_fused_decode_layer_is_five_launches`)."""
    import gpu_engine.gpu.runner as runner_module

    cfg, model, runner = _setup("llama", plan)
    calls = {"norm": 0, "silu": 0, "prep": 0, "last": 0}
    counted = functools.partial(_counted, calls)
    monkeypatch.setattr(runner_module, "rms_norm", counted("norm", runner_module.rms_norm))
    monkeypatch.setattr(runner_module, "silu_and_mul", counted("silu", runner_module.silu_and_mul))
    monkeypatch.setattr(runner_module, "qkv_prep", counted("prep", runner_module.qkv_prep))
    attend = runner_module.decode_attention
    monkeypatch.setattr(runner_module, "decode_attention",
                        lambda *a, **k: (calls.__setitem__("last", calls["last"] + (k.get("form") == "last")),
                                         attend(*a, **k))[1])
    meta = build_metadata([(5, 1, [0, 1]), (9, 1, [2, 3, 4]), (3, 1, [5]), (2, 1, [6])], 4)
    runner.stage(torch.arange(4), meta)
    runner.forward(4, 4, True)
    assert calls == {"norm": norms, "silu": silus, "prep": preps, "last": 0}


@pytest.mark.parametrize(("fused", "norms", "routes"), [(False, 5, 2), (True, 1, 0)])
def test_a_fused_moe_layer_takes_its_norms_and_routing_in_its_kernels(fused, norms, routes, monkeypatch):
    """The 2-layer Qwen3-MoE at a 4-row decode step (the sort-free path), every dense product through one tiled
    configuration: unfused, 2 norms a layer and the final one, and the routing apart from the router's product;
    fused, only the final norm runs apart (the MLP's in the router's and gate_up kernels, the attention's in qkv) and
    the routing is the router kernel's."""
    import gpu_engine.gpu.runner as runner_module
    import gpu_engine.kernels.moe as moe_module

    cfg, model, runner = _setup("qwen3_moe", KernelPlan.every_weight("n32_k128_s4", fused))
    calls = {"norm": 0, "route": 0}
    counted = functools.partial(_counted, calls)
    monkeypatch.setattr(runner_module, "rms_norm", counted("norm", runner_module.rms_norm))
    monkeypatch.setattr(moe_module, "moe_route", counted("route", moe_module.moe_route))
    meta = build_metadata([(5, 1, [0, 1]), (9, 1, [2, 3, 4]), (3, 1, [5]), (2, 1, [6])], 4)
    runner.stage(torch.arange(4), meta)
    runner.forward(4, 4, True)
    assert calls == {"norm": norms, "route": routes}


def _launches(monkeypatch) -> list:
    """The Triton launches made from here on (interpreter), in a list."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    return launches


def test_a_fused_decode_layer_is_five_launches(monkeypatch):
    """Triton launches of a one-row decode step of the 2-layer llama with every product through one tiled
    configuration: 10 a layer unfused (norm, qkv, q/k/v preparation, attention, its fold, o, norm, gate_up, SiLU,
    down), 5 fused (qkv, attention, o, gate_up, down); the rest of the step (embedding, final norm, LM head,
    sampling) the same either way."""
    launches = _launches(monkeypatch)
    counts = {}
    for fused in (False, True):
        cfg, model, runner = _setup("llama", KernelPlan.every_weight("n64_k64_s6", fused))
        runner.stage(torch.arange(1), build_metadata([(5, 1, [0, 1])], 4))
        launches.clear()
        runner.forward(1, 1, True)
        counts[fused] = len(launches)
        assert _at_rest(runner)
    assert counts[False] - counts[True] == 5 * len(runner.layers), counts
