"""Host-driven GPU mode: the same graphs and policy, the loop on the host, one sync per step.

This is the baseline of the paper's Fig. 3 and the fallback where device launch is unavailable:
host bookkeeping (policy, metadata), staging copies, ``replay`` of the captured graph, then a
stream synchronization and a copy of the sampled tokens back. A decode step with no row that uses
top-k / top-p / min-p replays the sort-free variant of the decode graph (``step_filters``). A step
with a row that uses penalties, logit_bias or min_tokens stages the processor columns (dense
[batch, vocab] tensors built on the host from each row's prompt and output). A step with a prompt chunk of a
request that asks for prompt log-probs runs the same forward eagerly instead of replaying its graph (every
request of the step pays for it), keeping every token's final hidden state, and scores the chunk's positions
as the CPU backend does (``gpu_engine/prompt_logprobs.py``); other steps are unchanged. The eager forward runs
at the shape of the graph it replaces (the kernels were compiled there at capture). That eager path
allocates outside the graph pool (its activations, the kept hidden states, the [256, vocab] float32 scoring
temporaries), memory the KV cache's sizing did not count: when it runs out, the step is replayed from its
graph as any other and only the requests that asked fail (``StepOutput.failed``, OUT_OF_MEMORY).

The wait is bounded: a step not complete within ``step_timeout_s`` is a ``DeviceHang``, and a CUDA error
from the replay or from the step itself (its prompt scoring included) a ``LaunchFailure`` /
``DeviceFailure`` (``gpu_engine/faults.py``); either ends the engine's requests with ENGINE_FAILURE and
restarts the engine.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_engine.faults import DeviceFailure, LaunchFailure, poll_until
from gpu_engine.gpu.graph_cache import GraphCache, GraphShape
from gpu_engine.gpu.runner import GpuModelRunner
from gpu_engine.kernels.sampling import processor_columns
from gpu_engine.models.attention import build_metadata
from gpu_engine.policy import StepPlan, step_filters
from gpu_engine.prompt_logprobs import PromptSpan, Scored, fetch, prompt_spans, score_spans
from gpu_engine.runner import StepOutput, step_inputs
from shared.log import get_logger

log = get_logger("host_runner")


class HostGraphRunner:
    """Runner protocol over a GraphCache: stage, replay, synchronize, read back."""

    def __init__(self, runner: GpuModelRunner, cache: GraphCache, step_timeout_s: float = 5.0) -> None:
        self.runner = runner
        self.cache = cache
        self.block_size = runner.kv.block_size
        self.step_timeout_s = step_timeout_s

    def _sampling(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        specs = [w.req.sampling for w in plan.work]
        cols = {}
        if any(s.processed for s in specs):
            steps = [len(w.req.output) for w in plan.work]
            history = [(w.req.prompt, w.req.output) for w in plan.work]
            cols = processor_columns(specs, steps, history, self.runner.config.vocab_size)
        return cols | {
            "temperature": torch.tensor([s.temperature for s in specs], dtype=torch.float32),
            "top_k": torch.tensor([s.top_k for s in specs], dtype=torch.int32),
            "top_p": torch.tensor([s.top_p for s in specs], dtype=torch.float32),
            "min_p": torch.tensor([s.min_p for s in specs], dtype=torch.float32),
            "seeds": torch.tensor([s.seed for s in specs], dtype=torch.int64),
            "sample_index": torch.tensor([len(w.req.output) for w in plan.work], dtype=torch.int64),
            "want_logprobs": torch.tensor([s.want_logprobs for s in specs], dtype=torch.int32),
        }

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        steps, ids = step_inputs(plan)
        meta = build_metadata(steps, self.block_size, "cpu")
        self.runner.stage(torch.tensor(ids, dtype=torch.int64), meta, self._sampling(plan))
        b, t = len(plan.work), len(ids)
        spans = prompt_spans(plan)
        failed: tuple[int, ...] = ()
        try:
            scored, shape = self._replay_and_wait(plan, b, t, spans)
        except torch.cuda.OutOfMemoryError as exc:  # only the eager path allocates: the graph needs nothing more
            failed = tuple(s.row for s in spans)
            log.warning("out of device memory computing prompt log-probs; those requests fail", rows=len(failed),
                        tokens=t, error=str(exc).splitlines()[0])
            scored, shape = self._replay_and_wait(plan, b, t, [])
        buf = self.runner.buffers
        return StepOutput(
            tokens=buf.next_tokens[:b].cpu().tolist(),
            logprobs=buf.token_logprobs[:b].float().cpu().numpy(),
            top_ids=buf.top_ids[:b].to(torch.int32).cpu().numpy(),
            top_logprobs=buf.top_logprobs[:b].float().cpu().numpy().astype(np.float32),
            prompt=fetch(scored),
            failed=failed,
            graph_tokens=shape.tokens,
        )

    def _replay_and_wait(self, plan: StepPlan, b: int, t: int,
                         spans: list[PromptSpan]) -> tuple[list[Scored], GraphShape]:
        """Replay the step's graph (with ``spans``: run its forward eagerly, keeping the hidden states, and
        score them) and wait, within ``step_timeout_s``, for it to complete; the scores and the captured shape
        that ran. An out-of-memory of the eager path is raised as it is, before anything is waited for."""
        what = f"the {plan.kind} step of {b} rows and {t} tokens"
        decode, filtered = plan.kind == "decode", step_filters(plan)
        scored: list[Scored] = []
        try:
            if spans:  # at the shape of the graph it replaces: kernels compiled at capture, padding staged
                shape = self.cache.shapes[self.cache.captured(decode, b, t, filtered)]
                try:
                    self.runner.forward(shape.batch, shape.tokens, decode, shape.filtered, keep_hidden=True)
                    scored = score_spans(spans, self.runner.logits_at)
                finally:
                    self.runner.drop_hidden()
            else:
                shape = self.cache.replay((decode, b, t), filtered=filtered)
            done = torch.cuda.Event()
            done.record()
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # torch raises CUDA errors as RuntimeError
            raise LaunchFailure(f"{what}: launch failed: {exc}") from exc

        def complete() -> bool:
            try:
                return bool(done.query())
            except RuntimeError as exc:  # an error of the step itself (an illegal address, ...)
                raise DeviceFailure(f"{what} failed on the device: {exc}") from exc

        poll_until(complete, self.step_timeout_s, what)
        return scored, shape
