"""A token-level DFA: the tables a constrained decoder looks up, and where the frontend stores them.

The frontend compiles a grammar (JSON mode, a JSON schema, a forced tool call) against the served
tokenizer once (``dpu_gateway/grammar.py``) and stores the tables under a 64-bit id; a slot names the
id in ``SamplingParams.grammar_id`` (ring schema minor 3). The engine loads the tables once per id
and, per step, only looks up: the allowed-token mask of the row's state, and the state after the
sampled token. No grammar code runs on the engine's side.

Tables, for ``S`` states over a vocabulary of ``V`` ids:

- ``bits`` uint8 [S, ceil(V / 8)]: bit ``t`` (``np.packbits`` order) set when token ``t`` may follow;
- ``default`` int32 [S]: the state after most allowed tokens;
- ``exc_offsets`` int64 [S + 1], ``exc_tokens`` int32, ``exc_next`` int32: per state, the allowed
  tokens (ascending) whose next state is not ``default``, and that state;
- ``accept`` bool [S]: the text so far is a complete sentence: the end tokens (EOS, stop ids) may follow.

On the device (the persistent scheduler's arena, ``gpu_engine/gpu/grammar_arena.py``) one grammar is one
contiguous range (``device_layout``): ``bits`` with each row padded to ``device_row_bytes(V)``, then int32
``default``, ``accept``, ``exc_offsets``, ``exc_tokens`` and ``exc_next``; ``device_bytes`` is its size, which
the gateway checks against the arena's before it publishes a request.

They live in ``/dev/shm/<ring name>.grammars/<id as 16 hex digits>.npz``, a private folder of the
ring's owner next to the ring itself (the engine and the frontend already share that segment). The store is
bounded (``prune``, the gateway's --grammar-store-mb): each distinct schema adds a file of up to tens of MiB, in
memory, and a client that sends a new one with every request would otherwise fill it. Only grammars no request
uses are removed, least recently used first; one asked for again is compiled again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from pathlib import Path

import numpy as np

from shared.transport import SHM_DIR

TABLES = ("bits", "default", "exc_offsets", "exc_tokens", "exc_next", "accept")


class GrammarError(ValueError):
    """Tables that are missing, malformed, or of another vocabulary."""


def device_row_bytes(vocab_size: int) -> int:
    """Bytes of one state's allowed-token bits on the device: ``ceil(V / 8)`` rounded up to 16."""
    return ((vocab_size + 7) // 8 + 15) // 16 * 16


def device_bytes(num_states: int, num_exceptions: int, vocab_size: int) -> int:
    """The device arena bytes a grammar takes (``device_layout``), rounded up to 256."""
    raw = num_states * device_row_bytes(vocab_size) + 4 * (3 * num_states + 1 + 2 * num_exceptions)
    return (raw + 255) // 256 * 256


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class TokenDFA:
    start: int
    vocab_size: int
    bits: np.ndarray
    default: np.ndarray
    exc_offsets: np.ndarray
    exc_tokens: np.ndarray
    exc_next: np.ndarray
    accept: np.ndarray

    def __post_init__(self) -> None:
        S = len(self.default)
        ok = (self.bits.shape == (S, (self.vocab_size + 7) // 8) and self.accept.shape == (S,)
              and self.exc_offsets.shape == (S + 1,) and len(self.exc_tokens) == len(self.exc_next)
              and 0 <= self.start < S and int(self.exc_offsets[-1]) == len(self.exc_tokens))
        if not ok or (S and (self.default.min() < 0 or self.default.max() >= S)):
            raise GrammarError("token DFA tables of inconsistent shapes")
        if len(self.exc_next) and (self.exc_next.min() < 0 or self.exc_next.max() >= S):
            raise GrammarError("token DFA exception names a state out of range")

    @property
    def num_states(self) -> int:
        return len(self.default)

    def allowed(self, state: int) -> np.ndarray:
        """bool [V]: the tokens that may follow ``state`` (end tokens aside: see ``accept``)."""
        return np.unpackbits(self.bits[state], count=self.vocab_size).astype(bool)

    def advance(self, state: int, token: int) -> int:
        """The state after ``token``; -1 when the token is not allowed there."""
        if not 0 <= token < self.vocab_size or not self.bits[state, token >> 3] & (0x80 >> (token & 7)):
            return -1
        lo, hi = int(self.exc_offsets[state]), int(self.exc_offsets[state + 1])
        i = lo + int(np.searchsorted(self.exc_tokens[lo:hi], token))
        return int(self.exc_next[i]) if i < hi and int(self.exc_tokens[i]) == token else int(self.default[state])

    def walk(self, tokens: list[int] | tuple[int, ...]) -> int:
        """The state after ``tokens`` from the start; -1 once one of them was not allowed."""
        state = self.start
        for tok in tokens:
            state = self.advance(state, int(tok))
            if state < 0:
                return -1
        return state

    @property
    def num_exceptions(self) -> int:
        return len(self.exc_tokens)

    def device_layout(self) -> np.ndarray:
        """uint8 [device_bytes]: the tables as the device arena holds them (module docstring)."""
        S, rb = self.num_states, device_row_bytes(self.vocab_size)
        out = np.zeros(device_bytes(S, self.num_exceptions, self.vocab_size), dtype=np.uint8)
        out[: S * rb].reshape(S, rb)[:, : self.bits.shape[1]] = self.bits
        words = [self.default, self.accept.astype(bool), self.exc_offsets, self.exc_tokens, self.exc_next]
        flat = np.concatenate([np.asarray(w).astype(np.int32) for w in words])
        out[S * rb: S * rb + 4 * len(flat)] = flat.view(np.uint8)
        return out

    def save(self, path: Path) -> None:
        """Write atomically (a temporary name, then a rename), readable by the owner only."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, start=np.int64(self.start), vocab_size=np.int64(self.vocab_size),
                     **{name: getattr(self, name) for name in TABLES})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> TokenDFA:
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls(int(z["start"]), int(z["vocab_size"]), *(np.asarray(z[name]) for name in TABLES))
        except (OSError, KeyError, ValueError) as exc:
            raise GrammarError(f"cannot read token DFA {path}: {exc}") from None


def grammar_dir(ring_name: str) -> Path:
    """The store of a frontend's ring and of its engines' (``RING-dpK`` under --data-parallel-size, see
    shared/data_parallel.engine_ring_names): one folder per ``RING``, named without the ``-dpK`` suffix,
    so the gateway compiles a grammar once, before it knows which engine the request goes to."""
    return SHM_DIR / f"{re.sub(r'-dp[0-9]+$', '', ring_name)}.grammars"


def grammar_path(ring_name: str, grammar_id: int) -> Path:
    return grammar_dir(ring_name) / f"{grammar_id:016x}.npz"


def private_dir(path: Path) -> Path:
    """``path`` as a folder of this user with mode 0700, created if missing (GrammarError otherwise)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise GrammarError(f"{path} is not a private folder of this user (mode 0700)")
    return path


def store(ring_name: str, grammar_id: int, dfa: TokenDFA) -> Path:
    """Store ``dfa`` under ``grammar_id`` for the engine of ``ring_name`` (no-op when already there)."""
    if not 0 < grammar_id < 2**64:
        raise GrammarError(f"grammar id {grammar_id} out of range (1 .. 2**64 - 1)")
    path = grammar_path(ring_name, grammar_id)
    private_dir(path.parent)
    if not path.exists():
        dfa.save(path)
    return path


def touch(ring_name: str, grammar_id: int) -> bool:
    """Mark a stored grammar as just used (its modification time, which ``prune`` orders by); False when it is
    not stored (never, or pruned since)."""
    try:
        os.utime(grammar_path(ring_name, grammar_id))
    except FileNotFoundError:
        return False
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class Pruned:
    removed: int      # files removed: grammars, and temporary files a killed compile left
    freed: int        # their bytes
    left: int         # bytes the store holds now
    kept: int         # grammars over the limit that were not removed: in use, or used within the grace


def _is_grammar(name: str) -> bool:
    return len(name) == 20 and name.endswith(".npz") and re.fullmatch(r"[0-9a-f]{16}", name[:16]) is not None


def prune(ring_name: str, limit_bytes: int, in_use: frozenset[int] | set[int] = frozenset(),
          grace_s: float = 0.0) -> Pruned:
    """Remove the least recently used grammars of the ring's store until it holds at most ``limit_bytes``,
    never one in ``in_use`` nor one used (stored or ``touch``-ed) in the last ``grace_s`` seconds: another
    gateway of the same ring may have a request on it, which it keeps touching while the request lives.
    Temporary files older than the grace (a compile killed while it wrote, ``TokenDFA.save``) go first.
    A file that cannot be removed is left, and counted."""
    folder = grammar_dir(ring_name)
    grammars: list[tuple[float, int, int, str]] = []  # (last use, bytes, id, name)
    stale: list[tuple[int, str]] = []
    total = 0
    newest = time.time() - grace_s
    try:
        with os.scandir(folder) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                total += st.st_size
                if _is_grammar(entry.name):
                    grammars.append((st.st_mtime, st.st_size, int(entry.name[:16], 16), entry.name))
                elif entry.name.endswith(".tmp") and st.st_mtime <= newest:
                    stale.append((st.st_size, entry.name))
    except FileNotFoundError:
        return Pruned(0, 0, 0, 0)
    removed = freed = kept = 0

    def remove(name: str, size: int) -> None:
        nonlocal removed, freed, total
        try:
            os.unlink(folder / name)
        except FileNotFoundError:  # another gateway's prune got there first
            pass
        except OSError:
            return
        else:
            removed, freed = removed + 1, freed + size
        total -= size

    for size, name in stale:
        remove(name, size)
    for _, size, gid, name in sorted(grammars):
        if total <= limit_bytes:
            break
        if gid in in_use:
            kept += 1
            continue
        try:  # used since the scan (another gateway's request asked for it again): it stays
            recent = os.stat(folder / name).st_mtime > newest
        except FileNotFoundError:
            total -= size
            continue
        if recent:
            kept += 1
            continue
        remove(name, size)
    return Pruned(removed, freed, total, kept)


def load(ring_name: str, grammar_id: int) -> TokenDFA:
    path = grammar_path(ring_name, grammar_id)
    private_dir(path.parent)
    return TokenDFA.load(path)


def stored_device_bytes(ring_name: str, grammar_id: int) -> int:
    """``device_bytes`` of a stored grammar, reading only its small tables (GrammarError if unreadable)."""
    path = grammar_path(ring_name, grammar_id)
    try:
        with np.load(path, allow_pickle=False) as z:
            return device_bytes(len(z["default"]), len(z["exc_tokens"]), int(z["vocab_size"]))
    except (OSError, KeyError, ValueError) as exc:
        raise GrammarError(f"cannot read token DFA {path}: {exc}") from None


def remove_store(ring_name: str) -> None:
    """Remove the ring's stored grammars (the supervisor's cleanup)."""
    folder = grammar_dir(ring_name)
    if folder.is_dir() and not folder.is_symlink():
        for f in folder.iterdir():
            with contextlib.suppress(OSError):
                f.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()
