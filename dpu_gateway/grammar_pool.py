"""Grammar compiles in worker processes: the gateway's event loop never runs one.

A compile is pure Python and numpy work of up to a few seconds (``grammar.Budget`` bounds it). In a thread
it would hold the GIL in long stretches and starve the event loop (``/health``, streams, other requests);
in a worker process it cannot. ``GrammarPool`` keeps ``workers`` processes (spawned on first use, so a
gateway that never compiles starts none), a queue of at most ``queue_bound`` compiles waiting for one, and
one compile per key: requests asking for the same grammar at once wait on the same job. A job whose last
waiter leaves (the client disconnected, the server stops) is dropped from the queue, or its worker is
killed and replaced. A worker that runs past ``timeout_s`` is killed too (a backstop: the budget should
end every compile first). Workers die with the gateway (``PR_SET_PDEATHSIG``), so nothing they do can hold
up its exit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import dataclasses
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from dpu_gateway.grammar import DEFAULT_BUDGET, Budget, TooComplex, Vocab, byte_dfa, token_dfa
from shared import token_dfa as store
from shared.log import get_logger
from shared.token_dfa import GrammarError

log = get_logger("gateway")


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a grammar cannot be served: the message, the schema keyword or budget limit it names, and
    whether the same key would be refused again (a timeout or a dead worker might not be)."""

    message: str
    keyword: str = ""
    final: bool = True


class PoolBusy(Exception):
    """Every worker is busy and the queue is full."""


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    key: str           # the constraint's key: all the worker needs to build the pattern
    grammar_id: int
    vocab_size: int


# ------------------------------------------------------------------------------------------------ worker
def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main(fd: int) -> None:
    """A worker's loop on the socket ``fd``: first the vocabulary's texts, the ring's name and the budget,
    then a ``Job`` in, ``None`` (stored) or a ``Refusal`` out, until the socket closes."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the gateway's to handle
    from dpu_gateway.structured import pattern_of

    conn = Connection(fd)
    try:
        texts, ring_name, budget = conn.recv()
    except (EOFError, OSError):
        return
    vocabs: dict[int, Vocab] = {}
    while True:
        try:
            job: Job = conn.recv()
        except (EOFError, OSError):
            return
        vocab = vocabs.get(job.vocab_size) or vocabs.setdefault(job.vocab_size, Vocab.of(texts, job.vocab_size))
        conn.send(compile_one(job, pattern_of, vocab, ring_name, budget))


def compile_one(job: Job, pattern_of: Any, vocab: Vocab, ring_name: str, budget: Budget) -> Refusal | None:
    """Build, compile and store one grammar; a grammar that cannot be served is a ``Refusal``."""
    from dpu_gateway.structured import id_table  # noqa: PLC0415 (the worker's imports, as pattern_of)

    try:
        dfa = id_table(job.key, job.vocab_size) or token_dfa(byte_dfa(pattern_of(job.key), budget), vocab, budget)
        store.store(ring_name, job.grammar_id, dfa)
        return None
    except TooComplex as exc:
        return Refusal(str(exc), exc.limit)
    except GrammarError as exc:
        return Refusal(str(exc), getattr(exc, "keyword", ""))
    except RecursionError:
        return Refusal("the grammar is too complex to enforce: it nests too deeply", "depth")
    except MemoryError:
        return Refusal("the grammar is too complex to enforce: it needs more memory than this server has",
                       "memory", final=False)


# ------------------------------------------------------------------------------------------------ pool
class _Worker:
    """One worker process (``python -m dpu_gateway.grammar_pool FD``) and its end of a socket pair. The setup
    (every token's text: megabytes for a large vocabulary) is sent by a thread: a blocking send of it on the
    event loop would wait for the new process to start and read it. Jobs follow it on the same thread where it
    is still under way, so they arrive after it. A send that fails leaves the worker to be found dead by the
    reply's reader."""

    def __init__(self, setup: tuple[list[bytes | None], str, Budget]) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "dpu_gateway.grammar_pool", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self._setup = threading.Thread(target=self._send, args=(setup,), name="grammar-setup", daemon=True)
        self._setup.start()
        self.job: Job | None = None
        self.timer: asyncio.TimerHandle | None = None

    def _send(self, message: object, after: threading.Thread | None = None) -> None:
        if after is not None:
            after.join()
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(message)

    def submit(self, job: Job) -> None:
        """Send ``job``, after the setup where that is still being sent."""
        if self._setup.is_alive():
            threading.Thread(target=self._send, args=(job, self._setup), daemon=True).start()
        else:
            self._send(job)

    def kill(self) -> None:
        """SIGKILL, the socket closed, and the process reaped by a thread (never a wait on the event loop)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.conn.close()
        threading.Thread(target=self.proc.wait, name="grammar-reap", daemon=True).start()


class GrammarPool:
    def __init__(self, texts: list[bytes | None], ring_name: str, *, workers: int, queue_bound: int,
                 budget: Budget = DEFAULT_BUDGET, timeout_s: float = 120.0) -> None:
        self.texts, self.ring_name, self.budget = texts, ring_name, budget
        self.workers, self.queue_bound, self.timeout_s = workers, queue_bound, timeout_s
        self._idle: list[_Worker] = []
        self._busy: list[_Worker] = []
        self._queue: collections.deque[Job] = collections.deque()
        self._futures: dict[int, asyncio.Future] = {}
        self._waiters: collections.Counter[int] = collections.Counter()

    async def run(self, job: Job) -> Refusal | None:
        """Compile ``job`` (or wait for the same grammar's compile already under way)."""
        fut = self._futures.get(job.grammar_id)
        if fut is None:
            if len(self._queue) >= self.queue_bound:
                raise PoolBusy()
            fut = self._futures[job.grammar_id] = asyncio.get_running_loop().create_future()
            self._queue.append(job)
            try:
                self._dispatch()
            except OSError:  # no worker could be started: nothing is left waiting on this job
                self._futures.pop(job.grammar_id, None)
                with contextlib.suppress(ValueError):
                    self._queue.remove(job)
                raise
        self._waiters[job.grammar_id] += 1
        try:
            return await asyncio.shield(fut)
        finally:
            self._waiters[job.grammar_id] -= 1
            if not self._waiters[job.grammar_id]:
                del self._waiters[job.grammar_id]
                if not fut.done():
                    self._abandon(job.grammar_id)

    def stats(self) -> dict[str, int]:
        return {"running": len(self._busy), "queued": len(self._queue), "workers": len(self._idle) + len(self._busy)}

    def close(self) -> None:
        for w in self._idle + self._busy:
            w.kill()
        self._idle, self._busy = [], []
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()
        self._queue.clear()

    # -- internals ------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while self._queue:
            worker = self._free_worker()
            if worker is None:
                return
            job = self._queue.popleft()
            worker.job = job
            self._busy.append(worker)
            loop = asyncio.get_running_loop()
            worker.timer = loop.call_later(self.timeout_s, self._expire, worker)
            loop.add_reader(worker.conn.fileno(), self._on_reply, worker)
            worker.submit(job)
            log.info("grammar_compile_started", grammar_id=f"{job.grammar_id:016x}", pid=worker.proc.pid,
                     queued=len(self._queue))

    def _free_worker(self) -> _Worker | None:
        if self._idle:
            return self._idle.pop()
        if len(self._busy) < self.workers:
            return _Worker((self.texts, self.ring_name, self.budget))
        return None

    def _finish(self, worker: _Worker, result: Refusal | None, keep: bool) -> None:
        """``worker``'s job is over with ``result``; the worker goes back idle, or is killed."""
        asyncio.get_running_loop().remove_reader(worker.conn.fileno())
        if worker.timer is not None:
            worker.timer.cancel()
        self._busy.remove(worker)
        job, worker.job = worker.job, None
        if keep:
            self._idle.append(worker)
        else:
            worker.kill()
        fut = self._futures.pop(job.grammar_id, None) if job is not None else None
        if fut is not None and not fut.done():
            fut.set_result(result)
        self._dispatch()

    def _on_reply(self, worker: _Worker) -> None:
        try:
            result = worker.conn.recv()
        except Exception:  # noqa: BLE001 - a dead worker, or a reply that does not unpickle
            log.error("grammar_worker_died", pid=worker.proc.pid, exitcode=worker.proc.poll())
            self._finish(worker, Refusal("the grammar compiler stopped while compiling this grammar",
                                         "compile", final=False), keep=False)
            return
        self._finish(worker, result, keep=True)

    def _expire(self, worker: _Worker) -> None:
        worker.timer = None
        self._finish(worker, Refusal(f"the grammar did not compile within {self.timeout_s:g} s", "timeout",
                                     final=False), keep=False)

    def _abandon(self, grammar_id: int) -> None:
        """No request waits for ``grammar_id`` any more: forget it, and stop its compile if one runs."""
        fut = self._futures.pop(grammar_id, None)
        if fut is not None:
            fut.cancel()
        for job in self._queue:
            if job.grammar_id == grammar_id:
                self._queue.remove(job)
                return
        for worker in self._busy:
            if worker.job is not None and worker.job.grammar_id == grammar_id:
                log.info("grammar_compile_cancelled", grammar_id=f"{grammar_id:016x}")
                self._finish(worker, None, keep=False)
                return


if __name__ == "__main__":  # run from the module's own name, so what it sends unpickles in the gateway
    from dpu_gateway import grammar_pool

    grammar_pool.worker_main(int(sys.argv[1]))
