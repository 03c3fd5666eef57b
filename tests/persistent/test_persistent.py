"""The persistent scheduler on the GPU, against the host-driven mode and the CPU engine.

Small fp32 Llama with random weights; requests go through the ring exactly as the slot tracker
writes them. Marked gpu: skipped without CUDA, run by scripts/gpu_run.sh on the GPU machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from harness.ring_driver import Driver, Job, Result, random_jobs, start_engine, stop_engine, wait_ready
from shared import ring_layout as L
from shared.config import DEFAULT_GPU_MEMORY_UTILIZATION
from shared.messages import Sampling
from shared.ring import Ring
from shared.transport import SHM_DIR

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
F = L.FinishReason
VOCAB = 512
ENGINE_ARGS = ("--dtype", "float32", "--num-slots", "256", "--max-prompt-tokens", "256", "--max-output-tokens",
               "4352", "--max-batch", "64", "--kv-blocks", "6000", "--block-size", "16", "--top-logprobs", "2")
OUT = Path(os.environ.get("BLINK_GPU_OUT", "/tmp/blink-gpu-out"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_llama_gpu")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def settled_header(ring: Ring, timeout: float = 30.0) -> np.void:
    """The header once the engine's stats caught up (they are published with the heartbeat)."""
    end = time.time() + timeout
    while True:
        h = ring.read_header()
        st = h["stats"]
        if (st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == 0) or time.time() > end:
            return h
        time.sleep(0.05)


def sampling_jobs(n: int, seed: int) -> list[Job]:
    """Greedy, plain-temperature and top-k/top-p requests, seeded, some cancelled."""
    base = random_jobs(n, VOCAB, seed=seed, max_prompt=120, max_new=64, cancel_frac=0.1)
    out = []
    for k, j in enumerate(base):
        kind = k % 3
        out.append(dataclasses.replace(j, temperature=0.0 if kind == 0 else 0.8, seed=1000 + k,
                                       top_p=0.9 if kind == 2 else 1.0, top_k=40 if kind == 2 else 0))
    return out


def serve_jobs(model: Path, backend: str, jobs: list[Job], window: int, tag: str,
               engine_args: tuple[str, ...] = ENGINE_ARGS, minor0_every: int = 0,
               burst: bool = False) -> tuple[dict[int, Result], dict]:
    """Every job's result and the ring's stats at the end; the engine's log in OUT/engine-{tag}-{backend}.log.
    ``burst``: the jobs ring the doorbell once (``Driver``)."""
    name = f"blink-gpu-{backend}-{uuid.uuid4().hex[:6]}"
    OUT.mkdir(parents=True, exist_ok=True)
    proc = start_engine(name, model, backend, *engine_args, log=OUT / f"engine-{tag}-{backend}.log")
    ring = wait_ready(name, proc)
    try:
        results = Driver(ring, window, minor0_every, burst=burst).run(jobs, timeout=480)
        header = settled_header(ring)
        stats = {k: int(header["stats"][k]) for k in ("kv_blocks_total", "kv_blocks_free", "steps",
                                                       "window_relaunches", "preemptions", "output_tokens")}
        stats["prefix_cache_hits"] = int(header["prefix_cache_hits"])
        stats |= {k: int(header[k]) for k in ("step_tokens", "padded_tokens")}  # schema minor 7
        stats["cache"] = {k: header[k].item() for k in ("kv_block_size", "kv_cache_dtype", "cache_features",
                                                         "prefix_hash", "gpu_memory_utilization")}
        rc = stop_engine(ring, proc)
        stats["exit_code"] = rc
        stats["segment_left"] = (SHM_DIR / name).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        ring.close()
    return results, stats


def scheduler_counters(log: Path) -> dict:
    """The persistent scheduler's counters from the engine's "scheduler exited" log line (JSON lines)."""
    for line in log.read_text(errors="replace").splitlines():
        if "scheduler exited" in line:
            return json.loads(line)
    raise AssertionError(f"no 'scheduler exited' line in {log}")


def test_host_driven_matches_cpu_engine(tiny: Path) -> None:
    jobs = random_jobs(48, VOCAB, seed=1, max_prompt=200, max_new=40, cancel_frac=0.0)
    cpu, _ = serve_jobs(tiny, "cpu", jobs, window=16, tag="equal")
    host, stats = serve_jobs(tiny, "host", jobs, window=16, tag="equal")
    diff = [j.rid for j in jobs if cpu[j.rid].tokens != host[j.rid].tokens]
    assert not diff, f"{len(diff)} of {len(jobs)} requests differ between the CPU engine and the host-driven mode"
    assert all(len(host[j.rid].tokens) == j.max_new for j in jobs)
    # the steps' tokens: every prompt token and every output token but each request's last, once
    assert stats["step_tokens"] == sum(len(j.prompt) + j.max_new - 1 for j in jobs), stats
    assert 0 < stats["padded_tokens"] < stats["step_tokens"], stats  # graphs of at most twice a step's tokens
    assert stats["exit_code"] == 0 and not stats["segment_left"]


@dataclasses.dataclass(frozen=True)
class FieldJob(Job):
    """A driver job with more sampling fields (penalties, logit_bias, min_tokens)."""

    fields: tuple[tuple[str, object], ...] = ()

    def sampling(self) -> Sampling:
        return msgspec.structs.replace(super().sampling(), **dict(self.fields))


def with_device_features(jobs: list[Job], seed: int) -> list[Job]:
    """Every third job behind one of four shared system prompts (the prefix cache's hits), every fifth with a
    processor (repetition, frequency + presence, a logit_bias ban)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, VOCAB, size=k).astype(np.int32) for k in (33, 64, 80, 100)]
    kinds = ((("repetition_penalty", 1.5),), (("frequency_penalty", 0.8), ("presence_penalty", 0.3)),
             (("logit_bias", ((7, -100.0),)),))
    out: list[Job] = []
    for k, j in enumerate(jobs):
        prompt = np.concatenate([systems[k % 4], j.prompt[:120]]) if k % 3 == 0 else j.prompt
        fields = kinds[k % 3] if k % 5 == 0 else ()
        out.append(FieldJob(j.rid, prompt, j.max_new, j.cancel_after, fields=fields))
    return out


# Two candidates whose log-probs are this close are a tie that fp32 GEMMs of another shape may break the
# other way (cuBLAS picks its kernel, and so its summation order, by the step's size); a greedy run
# that takes the other branch there differs from then on.
TIE_NATS = 1e-3


def tie_at(got: list[int], ref: Result) -> int | None:
    """Where ``got`` first leaves the reference's tokens, if the reference had a tie there between its own
    token and ``got``'s (from its top-2 log-probs); None where they agree or differ otherwise."""
    i = next((k for k, (a, b) in enumerate(zip(got, ref.tokens, strict=False)) if a != b), None)
    if i is None or ref.tops is None:
        return None
    (t0, lp0), (t1, lp1) = (tuple(x) for x in ref.tops[i][:2])
    return i if (t0, t1) == (ref.tokens[i], got[i]) and lp0 - lp1 <= TIE_NATS else None


@pytest.mark.parametrize("switches", ["device_features", "defaults"])
def test_persistent_5000_requests_with_cancellations(tiny: Path, switches: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 requests, a tenth hung up, and one crossing many launch windows: the host-driven mode's tokens,
    up to a near-tie (``TIE_NATS``) broken the other way in at most 3 of them (the steps batch requests
    differently and fp32 GEMMs are not batch-invariant; the reference reads back every request's top-2
    log-probs, the persistent run half of them, so both of its sampling paths run).
    ``defaults``: random prompts, no processors, the switches as the environment has them (both on by
    default); ``device_features``: the device processors and the device prefix cache set on, a third of the
    requests behind shared system prompts and a fifth with a processor, so that the pass exercises both."""
    jobs = random_jobs(5000, VOCAB, seed=2, max_prompt=160, max_new=96, cancel_frac=0.1)
    if switches == "device_features":
        monkeypatch.setenv("BLINK_DEVICE_PROCESSORS", "1")
        monkeypatch.setenv("BLINK_DEVICE_PREFIX_CACHE", "1")
        jobs = with_device_features(jobs, seed=3)
    jobs = [dataclasses.replace(j, top_logprobs=2 * (k % 2)) for k, j in enumerate(jobs)]  # half ask
    jobs.append(Job(10_000, jobs[0].prompt[:8], 4096))  # crosses many launch windows
    # host-driven, nothing cancelled, every request's top-2 log-probs (the ties)
    reference = [dataclasses.replace(j, cancel_after=None, top_logprobs=2) for j in jobs]
    host, _ = serve_jobs(tiny, "host", reference, window=16, tag=f"5k-{switches}")
    pers, stats = serve_jobs(tiny, "persistent", jobs, window=16, tag=f"5k-{switches}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"persistent_5k_{switches}.json").write_text(json.dumps(stats))
    assert set(pers) == {j.rid for j in jobs}
    cancelled = [j for j in jobs if pers[j.rid].reason == F.CANCELLED]
    assert all(j.cancel_after is not None for j in cancelled)
    ties: dict[int, int] = {}
    for j in jobs:
        got, ref = pers[j.rid], host[j.rid]
        if got.reason != F.CANCELLED:
            assert got.reason == F.LENGTH and len(got.tokens) == len(ref.tokens), f"request {j.rid}: {got.reason}"
        at = tie_at(got.tokens, ref)
        if at is not None:
            ties[j.rid] = at
            continue
        if got.reason == F.CANCELLED:
            assert got.tokens == ref.tokens[: len(got.tokens)], f"request {j.rid}: cancelled output not a prefix"
        else:
            assert got.tokens == ref.tokens, f"request {j.rid} differs from host-driven"
    stats["ties"] = {str(k): v for k, v in ties.items()}
    (OUT / f"persistent_5k_{switches}.json").write_text(json.dumps(stats))
    assert len(ties) <= 3, f"near-ties broken the other way in {len(ties)} requests: {ties}"
    assert len(pers[10_000].tokens) == 4096
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["window_relaunches"] > 100
    assert stats["exit_code"] == 0 and not stats["segment_left"]
    if switches == "device_features":
        assert stats["prefix_cache_hits"] > 1000 * 32, stats  # ~1,667 requests behind 33-100 shared tokens


def check_against(jobs: list[Job], got: dict[int, Result], ref: dict[int, Result], what: str) -> None:
    for j in jobs:
        g, r = got[j.rid], ref[j.rid].tokens
        if g.reason == F.CANCELLED:
            assert j.cancel_after is not None and g.tokens == r[: len(g.tokens)], f"{what}: request {j.rid}"
        else:
            assert g.reason == F.LENGTH and g.tokens == r, f"{what}: request {j.rid} differs from host-driven"


def test_persistent_sampling_variants_and_yield_mode(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded sampling (greedy, temperature, top-k/top-p) gives the host-driven mode's tokens, both
    with the scheduler polling beside each graph and with it leaving its SM every step."""
    jobs = sampling_jobs(600, seed=5)
    reference = [dataclasses.replace(j, cancel_after=None) for j in jobs]
    host, _ = serve_jobs(tiny, "host", reference, window=16, tag="sampling")
    pers, stats = serve_jobs(tiny, "persistent", jobs, window=16, tag="sampling")
    check_against(jobs, pers, host, "persistent")
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["exit_code"] == 0
    monkeypatch.setenv("BLINK_SCHED_YIELD_ALL", "1")
    yld, ystats = serve_jobs(tiny, "persistent", jobs, window=16, tag="yield")
    check_against(jobs, yld, host, "persistent, yielding")
    assert ystats["kv_blocks_free"] == ystats["kv_blocks_total"] and ystats["exit_code"] == 0
    assert not ystats["segment_left"]


# A small prefill budget (64 + 32 tokens) leaves prefill graphs of at most 4 prompts at 96 tokens:
# more short prompts than that are pending at once, and every mode must split them.
NARROW_ARGS = ("--dtype", "float32", "--num-slots", "64", "--max-prompt-tokens", "64", "--max-output-tokens", "32",
               "--max-batch", "32", "--kv-blocks", "2000", "--block-size", "16", "--top-logprobs", "1")


def test_many_short_prompts_match_the_cpu_engine(tiny: Path) -> None:
    """Prefill steps never hold more prompts than the captured graph they run (rows past a graph's
    batch would come back with another step's tokens)."""
    rng = np.random.default_rng(9)
    jobs = [Job(k + 1, rng.integers(3, VOCAB, int(rng.integers(8, 25))).astype(np.int32), 16) for k in range(256)]
    cpu, _ = serve_jobs(tiny, "cpu", jobs, window=64, tag="narrow", engine_args=NARROW_ARGS)
    for backend in ("host", "persistent"):
        got, stats = serve_jobs(tiny, backend, jobs, window=64, tag="narrow", engine_args=NARROW_ARGS)
        diff = [j.rid for j in jobs if got[j.rid].tokens != cpu[j.rid].tokens]
        assert not diff, f"{backend}: {len(diff)} of {len(jobs)} requests differ from the CPU engine"
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["exit_code"] == 0


def test_persistent_serves_a_frontend_without_flips(tiny: Path) -> None:
    """Every third request is published as a frontend of schema minor 0 does (no ``pending_flips``),
    the rest with flips, on one ring: the scheduler's flip scan misses none of them."""
    jobs = random_jobs(600, VOCAB, seed=4, max_prompt=64, max_new=24, cancel_frac=0.0)
    ref, _ = serve_jobs(tiny, "host", jobs, window=32, tag="minor0")
    got, stats = serve_jobs(tiny, "persistent", jobs, window=32, tag="minor0", minor0_every=3)
    check_against(jobs, got, ref, "schema minor 0 beside minor 1")
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["exit_code"] == 0


# A budget of 96 tokens per step (64 of them may be decodes) against prompts of up to 256 tokens, and a
# cache of 64 blocks (1,024 tokens) for up to 64 requests of up to 304: chunks, mixed steps and
# preemptions on every side.
CHUNK_ARGS = tuple(a if a != "6000" else "64" for a in ENGINE_ARGS) + ("--max-num-batched-tokens", "96")


@pytest.mark.parametrize("backend", ["host", "persistent"])
def test_every_request_carries_its_phase_clocks(tiny: Path, backend: str) -> None:
    """Slot.schedule_ns (schema minor 6): each request's first prompt chunk's step, between its claim and its first
    token, under chunked prefill and preemptions; and the KV cache's configuration in the header, as the
    frontend reports it in vllm:cache_config_info."""
    jobs = random_jobs(96, VOCAB, seed=9, max_prompt=250, max_new=48, cancel_frac=0.0)
    got, stats = serve_jobs(tiny, backend, jobs, window=64, tag="clocks", engine_args=CHUNK_ARGS)
    assert stats["preemptions"] > 0 and stats["exit_code"] == 0
    bad = [(j.rid, got[j.rid].clocks) for j in jobs
           if not 0 < got[j.rid].clocks[0] <= got[j.rid].clocks[1] <= got[j.rid].clocks[2] <= got[j.rid].clocks[3]]
    assert not bad, bad[:5]
    splitmix = backend == "persistent"
    assert stats["cache"] == {"kv_block_size": 16, "kv_cache_dtype": L.KvCacheDtype.FLOAT32,
                              "cache_features": L.CacheFeatures.PREFIX_CACHING,
                              "prefix_hash": L.PrefixHash.SPLITMIX64 if splitmix else L.PrefixHash.BLAKE2B_64,
                              "gpu_memory_utilization": pytest.approx(DEFAULT_GPU_MEMORY_UTILIZATION)}


@pytest.mark.parametrize("backend", ["host", "persistent"])
def test_a_stop_id_ends_the_request_and_is_named_in_the_slot(tiny: Path, backend: str) -> None:
    """Slot.stop_token (schema minor 6, stop_reason's source): greedy jobs run once to learn their tokens, then
    again with one of their own later tokens and one other id as stop ids. A job that stops has finish STOP_ID,
    no stop id among its tokens (a stop id is not emitted) and names the one that ended it; one that does not
    runs to max_new with -1. (Where a tie breaks otherwise in the second run's other batch shapes the stop may
    come elsewhere: the rules hold wherever it comes.)"""
    base = random_jobs(24, VOCAB, seed=11, max_prompt=100, max_new=32, cancel_frac=0.0)
    first, _ = serve_jobs(tiny, backend, base, window=24, tag="stopfree")
    own = [first[j.rid].tokens[k * 7 % len(first[j.rid].tokens)] for k, j in enumerate(base)]
    jobs = [FieldJob(j.rid, j.prompt, j.max_new, fields=(("stop_ids", (own[k], VOCAB - 1)),))
            for k, j in enumerate(base)]
    got, stats = serve_jobs(tiny, backend, jobs, window=24, tag="stopids")
    assert stats["exit_code"] == 0
    wrong = []
    for j in jobs:
        stops, res = dict(j.fields)["stop_ids"], got[j.rid]
        emitted = any(t in stops for t in res.tokens)
        if res.reason == F.STOP_ID:
            ok = not emitted and res.stop_token in stops and len(res.tokens) < j.max_new
        else:
            ok = res.reason == F.LENGTH and not emitted and res.stop_token == -1 and len(res.tokens) == j.max_new
        if not ok:
            wrong.append((j.rid, res.reason, res.stop_token, stops, res.tokens[-3:]))
    assert not wrong, wrong[:5]
    assert sum(got[j.rid].reason == F.STOP_ID for j in jobs) >= len(jobs) // 2  # most meet their own token


def test_chunked_prefill_matches_whole_prompts(tiny: Path) -> None:
    """Prompts much longer than the step budget, some cancelled: the persistent scheduler and the
    host-driven mode, both chunking, give the tokens of the host-driven mode without chunking."""
    jobs = random_jobs(2000, VOCAB, seed=8, max_prompt=256, max_new=48, cancel_frac=0.1)
    reference = [dataclasses.replace(j, cancel_after=None) for j in jobs]
    whole, _ = serve_jobs(tiny, "host", reference, window=64, tag="whole",
                          engine_args=(*ENGINE_ARGS, "--no-enable-chunked-prefill"))
    host, hstats = serve_jobs(tiny, "host", reference, window=64, tag="chunked", engine_args=CHUNK_ARGS)
    check_against(reference, host, whole, "host-driven, chunked")
    pers, stats = serve_jobs(tiny, "persistent", jobs, window=64, tag="chunked", engine_args=CHUNK_ARGS)
    check_against(jobs, pers, whole, "persistent, chunked")
    (OUT / "persistent_chunked.json").write_text(json.dumps({"host": hstats, "persistent": stats}))
    for st in (hstats, stats):
        assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["exit_code"] == 0 and not st["segment_left"]
        assert st["preemptions"] > 0


def shared_prefix_jobs(n: int, seed: int) -> list[Job]:
    """Requests made of one of four system prompts (37-131 tokens, so around block boundaries of 16)
    and a tail of their own: most prompts start with blocks another request already computed."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, VOCAB, size=k).astype(np.int32) for k in (37, 64, 80, 131)]
    jobs = []
    for rid in range(1, n + 1):
        tail = rng.integers(3, VOCAB, size=int(rng.integers(1, 60))).astype(np.int32)
        jobs.append(Job(rid, np.concatenate([systems[rid % 4], tail]), int(rng.integers(1, 32))))
    return jobs


@pytest.mark.parametrize("backend", ["host", "persistent"])
def test_prompt_logprobs_equal_transformers(tiny: Path, backend: str) -> None:
    """Prompt log-probs on both GPU backends (host-driven: its eager forward at the captured graph's shape, the
    scoring inside the step's bounded wait; persistent: the score graph the scheduler launches after a prefill
    step), prompts chunked by a 96-token budget and preempted on a 64-block cache: each position's log-prob,
    rank and top-2 as transformers computes them in fp32; the requests that did not ask, beside them, keep
    their tokens."""
    rng = np.random.default_rng(21)
    prompts = [rng.integers(3, VOCAB, size=int(rng.integers(2, 200))).astype(np.int32) for _ in range(40)]
    jobs = [FieldJob(k + 1, p, 4, fields=(("prompt_logprobs", 2),) if k % 2 == 0 else ()) for k, p in
            enumerate(prompts)]
    plain, _ = serve_jobs(tiny, backend, [Job(j.rid, j.prompt, 4, top_logprobs=2) for j in jobs], window=8,
                          tag="plp-ref", engine_args=CHUNK_ARGS)
    got, stats = serve_jobs(tiny, backend, jobs, window=8, tag="plp", engine_args=CHUNK_ARGS)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["exit_code"] == 0
    model = transformers.LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for j in jobs:
        same = got[j.rid].tokens == plain[j.rid].tokens or tie_at(got[j.rid].tokens, plain[j.rid]) is not None
        assert same, f"request {j.rid}: tokens moved"  # up to a near-tie (the two runs batch differently)
        if not j.fields:
            assert got[j.rid].prompt is None
            continue
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([j.prompt.tolist()])).logits[0, :-1].float(), dim=-1)
        entries, tops = got[j.rid].prompt  # type: ignore[misc]
        for p in range(1, len(j.prompt)):
            want = float(ref[p - 1, j.prompt[p]])
            assert abs(float(entries["logprob"][p]) - want) < 1e-3, f"request {j.rid} position {p}"
            assert abs(int(entries["rank"][p]) - int((ref[p - 1] >= want).sum())) <= 1  # vLLM's rank, near-ties
            top = torch.topk(ref[p - 1], 2)
            assert np.allclose(tops["logprob"][p, :2], top.values.numpy(), atol=1e-3)


def test_host_driven_prefix_cache_gives_the_uncached_tokens(tiny: Path) -> None:
    """The host-driven backend with prefix caching on (the default) and off: the same greedy tokens, and
    the cache reports hits."""
    jobs = shared_prefix_jobs(400, seed=12)
    off, _ = serve_jobs(tiny, "host", jobs, window=32, tag="nocache",
                        engine_args=(*CHUNK_ARGS, "--no-enable-prefix-caching"))
    on, stats = serve_jobs(tiny, "host", jobs, window=32, tag="cache", engine_args=CHUNK_ARGS)
    check_against(jobs, on, off, "host-driven, prefix cache on")
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["exit_code"] == 0
    assert stats["prefix_cache_hits"] > 16 * len(jobs) // 2, stats  # most requests share at least 2 blocks


def test_persistent_prefix_cache_gives_the_uncached_tokens(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's prefix cache (sched_prefix.cuh) on, against the host-driven backend with it off: the
    same greedy tokens, hits counted, every block back (held, idle-cached or unused) at the end."""
    monkeypatch.setenv("BLINK_DEVICE_PREFIX_CACHE", "1")
    jobs = shared_prefix_jobs(400, seed=13)
    off, _ = serve_jobs(tiny, "host", jobs, window=32, tag="nocache-ref",
                        engine_args=(*CHUNK_ARGS, "--no-enable-prefix-caching"))
    on, stats = serve_jobs(tiny, "persistent", jobs, window=32, tag="cache", engine_args=CHUNK_ARGS)
    (OUT / "persistent_prefix_cache.json").write_text(json.dumps(stats))
    check_against(jobs, on, off, "persistent, prefix cache on")
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["exit_code"] == 0, stats
    assert stats["prefix_cache_hits"] > 16 * len(jobs) // 2, stats


# More sequences at once than the scheduler has threads (256): steps of up to 512 rows, which the threads loop
# over, with the per-row scratch in the state's arena, the decode graphs past 256 rows and the mixed graphs of as
# many rows as tokens. A ring of 1,024 slots holds every request at once. They ring the doorbell once (Driver's
# burst): published one at a time, the scheduler starts steps with the few it found while the rest are still being
# written (an H100 ran the first version of this test so, chunked, in 105 steps: what the policy takes with ~7
# arrivals a step, against 38 with all 512 at once).
WIDE_ARGS = ("--dtype", "float32", "--num-slots", "1024", "--max-prompt-tokens", "64", "--max-output-tokens", "64",
             "--max-batch", "512", "--kv-blocks", "4000", "--block-size", "16", "--top-logprobs", "2")


def wide_jobs(n: int, seed: int, new: int) -> list[Job]:
    """``n`` short prompts (4-16 tokens) of ``new`` greedy output tokens each, all submitted at once."""
    rng = np.random.default_rng(seed)
    return [Job(k + 1, rng.integers(3, VOCAB, int(rng.integers(4, 17))).astype(np.int32), new) for k in range(n)]


@pytest.mark.parametrize("chunking", ["chunked", "whole"])
def test_512_sequences_at_once_match_the_cpu_engine(tiny: Path, chunking: str) -> None:
    """512 requests in flight at once at --max-batch 512: the persistent scheduler gives the CPU engine's
    greedy tokens (the CPU engine at --max-batch 512 too), with chunked prefill (mixed steps) and without
    (whole-prompt prefill steps, then decode steps); the scheduler's max_step_rows shows a step of more rows
    than it has threads. All 512 are published before the doorbell rings once."""
    jobs = wide_jobs(512, seed=17, new=32)
    args = WIDE_ARGS if chunking == "chunked" else (*WIDE_ARGS, "--no-enable-chunked-prefill")
    cpu, _ = serve_jobs(tiny, "cpu", jobs, window=len(jobs), tag=f"wide-{chunking}", engine_args=args, burst=True)
    got, stats = serve_jobs(tiny, "persistent", jobs, window=len(jobs), tag=f"wide-{chunking}", engine_args=args,
                            burst=True)
    stats["max_step_rows"] = scheduler_counters(OUT / f"engine-wide-{chunking}-persistent.log")["max_step_rows"]
    admits = [got[j.rid].clocks[0] for j in jobs]
    stats["admit_span_ms"] = (max(admits) - min(admits)) / 1e6  # the first claim to the last (the device's clock)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"persistent_wide_{chunking}.json").write_text(json.dumps(stats))
    diff = [j.rid for j in jobs if got[j.rid].tokens != cpu[j.rid].tokens]
    assert not diff, f"{len(diff)} of {len(jobs)} requests differ from the CPU engine: {diff[:8]}"
    sampled = sum(len(got[j.rid].tokens) for j in jobs)
    assert sampled == 32 * len(jobs) and all(got[j.rid].reason == F.LENGTH for j in jobs)
    assert stats["max_step_rows"] > 256, stats  # a step of more rows than the scheduler's threads
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["exit_code"] == 0, stats
    assert not stats["segment_left"]


def test_600_sequences_sampling_and_cancellations_match_host_driven(tiny: Path) -> None:
    """Seeded sampling (greedy, temperature, top-k/top-p) over 600 requests in flight at --max-batch 512, a
    tenth of them hung up while they run: the host-driven mode's tokens (a cancelled request's a prefix of
    them), every block back at the end (4,000 blocks for up to 512 requests of up to 184 tokens: preemptions)."""
    jobs = sampling_jobs(600, seed=21)  # prompts of up to 120 tokens, outputs of up to 64
    args = (*WIDE_ARGS, "--max-prompt-tokens", "128")
    reference = [dataclasses.replace(j, cancel_after=None) for j in jobs]
    host, _ = serve_jobs(tiny, "host", reference, window=len(jobs), tag="wide-sampling", engine_args=args)
    pers, stats = serve_jobs(tiny, "persistent", jobs, window=len(jobs), tag="wide-sampling", engine_args=args)
    check_against(jobs, pers, host, "persistent, 512 rows")
    assert any(pers[j.rid].reason == F.CANCELLED for j in jobs)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["exit_code"] == 0, stats
    assert not stats["segment_left"]
