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
from gpu_engine.kernels.tiled_linear import TILED_PLANS  # noqa: E402
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


def _setup(family, skinny=None, tiled=None, pdl=False, walk="", lanes="", blocks=16, width=8, one_launch=""):
    """A runner over a random model of the family, a cache of `blocks` 4-token blocks, tables `width` blocks wide."""
    cfg = ModelConfig.from_hf({**BASE, **FAMILIES[family]})
    model = build_empty(cfg, torch.float32, "cpu")
    init_random(model, 0)
    runner = GpuModelRunner(model, KVCache(cfg, blocks, 4), RunnerLimits(4, 32, width), skinny=skinny, tiled=tiled,
                            pdl=pdl, walk=walk, lanes=lanes, one_launch=one_launch)
    return cfg, model, runner


# A plan over the llama test model's shapes: qkv [128, 64] tiled up to 4 rows, o [64, 64] in two configurations up to
# 32, gate_up [192, 64] up to 32, down [64, 96] up to 4; the LM head [97, 64] never.
MIXED_PLAN = {(128, 64): ((4, "n64_k64_s6"),), (64, 64): ((16, "n32_k128_s4"), (32, "n64_k128_s4_x2")),
              (192, 64): ((32, "n128_k64_s4_w8"),), (64, 96): ((4, "n64_k64_s6"),)}


@pytest.mark.parametrize(("family", "skinny", "tiled"), [(f, None, None) for f in sorted(FAMILIES)]
                         + [("llama", "fma_n16_k256", None), ("qwen3", "dot_n16_k128", None),
                            ("llama", "fma_n8_k512:1", "n64_k64_s6"), ("qwen3_moe", "fma_n8_k512", "n128_k64_s4_w8"),
                            ("llama", None, "mixed"), ("llama", None, "mixed+fused"),
                            ("qwen3", None, "n64_k64_s6+fused:32"), ("qwen3_moe", None, "n32_k128_s4+fused:4"),
                            ("phi3", "fma_n8_k512:1", "n128_k64_s4_w8+fused")])
def test_runner_matches_reference_model(family, skinny, tiled, monkeypatch):
    """Prefill, decode and mixed steps; with `skinny`, the linears of the decode step (4 rows) and of the lm head
    of every step (one row a sequence) go through the skinny matmul; with `tiled`, those of every step of up to
    128 rows (all of these) not taken by the skinny one go through the tiled linear (64-deep tiles: the down
    projection, 96 deep, in two slices through the runner's shared scratch); the rest through cuBLAS. The plan
    "mixed" (`MIXED_PLAN`) takes cuBLAS and four configurations by weight shape and step size, sharing one
    scratch. With +fused, the products the tiled linear takes carry the norm before them (every step by default,
    up to 32 or 4 rows where named), gate_up's SiLU, q/k/v's preparation and the residual add after them, in
    whatever mix the plan and step give (a pending add meets a fused norm, cuBLAS meets a fused add, the MoE layer
    after a fused o, the skinny matmul at one row beside fused tiled steps), and the decode attention folds its
    splits in its own launch."""
    monkeypatch.setitem(TILED_PLANS, "mixed", MIXED_PLAN)
    cfg, model, runner = _setup(family, skinny, tiled)
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


@pytest.mark.parametrize(("family", "tiled"), [("llama", None), ("llama", "n64_k64_s6+fused"),
                                               ("qwen3_moe", "n32_k128_s4+fused:4"), ("phi3", None)])
def test_walked_short_rows_give_the_split_form_s_logits(family, tiled):
    """BLINK_DECODE_WALK=1:4: decode and mixed steps of 4 rows walk the rows of one split (all of these) in one
    program each; the logits have the split form's bits (the fold of partials), fused or not, dense or MoE."""
    logits = []
    for walk in ("", "1:4"):
        cfg, _, runner = _setup(family, tiled=tiled, walk=walk)
        assert (runner.walk_upto, runner.walk_from) == ((1, 4) if walk else (0, 33))
        g = torch.Generator().manual_seed(3)
        got = []
        for seqs, decode, tokens in [([(0, 5, [0, 1]), (0, 9, [2, 3, 4])], False, 32),
                                     ([(5, 1, [0, 1]), (9, 1, [2, 3, 4])], True, 4),
                                     ([(6, 3, [0, 1, 5]), (10, 1, [2, 3, 4])], False, 16)]:
            meta = build_metadata(seqs, 4)
            runner.buffers.logits.fill_(float("nan"))
            runner.stage(torch.randint(0, cfg.vocab_size, (meta.positions.shape[0],), generator=g), meta)
            runner.forward(4, tokens, decode)
            got.append(runner.buffers.logits[: len(seqs)].clone())
        logits.append(got)
    for split, walked in zip(*logits, strict=True):
        assert not split.isnan().any() and torch.equal(walked, split)
    for bad in ("x", "2:0", "2:", "-1"):
        with pytest.raises(ValueError, match="decode walk"):
            _setup("llama", walk=bad)


def test_decode_lanes_give_the_split_form_s_logits(monkeypatch):
    """BLINK_DECODE_LANES=1:2: a decode step of 2 rows runs one program a row and KV head over its splits (128 tokens
    each here, two a row) instead of one a split; the logits have the split form's bits, and the setting reaches the
    decode attention only from its least batch on."""
    import gpu_engine.gpu.runner as runner_mod

    monkeypatch.setattr(runner_mod, "decode_partition", lambda batch, kv_heads: 128)
    cfg, _, runner = _setup("llama", lanes="1:2", blocks=120, width=64)  # tables of 256 tokens: 2 splits
    kv, g = runner.kv, torch.Generator().manual_seed(5)
    for layer in range(cfg.num_layers):  # a context the step did not write: the same cache for both forms
        kv.k[layer].copy_(torch.randn(kv.k[layer].shape, generator=g))
        kv.v[layer].copy_(torch.randn(kv.v[layer].shape, generator=g))
    assert (runner.lanes, runner.lanes_from) == (1, 2)
    assert runner.decode_form(1)["lanes"] == 0 and runner.decode_form(2)["lanes"] == 1
    seqs = [(199, 1, list(range(50))), (254, 1, list(range(50, 114)))]
    meta = build_metadata(seqs, 4)
    ids = torch.randint(0, cfg.vocab_size, (2,), generator=g)
    logits = []
    for lanes_from in (5, 2):  # past the step's rows: a program a split; then one program a row and KV head
        runner.lanes_from = lanes_from
        runner.buffers.logits.fill_(float("nan"))
        runner.stage(ids, meta)
        runner.forward(4, 4, True)
        logits.append(runner.buffers.logits[:2].clone())
    assert not logits[0].isnan().any() and torch.equal(logits[1], logits[0])
    for bad in ("x", "2:0", "2:", "-1"):
        with pytest.raises(ValueError, match="decode lanes"):
            _setup("llama", lanes=bad)


def test_runner_refuses_an_unknown_skinny_or_tiled_configuration():
    with pytest.raises(ValueError, match="skinny"):
        _setup("llama", "fma_tiny")
    with pytest.raises(ValueError, match="tiled"):
        _setup("llama", None, "n64_tiny")
    for rows in ("0", "9", "x", ""):
        with pytest.raises(ValueError, match="ROWS"):
            _setup("llama", f"dot_n16_k128:{rows}" if rows else "dot_n16_k128:")
    assert _setup("llama", "fma_n8_k512:1")[2].skinny_rows == 1 and _setup("llama", "fma_n8_k512")[2].skinny_rows == 8
    with pytest.raises(ValueError, match="pdl: programmatic dependent launch needs a CUDA device"):
        _setup("llama", pdl=True)


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


def test_a_tiled_plan_picks_each_weights_launcher_by_shape_and_step_size(monkeypatch):
    """A plan's launchers by weight shape: qkv tiled up to 4 rows, o in two configurations up to 32 rows, the LM
    head (a shape the plan does not name) never; a configuration's name alone takes every shape up to 128 rows;
    the skinny matmul, where given, first."""
    from gpu_engine.kernels.tiled_linear import TILED_CONFIGS

    monkeypatch.setitem(TILED_PLANS, "mixed", MIXED_PLAN)
    runner = _setup("llama", None, "mixed")[2]
    qkv, o, head = tuple(runner.layers[0].qkv.shape), tuple(runner.layers[0].o.shape), tuple(runner.lm_head.shape)
    assert (qkv, o, head) == ((128, 64), (64, 64), (97, 64))

    def config(rows, shape):
        launch = runner.matmul_for(rows, shape)
        return None if launch is None else (launch.args[0].keywords["block_n"], launch.args[0].keywords["per_sm"])

    def named(name):
        return TILED_CONFIGS[name].block_n, TILED_CONFIGS[name].per_sm

    assert config(4, qkv) == named("n64_k64_s6") and config(5, qkv) is None
    assert config(16, o) == named("n32_k128_s4") and config(17, o) == named("n64_k128_s4_x2")
    assert config(32, o) == named("n64_k128_s4_x2") and config(33, o) is None
    assert config(1, head) is None
    one = _setup("llama", None, "n64_k64_s6")[2]
    assert one.matmul_for(128, head) is not None and one.matmul_for(129, head) is None
    with_skinny = _setup("llama", "fma_n8_k512:1", "mixed")[2]
    assert with_skinny.matmul_for(1, o) is with_skinny.skinny
    assert with_skinny.matmul_for(2, o) not in (None, with_skinny.skinny)


def _counted(calls: dict, name: str, fn):
    """`fn`, counting its calls in calls[name]."""
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize(("tiled", "norms", "silus", "preps"), [
    ("n64_k64_s6", 5, 2, 2), ("n64_k64_s6+fused", 1, 0, 0), ("n64_k64_s6+fused:2", 5, 0, 0), ("mlp_o+fused", 3, 0, 2)])
def test_fused_tiled_linears_take_the_layers_norms_silu_and_adds(tiled, norms, silus, preps, monkeypatch):
    """A 4-row decode step of the 2-layer llama: unfused, 2 norms a layer and the final one, a SiLU and a q/k/v
    preparation a layer; +fused, the tiled linear takes every layer norm (the final one stays, before the LM head,
    which the tiled linear does not take here), every SiLU and every preparation; with the norm's limit at 2 rows,
    the SiLUs and preparations still fuse and the norms run apart; with a plan of o and gate_up only (qkv and down
    to cuBLAS), the norm before qkv runs apart (with the down output's add from layer 1), and so does the
    preparation, the one before gate_up fuses (o added its output). The decode attention's fold is counted by its
    launcher's form: the fold's own launch at 4 rows, fused or not (the last program's is for one-row steps:
    `attention.LAST_FOLD_ROWS`; `test_a_fused_decode_layer_is_five_launches`)."""
    import gpu_engine.gpu.runner as runner_module

    monkeypatch.setitem(TILED_PLANS, "mlp_o", {(64, 64): ((4, "n32_k128_s4"),), (192, 64): ((4, "n128_k64_s4_w8"),)})
    cfg, model, runner = _setup("llama", None, tiled)
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


def test_tiled_settings_take_a_fusion_suffix():
    from gpu_engine.kernels.tiled_linear import NORM_ROWS, Fusion, resolve_tiled, tiled_fusion

    assert tiled_fusion("h200") == ("h200", None)
    assert tiled_fusion("h200+fused") == ("h200", Fusion(NORM_ROWS))
    assert tiled_fusion("n64_k64_s6+fused:0") == ("n64_k64_s6", Fusion(0))
    assert resolve_tiled("h200+fused:16", "NVIDIA L4") == "h200+fused:16"
    for bad in ("h200+fast", "h200+fused:", "h200+fused:129", "h200+fused:x", "nothing+fused"):
        with pytest.raises(ValueError, match="tiled"):
            resolve_tiled(bad, "NVIDIA H200")


@pytest.mark.parametrize(("tiled", "norms", "routes"), [("n32_k128_s4", 5, 2), ("n32_k128_s4+fused", 1, 0)])
def test_a_fused_moe_layer_takes_its_norms_and_routing_in_its_kernels(tiled, norms, routes, monkeypatch):
    """The 2-layer Qwen3-MoE at a 4-row decode step (the sort-free path): unfused, 2 norms a layer and the final
    one, and the routing apart from the router's product; +fused, only the final norm runs apart (the MLP's in the
    router's and gate_up kernels, the attention's in qkv) and the routing is the router kernel's."""
    import gpu_engine.gpu.runner as runner_module
    import gpu_engine.kernels.moe as moe_module

    cfg, model, runner = _setup("qwen3_moe", None, tiled)
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
    for tiled in ("n64_k64_s6", "n64_k64_s6+fused"):
        cfg, model, runner = _setup("llama", None, tiled)
        runner.stage(torch.arange(1), build_metadata([(5, 1, [0, 1])], 4))
        launches.clear()
        runner.forward(1, 1, True)
        counts[tiled] = len(launches)
    assert counts["n64_k64_s6"] - counts["n64_k64_s6+fused"] == 5 * len(runner.layers), counts


@pytest.mark.parametrize(("family", "parts", "fewer"), [
    ("llama", "attention", {1: 2, 4: 3}),  # qkv, attention, o (and the fold at 4 rows) in one
    ("llama", "mlp", {1: 1, 4: 1}),  # gate_up, down in one
    ("llama", "attention,mlp", {1: 3, 4: 4}),
    ("llama", "layer", {1: 4, 4: 5}),  # the five or six in one
    ("llama", "all", {1: 4, 4: 5}),
    ("qwen3_moe", "moe", {1: 2, 4: 2}),  # router, gate_up, down in one
    ("qwen3_moe", "all", {1: 4, 4: 5}),
])
def test_parts_of_a_step_in_one_launch_have_the_bits_of_the_separate_launches(family, parts, fewer, monkeypatch):
    """The 2-layer models, fused through one 4-warp tiled configuration, at a one-row and a 4-row decode step with
    `one_launch`: the attention half (qkv with its norm and preparation, attention with its fold, o with its add),
    the dense MLP half (gate_up with its norm and SiLU, down with its add) and an MoE layer's router, gate_up and
    down (the sort-free path) as phases of one launch each, so that many
    Triton launches a layer fewer, and the same logits and tokens bit for bit, the counts left at rest. Refused
    without a fused setting, and for an unknown part."""
    launches = _launches(monkeypatch)
    seqs = [(5, 1, [0, 1]), (9, 1, [2, 3, 4]), (3, 1, [5]), (2, 1, [6])]
    for rows in (1, 4):
        got = {}
        for one in ("", parts):
            cfg, model, runner = _setup(family, None, "n32_k128_s4+fused", one_launch=one)
            runner.stage(torch.arange(rows), build_metadata(seqs[:rows], 4))
            launches.clear()
            runner.forward(rows, rows, True)
            got[one] = (len(launches), runner.buffers.logits[:rows].clone(), runner.buffers.next_tokens[:rows].clone())
            assert not runner.route_counters.any() and not runner.layer_counters.any()
            assert not runner.attn_counters.any() and not runner.scratch[1].any()
        assert got[""][0] - got[parts][0] == fewer[rows] * len(runner.layers), (rows, got[""][0], got[parts][0])
        assert torch.equal(got[parts][1], got[""][1]) and torch.equal(got[parts][2], got[""][2])
    with pytest.raises(ValueError, match="one_launch"):
        _setup(family, None, "n32_k128_s4", one_launch=parts)
    with pytest.raises(ValueError, match="one launch"):
        _setup(family, None, "n32_k128_s4+fused", one_launch="attention,norms")


def test_one_launch_parts_fall_back_where_a_step_cannot_take_them():
    """A 33-row decode step: the heads kernel takes 8 warps from 33 rows, so the attention half and the layer run as
    separate launches (the same bits as without `one_launch`) while the MLP half still takes one. And which parts a
    one-row step takes with each model and plan (`one_launch_takes`, logged at an engine's start)."""
    cfg = ModelConfig.from_hf({**BASE, **FAMILIES["llama"]})
    model = build_empty(cfg, torch.float32, "cpu")
    init_random(model, 0)
    seqs = [(i % 4, 1, [i]) for i in range(33)]
    got = {}
    for one in ("", "attention,layer,mlp"):
        runner = GpuModelRunner(model, KVCache(cfg, 40, 4), RunnerLimits(33, 33, 2), tiled="n32_k128_s4+fused",
                                one_launch=one)
        runner.stage(torch.arange(33) % 90, build_metadata(seqs, 4))
        runner.forward(33, 33, True)
        got[one] = runner.buffers.logits[:33].clone()
        assert not runner.layer_counters.any()
    assert torch.equal(got[""], got["attention,layer,mlp"])
    takes = {}
    for family, tiled in (("llama", "n32_k128_s4+fused"), ("qwen3_moe", "n32_k128_s4+fused"),
                          ("llama", "n128_k64_s4_w8+fused")):
        takes[family, tiled] = _setup(family, None, tiled, one_launch="all")[2].one_launch_takes()
    assert takes["llama", "n32_k128_s4+fused"] == {"attention": True, "layer": True, "mlp": True, "moe": False}
    assert takes["qwen3_moe", "n32_k128_s4+fused"] == {"attention": True, "layer": False, "mlp": False,
                                                       "moe": True}
    assert takes["llama", "n128_k64_s4_w8+fused"] == {"attention": False, "layer": False, "mlp": True, "moe": False}
