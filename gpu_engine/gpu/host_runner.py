"""Host-driven GPU mode: the same graphs and policy, the loop on the host, one sync per step.

This is the baseline of the paper's Fig. 3 and the fallback where device launch is unavailable:
host bookkeeping (policy, metadata), staging copies, ``replay`` of the captured graph, then a
stream synchronization and a copy of the sampled tokens back. A decode step with no row that uses
top-k / top-p / min-p replays the sort-free variant of the decode graph (``step_filters``). A step
with a row that uses penalties, logit_bias or min_tokens stages the processor columns (dense
[batch, vocab] tensors built on the host from each row's prompt and output).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_engine.gpu.graph_cache import GraphCache
from gpu_engine.gpu.runner import GpuModelRunner
from gpu_engine.kernels.sampling import processor_columns
from gpu_engine.models.attention import build_metadata
from gpu_engine.policy import StepPlan, step_filters
from gpu_engine.runner import StepOutput, step_inputs


class HostGraphRunner:
    """Runner protocol over a GraphCache: stage, replay, synchronize, read back."""

    def __init__(self, runner: GpuModelRunner, cache: GraphCache) -> None:
        self.runner = runner
        self.cache = cache
        self.block_size = runner.kv.block_size

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
        self.cache.replay((plan.kind == "decode", b, t), filtered=step_filters(plan))
        torch.cuda.current_stream().synchronize()
        buf = self.runner.buffers
        return StepOutput(
            tokens=buf.next_tokens[:b].cpu().tolist(),
            logprobs=buf.token_logprobs[:b].float().cpu().numpy(),
            top_ids=buf.top_ids[:b].to(torch.int32).cpu().numpy(),
            top_logprobs=buf.top_logprobs[:b].float().cpu().numpy().astype(np.float32),
        )
