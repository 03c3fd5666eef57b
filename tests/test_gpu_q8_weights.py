"""A Q8_0 GGUF on the GPU backends' path (``loader.load_gpu_weights``, ``GpuModelRunner`` with ``Q8Weight``
linears through ``kernels.q8_linear`` and a Q8_0 token table), on CPU tensors in the interpreter: the file's
codes and scales kept, nothing dense allocated for them, and the same logits as the reference model on the
dequantized weights."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits  # noqa: E402
from gpu_engine.kv_cache import KVCache  # noqa: E402
from gpu_engine.models.attention import build_metadata  # noqa: E402
from gpu_engine.models.loader import load_gpu_weights, load_model  # noqa: E402
from gpu_engine.models.q8_weight import Q8Weight  # noqa: E402
from shared.config import EngineConfig  # noqa: E402

Q = gguf.GGMLQuantizationType
VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 96, 64, 96, 4, 2, 16, 2
LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")


def write_gguf(path: Path, qtype: Q, tied: bool) -> None:
    """A tiny llama whose matrices (token table included) are stored as ``qtype``, norms as F32."""
    g = torch.Generator().manual_seed(3)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (HIDDEN,), b + "ffn_norm.weight": (HIDDEN,),
                   b + "attn_q.weight": (HEADS * HEAD_DIM, HIDDEN), b + "attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   b + "attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), b + "attn_output.weight": (HIDDEN, HIDDEN),
                   b + "ffn_gate.weight": (FFN, HIDDEN), b + "ffn_up.weight": (FFN, HIDDEN),
                   b + "ffn_down.weight": (HIDDEN, FFN)}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("vocab_size", VOCAB),
                       ("rope.dimension_count", HEAD_DIM)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * torch.randn(shape, generator=g)).numpy().astype(np.float32))
        else:
            t = (0.2 * torch.randn(shape, generator=g)).numpy()
            w.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def q8_file(request, tmp_path: Path) -> tuple[Path, bool]:
    path = tmp_path / "tiny-q8_0.gguf"
    write_gguf(path, Q.Q8_0, request.param)
    return path, request.param


def test_loader_keeps_q8_0_linears(q8_file) -> None:
    path, tied = q8_file
    dense, _ = load_model(path)  # every tensor dequantized to fp32: the reference
    got = load_gpu_weights(path, dtype=torch.float32, device="cpu")
    names = {f"layers.{i}.{p}.weight" for i in range(LAYERS) for p in LINEARS} | {"embed.weight"}
    names |= set() if tied else {"lm_head.weight"}
    assert set(got.quantized) == names
    params = dict(got.model.named_parameters())
    for name, w in got.quantized.items():
        assert isinstance(w, Q8Weight) and w.codes.dtype == torch.int8 and w.scales.dtype == torch.float16
        n, k = w.shape
        assert w.nbytes == n * k + n * k // 32 * 2  # the file's 34 bytes a block of 32
        assert params[name].numel() == 0  # never allocated dense
        # the same values as the dequantized model: fused and unpermuted the same way, nothing rounded
        assert torch.equal(w.dequantize(), dict(dense.named_parameters())[name]), name
    s = got.summary
    assert s["q8_0_kinds"] == ("attn.o,attn.qkv,embed,mlp.down,mlp.gate_up" if tied else
                               "attn.o,attn.qkv,embed,lm_head,mlp.down,mlp.gate_up")
    assert s["q8_0_linears"] == len(names) and s["q8_0_bytes"] == sum(w.nbytes for w in got.quantized.values())
    assert s["q8_0_as_dense_bytes"] == sum(w.shape[0] * w.shape[1] * 4 for w in got.quantized.values())
    assert s["dequantized_gguf_tensors"] == {}  # the norms are F32
    assert s["dense_bytes"] == sum(p.nbytes for p in got.model.parameters()) == (2 * LAYERS + 1) * HIDDEN * 4

    old = load_gpu_weights(path, dtype=torch.float32, device="cpu", weights="dense")  # the switch: as before
    assert old.quantized == {} and old.summary["q8_0_bytes"] == 0
    for name, p in dense.named_parameters():
        assert torch.equal(dict(old.model.named_parameters())[name], p), name


def test_loader_dequantizes_other_types(tmp_path: Path) -> None:
    path = tmp_path / "tiny-q4_0.gguf"
    write_gguf(path, Q.Q4_0, tied=False)
    got = load_gpu_weights(path, dtype=torch.float32, device="cpu")
    assert got.quantized == {}
    assert got.summary["dequantized_gguf_tensors"] == {"Q4_0": 2 + 7 * LAYERS}
    assert got.model.layers[0].attn.qkv.weight.shape == (128, HIDDEN)


def test_runner_on_q8_0_weights_matches_reference(q8_file) -> None:
    path, _ = q8_file
    reference, cfg = load_model(path)
    got = load_gpu_weights(path, dtype=torch.float32, device="cpu")
    runner = GpuModelRunner(got.model, KVCache(cfg, 16, 4), RunnerLimits(4, 32, 8), quantized=got.quantized)
    assert isinstance(runner.layers[1].gate_up, Q8Weight) and isinstance(runner.embed, Q8Weight)
    assert isinstance(runner.lm_head, Q8Weight)
    ref_kv = KVCache(cfg, 16, 4)
    g = torch.Generator().manual_seed(1)
    steps = [([(0, 5, [0, 1]), (0, 9, [2, 3, 4])], False, 32),  # prefill, padded to 4 seqs / 32 tokens
             ([(5, 1, [0, 1]), (9, 1, [2, 3, 4])], True, 4),  # decode, padded to batch 4
             ([(6, 3, [0, 1, 5]), (10, 1, [2, 3, 4])], False, 16)]  # mixed prefill + decode
    for seqs, decode, tokens in steps:
        meta = build_metadata(seqs, 4)
        ids = torch.randint(0, cfg.vocab_size, (meta.positions.shape[0],), generator=g)
        want = reference(ids, meta, ref_kv)
        runner.buffers.logits.fill_(float("nan"))
        runner.stage(ids, meta)
        runner.forward(4, tokens, decode)
        torch.testing.assert_close(runner.buffers.logits[: len(seqs)], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(runner.buffers.next_tokens[: len(seqs)], want.argmax(-1))


def test_runner_refuses_misplaced_q8_weights(q8_file) -> None:
    path, _ = q8_file
    got = load_gpu_weights(path, dtype=torch.float32, device="cpu")
    cfg = got.config
    extra = dict(got.quantized) | {"layers.0.attn.qkv_typo.weight": got.quantized["layers.0.attn.o.weight"]}
    with pytest.raises(ValueError, match="no Q8_0 path"):
        GpuModelRunner(got.model, KVCache(cfg, 16, 4), RunnerLimits(4, 32, 8), quantized=extra)


def test_gpu_weights_flag() -> None:
    assert EngineConfig(ring_name="r").gpu_weights == "auto"
    cfg = EngineConfig(ring_name="r", backend="host", gpu_weights="dense")
    assert "--gpu-weights" in cfg.to_argv()
    with pytest.raises(ValueError, match="--gpu-weights dense applies to the GPU backends"):
        EngineConfig(ring_name="r", backend="cpu", gpu_weights="dense")
    with pytest.raises(ValueError):
        EngineConfig(ring_name="r", gpu_weights="int4")


@pytest.mark.gpu
def test_q8_0_gguf_on_cuda_keeps_int8(q8_file) -> None:
    path, _ = q8_file
    got = load_gpu_weights(path, dtype=torch.bfloat16, device="cuda")
    assert all(w.codes.is_cuda for w in got.quantized.values())
    dense = load_gpu_weights(path, dtype=torch.bfloat16, device="cuda", weights="dense")
    cfg = got.config
    meta = build_metadata([(0, 5, [0, 1]), (0, 9, [2, 3, 4])], 4, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (14,), device="cuda")
    logits = []
    for w in (got, dense):  # the same runner on the kept Q8_0 linears and on the dequantized model
        runner = GpuModelRunner(w.model, KVCache(cfg, 16, 4, dtype=torch.bfloat16, device="cuda"),
                                RunnerLimits(4, 32, 8), quantized=w.quantized)
        runner.stage(ids, meta)
        runner.forward(4, 32, False)
        logits.append(runner.buffers.logits[:2].clone())
    torch.testing.assert_close(logits[0], logits[1], rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_q8_0_gguf_takes_less_gpu_memory(q8_file) -> None:
    """What the device holds after loading: the Q8_0 linears at 34 bytes a block of 32 instead of bf16."""
    path, _ = q8_file
    held = {}
    for weights in ("auto", "dense"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        got = load_gpu_weights(path, dtype=torch.bfloat16, device="cuda", weights=weights)
        torch.cuda.synchronize()
        held[weights] = (torch.cuda.memory_allocated() - before, got.summary)
        del got
    (auto, s), (dense, _) = held["auto"], held["dense"]
    assert auto < dense
    assert dense - auto >= (s["q8_0_as_dense_bytes"] - s["q8_0_bytes"]) * 0.9
