"""GGUF tensor names -> this package's parameter names, per family (fused the way our modules hold them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from gpu_engine.models.config import ModelConfig
from gpu_engine.models.errors import ModelLoadError

Getter = Callable[[str], torch.Tensor]
Mapped = Iterator[tuple[str, torch.Tensor, str]]


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> half-split) on a [rows, cols] weight."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_heads: int, name: str) -> torch.Tensor:
    if w.shape[0] % (2 * n_heads):
        raise ModelLoadError(f"shape mismatch for {name}: {w.shape[0]} rows don't split into {n_heads} heads")
    return unpermute_rope_rows(w, n_heads)


def _cat(parts: list[torch.Tensor], names: list[str], dim: int = 0) -> tuple[torch.Tensor, str]:
    joined = "+".join(names)
    if all(p.is_meta for p in parts):  # shapes only (GGUFSource's placeholders): torch.cat on meta tensors
        shapes = [list(p.shape) for p in parts]  # would import the compiler stack for nothing
        if any(len(sh) != len(shapes[0]) or sh[:dim] + sh[dim + 1:] != shapes[0][:dim] + shapes[0][dim + 1:]
               for sh in shapes):
            raise ModelLoadError(f"shape mismatch joining {joined}: {shapes}")
        out = shapes[0][:dim] + [sum(sh[dim] for sh in shapes)] + shapes[0][dim + 1:]
        return torch.empty(out, device="meta"), joined
    try:
        return torch.cat(parts, dim=dim), joined
    except RuntimeError as exc:
        raise ModelLoadError(f"shape mismatch joining {joined}: {exc}") from None


def map_gguf_weights(config: ModelConfig, get: Getter, has: Callable[[str], bool], *,
                     permuted_qk: bool) -> Mapped:
    """Yield ``(our_name, tensor, gguf_names)`` for every parameter of ``CausalLM(config)``."""
    yield "embed.weight", get("token_embd.weight"), "token_embd.weight"
    yield "norm.weight", get("output_norm.weight"), "output_norm.weight"
    if not config.tie_word_embeddings:
        yield "lm_head.weight", get("output.weight"), "output.weight"
    for i in range(config.num_layers):
        yield from _layer(config, i, get, permuted_qk)


def _attention(config: ModelConfig, blk: str, get: Getter, permuted_qk: bool) -> tuple[torch.Tensor, str]:
    if config.family == "phi3":
        return get(f"{blk}attn_qkv.weight"), f"{blk}attn_qkv.weight"
    names = [f"{blk}attn_{p}.weight" for p in "qkv"]
    q, k, v = (get(n) for n in names)
    if permuted_qk:
        q = _unpermute(q, config.num_heads, names[0])
        k = _unpermute(k, config.num_kv_heads, names[1])
    return _cat([q, k, v], names)


def _layer(config: ModelConfig, i: int, get: Getter, permuted_qk: bool) -> Mapped:
    blk, ours = f"blk.{i}.", f"layers.{i}."
    for src, dst in (("attn_norm", "attn_norm"), ("ffn_norm", "mlp_norm"), ("attn_output", "attn.o")):
        yield f"{ours}{dst}.weight", get(f"{blk}{src}.weight"), f"{blk}{src}.weight"
    yield f"{ours}attn.qkv.weight", *_attention(config, blk, get, permuted_qk)
    if config.qk_norm:
        for p in ("q", "k"):
            name = f"{blk}attn_{p}_norm.weight"
            yield f"{ours}attn.{p}_norm.weight", get(name), name
    if config.is_moe_layer(i):
        yield f"{ours}mlp.router.weight", get(f"{blk}ffn_gate_inp.weight"), f"{blk}ffn_gate_inp.weight"
        names = [f"{blk}ffn_gate_exps.weight", f"{blk}ffn_up_exps.weight"]
        yield f"{ours}mlp.gate_up", *_cat([get(n) for n in names], names, dim=1)
        yield f"{ours}mlp.down", get(f"{blk}ffn_down_exps.weight"), f"{blk}ffn_down_exps.weight"
        return
    if config.family == "phi3":  # ffn_up holds [gate; up] fused
        yield f"{ours}mlp.gate_up.weight", get(f"{blk}ffn_up.weight"), f"{blk}ffn_up.weight"
    else:
        names = [f"{blk}ffn_gate.weight", f"{blk}ffn_up.weight"]
        yield f"{ours}mlp.gate_up.weight", *_cat([get(n) for n in names], names)
    yield f"{ours}mlp.down.weight", get(f"{blk}ffn_down.weight"), f"{blk}ffn_down.weight"


class NotBlocks(Exception):
    """A GGUF part of a linear is not of the block type asked for."""


def map_gguf_blocks(config: ModelConfig, get_blocks: Callable[[str], torch.Tensor | None], *,
                    permuted_qk: bool, lm_head: bool = False, embedding: bool = False) -> dict[str, torch.Tensor]:
    """The dense layers' linear weights whose every GGUF part is stored in one block type, as block rows
    (``get_blocks``: uint8 [rows, bytes], None for another type), fused, unpermuted and named as
    ``map_gguf_weights`` does with the dequantized tensors (whole rows move, so the blocks move with them);
    with ``lm_head``, an untied ``output.weight`` too, and with ``embedding`` the token table."""

    def blocks(name: str) -> torch.Tensor:
        found = get_blocks(name)
        if found is None:
            raise NotBlocks(name)
        return found

    out: dict[str, torch.Tensor] = {}
    if embedding:
        table = get_blocks("token_embd.weight")
        if table is not None:
            out["embed.weight"] = table
    if lm_head and not config.tie_word_embeddings:
        found = get_blocks("output.weight")
        if found is not None:
            out["lm_head.weight"] = found
    for i in range(config.num_layers):
        if not config.is_moe_layer(i) and config.family != "phi3":
            out.update(_blocks_layer(config, i, blocks, permuted_qk))
    return out


def map_gguf_q4_1(config: ModelConfig, get_blocks: Callable[[str], torch.Tensor | None], *,
                  permuted_qk: bool) -> dict[str, torch.Tensor]:
    """``map_gguf_blocks`` for the Q4_1 blocks of the CPU backend (decoder layers only)."""
    return map_gguf_blocks(config, get_blocks, permuted_qk=permuted_qk)


def _blocks_layer(config: ModelConfig, i: int, blocks: Getter, permuted_qk: bool) -> dict[str, torch.Tensor]:
    blk, ours = f"blk.{i}.", f"layers.{i}."
    makers: dict[str, Callable[[], torch.Tensor]] = {
        "attn.qkv": lambda: _attention(config, blk, blocks, permuted_qk)[0],
        "attn.o": lambda: blocks(f"{blk}attn_output.weight"),
        "mlp.gate_up": lambda: _cat([blocks(f"{blk}ffn_gate.weight"), blocks(f"{blk}ffn_up.weight")],
                                    [f"{blk}ffn_gate.weight", f"{blk}ffn_up.weight"])[0],
        "mlp.down": lambda: blocks(f"{blk}ffn_down.weight"),
    }
    out = {}
    for name, make in makers.items():
        try:
            out[f"{ours}{name}.weight"] = make()
        except NotBlocks:
            continue
    return out
