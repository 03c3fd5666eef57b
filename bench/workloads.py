"""Synthetic serving workloads: request lengths drawn from documented distributions, prompts cut from real text.

Workloads (token counts; the server's limits clip every draw):

- ``paper``: log-normal prompt and output lengths, means 1019 / 463 tokens (the ShareGPT means the paper
  reports), sigma 1.0 for prompts and 0.8 for outputs (natural-log scale). ShareGPT's lengths are
  heavy-tailed: a few long pastes among many short questions, so prompts get the wider spread.
- ``vllm``: log-normal, means 200 / 180, sigma 0.6 for both: the shorter, tighter request mix that
  vLLM's own serving benchmark runs on ShareGPT after its filtering.
- ``fixed``: every request 1024 prompt / 512 output tokens (sigma 0).
- ``shared``: chat traffic that repeats itself (``Conversations``): one 1,000-token system prompt starts every
  request, and each conversation of 2-5 turns re-sends its whole history (the system prompt, the earlier user
  turns and replies) with a new user turn; the prefix caches of both servers get the same repeats. Replies
  are corpus text of the drawn reply length, not the server's own output, and each request asks for that many
  tokens; conversations are interleaved in groups, turn by turn, so a turn arrives seconds after the one
  before it. ``--prompt-mean`` / ``--output-mean`` do not apply.

A log-normal with mean ``m`` and spread ``s`` has ``mu = ln(m) - s**2 / 2``. After clipping and rounding,
the mean of the drawn set drifts from ``m``; ``sample_lengths`` shifts ``mu`` by bisection until the drawn
set's mean is ``m`` again (when the limits allow it), so runs offer the stated token load whatever their size.

Prompts are slices of a corpus of real English (the prose below plus the Python reference text shipped with
the standard library in ``pydoc_data``), tokenized with the served model's own tokenizer and sent as token-id
lists, so the server sees exactly the drawn length. Output lengths are exact through ``max_tokens`` with
``ignore_eos``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PROSE = """\
The harbour was quiet in the hour before dawn. Fishing boats rocked against their moorings, ropes creaking,
and a single lamp burned in the window of the net-mender's shed. Nobody in the town could remember when the
old man had last slept through a night; he said the sea talked too loudly for that, and that a person who
listened long enough could tell from the sound of the swell which boats would come home full.

Bread is older than writing. Long before anyone pressed marks into clay, people were grinding wild grain
between stones, mixing the flour with water and baking flat cakes on hot rocks. Leavened loaves came later,
probably by accident, when a batch of dough was left out long enough for wild yeasts to settle in it. The
baker who noticed that the forgotten dough rose, and that the bread it made was lighter and kept better,
changed the diet of half the world without ever knowing it.

When the committee finally published its report, it ran to four hundred pages and satisfied no one. The
engineers complained that the budget ignored maintenance; the residents said their objections to the new
road had been summarised in a single paragraph; and the mayor, who had asked for a recommendation, found
three of them, each hedged with conditions. Still, the report did one useful thing: it measured the traffic
on every street for a whole year, and those numbers settled arguments that opinion never could.

A good experiment changes one thing at a time. If you alter the temperature and the pressure together and
the reaction speeds up, you have learned that something you did mattered, but not which. Careful workers
write down what they expect before they look at the result, because it is remarkably easy, afterwards, to
persuade yourself that you predicted whatever happened. They also repeat the measurement, since a single
number says nothing about how much the next one might differ.

My grandmother kept bees for forty years and never wore gloves. She moved slowly around the hives, talked to
the colonies in a low voice, and told us that the bees knew her smell. Each spring she checked the frames for
the queen's eggs, and each autumn she left enough honey behind for the winter, taking only what she called the
rent. When she died, a neighbour went out to the garden and told the hives, as the old custom required.

The river changes its course more often than maps admit. Over a few centuries a lowland stream can wander
across its whole valley, cutting into the outside of each bend and dropping sand on the inside, until a loop
grows so tight that a flood breaks straight through its neck. The abandoned curve becomes a crescent lake,
slowly filling with reeds, and a town that was built on the bank may find itself a mile from the water.

Learning a second language as an adult is humbling. Children seem to absorb grammar without effort, while
grown-ups memorise rules and still trip over them in conversation. Yet adults have advantages too: they can
read, they understand how sentences are built, and they know what they want to say. The hardest part is often
not the vocabulary but the willingness to sound foolish for a year or two while the new words find their place.

At the edge of the desert the night sky is crowded with stars, far more than a city dweller would believe.
The band of the galaxy stretches from horizon to horizon, pale and grainy, and satellites slide across it in
steady lines. Travellers once steered by these lights; today most people see them only on holiday, and are
surprised each time by how many there are and how slowly, patiently, the whole sky turns overhead.
"""


@dataclass(frozen=True)
class Conversations:
    """The ``shared`` workload's traffic (module docstring): lengths in tokens, log-normal with these means."""

    system_len: int = 1000
    min_turns: int = 2
    max_turns: int = 5
    user_mean: float = 120.0
    reply_mean: float = 150.0
    sigma: float = 0.6
    group: int = 16  # conversations interleaved turn by turn


@dataclass(frozen=True)
class Workload:
    """Length distributions of one workload: log-normal means and spreads (sigma 0: fixed lengths), or
    conversations sharing a system prompt."""

    name: str
    prompt_mean: float
    output_mean: float
    prompt_sigma: float
    output_sigma: float
    doc: str
    conversations: Conversations | None = None

    def record(self) -> dict[str, Any]:
        """The workload as results files record it (no ``conversations`` key for a length workload: the files
        written before that field stay comparable)."""
        out = asdict(self)
        if self.conversations is None:
            del out["conversations"]
        return out

    def scaled(self, prompt_mean: float | None = None, output_mean: float | None = None) -> Workload:
        """The same shape with other means (e.g. a shorter mix for a slow CPU engine)."""
        if self.conversations is not None and (prompt_mean or output_mean):
            raise ValueError(f"the {self.name} workload's lengths come from its conversations, not from means")
        return Workload(self.name, prompt_mean or self.prompt_mean, output_mean or self.output_mean,
                        self.prompt_sigma, self.output_sigma, self.doc, self.conversations)


WORKLOADS = {
    "paper": Workload("paper", 1019, 463, 1.0, 0.8, "ShareGPT-like means from the paper, heavy-tailed"),
    "vllm": Workload("vllm", 200, 180, 0.6, 0.6, "vLLM's filtered ShareGPT mix, shorter and tighter"),
    "fixed": Workload("fixed", 1024, 512, 0.0, 0.0, "every request the same length"),
    "shared": Workload("shared", 0, 150, 0.0, 0.6, "a shared system prompt and multi-turn conversations "
                       "re-sending their history", Conversations()),
}


@dataclass(frozen=True)
class Limits:
    """What the server accepts: longest prompt, longest output, prompt + output."""

    max_prompt: int = 1 << 30
    max_output: int = 1 << 30
    max_context: int = 1 << 30


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: the prompt (token ids, or text that encodes to exactly prompt_len) and its length."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def _clipped(normals: np.ndarray, mu: float, sigma: float, hi: int) -> np.ndarray:
    return np.clip(np.rint(np.exp(mu + sigma * normals)), 1, max(1, hi)).astype(np.int64)


def sample_lengths(mean: float, sigma: float, n: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` log-normal lengths in [1, hi] whose mean is ``mean`` (as close as the clipping allows)."""
    if sigma <= 0:
        return np.full(n, min(max(1, round(mean)), max(1, hi)), dtype=np.int64)
    normals = rng.standard_normal(n)
    mu0 = math.log(mean) - sigma * sigma / 2
    lo, up = mu0 - 3.0, mu0 + 3.0
    for _ in range(60):
        mid = (lo + up) / 2
        if _clipped(normals, mid, sigma, hi).mean() < mean:
            lo = mid
        else:
            up = mid
    return _clipped(normals, (lo + up) / 2, sigma, hi)


def draw_lengths(workload: Workload, n: int, limits: Limits, seed: int = 0) -> list[tuple[int, int]]:
    """``n`` (prompt, output) length pairs; a pair longer than the context gives up prompt tokens first."""
    if workload.conversations is not None:
        raise ValueError(f"the {workload.name} workload's lengths come from its conversations")
    rng = np.random.default_rng(seed)
    prompts = sample_lengths(workload.prompt_mean, workload.prompt_sigma, n, limits.max_prompt, rng)
    outputs = sample_lengths(workload.output_mean, workload.output_sigma, n, limits.max_output, rng)
    pairs = []
    for p, o in zip(prompts.tolist(), outputs.tolist(), strict=True):
        o = min(o, max(1, limits.max_context - 1))
        p = max(1, min(p, limits.max_context - o))
        pairs.append((p, o))
    return pairs


def corpus_text() -> str:
    """The built-in corpus: the prose above, then the Python reference topics shipped with the interpreter."""
    parts = [PROSE]
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a stripped interpreter: the prose alone, repeated by the slicer
        return PROSE
    parts.extend(topics[key] for key in sorted(topics))
    return "\n\n".join(parts)


class PromptMaker:
    """Cuts prompts of an exact token length out of the corpus tokenized with one tokenizer."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tok = tokenizer
        self.ids = np.asarray(tokenizer.encode(corpus_text()), dtype=np.int64)
        self.rng = np.random.default_rng(seed)

    def ids_of_length(self, length: int) -> list[int]:
        """A run of ``length`` consecutive corpus tokens from a random place (the corpus repeats if short)."""
        reps = length // len(self.ids) + 2
        start = int(self.rng.integers(0, len(self.ids)))
        if reps > 2 or start + length > len(self.ids):
            return np.tile(self.ids, reps)[start:start + length].tolist()
        return self.ids[start:start + length].tolist()

    def text_of_length(self, length: int, tries: int = 6) -> str | None:
        """Text that the tokenizer encodes to exactly ``length`` tokens, or None when none was found."""
        ids = self.ids_of_length(length + 8)
        n = length
        for _ in range(tries):
            text = self.tok.decode(ids[:n])
            got = len(self.tok.encode(text))
            if got == length:
                return text
            n = max(1, min(len(ids), n + length - got))
        return None

    def request(self, prompt_len: int, output_len: int, as_text: bool = False) -> RequestSpec:
        if as_text:
            text = self.text_of_length(prompt_len)
            if text is not None:
                return RequestSpec(text, prompt_len, output_len)
        return RequestSpec(self.ids_of_length(prompt_len), prompt_len, output_len)


def build_requests(workload: Workload, n: int, tokenizer: Any, limits: Limits = Limits(), seed: int = 0,
                   as_text: bool = False) -> list[RequestSpec]:
    """``n`` requests of ``workload``: lengths from ``draw_lengths``, prompts from the real-text corpus (or the
    ``shared`` workload's conversations, always as token ids: a prefix must be a prefix token for token)."""
    if workload.conversations is not None:
        return conversation_requests(workload.conversations, n, tokenizer, limits, seed)
    maker = PromptMaker(tokenizer, seed)
    return [maker.request(p, o, as_text) for p, o in draw_lengths(workload, n, limits, seed)]


SYSTEM_PROMPT_SEED = 7  # one system prompt for every rate and run: a deployment's does not change


def conversation_requests(conv: Conversations, n: int, tokenizer: Any, limits: Limits = Limits(),
                          seed: int = 0) -> list[RequestSpec]:
    """``n`` requests of interleaved conversations (the ``shared`` workload): every prompt starts with the one
    system prompt; turn k of a conversation is turn k-1's prompt, its reply and a new user turn. A
    conversation ends early where its next turn would pass the server's limits."""
    system = PromptMaker(tokenizer, SYSTEM_PROMPT_SEED).ids_of_length(min(conv.system_len, limits.max_prompt - 1))
    maker, rng = PromptMaker(tokenizer, seed), np.random.default_rng(seed)

    def length(mean: float) -> int:
        mu = math.log(mean) - conv.sigma * conv.sigma / 2
        return int(_clipped(rng.standard_normal(1), mu, conv.sigma, 1 << 20)[0])

    out: list[RequestSpec] = []
    while len(out) < n:
        before = len(out)
        histories = [list(system) for _ in range(conv.group)]
        turns = rng.integers(conv.min_turns, conv.max_turns + 1, size=conv.group).tolist()
        for turn in range(max(turns)):
            for c in range(conv.group):
                if turn >= turns[c] or len(out) >= n:
                    continue
                prompt = histories[c] + maker.ids_of_length(length(conv.user_mean))
                reply = length(conv.reply_mean)
                if len(prompt) > limits.max_prompt or len(prompt) + reply > limits.max_context:
                    turns[c] = turn  # the conversation ends here
                    continue
                out.append(RequestSpec(prompt, len(prompt), min(reply, limits.max_output)))
                histories[c] = prompt + maker.ids_of_length(reply)
        if len(out) == before:
            raise ValueError(f"no first turn of {conv.group} conversations fits the limits ({limits}) after the "
                             f"{len(system)}-token system prompt")
    return out


def summary(requests: Sequence[RequestSpec]) -> dict[str, float]:
    """Mean and extremes of a request set's lengths (for the run's config record)."""
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    return {"prompt_mean": float(p.mean()), "prompt_max": int(p.max()), "output_mean": float(o.mean()),
            "output_max": int(o.max()), "count": len(requests)}
