"""The fused small ops of the CPU serving form (``kernels.cpu_fused``) against the torch forms they replace, and
the packed model with them on against it with them off."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gpu_engine.kernels import cpu_fused
from gpu_engine.kernels.cpu_attention import paged_attention_ref
from gpu_engine.kernels.cpu_linear import GroupInt8Embedding, KernelThreads, Q8Head, quant_kernels_available
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.attention import build_metadata, write_kv
from gpu_engine.models.cpu_pack import fuse_small_ops, pack_for_cpu
from gpu_engine.models.layers import RMSNorm
from gpu_engine.models.loader import load_model
from gpu_engine.models.reference import greedy_generate
from gpu_engine.models.rope import apply_rotary
from tests.helpers.q4 import q4_1_weight

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no AVX2/FMA, or _cpu_quant not built")


def test_rms_norm_is_the_module_s_arithmetic() -> None:
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.rand(96) + 0.5
    x = torch.randn(7, 96) * 3
    want = norm(x)
    norm.fused = True
    torch.testing.assert_close(norm(x), want, rtol=2e-7, atol=1e-6)


def test_rope_and_cache_write_match_the_torch_forms() -> None:
    gen = torch.Generator().manual_seed(1)
    t, heads, kv_heads, dim, bs = 5, 6, 2, 32, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(t, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.tensor([3, 9, 0, 17, 30])
    k_want, v_want = torch.zeros(8, bs, kv_heads, dim, dtype=torch.float16), torch.zeros(8, bs, kv_heads, dim,
                                                                                         dtype=torch.float16)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].reshape(t, -1, dim), cos, sin)
    write_kv(k_want, v_want, qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].reshape(t, kv_heads, dim), slots)
    k_got, v_got = torch.zeros_like(k_want), torch.zeros_like(v_want)
    got = qkv.clone()
    cpu_fused.rope_write_kv(got, cos, sin, k_got, v_got, slots, heads, kv_heads)
    torch.testing.assert_close(got[:, : (heads + kv_heads) * dim], qk.reshape(t, -1), rtol=0, atol=0)
    torch.testing.assert_close(k_got, k_want, rtol=0, atol=0)
    torch.testing.assert_close(v_got, v_want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="fp16 cache"):
        cpu_fused.rope_write_kv(got, cos, sin, k_got.float(), v_got.float(), slots, heads, kv_heads)


@pytest.mark.parametrize(("window", "dim"), [(None, 16), (5, 16), (None, 64), (5, 80)])
def test_decode_attention_matches_the_per_sequence_loop(window: int | None, dim: int) -> None:
    """(Head sizes of 64 dimensions at a time and of 8 at a time take apart paths of the values' sum.)"""
    gen = torch.Generator().manual_seed(3)
    bs, heads, kv_heads = 4, 6, 2
    k_cache = torch.randn(40, bs, kv_heads, dim, generator=gen).half()
    v_cache = torch.randn(40, bs, kv_heads, dim, generator=gen).half()
    meta = build_metadata([(13, 1, [7, 3, 9, 30]), (2, 1, [20]), (0, 1, [5])], bs)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].reshape(3, heads, dim)
    want = paged_attention_ref(q, k_cache, v_cache, meta.positions, meta.cu_seqlens_q, meta.context_lens,
                               meta.block_tables, dim**-0.5, window)
    got = cpu_fused.attend_decode(qkv, k_cache, v_cache, meta.block_tables, meta.context_lens, heads, dim**-0.5,
                                  window)
    torch.testing.assert_close(got, want.reshape(3, -1), rtol=2e-5, atol=2e-5)


TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "eos_token_id": [2], "bos_token_id": 1}


def test_packed_tiny_model_fused_equals_unfused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, cfg = load_model(tmp_path, random_weights=True, seed=5)
    fused = pack_for_cpu(model)
    assert fused.layers[0].attn.fused and fused.layers[0].residual_in_place and fused.norm.fused
    plain = copy.deepcopy(fused)
    fuse_small_ops(plain, on=False)
    prompts = [[1, 5, 9, 200, 33], [1, 77], [1]]
    want = greedy_generate(plain, KVCache(cfg, 16, 4, dtype=torch.float16), prompts, 6)
    got = greedy_generate(fused, KVCache(cfg, 16, 4, dtype=torch.float16), prompts, 6)
    assert float((got.logits - want.logits).abs().max()) < 1e-4 * float(want.logits.abs().max())


@pytest.mark.parametrize("int8_activations", [False, True])
def test_decode_stack_equals_the_layers_fused_forms(tmp_path: Path, int8_activations: bool) -> None:
    """With every linear a Q4_1 tensor, a decode step runs as one C call over all layers: its logits are the
    layer-by-layer fused forms' (the same ops; SiLU's exp may differ by an ulp, which with int8 activations can
    move an input across a rounding boundary of its int8 code: a looser bound there), and the same tokens."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, cfg = load_model(tmp_path, random_weights=True, seed=6)
    for i, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            mod.weight.data = q4_1_weight(mod.out_features, mod.in_features, 100 + i)
    stacked = pack_for_cpu(model, int8_activations=int8_activations)
    assert stacked.decode_stack is not None
    layered = copy.deepcopy(stacked)
    layered.decode_stack = None
    prompts = [[1, 5, 9, 200, 33], [1, 77], [1, 250, 3]]
    want = greedy_generate(layered, KVCache(cfg, 16, 4, dtype=torch.float16), prompts, 8)
    got = greedy_generate(stacked, KVCache(cfg, 16, 4, dtype=torch.float16), prompts, 8)
    assert got.tokens == want.tokens
    bound = 5e-3 if int8_activations else 1e-5
    assert float((got.logits - want.logits).abs().max()) < bound * float(want.logits.abs().max())
    fuse_small_ops(stacked, on=False)
    assert stacked.decode_stack is None


def test_decode_stack_is_the_same_on_one_thread_and_two(tmp_path: Path) -> None:
    """The pool splits a step's products by weight rows and its attention and SiLU by heads and items, each
    computed as on one thread: two threads give the same bits. (Head size 64: the values' register path.)"""
    config = {**TINY, "hidden_size": 256, "intermediate_size": 320, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, cfg = load_model(tmp_path, random_weights=True, seed=7)
    for i, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            mod.weight.data = q4_1_weight(mod.out_features, mod.in_features, 200 + i)
    stacked = pack_for_cpu(model)
    assert stacked.decode_stack is not None
    gen = torch.Generator().manual_seed(8)  # long contexts: the threads' heads overlap in time
    prompts = [[1, *torch.randint(3, 300, (n,), generator=gen).tolist()] for n in (150, 90, 200)]
    runs = []
    for threads in (1, 2):
        KernelThreads.count = threads
        try:
            runs.append(greedy_generate(stacked, KVCache(cfg, 160, 4, dtype=torch.float16), prompts, 16))
        finally:
            KernelThreads.count = 0
    assert runs[0].tokens == runs[1].tokens
    assert torch.equal(runs[0].logits, runs[1].logits)


def test_decode_stack_refuses_bad_input() -> None:
    shape = cpu_fused.StackShape(64, 96, 4, 2, 16, 4, 0, 1e-6)
    plan = torch.zeros(2, 8, dtype=torch.int64)
    cos = sin = torch.zeros(1, 16)
    args = (cos, sin, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1, False)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_fused.decode_stack(torch.zeros(1, 32), plan, shape, *args)
    with pytest.raises(ValueError, match="int64"):
        cpu_fused.decode_stack(torch.zeros(1, 64), plan[:, :7].contiguous(), shape, *args)
    with pytest.raises(ValueError, match="bad shape"):
        cpu_fused.decode_stack(torch.zeros(1, 64), plan, dataclasses.replace(shape, head_dim=8), *args)


def _q8_table(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    """A table that a ``GroupInt8Embedding`` holds exactly: int8 codes times an fp16-exact scale per group."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (vocab, hidden // 32, 32), generator=gen).float()
    codes[..., 0] = 127
    scale = (torch.rand(vocab, hidden // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()
    return (codes * scale).reshape(vocab, hidden)


@pytest.mark.parametrize("int8_x", [False, True])
def test_greedy_head_is_the_norm_the_head_and_argmax(int8_x: bool) -> None:
    """The fused tail gives torch.argmax of Q8Head(rms_norm(x[rows])), ties to the lowest index (rows 3 and 11 of
    the table alike, x along them) and a NaN logit as the maximum (as torch.argmax), on one thread and two."""
    hidden, vocab = 64, 301
    table = _q8_table(vocab, hidden, 4)
    table[11] = table[3]
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.rand(hidden, generator=torch.Generator().manual_seed(5)) + 0.5
    norm.fused = True
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, hidden, generator=gen)
    x[2] = table[3] / norm.weight.data * 50  # its largest logit: rows 3 and 11, equal
    x[7] = 0.0
    for with_nan in (False, True):
        emb = GroupInt8Embedding(table)
        if with_nan:
            emb.scales[200, 1] = float("nan")
        head = Q8Head(emb)
        head.int8_activations = int8_x
        for rows in (None, [8, 2, 2, 0, 5]):
            index = None if rows is None else torch.tensor(rows)
            logits = head(norm(x if index is None else x[index]))
            want = torch.argmax(logits, dim=-1)
            assert bool(torch.isnan(logits).any()) == with_nan
            assert int(want[1 if rows else 2]) == (200 if with_nan else 3)
            for threads in (1, 2):
                got = cpu_fused.greedy_head(x, index, norm.weight.data, emb.codes, emb.scales, 1e-6, threads,
                                            int8_x)
                assert torch.equal(got, want), (with_nan, rows, threads)


def test_greedy_head_refuses_bad_input() -> None:
    emb = GroupInt8Embedding(_q8_table(50, 64, 1))
    w, x = torch.ones(64), torch.randn(3, 64)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_fused.greedy_head(x.t(), None, w, emb.codes, emb.scales, 1e-6, 1, False)
    with pytest.raises(ValueError, match="outside"):
        cpu_fused.greedy_head(x, torch.tensor([0, 3]), w, emb.codes, emb.scales, 1e-6, 1, False)
    with pytest.raises(ValueError, match="int8 codes"):
        cpu_fused.greedy_head(x, None, w, emb.codes.float(), emb.scales, 1e-6, 1, False)
    with pytest.raises(ValueError, match="norm"):
        cpu_fused.greedy_head(x, None, w[:32], emb.codes, emb.scales, 1e-6, 1, False)
    with pytest.raises(ValueError, match="scratch"):
        cpu_fused.greedy_head(x, None, w, emb.codes, emb.scales, 1e-6, 1, False, torch.empty(10))


def test_packed_model_greedy_at_is_the_argmax_of_its_logits(tmp_path: Path) -> None:
    """A packed model with a tied Q8_0 table and Q4_1 layers takes greedy tokens from one C call after the stack
    (``GreedyHead``): the argmax of ``logits_at`` on prefill rows (given) and decode rows (all)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, cfg = load_model(tmp_path, random_weights=True, seed=9)
    model.embed.weight.data = _q8_table(TINY["vocab_size"], TINY["hidden_size"], 10)
    for i, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            mod.weight.data = q4_1_weight(mod.out_features, mod.in_features, 300 + i)
    packed = pack_for_cpu(model)
    assert packed.greedy_head is not None and packed.decode_stack is not None
    kv = KVCache(cfg, 16, 4, dtype=torch.float16)
    prompts = [[1, 5, 9, 200, 33], [1, 77], [1, 250, 3]]
    tables = [kv.allocator.allocate(2) for _ in prompts]
    meta = build_metadata([(0, len(p), t) for p, t in zip(prompts, tables, strict=True)], 4)
    hidden = packed.hidden_states(torch.tensor([t for p in prompts for t in p]), meta, kv)
    last = [4, 6, 9]
    want = torch.argmax(packed.logits_at(hidden, torch.tensor(last)), dim=-1).tolist()
    assert packed.greedy_at(hidden, last) == want
    meta = build_metadata([(len(p), 1, t) for p, t in zip(prompts, tables, strict=True)], 4)
    hidden = packed.hidden_states(torch.tensor(want), meta, kv)
    want = torch.argmax(packed.logits_at(hidden, torch.arange(3)), dim=-1).tolist()
    assert packed.greedy_at(hidden, None) == want
    head, packed.greedy_head = packed.greedy_head, None
    assert packed.greedy_at(hidden, None) == want and packed.greedy_at(hidden, [2, 0]) == [want[2], want[0]]
    packed.greedy_head = head
    fuse_small_ops(packed, on=False)
    assert packed.greedy_head is None


def test_engine_greedy_steps_take_the_same_tokens_as_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model through the CPU engine, greedy requests (two prefilled together, the third with the
    others' decode): the runner's greedy tail gives the tokens ``sample`` gives."""
    import numpy as np  # noqa: PLC0415

    from gpu_engine import runner as runner_mod  # noqa: PLC0415
    from gpu_engine.engine import RingEngine  # noqa: PLC0415
    from gpu_engine.models.errors import ModelLoadError  # noqa: PLC0415
    from gpu_engine.models.loader import default_model_path  # noqa: PLC0415
    from gpu_engine.serve import build_cpu_backend  # noqa: PLC0415
    from shared.config import EngineConfig  # noqa: PLC0415
    from shared.messages import Sampling  # noqa: PLC0415
    from shared.ring import RingGeometry, local_ring  # noqa: PLC0415
    from shared.slots import SlotRequest, SlotWriter  # noqa: PLC0415

    try:
        default_model_path()
    except ModelLoadError:
        pytest.skip("embedded model not installed")
    geo = RingGeometry(4, 64, 16, 1)
    backend = build_cpu_backend(EngineConfig(ring_name="local", geometry=geo, kv_blocks=64, max_batch=4))
    assert backend.runner is not None and backend.runner.model.greedy_head is not None  # type: ignore[attr-defined]
    prompts = [[1, 504, 3458, 282, 4649, 314, 9, 17, 4511, 33, 12, 908, 16, 77, 1024, 5, 300, 21],
               [1, 504, 3458, 282, 4649, 314, 9, 17, 4511, 33, 12, 908, 16, 77, 1024, 5, 42],
               [1, 28, 1095, 314]]

    def run() -> list[list[int]]:
        ring = local_ring(geo)
        engine = RingEngine(ring, backend.runner, backend.policy, backend.eos_ids, backend.max_context,
                            backend.vocab_size)
        writer = SlotWriter(ring)
        for i, prompt in enumerate(prompts):
            if i == 2:
                for _ in range(3):
                    engine.step()
            seq = writer.try_reserve(i, int(ring.slots[i]["seq"]))
            assert seq is not None
            writer.publish(i, seq, SlotRequest(i + 1, np.array(prompt, np.int32), Sampling(12, ignore_eos=True)))
        for _ in range(200):
            if not engine.step() and not engine.by_slot:
                break
        return [ring.output_tokens[i, : int(ring.slots[i]["generated"])].tolist() for i in range(len(prompts))]

    model = backend.runner.model  # type: ignore[attr-defined]
    head, calls = model.greedy_head, []
    model.greedy_head = lambda hidden, rows: calls.append(rows) or head(hidden, rows)
    fast = run()
    assert calls[0] == [17, 34] and [0, 1, 5] in calls and None in calls  # prefill rows, a mixed step, decode
    n = len(calls)
    monkeypatch.setattr(runner_mod, "plain_greedy", lambda spec: False)
    slow = run()
    assert len(calls) == n
    assert fast == slow and all(len(t) == 12 for t in fast)


def test_rope_tables_are_the_cat_of_the_frequencies() -> None:
    """``RotaryEmbedding.cos_sin``'s plain case (one product with the frequencies laid twice) gives the bits of
    cos and sin of ``cat([pos * f, pos * f])``."""
    from gpu_engine.models.config import ModelConfig  # noqa: PLC0415
    from gpu_engine.models.rope import RotaryEmbedding  # noqa: PLC0415

    rope = RotaryEmbedding(ModelConfig.from_hf({**TINY, "rope_theta": 100000.0}))
    positions = torch.tensor([0, 1, 7, 33, 500, 4095, 123456])
    freqs = positions.to(torch.float32)[:, None] * rope.inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = rope.cos_sin(positions)
    assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())


def test_moving_the_weights_after_a_step_remakes_the_stack_s_plan(tmp_path: Path) -> None:
    """``move_to_huge_pages`` on a model that has stepped (its stack's plan holding the weights' addresses): the
    plan is made anew, the same tokens and logits."""
    from gpu_engine.models.cpu_pack import move_to_huge_pages  # noqa: PLC0415

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, cfg = load_model(tmp_path, random_weights=True, seed=14)
    for i, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            mod.weight.data = q4_1_weight(mod.out_features, mod.in_features, 400 + i)
    packed = pack_for_cpu(model)
    assert packed.decode_stack is not None
    prompts = [[1, 5, 9, 200, 33], [1, 77]]
    kv = KVCache(cfg, 16, 4, dtype=torch.float16)  # one cache: the plan is kept for it between the runs
    want = greedy_generate(packed, kv, prompts, 5)
    before = packed.layers[0].attn.qkv.blocks.data_ptr()
    if move_to_huge_pages(packed) == 0:
        pytest.skip("no madvise here")
    assert packed.layers[0].attn.qkv.blocks.data_ptr() != before
    got = greedy_generate(packed, kv, prompts, 5)
    assert got.tokens == want.tokens and torch.equal(got.logits, want.logits)
