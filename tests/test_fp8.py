"""FP8 linears (``--quantization fp8`` and FP8 checkpoints) on the CPU, through the float32 reference product.

Numerics. The bound is stated against the quantization's own error, as tests/test_cpu_int4.py states its own:
a reference holds the very weights the FP8 model stores (``Fp8Weight.dequantize``) but runs them in float32
with float32 activations; what it departs from the dense model by is the price of FP8 weights. The FP8 model
also rounds each linear's input to e4m3 (per token, or per tensor), an error of the same size, so its departure
is that of about twice as many roundings. Measured on the tiny Llama and Qwen3 below (random bf16 weights, seeds
0-2, three steps of three sequences, every scheme of channel|tensor weights x token|tensor activations): the
reference's largest |logit difference| 0.12-0.25, the FP8 model's 1.11-2.21x that, 8-15% of the logits' largest
|value| (1.8-2.4). Stated: within 2.5x the reference's departure and within 20% of the logits' largest |value|.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from gpu_engine.kernels.fp8_linear import fp8_linear, fp8_linear_ref, quantize_rows_ref
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.attention import build_metadata
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.fp8_checkpoint import Fp8Scheme, quantize_linears
from gpu_engine.models.fp8_weight import FP8, FP8_MAX, Fp8Weight, quantize_fp8
from gpu_engine.models.loader import load_gpu_weights, load_model
from shared.config import EngineConfig

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
FAMILIES = {"llama": {"architectures": ["LlamaForCausalLM"], **TINY},
            "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16, **TINY}}
LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
STD = 0.08  # weights' spread: logits of about +-1, so that a departure means something against them
FACTOR, SPREAD_SHARE = 2.5, 0.2


def tiny_model(family: str, seed: int = 0) -> tuple[CausalLM, dict]:
    """A tiny model of ``family`` whose weights are bf16 values (a bf16 checkpoint's), held in float32."""
    hf = FAMILIES[family]
    model = CausalLM(ModelConfig.from_hf(hf)).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight") \
                else STD * torch.randn(p.shape, generator=g)
            p.copy_(value.to(torch.bfloat16).float())
    return model, hf


class Fp8Linear(nn.Module):
    """A linear on an ``Fp8Weight``, through ``fp8_linear`` (the float32 reference on the CPU)."""

    def __init__(self, w: Fp8Weight) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x.reshape(-1, x.shape[-1]), self.w).view(*x.shape[:-1], -1)


def with_linears(model: CausalLM, quantized: dict[str, Fp8Weight], dequantized: bool) -> CausalLM:
    """A copy whose FP8 linears run as ``Fp8Linear`` (``dequantized``: as float32 nn.Linear of the stored values)."""
    out = copy.deepcopy(model)
    for name, w in quantized.items():
        owner, _, leaf = name.removesuffix(".weight").rpartition(".")
        if dequantized:
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
            linear.weight = nn.Parameter(w.dequantize(), requires_grad=False)
        setattr(out.get_submodule(owner), leaf, linear if dequantized else Fp8Linear(w))
    return out


STEPS = [[(0, 7, [0, 1]), (0, 11, [2, 3, 4]), (0, 3, [5])],  # prefill
         [(7, 1, [0, 1]), (11, 1, [2, 3, 4]), (3, 1, [5])],  # decode
         [(8, 4, [0, 1, 6]), (12, 1, [2, 3, 4, 7]), (4, 2, [5, 8])]]  # mixed


def logits_of(model: CausalLM, cfg: ModelConfig) -> torch.Tensor:
    kv, g, out = KVCache(cfg, 16, 4), torch.Generator().manual_seed(1), []
    for seqs in STEPS:
        meta = build_metadata(seqs, 4)
        out.append(model(torch.randint(0, cfg.vocab_size, (meta.positions.shape[0],), generator=g), meta, kv))
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", [Fp8Scheme(), Fp8Scheme("tensor", "tensor")], ids=["channel-token", "tensor"])
def test_fp8_logits_within_the_quantization_bound(family: str, scheme: Fp8Scheme) -> None:
    model, _ = tiny_model(family)
    cfg = model.config
    want = logits_of(model, cfg)
    quantized = quantize_linears(copy.deepcopy(model), scheme)
    assert set(quantized) == {f"layers.{i}.{p}.weight" for i in range(2) for p in LINEARS}
    weights_only = (logits_of(with_linears(model, quantized, True), cfg) - want).abs().max().item()
    got = (logits_of(with_linears(model, quantized, False), cfg) - want).abs().max().item()
    assert 0.0 < weights_only and got <= FACTOR * weights_only, (got, weights_only)
    assert got <= SPREAD_SHARE * want.abs().max().item(), (got, want.abs().max().item())


def test_quantize_fp8_rounds_each_row_to_its_scale() -> None:
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48).unsqueeze(1)  # rows of very different sizes
    q = quantize_fp8(w)
    assert q.weight.dtype == FP8 and q.scale.shape == (48,) and not q.per_tensor
    assert torch.equal(q.weight.float().abs().amax(1), torch.full((48,), FP8_MAX))  # each row's max maps to 448
    err = (q.dequantize() - w).abs() / w.abs().amax(1, keepdim=True)
    assert err.max() <= 2.0**-4 * 1.01  # e4m3: half a step of 3 mantissa bits, at the row's top binade
    t = quantize_fp8(w, per_tensor=True)
    assert t.per_tensor and bool((t.scale == t.scale[0]).all())
    assert (t.dequantize() - w).abs().max() <= w.abs().max() * 2.0**-4


def test_reference_product_is_the_dequantized_arithmetic() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    x[3] = 0.0  # a row of zeros keeps a positive scale
    w = quantize_fp8(torch.randn(32, 64, generator=g))
    xq, scale = quantize_rows_ref(x, w)
    assert scale.shape == (5, 1) and bool((scale > 0).all()) and torch.equal(xq[3].float(), torch.zeros(64))
    want = ((xq.float() * scale) @ (w.weight.float() * w.scale[:, None]).t()).to(torch.bfloat16)
    assert torch.equal(fp8_linear_ref(x, w), want) and torch.equal(fp8_linear(x, w), want)
    # torch's own FP8 product on the CPU, scales in its epilogue, agrees to bf16's rounding
    cpu = torch._scaled_mm(xq, w.weight.t(), scale_a=scale, scale_b=w.scale.view(1, -1), out_dtype=torch.bfloat16)
    torch.testing.assert_close(cpu, want, rtol=1e-2, atol=1e-2)
    static = Fp8Weight(w.weight, w.scale, input_scale=torch.tensor([0.01]))
    assert torch.equal(quantize_rows_ref(x, static)[1], torch.full((5, 1), 0.01))


# --- checkpoints ----------------------------------------------------------------------------------------------

def hf_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under a Hugging Face checkpoint's names, fused ones split (bf16)."""
    cfg, out = model.config, {}
    p = {k: v.detach().to(torch.bfloat16) for k, v in model.named_parameters()}
    out |= {"model.embed_tokens.weight": p["embed.weight"], "model.norm.weight": p["norm.weight"],
            "lm_head.weight": p["lm_head.weight"]}
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = p[ours + "attn.qkv.weight"].split([q_rows, kv_rows, kv_rows])
        gate, up = p[ours + "mlp.gate_up.weight"].chunk(2)
        out |= {hf + "input_layernorm.weight": p[ours + "attn_norm.weight"],
                hf + "post_attention_layernorm.weight": p[ours + "mlp_norm.weight"],
                hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k, hf + "self_attn.v_proj.weight": v,
                hf + "self_attn.o_proj.weight": p[ours + "attn.o.weight"], hf + "mlp.gate_proj.weight": gate,
                hf + "mlp.up_proj.weight": up, hf + "mlp.down_proj.weight": p[ours + "mlp.down.weight"]}
        if cfg.qk_norm:
            out |= {hf + f"self_attn.{n}.weight": p[f"{ours}attn.{n}.weight"] for n in ("q_norm", "k_norm")}
    return out


PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = {  # name -> (quantization_config, weight scale per tensor, static input scales)
    "fp8-dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, True, False),
    "fp8-static": ({"quant_method": "fp8", "activation_scheme": "static"}, True, True),
    "ct-channel-token": ("channel", False, False),
    "ct-tensor-static": ("tensor", True, True),
}


def compressed_tensors(strategy: str, static: bool) -> dict:
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def write_checkpoint(folder: Path, model: CausalLM, hf: dict, fmt: str) -> dict[str, Fp8Weight]:
    """``model`` as an FP8 checkpoint of ``fmt``; returns each projection's ``Fp8Weight`` by its HF name."""
    qc, per_tensor, static = FORMATS[fmt]
    qc = qc if isinstance(qc, dict) else compressed_tensors(qc, static)
    tensors, parts = hf_tensors(model), {}
    for name in [n for n in tensors if n.removesuffix(".weight").endswith(PROJ)]:
        base = name.removesuffix(".weight")
        w = quantize_fp8(tensors[name].float(), per_tensor=per_tensor)
        if static:
            w = Fp8Weight(w.weight, w.scale, w.per_tensor, input_scale=torch.tensor([0.02 + len(parts) * 1e-3]))
            tensors[base + ".input_scale"] = w.input_scale if fmt.startswith("ct") else w.input_scale[0]
        tensors[name] = w.weight
        scale = w.scale[:1] if per_tensor else w.scale.unsqueeze(1)  # compressed-tensors: [N, 1]; AutoFP8: a scalar
        tensors[base + ".weight_scale"] = scale[0] if fmt.startswith("fp8") else scale
        parts[base] = w
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**hf, "quantization_config": qc}))
    return parts


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_checkpoint_loads_as_stored(fmt: str, family: str, tmp_path: Path) -> None:
    model, hf = tiny_model(family)
    parts = write_checkpoint(tmp_path / "ckpt", model, hf, fmt)
    got = load_gpu_weights(tmp_path / "ckpt", dtype=torch.float32, device="cpu")
    assert set(got.quantized) == {f"layers.{i}.{p}.weight" for i in range(2) for p in LINEARS}
    joined = {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn.o": ("self_attn.o_proj",),
              "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down": ("mlp.down_proj",)}
    params = dict(got.model.named_parameters())
    for name, w in got.quantized.items():
        _, i, ours = name.removesuffix(".weight").split(".", 2)
        stored = [parts[f"model.layers.{i}.{p}"] for p in joined[ours]]
        assert isinstance(w, Fp8Weight) and w.weight.dtype == FP8 and params[name].numel() == 0
        assert torch.equal(w.weight.view(torch.uint8), torch.cat([s.weight for s in stored]).view(torch.uint8))
        assert torch.equal(w.dequantize(), torch.cat([s.dequantize() for s in stored]))  # the file's values exactly
        static = FORMATS[fmt][2]
        assert (w.input_scale is not None) == static
        if static:  # one scale for the input the fused parts share: their largest, as vLLM takes it
            assert w.input_scale.item() == max(s.input_scale.item() for s in stored)
    dense = dict(model.named_parameters())
    for name, p in params.items():
        if name not in got.quantized:
            assert torch.equal(p, dense[name]), name
    assert got.summary["fp8_linears"] == 8 and got.summary["fp8_source"] != "quantized at load"
    # and it runs: the stored linears through the product, logits within the bound of the bf16 model's
    ours = logits_of(with_linears(got.model, got.quantized, False), got.config)
    want = logits_of(model, model.config)
    ref = logits_of(with_linears(model, got.quantized, True), model.config)
    got_err, ref_err = (ours - want).abs().max(), (ref - want).abs().max()
    assert got_err <= FACTOR * ref_err and got_err <= SPREAD_SHARE * want.abs().max(), (got_err, ref_err)


def test_quantization_fp8_at_load(tmp_path: Path) -> None:
    model, hf = tiny_model("llama")
    folder = tmp_path / "bf16"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in hf_tensors(model).items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf))
    plain = load_gpu_weights(folder, dtype=torch.float32, device="cpu")
    assert plain.quantized == {} and "fp8_linears" not in plain.summary and plain.summary["q8_0_bytes"] == 0
    got = load_gpu_weights(folder, dtype=torch.float32, device="cpu", quantization="fp8")
    want = quantize_linears(copy.deepcopy(model))
    assert set(got.quantized) == set(want) and got.summary["fp8_scheme"] == "channel/token"
    for name, w in got.quantized.items():
        assert torch.equal(w.dequantize(), want[name].dequantize()), name
    s = got.summary
    assert s["fp8_bytes"] == sum(w.shape[0] * (w.shape[1] + 4) for w in got.quantized.values())


def test_runner_takes_fp8_linears(tmp_path: Path) -> None:
    """The GPU runner (its Triton kernels interpreted) on FP8 linears: the reference model's logits on them."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits

    model, hf = tiny_model("qwen3")
    write_checkpoint(tmp_path / "ckpt", model, hf, "ct-channel-token")
    got = load_gpu_weights(tmp_path / "ckpt", dtype=torch.float32, device="cpu")
    runner = GpuModelRunner(got.model, KVCache(got.config, 16, 4), RunnerLimits(4, 32, 8), quantized=got.quantized)
    assert isinstance(runner.layers[1].gate_up, Fp8Weight) and isinstance(runner.lm_head, torch.Tensor)
    reference, kv, g = with_linears(got.model, got.quantized, False), KVCache(got.config, 16, 4), torch.Generator()
    g.manual_seed(1)
    for seqs, decode, tokens in zip(STEPS, (False, True, False), (32, 4, 16), strict=True):
        meta = build_metadata(seqs, 4)
        ids = torch.randint(0, got.config.vocab_size, (meta.positions.shape[0],), generator=g)
        want = reference(ids, meta, kv)
        runner.stage(ids, meta)
        runner.forward(4, tokens, decode)
        torch.testing.assert_close(runner.buffers.logits[: len(seqs)], want, rtol=1e-4, atol=1e-4)


# --- refusals -----------------------------------------------------------------------------------------------

def _config_with(folder: Path, qc: dict) -> None:
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))


@pytest.mark.parametrize(("change", "message"), [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     r"block-wise FP8 \(weight_block_size \[128, 128\], weight_scale_inv\) is not supported"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
    ("weights.strategy=block", "weight strategy 'block'"),
    ("weights.strategy=group", "weight strategy 'group'"),
    ("input_activations=None", r"weight-only FP8 \(W8A16"),
    ("input_activations.strategy=token,dynamic=False", "input activation strategy 'token'"),
    ("kv_cache_scheme", "an FP8 KV cache with calibrated scales"),
    ("format=pack-quantized", "compressed-tensors format 'pack-quantized'"),
    ("weights.type=int", "compressed-tensors weights"),
])
def test_unsupported_fp8_variants_are_refused_by_name(change, message: str, tmp_path: Path) -> None:
    model, hf = tiny_model("llama")
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, model, hf, "ct-channel-token")
    if isinstance(change, dict):
        qc = change
    else:
        qc = compressed_tensors("channel", False)
        group = qc["config_groups"]["group_0"]
        if change == "kv_cache_scheme":
            qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
        elif change.startswith("format="):
            qc["format"] = change.partition("=")[2]
        elif change == "input_activations=None":
            group["input_activations"] = None
        else:
            key, _, settings = change.partition(".")
            for setting in settings.split(","):
                field, _, value = setting.partition("=")
                group[key][field] = {"False": False}.get(value, value)
    _config_with(folder, qc)
    with pytest.raises(ModelLoadError, match=message):
        load_gpu_weights(folder, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("case", ["input-channel scale", "zero scale", "nan scale", "negative input scale",
                                  "k_scale", "output_scale", "kv_cache_scheme", "scale beside int8"])
def test_scales_a_checkpoint_cannot_mean_are_refused_not_loaded(tmp_path: Path, case: str) -> None:
    """A weight scale per input channel on a square weight (its element count is the rows'), a scale that is not
    finite and positive, calibrated KV-cache or output scales (in tensors, or kv_cache_scheme under quant_method
    fp8), and a scale beside a weight not stored in FP8 each load as something else than the checkpoint means
    (saturated keys, zeroed or non-finite weights, raw codes as weights): refused, naming the tensor."""
    from safetensors.torch import load_file

    model, hf = tiny_model("llama")
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, model, hf, "fp8-static" if "input" in case else "fp8-dynamic")
    tensors = dict(load_file(str(folder / "model.safetensors")))
    o = "model.layers.0.self_attn.o_proj"  # 64 x 64: square
    want = {"input-channel scale": r"o_proj.weight_scale of shape \(1, 64\)",
            "zero scale": "o_proj.weight_scale holds 1 scale\\(s\\) that are not finite and positive",
            "nan scale": "o_proj.weight_scale holds 1 scale",
            "negative input scale": "o_proj.input_scale holds 1 scale",
            "k_scale": "calibrated scales \\(model.layers.0.self_attn.k_scale",
            "output_scale": "calibrated scales \\(model.layers.1.self_attn.k_proj.output_scale",
            "kv_cache_scheme": "calibrated scales \\(kv_cache_scheme",
            "scale beside int8": "down_proj.weight_scale beside a weight not stored as float8_e4m3fn"}[case]
    if case == "input-channel scale":
        tensors[f"{o}.weight_scale"] = torch.full((1, 64), 0.01)
    elif case == "zero scale":
        scale = tensors[f"{o}.weight_scale"].clone()
        scale.view(-1)[-1] = 0.0
        tensors[f"{o}.weight_scale"] = scale
    elif case == "nan scale":
        scale = tensors[f"{o}.weight_scale"].clone()
        scale.view(-1)[0] = float("nan")
        tensors[f"{o}.weight_scale"] = scale
    elif case == "negative input scale":
        tensors[f"{o}.input_scale"] = -tensors[f"{o}.input_scale"]
    elif case == "k_scale":
        tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    elif case == "output_scale":
        tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor(0.5)
    elif case == "scale beside int8":
        down = "model.layers.1.mlp.down_proj"
        tensors[f"{down}.weight"] = torch.zeros_like(tensors[f"{down}.weight"], dtype=torch.int8)
    if case == "kv_cache_scheme":
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
        (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=want):
        load_gpu_weights(folder, dtype=torch.float32, device="cpu")


def test_gpu_weights_dense_is_refused_where_the_linears_stay_fp8(tmp_path: Path) -> None:
    """--gpu-weights dense (every tensor dequantized) cannot be honoured by an FP8 checkpoint or --quantization fp8,
    whose linears stay FP8: refused, not ignored."""
    model, hf = tiny_model("llama")
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, model, hf, "fp8-dynamic")
    with pytest.raises(ModelLoadError, match="--gpu-weights dense dequantizes a GGUF"):
        load_gpu_weights(folder, dtype=torch.float32, device="cpu", weights="dense")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in hf_tensors(model).items()}, str(plain / "model.safetensors"))
    assert load_gpu_weights(plain, dtype=torch.float32, device="cpu", weights="dense").quantized == {}
    with pytest.raises(ModelLoadError, match="--gpu-weights dense"):
        load_gpu_weights(plain, dtype=torch.float32, device="cpu", weights="dense", quantization="fp8")


def test_block_scales_and_stray_fp8_tensors_are_refused(tmp_path: Path) -> None:
    model, hf = tiny_model("llama")
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, model, hf, "fp8-dynamic")
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj"
    odd = dict(tensors) | {f"{name}.weight_scale": torch.ones(2, 2)}
    save_file(odd, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"o_proj.weight_scale of shape \(2, 2\) for a weight of 64 rows"):
        load_gpu_weights(folder, dtype=torch.float32, device="cpu")
    stray = dict(tensors) | {"lm_head.weight": tensors["lm_head.weight"].to(FP8)}
    save_file(stray, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="FP8 tensor lm_head.weight .* outside the decoder layers' dense"):
        load_gpu_weights(folder, dtype=torch.float32, device="cpu")
    half = dict(tensors) | {"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}
    save_file(half, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="FP8 for only some of"):
        load_gpu_weights(folder, dtype=torch.float32, device="cpu")


def test_cpu_backend_refuses_fp8(tmp_path: Path) -> None:
    """vLLM's fp8 is a GPU feature (its CPU backend has no FP8 kernels): the CPU backend refuses both the flag and
    an FP8 checkpoint, naming the backends that take them, rather than dequantizing behind the user's back."""
    with pytest.raises(ValueError, match="--quantization fp8 runs on the GPU backends"):
        EngineConfig(ring_name="r", backend="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="--quantization fp8 computes in bfloat16"):
        EngineConfig(ring_name="r", backend="host", quantization="fp8", dtype="float16")
    argv = EngineConfig(ring_name="r", backend="host", quantization="fp8").to_argv()
    assert argv[argv.index("--quantization") + 1] == "fp8"
    assert EngineConfig(ring_name="r", backend="auto", quantization="fp8").refusal_on("cpu", None) is not None
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 runs on the GPU backends"):
        EngineConfig(ring_name="r", backend="cpu", kv_cache_dtype="fp8")
    assert EngineConfig(ring_name="r", backend="host", quantization="fp8", kv_cache_dtype="fp8").fp8_kv_cache
    model, hf = tiny_model("llama")
    write_checkpoint(tmp_path / "ckpt", model, hf, "fp8-dynamic")
    with pytest.raises(ModelLoadError, match="an FP8 checkpoint .* runs on the GPU backends"):
        load_model(tmp_path / "ckpt")


def test_quantization_flag_refuses_gguf_and_kv_cache_dtype_takes_only_e4m3(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="a GGUF file's weights are already quantized"):
        load_gpu_weights(gguf, dtype=torch.bfloat16, device="cpu", quantization="fp8")
    from blink.cli import build_parser

    for argv, message in ((["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: invalid choice"),
                          (["--quantization", "awq"], "invalid choice: 'awq'")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *argv])
        assert message in capsys.readouterr().err
