"""Blink's embedded CPU mode against llama.cpp's ``llama-server`` and ``transformers``, on the same GGUF.

llama.cpp is built from the source tree that PyPI's ``llama-cpp-python`` sdist carries in
``vendor/llama.cpp`` (CPU, ``GGML_NATIVE``, ``llama-server`` only), cached under ``.cache/llama_cpp``.
The two servers run one at a time, each spoken to by the same client with the same requests (streaming
``/v1/completions``, token-id prompts, greedy, ``ignore_eos``): one stream's decode tokens/s (the median of
three 128-token streams), one stream's TTFT on a 33-token prompt (the median of nine), 8 concurrent streams'
total output tokens/s, a 1,969-token prompt's prefill tokens/s, and the memory of all the server's processes:
PSS (a page that k of them map counts 1/k in each, so the sum is what they take of the machine) and, beside it,
their RSS summed (a shared page counted in every process that maps it: the shared libraries, Blink's shared
weights file). Each server is measured once it has settled (``wait_settled``: its processes under a quarter of a
core for 5 s after it answers).
``transformers`` ``generate`` runs in-process on the same weights dequantized to fp32. Blink runs as its default
(``blink``: the GGUF's Q4_1 linears kept as its Q4_1 blocks, fp32 arithmetic, the kernels' pool on every
core, the frontend sharing them), with ``--cpu-weights int8act`` (``blink_int8act``: the same weights times
int8-quantized activations), with ``--threads 1`` (``blink_threads1``: one engine thread, a core left to the
frontend) and, on request, with ``--cpu-weights int4`` (``blink_int4``).

    python -m bench.cpu_peer                      # build (once), run all four, write the JSON
    python -m bench.cpu_peer --only blink         # one side (the others' columns stay null)
    python -m bench.cpu_peer --only blink --only llama_cpp --rounds 3   # alternated three times, medians
    python -m bench.cpu_peer --only blink_int8act --smoke   # a few tokens per row: checks the run, not the speed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from harness.serve_proc import cpu_seconds

LLAMA_CPP_PYTHON = "0.3.36"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "llama_cpp"
OUT = ROOT / "bench" / "results" / "cpu_peer.json"
DECODE_TOKENS, TTFT_PROMPT, CONCURRENT, LONG_PROMPT = 128, 33, 8, 1969
ROWS = (  # metric, unit, higher_is_better
    ("one stream decode", "tokens/s", True),
    ("one stream TTFT (33-token prompt)", "ms", False),
    ("8 concurrent streams, total output", "tokens/s", True),
    ("1,969-token prompt prefill", "tokens/s", True),
    ("memory, all processes (PSS)", "MiB", False),
    ("resident memory summed over processes (RSS)", "MiB", False),
)


# ---------------------------------------------------------------------- llama.cpp build
def build_llama_server(pin: str = LLAMA_CPP_PYTHON) -> Path:
    """``llama-server`` built from the ``llama-cpp-python==pin`` sdist's vendored llama.cpp (cached)."""
    binary = CACHE / f"build-{pin}" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    src = _unpack_sdist(pin) / "vendor" / "llama.cpp"
    build = CACHE / f"build-{pin}"
    nice = ["nice", "-n", "19"]
    subprocess.run(nice + ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                           "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_CUDA=OFF"], check=True)
    subprocess.run(nice + ["cmake", "--build", str(build), "--target", "llama-server", "-j",
                           str(os.cpu_count() or 2)], check=True)
    if not binary.is_file():
        raise RuntimeError(f"build finished but {binary} is missing")
    return binary


def _unpack_sdist(pin: str) -> Path:
    tree = CACHE / f"llama_cpp_python-{pin}"
    if (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    f"llama-cpp-python=={pin}", "-d", str(CACHE)], check=True)
    archive = next(CACHE.glob(f"llama_cpp_python-{pin}.tar.gz"))
    shutil.unpack_archive(str(archive), str(CACHE))
    return tree


# ---------------------------------------------------------------------- servers
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama(binary: Path, gguf: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    slot_ctx = 2048  # each of the 8 slots holds the 1,969-token prompt; llama.cpp allocates its KV up front
    return subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(threads), "-np", str(CONCURRENT), "-c", str(slot_ctx * CONCURRENT),
                             "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_blink(port: int, run_dir: Path, *flags: str) -> subprocess.Popen[bytes]:
    # a ring of its own: another Blink on the machine (on the default ring) is neither stopped nor measured
    ring = f"blink-peer-{os.getpid()}-{port}"
    return subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--port", str(port), "--run-dir", str(run_dir),
                             "--ring", ring, "--max-prompt-tokens", "2048", "--max-output-tokens", "256", *flags],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


BLINK_SIDES = {"blink": (), "blink_int8act": ("--cpu-weights", "int8act"), "blink_threads1": ("--threads", "1"),
               "blink_int4": ("--cpu-weights", "int4")}  # column -> extra `blink serve` flags


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def memory_mib(pids: list[int]) -> dict[str, float]:
    """The memory of these processes: ``pss``, each page counted once however many of them map it (a page
    mapped by k processes counts 1/k in each: the machine's memory they take), and ``rss``, every process's
    resident pages summed (a page they share counted in each: the shared libraries, a shared weights file)."""
    total = {"pss": 0, "rss": 0}
    for p in pids:
        try:
            lines = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Rss"):
                total[key.lower()] += int(rest.split()[0])  # kB
    return {k: v / 1024 for k, v in total.items()}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants."""
    return sum(cpu_seconds(p) or 0.0 for p in tree_pids(pid))


def wait_settled(pid: int, quiet_s: float = 5.0, busy_below: float = 0.25, timeout_s: float = 180) -> None:
    """Wait until the server's processes have used less than ``busy_below`` of a core for ``quiet_s`` in a row
    (an idle Blink polls its rings: a few percent of a core): what a server starts after it answers is not
    measured as its speed (Blink's standby engine loads its weights once the engines have idled 2 s: seconds of
    a core, that the first rows took otherwise)."""
    deadline = time.monotonic() + timeout_s
    quiet_since, last = time.monotonic(), tree_cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now, used = time.monotonic(), tree_cpu_s(pid)
        if used - last > busy_below * 0.5:
            quiet_since = now
        last = used
        if now - quiet_since >= quiet_s:
            return
    raise RuntimeError(f"server {pid} still busy after {timeout_s} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------- the client
async def stream(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                 max_tokens: int) -> list[float]:
    """Arrival times (perf_counter) of the streamed tokens of one greedy ``ignore_eos`` completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices"):
                times.append(time.perf_counter())
    return times


async def measure_server(url: str, model: str, prompts: dict[str, list[int]],
                         memory: Callable[[], dict[str, float]]) -> dict[str, float]:
    # a new connection per request: llama-server closes idle keep-alive connections under the client
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=connector) as s:
        await stream(s, url, model, prompts["short"], 8)  # warm-up
        decodes = []
        for _ in range(3):
            t = await stream(s, url, model, prompts["short"], DECODE_TOKENS)
            decodes.append((len(t) - 1) / (t[-1] - t[0]))
        decode = float(np.median(decodes))
        ttfts = []
        for _ in range(9):
            t0 = time.perf_counter()
            first = await stream(s, url, model, prompts["short"], 1)
            ttfts.append((first[0] - t0) * 1e3)
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(stream(s, url, model, prompts[f"c{i}"], DECODE_TOKENS)
                                      for i in range(CONCURRENT)))
        concurrent = sum(len(r) for r in runs) / (max(r[-1] for r in runs) - t0)
        t0 = time.perf_counter()
        first = await stream(s, url, model, prompts["long"], 1)
        prefill = LONG_PROMPT / (first[0] - t0)
        return {"decode": decode, "ttft": float(np.median(ttfts)), "concurrent": concurrent, "prefill": prefill,
                **memory()}


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> str:
    """The served model name once ``/health`` and ``/v1/models`` answer."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:  # both servers answer /health with 200 once they can serve
            with urllib.request.urlopen(url + "/health", timeout=2):
                pass
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                return str(json.load(r)["data"][0]["id"])
        except (OSError, KeyError, IndexError, ValueError):
            time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def run_server(proc: subprocess.Popen[bytes], port: int, prompts: dict[str, list[int]]) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    try:
        model = wait_ready(url, proc)
        wait_settled(proc.pid)
        return asyncio.run(measure_server(url, model, prompts, lambda: memory_mib(tree_pids(proc.pid))))
    finally:
        stop(proc)


# ---------------------------------------------------------------------- transformers, in-process
def run_transformers(gguf: Path, prompts: dict[str, list[int]], threads: int) -> dict[str, float]:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32).eval()

    def generate(ids: list[list[int]], n: int) -> float:
        x = torch.tensor(ids, dtype=torch.int64)
        t0 = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        return time.perf_counter() - t0

    with torch.inference_mode():
        generate([prompts["short"]], 4)
        ttft = float(np.median([generate([prompts["short"]], 1) for _ in range(5)]))
        decode = (DECODE_TOKENS - 1) / (generate([prompts["short"]], DECODE_TOKENS) - ttft)
        batch = [prompts[f"c{i}"] for i in range(CONCURRENT)]
        concurrent = CONCURRENT * DECODE_TOKENS / generate(batch, DECODE_TOKENS)
        prefill = LONG_PROMPT / generate([prompts["long"]], 1)
    return {"decode": decode, "ttft": ttft * 1e3, "concurrent": concurrent, "prefill": prefill,
            **memory_mib([os.getpid()])}


# ---------------------------------------------------------------------- main
def make_prompts(vocab: int = 49152) -> dict[str, list[int]]:
    """Fixed token-id prompts (ordinary-token range, seeded): the same requests for every server."""
    rng = np.random.default_rng(0)
    draw = lambda n: [1] + rng.integers(200, vocab - 200, n - 1).tolist()  # noqa: E731 - BOS then tokens
    out = {"short": draw(TTFT_PROMPT), "long": draw(LONG_PROMPT)}
    out.update({f"c{i}": draw(TTFT_PROMPT) for i in range(CONCURRENT)})
    return out


SIDES = ("blink", "blink_int8act", "blink_threads1", "blink_int4", "llama_cpp", "transformers")
DEFAULT_SIDES = ("blink", "blink_int8act", "blink_threads1", "llama_cpp", "transformers")


def table(result: dict[str, Any]) -> str:
    lines = [f"{'metric':40s} {'unit':9s} " + " ".join(f"{side:>12s}" for side in SIDES)]
    for r in result["rows"]:
        cells = [f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in SIDES]
        lines.append(f"{r['metric']:40s} {r['unit']:9s} " + " ".join(f"{c:>12s}" for c in cells))
    return "\n".join(lines)


def rows_of(results: dict[str, dict[str, float] | None]) -> list[dict[str, Any]]:
    keys = ("decode", "ttft", "concurrent", "prefill", "pss", "rss")
    return [{"metric": m, "unit": u, "higher_is_better": h,
             **{side: (None if res is None else round(res[k], 2)) for side, res in results.items()}}
            for (m, u, h), k in zip(ROWS, keys, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=SIDES, action="append")
    ap.add_argument("--smoke", action="store_true", help="4 tokens per decode row, a 65-token long prompt")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp and transformers threads")
    ap.add_argument("--rounds", type=int, default=1, help="each server measured this many times, alternated with the "
                    "others; the rows are the medians, every round's figures in per_round (transformers: once)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--note", default="", help="written into the JSON (e.g. how busy the machine was)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from gpu_engine.models.loader import default_model_path  # noqa: PLC0415 - after the path is set

    if args.smoke:
        global DECODE_TOKENS, LONG_PROMPT
        DECODE_TOKENS, LONG_PROMPT = 4, 65
    gguf, prompts, sides = default_model_path(), make_prompts(), args.only or list(DEFAULT_SIDES)
    binary = build_llama_server() if "llama_cpp" in sides else None
    rounds: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):  # the servers alternated: a slow spell of a shared machine falls on all of them
        if binary is not None:
            port = free_port()
            rounds["llama_cpp"].append(run_server(start_llama(binary, gguf, port, args.threads), port, prompts))
        for side, flags in BLINK_SIDES.items():
            if side in sides:
                port = free_port()
                with tempfile.TemporaryDirectory(prefix="blink-peer-") as run_dir:
                    rounds[side].append(run_server(start_blink(port, Path(run_dir), *flags), port, prompts))
    if "transformers" in sides:
        rounds["transformers"].append(run_transformers(gguf, prompts, args.threads))
    results = {side: ({k: float(np.median([r[k] for r in got])) for k in got[0]} if got else None)
               for side, got in rounds.items()}
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"load average {os.getloadavg()[0]:.1f} at the end. {args.note}".strip(),
              "rounds": args.rounds, "rows": rows_of(results),
              "per_round": {side: [{k: round(v, 2) for k, v in r.items()} for r in got]
                            for side, got in rounds.items() if got}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
