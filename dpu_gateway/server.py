"""The gateway process: serve the app on host:port (SO_REUSEPORT) until SIGTERM/SIGINT, then drain."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from aiohttp import web

from dpu_gateway.app import create_app
from dpu_gateway.state import BACKEND, GatewayConfig
from shared import ipc
from shared.log import get_logger

log = get_logger("gateway")


async def _mark_ready_when_linked(app: web.Application, cfg: GatewayConfig, name: str) -> None:
    await app[BACKEND].wait_linked()
    ipc.mark_ready(cfg.run_dir, name)
    log.info("gateway_ready", name=name)


async def run_gateway(cfg: GatewayConfig, host: str, port: int, name: str = "gateway") -> None:
    app = create_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=cfg.drain_timeout_s + 5,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=True)
    await site.start()
    log.info("gateway_listening", host=host, port=port, model=cfg.served_model_name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.create_task(_mark_ready_when_linked(app, cfg, name))
    try:
        await stop.wait()
        log.info("gateway_draining")
    finally:
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ready
        ipc.clear_ready(cfg.run_dir, name)
        await runner.cleanup()
