"""The tokenizer service: turns prompt text into token ids for the gateways.

Gateways send ``Encode`` messages over ``tokenizer.sock``; every request that arrived while
the previous batch was being encoded is encoded in one ``encode_batch`` call, and each
gateway gets its answers back in one frame. Encoding runs in a worker thread so the socket
keeps accepting (that is what fills the next batch).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from dpu_tokenizer import Tokenizer, TokenizerError, load_tokenizer
from dpu_tokenizer.sources import default_model_path
from shared import ipc
from shared import messages as m
from shared.log import get_logger

log = get_logger("tokenizer")


def resolve_model(model: str | None) -> str:
    """The model path to serve: the given one, or the embedded default model's file."""
    if model:
        return model
    try:
        return str(default_model_path())
    except TokenizerError as exc:
        raise SystemExit(f"no --model given: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizerServiceConfig:
    run_dir: Path
    model: str


class TokenizerService:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pending: list[tuple[ipc.Channel, m.Encode]] = []
        self._wake = asyncio.Event()
        self.batches = 0

    async def on_channel(self, chan: ipc.Channel) -> None:
        try:
            while True:
                msgs = await chan.recv()  # before touching self.pending: the loop swaps it meanwhile
                self.pending.extend((chan, msg) for msg in msgs)
                self._wake.set()
        except ipc.LinkClosed:
            pass

    async def loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self.pending = self.pending, []
            if batch:
                await asyncio.to_thread(self.encode_and_reply, batch)

    def encode_and_reply(self, batch: list[tuple[ipc.Channel, m.Encode]]) -> None:
        self.batches += 1
        replies: list[tuple[ipc.Channel, Any]] = []
        for add_special in (True, False):
            part = [(chan, msg) for chan, msg in batch if msg.add_special is add_special]
            if part:
                replies.extend(self._encode_part(part, add_special))
        loop_call = self._loop.call_soon_threadsafe
        for chan, reply in replies:
            loop_call(chan.send, reply)

    def _encode_part(self, part: list[tuple[ipc.Channel, m.Encode]], add_special: bool) -> list[tuple[Any, Any]]:
        try:
            ids = self.tokenizer.encode_batch([msg.text for _, msg in part], add_special_tokens=add_special)
            return [(chan, m.Encoded(msg.req_id, i)) for (chan, msg), i in zip(part, ids, strict=True)]
        except Exception as exc:  # a bad text must not take the service down
            log.exception("encode_failed", n=len(part))
            return [(chan, m.EncodeFailed(msg.req_id, f"tokenizer error: {exc}")) for chan, msg in part]

    async def run(self, cfg: TokenizerServiceConfig) -> None:
        self._loop = asyncio.get_running_loop()
        server = await ipc.serve(cfg.run_dir, "tokenizer", m.ToTokenizer, self.on_channel)
        ipc.mark_ready(cfg.run_dir, "tokenizer")
        log.info("tokenizer_ready", model=cfg.model)
        try:
            await self.loop()
        finally:
            ipc.clear_ready(cfg.run_dir, "tokenizer")
            server.close()


def load_encoder(model: str | None) -> Tokenizer:
    """The tokenizer with its encoder built now (a C encoder is otherwise built at the first request)."""
    tokenizer = load_tokenizer(model)
    log.info("encoder", c_encoder=bool(getattr(tokenizer, "native", False)))
    return tokenizer


async def run_tokenizer(cfg: TokenizerServiceConfig) -> None:
    tokenizer = await asyncio.to_thread(load_encoder, cfg.model)
    await TokenizerService(tokenizer).run(cfg)
