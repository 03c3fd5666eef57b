"""The host-driven GPU runner's prompt log-probs, run on the CPU (Triton's interpreter; a stand-in for the graph
cache that runs each "graph" eagerly, and for the CUDA event): the entries match the reference model, the
scoring is enqueued before the step's completion event (inside its bounded wait) and its CUDA errors are the
step's, and an out-of-memory there fails only the request that asked while its co-batched request goes on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_engine.engine import RingEngine
from gpu_engine.faults import LaunchFailure
from gpu_engine.gpu.graph_cache import GraphShape
from gpu_engine.gpu.host_runner import HostGraphRunner
from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.attention import build_metadata
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.loader import build_empty, init_random
from gpu_engine.policy import Policy
from shared import ring_layout as L
from shared.messages import Sampling
from shared.ring import RingGeometry, local_ring
from shared.slots import SlotRequest, SlotWriter

CFG = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
                           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                           "max_position_embeddings": 256})
GEO = RingGeometry(4, 48, 8, 4, 40)
PROMPT = [5, 9, 13, 9, 5, 40, 41, 77, 3, 3, 3, 60, 12, 90, 1, 7, 22, 18, 64, 30]
OTHER = [8, 6, 4, 2, 11, 13]
MAX_NEW = 3


class Event:
    """torch.cuda.Event's part the runner uses: recorded after the step's work, complete at once."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("event")

    def query(self) -> bool:
        return True


class Graphs:
    """GraphCache's part the host runner uses, with one prefill and one decode shape, each "replayed" eagerly."""

    def __init__(self, runner: GpuModelRunner, log: list[str]) -> None:
        self.runner, self.log = runner, log
        self.shapes = [GraphShape(True, 4, 4, True), GraphShape(False, 4, 64, True)]

    def captured(self, decode: bool, batch: int, tokens: int, filtered: bool = True) -> int:
        return 0 if decode else 1

    def replay(self, shape: tuple[bool, int, int], filtered: bool = True) -> GraphShape:
        s = self.shapes[self.captured(*shape)]
        self.log.append("replay")
        self.runner.forward(s.batch, s.tokens, s.decode, filtered)
        return s  # the captured shape that ran, as GraphCache.replay returns it


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    """(engine, ring, model, log): two requests in the ring, slot 0 asking for prompt log-probs, slot 1 not."""
    model = build_empty(CFG, torch.float32, "cpu")
    init_random(model, 0)
    kv = KVCache(CFG, 64, 4)
    runner = GpuModelRunner(model, kv, RunnerLimits(4, 64, 16, num_top_logprobs=4))
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda: Event(log))
    logits_at = runner.logits_at

    def scoring(first: int, n: int) -> torch.Tensor:
        log.append("score")
        return logits_at(first, n)

    monkeypatch.setattr(runner, "logits_at", scoring)
    ring = local_ring(GEO)
    engine = RingEngine(ring, HostGraphRunner(runner, Graphs(runner, log)), Policy(kv.allocator, 4, 4, 64),
                        (2,), 64, CFG.vocab_size)
    writer = SlotWriter(ring)
    for idx, (prompt, k) in enumerate(((PROMPT, 3), (OTHER, -1))):
        seq = writer.try_reserve(idx, 0)
        assert seq is not None
        writer.publish(idx, seq, SlotRequest(idx + 1, np.array(prompt, np.int32),
                                             Sampling(MAX_NEW, ignore_eos=True, prompt_logprobs=k)))
    return engine, ring, model, log


def drain(engine: RingEngine) -> None:
    for _ in range(100):
        if not engine.step() and not engine.by_slot:
            return
    raise AssertionError("the engine did not finish its requests")


def outcome(ring, idx: int) -> tuple[int, int, int]:
    slot = ring.slots[idx]
    return int(slot["state"]), int(slot["error_code"]), int(slot["generated"])


def test_entries_match_the_reference_and_are_scored_inside_the_step(host) -> None:
    engine, ring, model, log = host
    drain(engine)
    assert outcome(ring, 0) == outcome(ring, 1) == (L.SlotState.DECODE_COMPLETED, L.ErrorCode.OK, MAX_NEW)
    meta = build_metadata([(0, len(PROMPT), list(range(5)))], 4)
    with torch.inference_mode():
        hidden = model.hidden_states(torch.tensor(PROMPT), meta, KVCache(CFG, 8, 4))
        ref = torch.log_softmax(model.logits_at(hidden, torch.arange(len(PROMPT) - 1)), dim=-1)
    entries, tops = ring.read_prompt_logprobs(0, 1, len(PROMPT))
    actual = ref.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    assert np.allclose(entries["logprob"], actual.numpy(), atol=1e-4)
    assert np.allclose(tops["logprob"][:, :3], torch.topk(ref, 3).values.numpy(), atol=1e-4)
    assert (entries["rank"] >= 1).all()
    # one eager step (no replay) whose scoring comes before its completion event; every other step replays
    first = log.index("score")
    assert log[:first] == [] and log[first : log.index("event")] == ["score"]
    assert log.count("score") == 1 and log.count("replay") == log.count("event") - 1


def test_a_cuda_error_in_the_scoring_is_a_launch_failure(host, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, *_ = host

    def broken(first: int, n: int) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner.runner, "logits_at", broken)
    with pytest.raises(LaunchFailure, match="launch failed: CUDA error"):
        drain(engine)


def test_out_of_memory_fails_only_the_request_that_asked(host, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, ring, _, log = host

    def no_memory(first: int, n: int) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 97.00 MiB")

    monkeypatch.setattr(engine.runner.runner, "logits_at", no_memory)
    drain(engine)
    assert outcome(ring, 0)[:2] == (L.SlotState.DECODE_COMPLETED, L.ErrorCode.OUT_OF_MEMORY)
    assert int(ring.slots[0]["finish_reason"]) == L.FinishReason.ERROR and outcome(ring, 0)[2] == 0
    assert outcome(ring, 1) == (L.SlotState.DECODE_COMPLETED, L.ErrorCode.OK, MAX_NEW)
    assert log[0] == "replay"  # the failed eager step ran again from its graph
    assert engine.runner.runner.kept_hidden.numel() == 0  # released after the failed attempt
    alloc = engine.policy.alloc
    assert alloc.num_free == alloc.num_total and not engine.by_slot
