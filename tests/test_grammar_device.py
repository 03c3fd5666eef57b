"""Grammars on the device, as far as the CPU goes: the arena's layout of a token DFA (read back the way the CUDA
scheduler reads it), the sampling graph's mask through Triton's interpreter against the host backends'
`allowed_tokens`, the gateway's refusal of a grammar larger than the arena, and the flag's checks. The
scheduler itself runs on the GPU: tests/persistent/test_grammar.py."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_engine.gpu.sched_structs import GRAM_COLS, GRAM_MAX_END  # noqa: E402
from gpu_engine.grammar_mask import allowed_tokens  # noqa: E402
from gpu_engine.kernels.grammar import DeviceGrammar, grammar_mask  # noqa: E402
from shared import token_dfa  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.token_dfa import TokenDFA, device_bytes, device_row_bytes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel on the GPU where there is one


def random_dfa(rng: np.random.Generator, states: int, vocab: int) -> TokenDFA:
    allowed = rng.random((states, vocab)) < 0.3
    allowed[:, 0] = True
    default = rng.integers(0, states, size=states).astype(np.int32)
    offsets, toks, nxt = [0], [], []
    for s in range(states):
        ids = np.flatnonzero(allowed[s])
        exc = np.sort(rng.choice(ids, size=min(len(ids), int(rng.integers(0, 6))), replace=False))
        toks += exc.tolist()
        nxt += rng.integers(0, states, size=len(exc)).tolist()
        offsets.append(len(toks))
    return TokenDFA(int(rng.integers(0, states)), vocab, np.packbits(allowed, axis=1), default,
                    np.asarray(offsets, np.int64), np.asarray(toks, np.int32), np.asarray(nxt, np.int32),
                    rng.random(states) < 0.5)


def advance_in_layout(layout: np.ndarray, states: int, exceptions: int, vocab: int, state: int, tok: int) -> int:
    """`gram_advance` of gpu_engine/csrc/sched_grammar.cuh, over the arena's bytes."""
    rb = device_row_bytes(vocab)
    if state < 0 or not 0 <= tok < vocab or not layout[state * rb + (tok >> 3)] & (0x80 >> (tok & 7)):
        return -1
    w = layout[states * rb:].view(np.int32)
    off, etok = w[2 * states:], w[3 * states + 1:]
    enext = etok[exceptions:]
    lo, hi = int(off[state]), int(off[state + 1])
    i = lo + int(np.searchsorted(etok[lo:hi], tok))
    return int(enext[i]) if i < hi and etok[i] == tok else int(w[state])


@pytest.mark.parametrize("vocab", [7, 128, 300])
def test_the_arena_layout_walks_as_the_tables_do(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    dfa = random_dfa(rng, 9, vocab)
    layout = dfa.device_layout()
    S, X = dfa.num_states, dfa.num_exceptions
    assert len(layout) == device_bytes(S, X, vocab) and len(layout) % 256 == 0
    accept = layout[S * device_row_bytes(vocab):].view(np.int32)[S: 2 * S]
    assert (accept != 0).tolist() == dfa.accept.tolist()
    for state in range(S):
        for tok in range(-1, vocab + 1):
            assert advance_in_layout(layout, S, X, vocab, state, tok) == dfa.advance(state, tok), (state, tok)


def staged(dfa: TokenDFA, rows: list[tuple[str, int, list[int]]]) -> tuple[DeviceGrammar, list]:
    """Rows as the scheduler stages them: ("off", ...), ("in", state, ends) or ("out", -1, ends)."""
    arena = np.zeros(512, np.uint8)
    layout = dfa.device_layout()
    arena = np.concatenate([arena, layout])  # the grammar at offset 512, as if another came first
    rb = device_row_bytes(dfa.vocab_size)
    bits = np.full(len(rows), -1, np.int64)
    ends = np.zeros((len(rows), GRAM_COLS), np.int32)
    for r, (kind, state, end) in enumerate(rows):
        if kind == "off":
            continue
        bits[r] = 512 + state * rb if kind == "in" else -2
        ends[r, 0] = kind == "out" or bool(dfa.accept[state])
        ends[r, 1] = len(end)
        ends[r, 2: 2 + len(end)] = end
    return DeviceGrammar(*(torch.from_numpy(a).to(DEV) for a in (bits, ends, arena))), rows


def test_the_mask_keeps_what_the_host_backends_allow() -> None:
    V = 300
    rng = np.random.default_rng(3)
    dfa = random_dfa(rng, 6, V)
    accepting = int(np.flatnonzero(dfa.accept)[0])
    rejecting = int(np.flatnonzero(~dfa.accept)[0])
    ends = [2, 299, 17]
    rows = [("in", accepting, ends), ("off", 0, []), ("in", rejecting, ends), ("out", -1, ends),
            ("in", accepting, list(range(100, 100 + GRAM_MAX_END)))]
    dg, rows = staged(dfa, rows)
    logits = torch.randn(len(rows), V, device=DEV)
    masked = logits.clone()
    grammar_mask(masked, dg)
    logits, masked = logits.cpu(), masked.cpu()
    for r, (kind, state, end) in enumerate(rows):
        if kind == "off":
            assert torch.equal(masked[r], logits[r])
            continue
        # the host backends' mask: the output so far led to `state` (or out of the grammar)
        want = np.zeros(V, bool)
        if kind == "in":
            want[:] = dfa.allowed(state)
        if kind == "out" or dfa.accept[state]:
            want[end] = True
        got = torch.isfinite(masked[r]).numpy()
        assert (got == want).all(), f"row {r} ({kind})"
        assert torch.equal(masked[r][torch.from_numpy(want)], logits[r][torch.from_numpy(want)])


def test_the_mask_agrees_with_allowed_tokens_along_a_walk() -> None:
    V = 128
    rng = np.random.default_rng(5)
    dfa = random_dfa(rng, 12, V)
    out: list[int] = []
    for _ in range(20):
        state = dfa.walk(out)
        dg, _ = staged(dfa, [("in", state, [1]) if state >= 0 else ("out", -1, [1])])
        x = torch.zeros(1, V, device=DEV)
        grammar_mask(x, dg)
        x = x.cpu()
        want = allowed_tokens(dfa, out, [1], V)
        assert (torch.isfinite(x[0]).numpy() == want).all()
        out.append(int(rng.choice(np.flatnonzero(want))))
        if out[-1] == 1 and state >= 0 and dfa.accept[state]:
            break


def test_a_grammar_larger_than_the_arena_is_a_400_naming_the_flag(tmp_path, monkeypatch) -> None:
    from dpu_gateway.constrain import GrammarCompiler
    from dpu_gateway.errors import APIError

    monkeypatch.setattr("shared.token_dfa.SHM_DIR", tmp_path)
    dfa = random_dfa(np.random.default_rng(8), 40, 1000)
    token_dfa.store("ring", 77, dfa)
    size = device_bytes(40, dfa.num_exceptions, 1000)
    assert token_dfa.stored_device_bytes("ring", 77) == size
    compiler = GrammarCompiler.__new__(GrammarCompiler)
    compiler.ring_name, compiler._sizes = "ring", {}
    compiler.check_fits(77, "response_format", size)  # fits exactly
    with pytest.raises(APIError) as info:
        compiler.check_fits(77, "response_format", size - 256)
    err = info.value
    assert err.status == 400 and err.code == "grammar_too_large" and "--grammar-cache-mb" in err.message


def test_the_arena_flag_is_the_persistent_backends() -> None:
    assert EngineConfig().grammar_arena_bytes == 256 << 20
    cfg = EngineConfig(backend="persistent", grammar_cache_mb=64)
    assert cfg.grammar_arena_bytes == 64 << 20 and "--grammar-cache-mb" in cfg.to_argv()
    for backend in ("cpu", "host"):
        with pytest.raises(ValueError, match="--grammar-cache-mb"):
            EngineConfig(backend=backend, grammar_cache_mb=64)


def test_the_loader_answers_the_schedulers_two_requests(tmp_path, monkeypatch) -> None:
    """The engine's host side of a load, driven as the scheduler drives it: META answers the sizes and the start
    state, COPY puts the device layout at the offset asked for; a missing grammar or another vocabulary fails."""
    from gpu_engine.gpu import grammar_arena as ga
    from gpu_engine.gpu.sched_structs import MAIL_FAILED, MAIL_OK, MAIL_OP_COPY, MAIL_OP_META

    monkeypatch.setattr("shared.token_dfa.SHM_DIR", tmp_path)
    dfa = random_dfa(np.random.default_rng(9), 5, 200)
    token_dfa.store("ring", 5, dfa)
    token_dfa.store("ring", 6, random_dfa(np.random.default_rng(9), 5, 100))
    loader = ga.GrammarArena(torch.zeros(8192, dtype=torch.uint8), "ring", 200)
    mail = loader.mail

    def ask(e: int, op: int, gid: int, offset: int = 0) -> np.ndarray:
        mail[e, ga.ID], mail[e, ga.OFFSET], mail[e, ga.OP] = gid, offset, op
        mail[e, ga.SEQ] += 1
        assert loader.poll() == 1 and loader.poll() == 0  # answered once
        assert mail[e, ga.DONE] == mail[e, ga.SEQ]
        return mail[e]

    m = ask(3, MAIL_OP_META, 5)
    assert (m[ga.RESULT], m[ga.STATES], m[ga.SIZES]) == (MAIL_OK, 5, dfa.num_exceptions | dfa.start << 32)
    assert ask(3, MAIL_OP_COPY, 5, offset=1024)[ga.RESULT] == MAIL_OK
    layout = dfa.device_layout()
    assert np.array_equal(loader.arena[1024: 1024 + len(layout)].numpy(), layout)
    assert ask(4, MAIL_OP_META, 404)[ga.RESULT] == MAIL_FAILED  # not in the store
    assert ask(4, MAIL_OP_META, 6)[ga.RESULT] == MAIL_FAILED  # another vocabulary
    assert ask(4, MAIL_OP_COPY, 6)[ga.RESULT] == MAIL_FAILED  # a copy without its tables
    assert ask(3, MAIL_OP_META, 5)[ga.RESULT] == MAIL_OK
    assert ask(3, MAIL_OP_COPY, 5, offset=8192 - 256)[ga.RESULT] == MAIL_FAILED  # past the arena: answered, not raised
