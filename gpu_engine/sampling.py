"""Token sampling: greedy, or temperature + top-k/top-p/min-p filtering + counter-based Gumbel-max draw.

Random draws come from a stateless hash of (seed, step, vocab index), so a request's tokens depend
only on its own seed and logits, never on what else shares the batch, and a GPU kernel can
reproduce the same noise without any RNG state. The exact recipe (all arithmetic on uint32,
wrapping mod 2**32; ``M = 0xFFFFFFFF``)::

    fmix32(x):  x ^= x >> 16;  x *= 0x85EBCA6B;  x ^= x >> 13;  x *= 0xC2B2AE35;  x ^= x >> 16
    s_lo = seed & M;  s_hi = (seed >> 32) & M        # seed as int64 (two's complement)
    key  = fmix32(s_lo ^ fmix32(s_hi ^ 0x243F6A88))
    kn   = fmix32(key ^ fmix32((step & M) ^ 0x85A308D3))
    h_i  = fmix32(kn ^ (i * 0x9E3779B1))             # i = vocab index
    u_i  = ((h_i >> 9) + 0.5) * 2**-23                # float32, exact, strictly inside (0, 1)
    token = argmax over allowed i of  logits_i / temperature - log(-log(u_i))

Before the draw (and before the greedy argmax) the request's logits processors apply, in vLLM's
order (``process_logits``): ``logit_bias`` is added; while fewer than ``min_tokens`` tokens were
generated, the stop ids and EOS ids are set to -inf; the repetition penalty divides the positive
logits (multiplies the negative ones) of every token seen in the prompt or output; then
``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over output counts.
A request with a grammar (``grammar_id``: a token DFA the frontend compiled) then has every token
its DFA does not allow at this point set to -inf (``gpu_engine/grammar_mask.py``). Log-probs stay those
of the raw logits.

``u`` keeps 23 hash bits (not 24) so that ``(h >> 9) + 0.5`` fits float32's 24-bit significand
exactly. Here it is computed with int64 torch ops masked to 32 bits; products are split into
16-bit halves so nothing overflows int64. Ties in the argmax go to the lowest index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_engine.grammar_mask import allowed_tokens
from shared import ring_layout as L
from shared.seeds import SEED_STEP
from shared.token_dfa import TokenDFA

MASK32 = 0xFFFFFFFF


def request_seed(request_id: int) -> int:
    """The seed of a request that gave none: derived from its id, as the CUDA scheduler does at claim."""
    return (request_id * SEED_STEP) & 0x7FFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Everything the engine needs of one request's sampling, decoded once from its ring slot.

    ``seed`` is always resolved (``from_ring``): the request's own, or ``request_seed`` of its id.
    """

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # >= 1: off
    top_k: int = 0  # <= 0: off
    min_p: float = 0.0  # <= 0: off
    seed: int = 0
    num_top_logprobs: int = 0
    stop_ids: frozenset[int] = frozenset()  # finish (not emitted) on any of these
    ignore_eos: bool = False
    want_logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    eos_ids: frozenset[int] = frozenset()  # the model's, resolved at claim: min_tokens suppresses them
    grammar: TokenDFA | None = None  # the tables of the slot's grammar_id, loaded at claim
    prompt_logprobs: int = -1  # alternatives per prompt position (gpu_engine/prompt_logprobs.py); -1: off

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def processed(self) -> bool:
        """Whether any logits processor applies to this request (``process_logits``)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None

    def grammar_allowed(self, output: Sequence[int], vocab: int) -> np.ndarray | None:
        """bool [vocab] of the tokens the grammar allows after ``output`` (end tokens where complete)."""
        if self.grammar is None:
            return None
        return allowed_tokens(self.grammar, output, self.stop_ids | self.eos_ids, vocab)

    @classmethod
    def from_ring(cls, sp: np.void, request_id: int, logit_bias: np.ndarray | None = None,
                  eos_ids: frozenset[int] = frozenset(), grammar: TokenDFA | None = None,
                  num_prompt_logprobs: int = 0) -> SamplingSpec:
        """Decode a slot's ``SamplingParams`` (``shared/ring_layout.SAMPLINGPARAMS_DTYPE``); ``logit_bias``
        holds its ``LogitBias`` entries (the prompt row's tail), ``eos_ids`` the model's EOS ids, ``grammar``
        the tables its ``grammar_id`` names, ``num_prompt_logprobs`` the slot's field of that name."""
        flags = int(sp["flags"])
        has_seed = flags & L.SamplingFlags.HAS_SEED
        bias = () if logit_bias is None else tuple((int(e["token"]), float(e["bias"])) for e in logit_bias)
        ignore_eos = bool(flags & L.SamplingFlags.IGNORE_EOS)
        return cls(
            temperature=float(sp["temperature"]),
            top_p=float(sp["top_p"]),
            top_k=int(sp["top_k"]),
            min_p=float(sp["min_p"]),
            seed=int(sp["seed"]) & 0x7FFFFFFFFFFFFFFF if has_seed else request_seed(request_id),
            num_top_logprobs=int(sp["num_top_logprobs"]),
            stop_ids=frozenset(int(x) for x in sp["stop_ids"][: int(sp["num_stop_ids"])]),
            ignore_eos=ignore_eos,
            want_logprobs=bool(flags & L.SamplingFlags.WANT_LOGPROBS),
            presence_penalty=float(sp["presence_penalty"]),
            frequency_penalty=float(sp["frequency_penalty"]),
            repetition_penalty=float(sp["repetition_penalty"]) or 1.0,  # 0: an older writer's zeros
            min_tokens=int(sp["min_tokens"]),
            logit_bias=bias,
            eos_ids=frozenset() if ignore_eos else frozenset(eos_ids),
            grammar=grammar,
            prompt_logprobs=num_prompt_logprobs if flags & L.SamplingFlags.WANT_PROMPT_LOGPROBS else -1,
        )


@dataclass(frozen=True, slots=True)
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, log-softmax of the raw logits at the chosen token (0 where no row asked)
    top_ids: torch.Tensor  # [B, K] int64, K = max num_top_logprobs in the batch
    top_logprobs: torch.Tensor  # [B, K] float32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), exact in int64 (no overflow)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, V] uniforms in (0, 1) from the counter hash described in the module docstring."""
    s_lo, s_hi = seeds & MASK32, (seeds >> 32) & MASK32
    key = fmix32(s_lo ^ fmix32(s_hi ^ 0x243F6A88))
    kn = fmix32(key ^ fmix32((steps & MASK32) ^ 0x85A308D3))
    idx = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    h = fmix32(kn[:, None] ^ _mul32(idx, 0x9E3779B1)[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside top-k, then outside the top-p nucleus, then below min-p.

    ``logits`` [B, V] are already temperature-scaled; ``top_k`` [B] (<= 0: off), ``top_p`` [B]
    (>= 1: off), ``min_p`` [B] (<= 0: off). The most likely token always survives.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = torch.softmax(sorted_logits, dim=-1) * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (top_p[:, None] >= 1.0) | (mass_before < top_p[:, None])
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    keep_orig = torch.zeros_like(keep).scatter_(-1, order, keep)
    return logits.masked_fill(~keep_orig, float("-inf"))


History = Sequence[tuple[Sequence[int], Sequence[int]]]  # per row: (prompt, output) token ids


def process_row(logits: torch.Tensor, spec: SamplingSpec, step: int, prompt: Sequence[int],
                output: Sequence[int]) -> torch.Tensor:
    """One row's logits [V] after its logits processors (the module docstring's order), plainly."""
    x = logits.clone()
    vocab = x.shape[0]
    for tok, bias in spec.logit_bias:
        if 0 <= tok < vocab:
            x[tok] += bias
    if step < spec.min_tokens:
        for tok in spec.stop_ids | spec.eos_ids:
            if 0 <= tok < vocab:
                x[tok] = float("-inf")
    if spec.repetition_penalty != 1.0:
        r = spec.repetition_penalty
        for tok in set(prompt) | set(output):
            x[tok] = x[tok] / r if x[tok] > 0 else x[tok] * r
    counts: dict[int, int] = {}
    for tok in output:
        counts[tok] = counts.get(tok, 0) + 1
    freq = torch.tensor(spec.frequency_penalty, dtype=torch.float32)
    pres = torch.tensor(spec.presence_penalty, dtype=torch.float32)
    for tok, c in counts.items():
        x[tok] = x[tok] - freq * float(c)
        x[tok] = x[tok] - pres
    allowed = spec.grammar_allowed(output, vocab)
    if allowed is not None:
        x[torch.from_numpy(~allowed)] = float("-inf")
    return x


def process_logits(logits: torch.Tensor, specs: list[SamplingSpec], steps: torch.Tensor,
                   history: History | None) -> torch.Tensor:
    """``logits`` [B, V] with each row's processors applied (rows without any are left as they are)."""
    if not any(s.processed for s in specs):
        return logits
    if history is None or len(history) != len(specs):
        raise ValueError("penalties, logit_bias and min_tokens need each row's (prompt, output) history")
    out = logits.clone()
    for b, s in enumerate(specs):
        if s.processed:
            out[b] = process_row(logits[b], s, int(steps[b]), *history[b])
    return out


def sample(logits: torch.Tensor, specs: list[SamplingSpec], steps: torch.Tensor,
           seeds: torch.Tensor, history: History | None = None) -> SampleResult:
    """Pick one token per row of float32 ``logits`` [B, V].

    ``steps`` [B] int64 is the index of the token being sampled in each sequence and ``seeds`` [B]
    int64 each request's seed (``SamplingSpec.seed``). Rows with temperature 0 are greedy.
    ``history`` (per row: prompt and output token ids) is needed when a row has a logits processor.
    """
    if logits.shape[0] != len(specs):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(specs)} sampling specs")
    raw = logits = logits.to(torch.float32)
    dev = logits.device
    logits = process_logits(logits, specs, steps, history)
    temps = torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=dev)
    tokens = torch.argmax(logits, dim=-1)
    random_rows = temps > 0
    if bool(random_rows.any()):
        rows = random_rows.nonzero().squeeze(1)
        sub = [specs[i] for i in rows.tolist()]
        scaled = logits[rows] / temps[rows, None]
        scaled = filter_logits(
            scaled,
            torch.tensor([s.top_k for s in sub], dtype=torch.int64, device=dev),
            torch.tensor([s.top_p for s in sub], dtype=torch.float32, device=dev),
            torch.tensor([s.min_p for s in sub], dtype=torch.float32, device=dev),
        )
        u = uniform_noise(seeds.to(dev)[rows], steps.to(dev)[rows], logits.shape[-1])
        tokens[rows] = torch.argmax(scaled - torch.log(-torch.log(u)), dim=-1)
    k = max((s.num_top_logprobs for s in specs), default=0)
    if k == 0 and not any(s.want_logprobs for s in specs):  # no row asked: the log-softmax is skipped, zeros
        empty = torch.zeros(len(specs), 0, device=dev)
        return SampleResult(tokens, torch.zeros(len(specs), device=dev), empty.long(), empty)
    return _with_logprobs(raw, tokens, k)


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SampleResult:
    logp = torch.log_softmax(logits, dim=-1)
    top_logprobs, top_ids = torch.topk(logp, k, dim=-1)
    return SampleResult(
        tokens=tokens,
        logprobs=logp.gather(-1, tokens[:, None]).squeeze(1),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )
