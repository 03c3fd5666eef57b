"""The frontend's CPU for each streamed token, service by service, on the CPU: ``blink serve`` with the test suite's
echo engine (``tests/helpers/fake_engine.py``: a step every ``--step-ms``, a token per running request, no
wake-up for the reader, so the reader polls as it does beside the persistent engine) and ``--streams`` clients of
the real ``openai`` package streaming chat answers of ``--max-tokens`` tokens for ``--duration-s``.

    python -m bench.frontend_cpu [--streams 32] [--duration-s 20] [--out bench/results/frontend_cpu.json]

Each service's CPU (user + system, from /proc) over the run, divided by the tokens the clients received. The
engine here is a stand-in; what is measured is the gateway, reader, tracker and tokenizer around it. Under a
co-tenant that takes the cores, this is the CPU those services must win back for every token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.serve_proc import ServeProc, cpu_seconds


def sample(serve: ServeProc) -> dict[str, float]:
    """CPU seconds so far of each of the server's processes, by role (``ServeProc.pids``)."""
    return {role: t for role, pid in serve.pids().items() if (t := cpu_seconds(pid)) is not None}


async def drive(url: str, streams: int, duration_s: float, max_tokens: int, prompt: str) -> int:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    end = time.monotonic() + duration_s
    tokens = 0

    async def one() -> None:
        nonlocal tokens
        while time.monotonic() < end:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:  # tokens as the server counts them: a chunk may carry several
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens

    await asyncio.gather(*(one() for _ in range(streams)))
    await client.close()
    return tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work:
        serve = ServeProc(("--num-slots", str(args.num_slots)), Path(work),
                          env={"FAKE_ENGINE_STEP_MS": str(args.step_ms)}, engine_module="tests.helpers.fake_engine")
        serve.start()
        try:
            prompt = " ".join(f"word{i}" for i in range(args.prompt_words))
            asyncio.run(drive(serve.url, min(args.streams, 4), 2.0, 8, prompt))  # warm: first requests
            before, t0 = sample(serve), time.monotonic()
            tokens = asyncio.run(drive(serve.url, args.streams, args.duration_s, args.max_tokens, prompt))
            after, wall = sample(serve), time.monotonic() - t0
        finally:
            serve.stop()
    used = {role: after[role] - before[role] for role in sorted(after) if role in before}
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "cpu_s": {k: round(v, 3) for k, v in used.items()},
            "us_per_token": {k: round(v / max(tokens, 1) * 1e6, 2) for k, v in used.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.frontend_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--step-ms", type=float, default=5.0, help="the echo engine's step")
    ap.add_argument("--num-slots", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench/results/frontend_cpu.json"))
    args = ap.parse_args(argv)
    result = run(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"frontend CPU per streamed token: {result['tokens']} tokens in {result['wall_s']} s "
          f"({result['tokens_per_s']}/s), {args.streams} streams, commit {commit}")
    print("| service | CPU s | us a token |")
    print("| --- | --- | --- |")
    for name, used in result["cpu_s"].items():
        print(f"| {name} | {used:.2f} | {result['us_per_token'][name]:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"commit": commit, "machine": platform.machine(), "cores": os.cpu_count(),
           "settings": {k: v for k, v in vars(args).items() if k != "out"}, **result}
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
