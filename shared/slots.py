"""Frontend-side slot transitions: the only code on the frontend that writes slots.

Each method performs one transition of schema/OWNERSHIP.md and nothing else: payload first,
the state word last with release order, a compare-and-swap wherever another writer could
race. The engine side is in ``shared/engine_slots.py``.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from shared import ring_layout as L
from shared.messages import Sampling
from shared.ring import FLIP_SLOTS, HEADER_OFF, MAX_STOP_IDS, Ring

S = L.SlotState
_SAMPLING_OFF = L.FIELD_OFFSETS["Slot"]["sampling"]
MAX_LOGIT_BIAS = 300  # entries per request (as OpenAI), in the tail of the slot's prompt row


def state_word(state: int, seq: int) -> int:
    """The 64-bit word at offset 0 of a slot: state in the low half, seq in the high half."""
    return (int(seq) & 0xFFFFFFFF) << 32 | int(state)


def split_word(word: int) -> tuple[int, int]:
    return word & 0xFFFFFFFF, word >> 32


@dataclasses.dataclass(frozen=True, slots=True)
class SlotRequest:
    """What the frontend writes into a slot for one request: its id, prompt and sampling record."""

    request_id: int
    prompt: np.ndarray  # int32 token ids
    sampling: Sampling

    def sampling_record(self) -> np.ndarray:
        """The slot's ``SamplingParams`` (schema/ring.fbs) encoding ``self.sampling``."""
        s = self.sampling
        rec = np.zeros(1, L.SAMPLINGPARAMS_DTYPE)
        rec["temperature"], rec["top_p"], rec["top_k"], rec["min_p"] = s.temperature, s.top_p, s.top_k, s.min_p
        flags = 0
        if s.seed is not None:
            flags |= L.SamplingFlags.HAS_SEED
            rec["seed"] = s.seed & 0xFFFFFFFFFFFFFFFF
        flags |= L.SamplingFlags.IGNORE_EOS if s.ignore_eos else 0
        flags |= L.SamplingFlags.WANT_LOGPROBS if s.logprobs or s.top_logprobs > 0 else 0
        flags |= L.SamplingFlags.WANT_PROMPT_LOGPROBS if s.prompt_logprobs >= 0 else 0
        rec["flags"] = int(flags)
        rec["num_top_logprobs"] = s.top_logprobs
        rec["num_stop_ids"] = len(s.stop_ids)
        rec["stop_ids"][0, : len(s.stop_ids)] = s.stop_ids
        rec["presence_penalty"], rec["frequency_penalty"] = s.presence_penalty, s.frequency_penalty
        rec["repetition_penalty"], rec["min_tokens"] = s.repetition_penalty, s.min_tokens
        rec["num_logit_bias"] = len(s.logit_bias)
        rec["grammar_id"] = s.grammar_id
        return rec

    def logit_bias_table(self) -> np.ndarray:
        """The ``LogitBias`` entries, as they sit in the tail of the slot's prompt row."""
        table = np.zeros(len(self.sampling.logit_bias), L.LOGITBIAS_DTYPE)
        if len(table):
            table["token"], table["bias"] = zip(*self.sampling.logit_bias, strict=True)
        return table


# Doorbell increments with no flip that make an engine read every slot (`SlotWriter.ring_for_full_scan`): more than
# the publications whose flip landed and whose increment did not, across the ring's writers, that an engine has not
# yet made up for by reading every slot.
FULL_SCAN_RINGS = 64


class SlotWriter:
    """Frontend transitions: EMPTY->RESERVED->PREFILL_PENDING, cancel, COMPLETED->EMPTY."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.t = ring.transport
        g = ring.geometry
        self.max_prompt, self.max_output, self.max_top = g.max_prompt_tokens, g.max_output_tokens, g.top_logprobs
        self.max_prompt_logprobs = g.prompt_logprob_rows
        # Flip the header's pending_flips at each publication: rings of schema minor >= 1 have them. A
        # writer without flips (an older frontend) is still served: the engine counts flips against
        # the doorbell and reads every slot when they fall short (schema/OWNERSHIP.md).
        self.flips = int(ring.read_header()["schema_minor"]) >= 1

    def try_reserve(self, idx: int, seq: int) -> int | None:
        """EMPTY(seq) -> RESERVED(seq+1) by CAS; the new seq, or None if someone else won."""
        new_seq = (seq + 1) & 0xFFFFFFFF
        seen = self.t.cas64(self.ring.slot_offset(idx), state_word(S.EMPTY, seq), state_word(S.RESERVED, new_seq))
        return new_seq if seen == state_word(S.EMPTY, seq) else None

    def check(self, req: SlotRequest) -> None:
        """Refuse what this ring can never carry (the gateway turns these into 400s)."""
        s = req.sampling
        if not 0 < len(req.prompt) <= self.max_prompt:
            raise ValueError(f"prompt has {len(req.prompt)} tokens; this ring carries 1..{self.max_prompt}")
        if not 0 < s.max_new_tokens <= self.max_output:
            raise ValueError(f"max_new_tokens is {s.max_new_tokens}; this ring carries 1..{self.max_output}")
        if s.top_logprobs > self.max_top:
            raise ValueError(f"top_logprobs is {s.top_logprobs}; this ring carries at most {self.max_top}")
        if s.prompt_logprobs > self.max_top:
            raise ValueError(f"prompt_logprobs is {s.prompt_logprobs}; this ring carries at most {self.max_top}")
        if s.prompt_logprobs >= 0 and len(req.prompt) > self.max_prompt_logprobs:
            raise ValueError(f"prompt log-probs of {len(req.prompt)} tokens; this ring carries them for at most "
                             f"{self.max_prompt_logprobs}")
        if len(s.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(s.stop_ids)} stop token ids; at most {MAX_STOP_IDS}")
        if len(s.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"{len(s.logit_bias)} logit_bias entries; at most {MAX_LOGIT_BIAS}")
        if len(req.prompt) + 2 * len(s.logit_bias) > self.max_prompt:
            raise ValueError(f"a prompt of {len(req.prompt)} tokens and {len(s.logit_bias)} logit_bias entries "
                             f"exceed the slot's prompt row ({self.max_prompt} words)")

    def publish(self, idx: int, seq: int, req: SlotRequest, doorbell: bool = True) -> None:
        """RESERVED(seq) -> PREFILL_PENDING(seq): prompt and metadata first, state word last, then the doorbell;
        with ``doorbell`` False the caller rings once for several publications (``ring_doorbell``)."""
        self.check(req)
        ring, t = self.ring, self.t
        t.write(ring.prompt_offset(idx), np.ascontiguousarray(req.prompt, dtype=np.int32))
        bias = req.logit_bias_table()
        if len(bias):  # the row's tail (schema/ring.fbs)
            t.write(ring.prompt_offset(idx) + 4 * self.max_prompt - bias.nbytes, bias.tobytes())
        meta = np.zeros(1, L.SLOT_DTYPE)
        meta["state"], meta["seq"] = S.RESERVED, seq
        meta["request_id"], meta["prompt_len"] = req.request_id, len(req.prompt)
        meta["max_new_tokens"] = req.sampling.max_new_tokens
        meta["submit_ns"] = time.time_ns()
        meta["sampling"] = req.sampling_record()
        meta["cache_salt"] = req.sampling.cache_salt & 0xFFFFFFFFFFFFFFFF
        meta["num_prompt_logprobs"] = max(req.sampling.prompt_logprobs, 0)
        meta["stop_token"] = -1  # the engine writes the stop id that ends it (schema minor 6)
        t.write(ring.slot_offset(idx), meta.tobytes())  # state word unchanged (RESERVED, seq)
        t.fence()
        t.store32(ring.slot_field(idx, "state"), S.PREFILL_PENDING)
        if self.flips and idx < FLIP_SLOTS:  # after the state word, before the doorbell (schema/OWNERSHIP.md)
            t.fetch_xor64(HEADER_OFF["pending_flips"] + 8 * (idx // 64), 1 << (idx % 64))
        if doorbell:
            self.ring_doorbell(1)

    def ring_doorbell(self, publications: int) -> None:
        """The doorbell's increments of ``publications`` publications, after the last of them: an engine then
        finds them all at one look (each flipped before its increment, as schema/OWNERSHIP.md asks)."""
        self.t.fetch_add64(HEADER_OFF["doorbell"], publications)

    def abandon(self, idx: int, seq: int) -> bool:
        """RESERVED(seq) -> EMPTY(seq), when a reservation cannot be filled."""
        return self.t.cas64(self.ring.slot_offset(idx), state_word(S.RESERVED, seq),
                            state_word(S.EMPTY, seq)) == state_word(S.RESERVED, seq)

    def pending(self, idx: int, seq: int) -> bool:
        """Whether slot ``idx`` is PREFILL_PENDING(seq): published, not claimed yet."""
        return self.t.load64(self.ring.slot_offset(idx)) == state_word(S.PREFILL_PENDING, seq)

    def ring_for_full_scan(self) -> None:
        """``FULL_SCAN_RINGS`` doorbell increments without a flip, for a publication whose flip may not have landed
        (its access cut): the flips then fall short of the rings by more than flips counted ahead of rings that never
        landed can make up, so the engine's next look reads every slot's state word (schema/OWNERSHIP.md) and finds
        the slot whatever its flip did."""
        self.t.fetch_add64(HEADER_OFF["doorbell"], FULL_SCAN_RINGS)

    def published(self, idx: int, seq: int) -> bool:
        """Whether slot ``idx`` still holds ``seq``'s request past RESERVED (published, running or finished)."""
        state, cur = split_word(self.t.load64(self.ring.slot_offset(idx)))
        return cur == seq and state not in (S.EMPTY, S.RESERVED)

    def cancel(self, idx: int, seq: int) -> bool:
        """Ask the engine to stop the request in slot ``idx`` if it is still ``seq``'s."""
        word = self.t.load64(self.ring.slot_offset(idx))
        state, cur = split_word(word)
        if cur != seq or state in (S.EMPTY, S.RESERVED, S.DECODE_COMPLETED):
            return False
        self.t.store32(self.ring.slot_field(idx, "cancel"), 1)
        return True

    def release(self, idx: int, seq: int) -> bool:
        """DECODE_COMPLETED(seq) -> EMPTY(seq), once the frontend has read the tail."""
        return self.t.cas64(self.ring.slot_offset(idx), state_word(S.DECODE_COMPLETED, seq),
                            state_word(S.EMPTY, seq)) == state_word(S.DECODE_COMPLETED, seq)
