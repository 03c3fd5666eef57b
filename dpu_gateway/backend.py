"""A gateway process's links to the tokenizer, the slot tracker and the token reader.

Each link is kept up by its own task: connect (waiting for the service), run, and when the
peer goes away fail what depended on it, then reconnect. A request's events (tokens,
finish, failure) arrive on its ``RequestStream`` queue; the stream is registered before the
request is submitted, so no token can arrive before there is somewhere to put it.

A lost reader link fails nothing at once: the streams wait up to ``reattach_s`` for the next reader,
whose hello names them with the tokens each received; that reader sends the rest (docs/DEPLOY.md).
Tokens a stream already has are dropped by position (``Tokens.at``), so none is seen twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpu_gateway.errors import APIError
from shared import ipc
from shared import messages as m
from shared.log import get_logger

log = get_logger("gateway")
Event = m.Tokens | m.Finished | m.Failed
REATTACH_S = 10.0  # how long streams wait for a new token reader before they fail
READER_GONE = "the token reader went away"


@dataclasses.dataclass(slots=True, eq=False)  # identity: streams live in sets
class RequestStream:
    req_id: int
    events: asyncio.Queue[Event] = dataclasses.field(default_factory=asyncio.Queue)
    admitted: asyncio.Future[int] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    done: bool = False
    received: int = 0  # output tokens put on ``events``
    link_pos: int = 0  # where the next Tokens without ``at`` starts (from a reader of an earlier build)
    engine: int = 0  # the engine whose ring holds it (``Admitted``), for the per-engine metrics
    # time.monotonic_ns() when it was handed to the tracker, and when the tracker said it sits in a ring slot: its
    # wait before the ring, the gateway's part of its queue time (the engine's part is on the engine's clock)
    submitted_ns: int = 0
    placed_ns: int = 0

    def placed(self) -> bool:
        """Admitted into a ring, or already streaming: a new reader can find it there."""
        ok = self.admitted.done() and not self.admitted.cancelled() and self.admitted.exception() is None
        return ok or self.received > 0

    def fresh(self, msg: m.Tokens) -> Event | None:
        """What of ``msg`` this stream lacks (a re-attached reader may start before what it has),
        None if nothing; a gap (tokens skipped) is a ``Failed``."""
        at = msg.at if msg.at >= 0 else self.link_pos
        self.link_pos = at + len(msg.ids)
        skip = self.received - at
        if skip < 0:
            return m.Failed(self.req_id, 500, f"tokens {self.received}..{at - 1} of the stream were lost")
        if skip >= len(msg.ids):
            return None
        self.received = self.link_pos
        if skip == 0:
            return msg
        return m.Tokens(msg.req_id, msg.ids[skip:], msg.logprobs[skip:] if msg.logprobs else msg.logprobs,
                        msg.top[skip:] if msg.top else msg.top, at=at + skip)


def default_gateway_id() -> int:
    """This process's id among the gateways (the top bits of its request ids): its pid, made distinct
    across PID namespaces by the namespace's inode, since every container's first process is pid 1
    (gateways of one namespace keep distinct ids: the mix is a bijection of the pid's low 24 bits)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return (os.getpid() ^ ns * 0x9E3779B1) & 0xFFFFFF


class Backend:
    def __init__(self, run_dir: Path, gateway_id: int | None = None, reattach_s: float = REATTACH_S) -> None:
        self.run_dir = run_dir
        self.reattach_s = reattach_s
        self._reader_links = 0  # reader links made so far: a re-attach timer checks none came since
        self.gateway_id = (default_gateway_id() if gateway_id is None else gateway_id) & 0xFFFFFF
        self._ids = itertools.count(1)
        self.links: dict[str, ipc.Channel | None] = {"tokenizer": None, "tracker": None, "reader": None}
        self._linked = {name: asyncio.Event() for name in self.links}
        self.encodes: dict[int, asyncio.Future[list[int]]] = {}
        self.streams: dict[int, RequestStream] = {}
        self._tasks: list[asyncio.Task] = []

    def next_id(self) -> int:
        return self.gateway_id << 40 | next(self._ids) & (2**40 - 1)

    # ------------------------------------------------------------ links
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._keep("tokenizer", m.FromTokenizer, self._on_tokenizer, self._tokenizer_down)),
            asyncio.create_task(self._keep("tracker", m.FromTracker, self._on_tracker, self._tracker_down)),
            asyncio.create_task(self._keep("reader", m.FromReader, self._on_reader, self._reader_down)),
        ]

    async def wait_linked(self) -> None:
        await asyncio.gather(*(e.wait() for e in self._linked.values()))

    def linked(self) -> bool:
        return all(e.is_set() for e in self._linked.values())

    async def _keep(self, name: str, inbound: Any, on_msg: Callable[[Any], None],
                    on_down: Callable[[], None]) -> None:
        while True:
            chan = await ipc.connect(self.run_dir, name, inbound)
            if name == "reader":
                chan.send(self._hello())
            self.links[name] = chan
            self._linked[name].set()
            try:
                while True:
                    for msg in await chan.recv():
                        on_msg(msg)
            except ipc.LinkClosed:
                log.warning("link_lost", service=name)
            finally:
                self.links[name] = None
                self._linked[name].clear()
                on_down()

    def _send(self, name: str, msg: Any) -> None:
        chan = self.links[name]
        if chan is None:
            raise APIError(503, f"the {name} service is not available", code="service_unavailable")
        chan.send(msg)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for chan in self.links.values():
            if chan is not None:
                chan.close()

    # ------------------------------------------------------------ tokenizer
    async def encode(self, text: str, add_special: bool) -> list[int]:
        req_id = self.next_id()
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self.encodes[req_id] = fut
        try:
            self._send("tokenizer", m.Encode(req_id, text, add_special))
            return await fut
        finally:
            self.encodes.pop(req_id, None)

    def _on_tokenizer(self, msg: m.Encoded | m.EncodeFailed) -> None:
        fut = self.encodes.get(msg.req_id)
        if fut is None or fut.done():
            return
        if isinstance(msg, m.Encoded):
            fut.set_result(msg.ids)
        else:
            fut.set_exception(APIError(400, msg.message, code="tokenizer_error"))

    def _tokenizer_down(self) -> None:
        for fut in self.encodes.values():
            if not fut.done():
                fut.set_exception(APIError(503, "the tokenizer service went away", code="service_unavailable"))

    # ------------------------------------------------------------ tracker and reader
    async def submit(self, prompt: list[int], sampling: m.Sampling) -> RequestStream:
        """Hand a request to the tracker; returns once it sits in a ring slot."""
        stream = RequestStream(self.next_id())
        self.streams[stream.req_id] = stream
        try:
            if self.links["reader"] is None:
                raise APIError(503, "the token reader service is not available", code="service_unavailable")
            stream.submitted_ns = time.monotonic_ns()
            self._send("tracker", m.Submit(stream.req_id, self.gateway_id, prompt, sampling))
            await stream.admitted
        except BaseException:
            self.forget(stream, cancel=True)
            raise
        return stream

    def forget(self, stream: RequestStream, *, cancel: bool) -> None:
        """The request is over for this gateway; ``cancel`` asks the engine to stop it too."""
        self.streams.pop(stream.req_id, None)
        if cancel and not stream.done and self.links["tracker"] is not None:
            self.links["tracker"].send(m.Cancel(stream.req_id))
        stream.done = True

    def _on_tracker(self, msg: m.Admitted | m.Rejected) -> None:
        stream = self.streams.get(msg.req_id)
        if stream is None or stream.admitted.done():
            return
        if isinstance(msg, m.Admitted):
            stream.engine, stream.placed_ns = msg.engine, time.monotonic_ns()
            stream.admitted.set_result(msg.slot)
            return
        stream.done = True
        retry = msg.retry_after_s if msg.status in (429, 503) else None
        stream.admitted.set_exception(APIError(msg.status, msg.message, retry_after_s=retry))

    def _tracker_down(self) -> None:
        for stream in self.streams.values():
            if not stream.admitted.done():
                stream.admitted.set_exception(APIError(503, "the slot tracker went away", retry_after_s=1))

    def _on_reader(self, msg: Event) -> None:
        stream = self.streams.get(msg.req_id)
        if stream is None or stream.done:
            return
        event = stream.fresh(msg) if isinstance(msg, m.Tokens) else msg
        if event is None:
            return
        if not isinstance(event, m.Tokens):
            stream.done = True
        stream.events.put_nowait(event)

    def _hello(self) -> m.GatewayHello:
        """The hello for a new reader link: the streams to go on with, and how many tokens each has."""
        self._reader_links += 1
        live = [s for s in self.streams.values() if not s.done and s.placed()]
        for stream in self.streams.values():
            stream.link_pos = 0
        if live:
            log.info("streams_reattached", streams=len(live))
        return m.GatewayHello(self.gateway_id, [m.Resume(s.req_id, s.received) for s in live])

    def _reader_down(self) -> None:
        """The streams wait for the next reader; if none has linked ``reattach_s`` later, they fail."""
        links = self._reader_links
        asyncio.get_running_loop().call_later(self.reattach_s, self._reattach_expired, links)

    def _reattach_expired(self, links: int) -> None:
        if self._reader_links != links:
            return  # a reader linked since: it has the streams (or failed those it could not find)
        for stream in self.streams.values():  # not marked done: forgetting them cancels their slots
            stream.events.put_nowait(m.Failed(stream.req_id, 503, READER_GONE))
