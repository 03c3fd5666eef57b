"""Gateway resident memory across storms of concurrent requests against a full server.

    python -m bench.conn_storm --sizes 1000,3000,6000,3000,1000,6000,6000

Starts ``blink serve`` (the CPU engine, 8 slots, 16 waiting), then for each size sends that many requests at
once (half streamed) and records every answer's status and the gateway's resident memory one second after the
storm. Most requests find the server full and get 429. Memory that follows the largest storm so far and stays
put when the same storm comes again is the allocator keeping its high-water mark; memory that grows with every
storm would be a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from harness.serve_proc import ServeProc, rss_kib
from harness.sse import request_body

SERVE_ARGS = ("--max-output-tokens", "8", "--max-prompt-tokens", "64", "--num-slots", "8", "--max-waiting", "16")


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> str:
    try:
        async with session.post(url + "/v1/completions", json=request_body([300, 301, 302, 303], 2, stream)) as resp:
            await resp.read()
            return str(resp.status)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return type(exc).__name__


async def storm(url: str, size: int) -> dict[str, int]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        answers = await asyncio.gather(*(one(session, url, k % 2 == 0) for k in range(size)))
    return dict(collections.Counter(answers))


def run(sizes: list[int], run_root: Path) -> dict[str, Any]:
    serve = ServeProc(SERVE_ARGS, run_root).start()
    rows = []
    try:
        gateway = serve.children()["gateway-0"]
        start_kib = rss_kib(gateway) or 0
        for size in sizes:
            t0 = time.monotonic()
            answers = asyncio.run(storm(serve.url, size))
            time.sleep(1.0)
            rows.append({"size": size, "seconds": round(time.monotonic() - t0, 1), "answers": answers,
                         "gateway_rss_mib": round((rss_kib(gateway) or 0) / 1024, 1)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.stop()
    return {"serve_args": list(SERVE_ARGS), "gateway_rss_start_mib": round(start_kib / 1024, 1), "storms": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.conn_storm", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,3000,6000,3000,1000,6000,6000", help="requests per storm, in order")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="blink-storm-") as tmp:
        result = run(sizes, Path(tmp))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
