"""The grammar arena's host side: the mailbox the persistent scheduler asks through, and the thread that answers.

The scheduler owns the arena (`gpu_engine/csrc/sched_grammar.cuh`): which grammars are resident, where, who
holds them, what is evicted. It never reads a file, so it asks the engine's host process, through one mailbox
entry per table entry in host-mapped memory (BLINK_MAIL_WORDS uint64 words: id, offset, op, seq written by the
scheduler, seq last; done, result, states, exceptions | start << 32 written here, done last):

- ``MAIL_OP_META``: load the grammar's tables from the frontend's store (``shared/token_dfa.load``), check their
  vocabulary, answer their sizes and start state;
- ``MAIL_OP_COPY``: copy them (``TokenDFA.device_layout``) into the arena at the offset the scheduler chose,
  on a stream of this thread's own, and answer once the copy is complete.

So the host works once per grammar, at its first admission, never per token; a busy host delays that first
admission only. The thread polls the mailbox every ``POLL_S`` (a few words of host memory) and keeps the tables
of a grammar between the two requests only.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

from gpu_engine.gpu.sched_structs import GRAMMAR_ENTRIES, MAIL_FAILED, MAIL_OK, MAIL_OP_COPY, MAIL_OP_META, MAIL_WORDS
from shared import token_dfa
from shared.log import get_logger
from shared.token_dfa import GrammarError, TokenDFA

log = get_logger("engine")
POLL_S = 0.001
ID, OFFSET, OP, SEQ, DONE, RESULT, STATES, SIZES = range(MAIL_WORDS)


def sizes(dfa: TokenDFA) -> tuple[int, int]:
    """The STATES and SIZES words of an answer: its states; its exceptions, and its start state shifted by 32."""
    return dfa.num_states, dfa.num_exceptions | dfa.start << 32


class GrammarArena:
    """The device arena (a torch uint8 tensor the graphs read), the host-mapped mailbox and its thread."""

    def __init__(self, arena, ring_name: str, vocab_size: int) -> None:
        self.arena, self.ring_name, self.vocab_size = arena, ring_name, vocab_size
        self._buf = mmap.mmap(-1, max(mmap.PAGESIZE, GRAMMAR_ENTRIES * MAIL_WORDS * 8))
        self.mail = np.frombuffer(self._buf, dtype=np.uint64)[: GRAMMAR_ENTRIES * MAIL_WORDS].reshape(
            GRAMMAR_ENTRIES, MAIL_WORDS)
        self.loaded: dict[int, TokenDFA] = {}  # entry -> the tables between its META and COPY answers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loads = self.failures = 0

    @property
    def address(self) -> int:
        """The mailbox's host address (to register for the device)."""
        return int(self.mail.ctypes.data)

    @property
    def size(self) -> int:
        return len(self._buf)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="grammar-loader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        import torch

        stream = torch.cuda.Stream(device=self.arena.device)
        while not self._stop.wait(POLL_S):
            self.poll(stream)

    def poll(self, stream=None) -> int:
        """Answer every request posted since the last poll; the number answered."""
        answered = 0
        for e in np.flatnonzero(self.mail[:, SEQ] != self.mail[:, DONE]):
            seq = int(self.mail[e, SEQ])  # read first: the request's words were written before it
            op, gid, offset = int(self.mail[e, OP]), int(self.mail[e, ID]), int(self.mail[e, OFFSET])
            try:
                result, states, sizes = self.answer(int(e), op, gid, offset, stream)
            except Exception as exc:  # noqa: BLE001 - answered as a failure: the request fails, the queue goes on
                log.error("grammar not loaded", grammar_id=f"{gid:016x}", reason=f"{type(exc).__name__}: {exc}")
                self.loaded.pop(int(e), None)
                self.failures += 1
                result, states, sizes = MAIL_FAILED, 0, 0
            self.mail[e, RESULT], self.mail[e, STATES], self.mail[e, SIZES] = result, states, sizes
            self.mail[e, DONE] = seq  # last: the scheduler reads the answer once it sees this
            answered += 1
        return answered

    def answer(self, e: int, op: int, gid: int, offset: int, stream) -> tuple[int, int, int]:
        if op == MAIL_OP_META:
            self.loaded.pop(e, None)
            try:
                dfa = token_dfa.load(self.ring_name, gid)
            except GrammarError as exc:
                log.error("grammar not loaded", grammar_id=f"{gid:016x}", reason=str(exc))
                self.failures += 1
                return MAIL_FAILED, 0, 0
            if dfa.vocab_size != self.vocab_size:
                log.error("grammar not loaded", grammar_id=f"{gid:016x}",
                          reason=f"vocabulary of {dfa.vocab_size} tokens, the model has {self.vocab_size}")
                self.failures += 1
                return MAIL_FAILED, 0, 0
            self.loaded[e] = dfa
            return MAIL_OK, *sizes(dfa)
        tables = self.loaded.pop(e) if e in self.loaded else None
        if op != MAIL_OP_COPY or tables is None:
            self.failures += 1
            return MAIL_FAILED, 0, 0
        self.copy(tables, offset, stream)
        self.loads += 1
        log.info("grammar loaded to the device", grammar_id=f"{gid:016x}", states=tables.num_states,
                 bytes=token_dfa.device_bytes(tables.num_states, tables.num_exceptions, tables.vocab_size),
                 offset=offset)
        return MAIL_OK, *sizes(tables)

    def copy(self, dfa: TokenDFA, offset: int, stream) -> None:
        """The tables into the arena at ``offset``, complete when this returns (a stream of its own: the
        persistent scheduler runs on another and never ends, so nothing device-wide may be waited for)."""
        import torch

        host = torch.from_numpy(dfa.device_layout())
        if offset + len(host) > len(self.arena):
            raise ValueError(f"grammar tables of {len(host)} bytes at {offset} overrun the arena of {len(self.arena)}")
        if stream is None:
            self.arena[offset: offset + len(host)].copy_(host)
            return
        with torch.cuda.stream(stream):
            self.arena[offset: offset + len(host)].copy_(host.pin_memory(), non_blocking=True)
        stream.synchronize()
