"""Frozen, validated configuration objects, one per process, built once at start-up.

``EngineConfig`` is the engine's one declaration: each field carries its help text, its default and,
where it has them, its choices or lower bound (the ring's geometry fields live in ``RingGeometry``
with theirs). Everything else is derived from it: the engine's command line (``blink engine``,
``python -m gpu_engine.serve``), the engine flags of ``blink serve`` and the supervisor's engine
command (``EngineConfig.to_argv``), which parses back to the same config.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from shared.env import env
from shared.ring import DEFAULT_MAX_MODEL_LEN, FLIP_SLOTS, RingGeometry

BACKENDS = ("auto", "cpu", "host", "persistent")
DTYPES = ("auto", "float16", "half", "bfloat16", "float32")
CPU_WEIGHTS = ("auto", "int8act", "fp16", "int4")
GPU_WEIGHTS = ("auto", "dense")
QUANTIZATIONS = ("auto", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3, as in vLLM
# --kernel-plan: auto and the names of gpu_engine.kernels.plan.PLANS (a test keeps them equal)
KERNEL_PLANS = ("auto", "cublas", "h100", "h200")
DEFAULT_GRAMMAR_CACHE_MB = 256  # the persistent backend's grammar arena: 8 of the largest grammars a 128k vocabulary
# Of the GPU memory free after the weights, the step buffers and the graphs, for the KV cache (vLLM's default figure,
# though vLLM's is of the whole card): on an H100 the 8B shape got a 53.6-GiB cache with 6.1 GiB left free, the
# Qwen3-30B-A3B shape 14.25 GiB (vLLM 14.53) with 1.7 GiB left (BENCHMARKS.md). The graphs' memory is counted
# before the cache is sized (gpu_engine/gpu/kv_memory.py); before that, 0.85 of the memory free after the weights
# gave the 8B shape 53.5 GiB and left the MoE no room for its graphs.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# --max-num-seqs left out: by the backend's kind. On a GPU, 256 sequences at 0.85 of the memory free after the weights
# (the fraction's meaning then) kept up with
# 17 req/s of the peer study's workload on an H100 where 64 at 0.5 fell behind at 14 (TTFT p50 8.8 s), and 512
# (with a 1,024- or 2,048-token budget) was worse than 256 on every figure at 18-20 req/s; the CPU keeps the
# earlier 64 (no CPU measurement has asked for another).
DEFAULT_MAX_NUM_SEQS = {"gpu": 256, "cpu": 64}
# --max-num-batched-tokens left at 0: the step token budget of each backend kind (chunked prefill). On the
# GPU a 1,024-token step still runs its prompt chunk near the matrix peak, and the decodes riding in it wait
# half as long as in a 2,048-token one: beside 2,048 on the same machine it gave 0.91-0.96x the TPOT p50 and
# 1.01-1.05x the throughput of the peer study, for 1.07x the TTFT p99 at 10 req/s (docs/benchmarks-history.md,
# the peer study). On the CPU a 256-token chunk of the embedded model takes about as long as a few decode steps,
# so a long prompt delays the other streams by a fraction of a second per chunk.
DEFAULT_TOKEN_BUDGET = {"gpu": 1024, "cpu": 256}
GPU_MAX_CONTEXT = 8192  # the largest prefill graph the GPU backends capture: their context limit
# The persistent scheduler's sequences per step at most (BLINK_MAX_BATCH of schema/sched_structs.py; a test keeps
# them equal): its 256 threads loop over a step's rows, whose scratch is sized by --max-num-seqs.
PERSISTENT_MAX_BATCH = 1024


def _flag(default: Any, help: str, *, flag: str | None = None, choices: tuple[str, ...] = (),
          minimum: float | None = None, factory: Callable[[], Any] | None = None,
          aliases: tuple[str, ...] = (), kind: type | None = None) -> Any:
    meta = {"help": help, "flag": flag, "choices": choices, "minimum": minimum, "aliases": aliases, "kind": kind}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _env_ring_name() -> str:
    return env().ring_name


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine process needs; one field per engine flag (``geometry``: one per its fields)."""

    ring_name: str = _flag(None, "shared-memory name of the ring the engine creates; BLINK_RING_NAME sets the default",
                           flag="--ring", factory=_env_ring_name)
    model: str | None = _flag(None, "Hugging Face folder (config.json + safetensors) or .gguf file; blink serve "
                              "also takes a Hugging Face Hub id, ORG/NAME or ORG/NAME-GGUF:QUANT, fetched before it "
                              "starts anything (default: the embedded SmolLM2-135M-Instruct)")
    random_weights: bool = _flag(False, "the model's architecture with seeded random weights (for benchmarks)")
    backend: str = _flag("auto", "cpu: PyTorch on the CPU; host: host-driven GPU loop; persistent: the "
                         "persistent GPU scheduler; auto: persistent on an sm_90 GPU with nvcc, host on another "
                         "CUDA GPU, cpu without one (resolved once by the engine, and logged)", choices=BACKENDS)
    dtype: str = _flag("auto", "weights and KV cache (half = float16); auto: on the CPU, the packed linears "
                       "--cpu-weights chooses and an fp16 KV cache (float32: everything fp32), bfloat16 on a GPU",
                       choices=DTYPES)
    cpu_weights: str = _flag("auto", "CPU backend with --dtype auto: the linears' weights. auto: a GGUF's Q4_1 "
                             "tensors kept as their Q4_1 groups (fp32 arithmetic on the exact weights) and a Q8_0 "
                             "token table shared with the LM head, fp16 (packed, fp32 arithmetic) for the rest; "
                             "int8act: auto with each quantized product's input quantized to int8 per group of 32 "
                             "first (llama.cpp's arithmetic: faster, greedy tokens within the bound "
                             "tests/test_cpu_q4.py states); fp16: every linear fp16; int4: the decoder layers' "
                             "linears as int4 (groups of 32 with a scale and a minimum, bf16 activations: greedy "
                             "tokens within the bound tests/test_cpu_int4.py holds)", choices=CPU_WEIGHTS)
    gpu_weights: str = _flag("auto", "GPU backends: the weights' form. auto: a GGUF's Q8_0 linears (the decoder "
                             "layers' dense projections and an untied LM head) and Q8_0 token table kept as int8 "
                             "codes with their fp16 scales (8.5 bits a weight), the linears multiplied by the Q8_0 "
                             "Triton kernel, every other tensor dequantized to --dtype; dense: every tensor "
                             "dequantized to --dtype (refused with an FP8 checkpoint or --quantization fp8, whose "
                             "linears stay FP8)",
                             choices=GPU_WEIGHTS)
    quantization: str = _flag("auto", "GPU backends (bfloat16): fp8 quantizes a Hugging Face folder's bf16/fp16 "
                              "weights at load, as vLLM's --quantization fp8: the decoder layers' q/k/v, o, gate/up "
                              "and down projections to float8_e4m3fn with a scale per output channel, their "
                              "activations quantized per token at run time, products on the FP8 tensor cores "
                              "(sm_90); embeddings, norms, the LM head and MoE experts stay in --dtype. auto: the "
                              "checkpoint's own form; an FP8 checkpoint (quantization_config quant_method fp8 or "
                              "compressed-tensors) loads as stored, with or without this flag", choices=QUANTIZATIONS,
                              aliases=("-q",))
    kv_cache_dtype: str = _flag("auto", "GPU backends: the KV cache's element type. auto: the model's dtype (--dtype); "
                                "fp8 (or fp8_e4m3, vLLM's names): float8_e4m3fn with a scale of 1.0 for the keys "
                                "and one for the values of every layer (vLLM's default without calibration), values "
                                "saturated to +-448, twice the blocks for the same memory; attention computes in "
                                "--dtype", choices=KV_CACHE_DTYPES)
    kernel_plan: str = _flag("auto", "GPU backends: which kernels take each product of a step (gpu_engine/kernels/"
                             "plan.py). auto: the plan measured fastest on this GPU (h200 on an NVIDIA H200, h100 on "
                             "an NVIDIA H100 80GB HBM3), cuBLAS and the plain kernels on any other; cublas: cuBLAS "
                             "for every product, whatever the GPU; h100: cuBLAS, and FP8 weights in steps of up to 8 "
                             "rows through the weight-only FP8 GEMV; h200: the H200's tiled linears and fused forms",
                             choices=KERNEL_PLANS)
    max_model_len: int = _flag(0, "the context limit, prompt plus output tokens, as /v1/models reports it; "
                               "the prompt limit is one less unless --max-prompt-tokens is given; 0: the "
                               f"model's context, capped at {DEFAULT_MAX_MODEL_LEN} (the prompt limit one less, "
                               "as with --max-model-len), or when --max-prompt-tokens is given at "
                               "--max-prompt-tokens + --max-output-tokens", minimum=0)
    geometry: RingGeometry = dataclasses.field(default=RingGeometry(), metadata={"fields_are_flags": True})
    block_size: int = _flag(16, "tokens per KV cache block", minimum=1)
    kv_blocks: int = _flag(0, "KV cache blocks; 0: sized from memory (1 GiB on the CPU, "
                           "--gpu-memory-utilization of the memory free after the graphs on a GPU)", minimum=0)
    gpu_memory_utilization: float | None = _flag(
        None, "fraction of the GPU memory free after the weights, the step buffers and the CUDA graphs that the KV "
        "cache takes (sized once the graphs are captured; GPU backends "
        f"only; the CPU backend refuses it: size its cache with --kv-blocks) (default: "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION} on a GPU)", kind=float)
    grammar_cache_mb: int | None = _flag(
        None, "persistent backend: MiB of GPU memory for the tables of the grammars in use (structured output and "
        "forced tool calls, applied on the device; a grammar's tables take its token DFA's states times vocabulary "
        "/ 8 bytes; a request whose grammar is larger is refused with a 400; idle grammars are evicted, least "
        f"recently used first); 0: constrained requests are refused (default: {DEFAULT_GRAMMAR_CACHE_MB})",
        minimum=0, kind=int)
    # 0: left out (a config built without the parser), the backend kind's default (`default_max_batch`)
    max_batch: int = _flag(0, "sequences in one engine step (vLLM's name; --max-batch is an alias; at most "
                           f"{PERSISTENT_MAX_BATCH:,} with the persistent backend)",
                           flag="--max-num-seqs", minimum=1, aliases=("--max-batch",))
    max_num_batched_tokens: int = _flag(
        0, "tokens in one engine step (vLLM's name): with chunked prefill, every running decode plus prompt "
        "chunks up to this budget; without, the prompt tokens of a prefill step (the first prompt may exceed "
        f"it alone); 0: {DEFAULT_TOKEN_BUDGET['gpu']} on a GPU, {DEFAULT_TOKEN_BUDGET['cpu']} on the CPU "
        "(at least --max-num-seqs)", minimum=0)
    no_enable_chunked_prefill: bool = _flag(
        False, "prefill whole prompts in steps of their own, during which the running decodes wait (chunked "
        "prefill, the default, mixes prompt chunks into the decode steps; vLLM's name)",
        flag="--no-enable-chunked-prefill")
    no_enable_prefix_caching: bool = _flag(
        False, "compute every prompt in full (prefix caching, the default, reuses the KV blocks of a prompt's "
        "leading full blocks that an earlier request of the same cache salt computed; it needs chunked prefill; "
        "vLLM's name)", flag="--no-enable-prefix-caching")
    seed: int = _flag(0, "seed of --random-weights and of torch (blink serve refuses another seed without "
                      "--random-weights: sampling is seeded per request)")
    threads: int = _flag(0, "threads of the CPU backend: the quantized kernels' own pool with --cpu-weights auto "
                         "or int8act (0: every core this process may use; it runs on one while the cores are "
                         "contended), else torch's (0: every core but one)", minimum=0)

    @property
    def cpu_threads(self) -> int:
        """Threads for the CPU backend: one core is left to the frontend services, whose polling
        would otherwise fight OpenMP's spinning workers for the same cores."""
        if self.threads:
            return self.threads
        return max(1, len(os.sched_getaffinity(0)) - 1)

    @property
    def grammar_arena_bytes(self) -> int:
        """The persistent backend's grammar arena (--grammar-cache-mb)."""
        mb = DEFAULT_GRAMMAR_CACHE_MB if self.grammar_cache_mb is None else self.grammar_cache_mb
        return mb << 20

    @property
    def kv_memory_fraction(self) -> float:
        """Of the GPU memory free after the weights, step buffers and graphs, what the KV cache takes when --kv-blocks
        is 0."""
        return self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION

    @property
    def chunked_prefill(self) -> bool:
        return not self.no_enable_chunked_prefill

    @property
    def prefix_caching(self) -> bool:
        """Whether the policy caches prefixes: asked for (the default) and possible (chunked prefill)."""
        return not self.no_enable_prefix_caching and self.chunked_prefill

    def token_budget(self, gpu: bool) -> int | None:
        """The policy's step token budget: --max-num-batched-tokens, else with chunked prefill the backend
        kind's default (never below --max-num-seqs, which a step of decodes needs); None: not given and
        no chunking (the backend's own prefill limit applies)."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        if not self.chunked_prefill:
            return None
        return max(DEFAULT_TOKEN_BUDGET["gpu" if gpu else "cpu"], self.max_batch)

    @property
    def fp8_kv_cache(self) -> bool:
        """--kv-cache-dtype fp8 (or fp8_e4m3): the GPU backends' KV cache holds float8_e4m3fn."""
        return self.kv_cache_dtype != "auto"

    def gpu_torch_dtype_name(self) -> str:
        """The torch dtype of the weights' activations on a GPU: ``auto`` and ``half`` resolved (the CPU backend's
        formats are ``gpu_engine.backend.CpuFormats``)."""
        if self.dtype == "auto":
            return "bfloat16"
        return "float16" if self.dtype == "half" else self.dtype

    def gpu_kv_dtype_name(self) -> str:
        """The torch dtype of the KV cache on a GPU: float8_e4m3fn under --kv-cache-dtype fp8, else the model's."""
        return "float8_e4m3fn" if self.fp8_kv_cache else self.gpu_torch_dtype_name()

    def context_limit(self, model_context: int, cap: int | None = None) -> int:
        """Prompt plus output tokens a request may have: --max-model-len, or the model's context capped
        by the slot's capacity (and by ``cap``, what the backend can run); a --max-model-len over the
        model's context or ``cap`` is refused. The default prompt slot (neither --max-model-len nor
        --max-prompt-tokens given) caps it at ``DEFAULT_MAX_MODEL_LEN``, which a prompt may fill but for
        one token (vLLM's prompt limit, max_model_len - 1); another prompt slot caps it at what the
        prompt and output slots hold together."""
        if self.max_model_len:
            for limit, what in ((model_context, "the model's context"), (cap, "what this backend runs")):
                if limit is not None and self.max_model_len > limit:
                    raise ValueError(f"--max-model-len {self.max_model_len} is more than {what} ({limit})")
            return self.max_model_len
        g = self.geometry
        slot = (DEFAULT_MAX_MODEL_LEN if g.max_prompt_tokens == PROMPT_TOKENS_DEFAULT
                else g.max_prompt_tokens + g.max_output_tokens)
        return min(model_context, slot, *(() if cap is None else (cap,)))

    @property
    def context_cap(self) -> int | None:
        """What the backend runs at most, prompt plus output: the GPU backends' largest graph; None on the CPU."""
        return None if self.backend == "cpu" else GPU_MAX_CONTEXT

    def refusal_on(self, backend: str, model_context: int | None) -> str | None:
        """Why the engine would refuse this config once it runs ``backend`` (``--backend auto`` resolved), or None:
        a flag that does not apply to that backend (the checks of ``__post_init__``), or a --max-model-len above
        ``model_context`` or above what that backend runs (``context_limit``). The engine makes these checks as it
        starts; blink serve makes them first, before it starts any process."""
        try:
            cfg = dataclasses.replace(self, backend=backend)
            if model_context is not None:
                cfg.context_limit(model_context, cap=cfg.context_cap)
        except ValueError as exc:
            return str(exc)
        return None

    def __post_init__(self) -> None:
        if self.max_batch == 0:  # left out: as the parser derives it, and the ring it derives for it
            default_ring = self.geometry.num_slots == SLOTS_DEFAULT
            batch = default_max_batch(self.backend, None if default_ring else self.geometry.num_slots)
            object.__setattr__(self, "max_batch", batch)
            if default_ring:
                object.__setattr__(self, "geometry", dataclasses.replace(self.geometry, num_slots=slots_for(batch)))
        for fl in engine_flags():
            if not fl.in_geometry:
                fl.check(getattr(self, fl.name))
        if not self.ring_name:
            raise ValueError("--ring must not be empty")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_utilization is not None and self.kv_blocks:
            raise ValueError(f"--kv-blocks {self.kv_blocks} sets the KV cache's size and --gpu-memory-utilization the "
                             "share of memory that sizes it: give one")
        if self.gpu_memory_utilization is not None and self.backend == "cpu":
            raise ValueError("--gpu-memory-utilization applies to the GPU backends; the CPU backend's KV cache "
                             "is sized by --kv-blocks (default: 1 GiB of blocks)")
        if self.grammar_cache_mb is not None and self.backend in ("cpu", "host"):
            raise ValueError(f"--grammar-cache-mb sizes the persistent backend's device arena; the {self.backend} "
                             "backend keeps grammars in host memory (no such limit)")
        if self.geometry.num_slots == SLOTS_DEFAULT and self.max_batch > SLOTS_DEFAULT:
            # a config built without the parser whose default ring would bound its batch widens it as the parser
            # does (`to_argv` must give flags that parse back to it); a ring of 256 given for a batch it holds stays
            wider = dataclasses.replace(self.geometry, num_slots=slots_for(self.max_batch))
            object.__setattr__(self, "geometry", wider)
        if self.backend == "persistent" and self.max_batch > PERSISTENT_MAX_BATCH:
            raise ValueError(f"--max-num-seqs {self.max_batch}: the persistent backend serves at most "
                             f"{PERSISTENT_MAX_BATCH} sequences at once")
        if self.chunked_prefill and 0 < self.max_num_batched_tokens < self.max_batch:
            raise ValueError(f"--max-num-batched-tokens {self.max_num_batched_tokens} cannot hold one decode token "
                             f"for each of --max-num-seqs {self.max_batch} sequences: give at least {self.max_batch}")
        if self.cpu_weights != "auto" and (self.backend not in ("auto", "cpu") or self.dtype != "auto"):
            raise ValueError(f"--cpu-weights {self.cpu_weights} applies to the CPU backend with --dtype auto "
                             f"(got --backend {self.backend}, --dtype {self.dtype})")
        if self.kernel_plan != "auto" and self.backend == "cpu":
            raise ValueError(f"--kernel-plan {self.kernel_plan} applies to the GPU backends (got --backend cpu)")
        if self.gpu_weights != "auto" and self.backend == "cpu":
            raise ValueError(f"--gpu-weights {self.gpu_weights} applies to the GPU backends (got --backend cpu)")
        if self.quantization == "fp8" and self.backend == "cpu":
            raise ValueError("--quantization fp8 runs on the GPU backends (FP8 tensor cores, sm_90); the CPU backend "
                             "has no FP8 arithmetic: drop the flag there (--cpu-weights picks its weights' form)")
        if self.quantization == "fp8" and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"--quantization fp8 computes in bfloat16 (the FP8 products' output): --dtype "
                             f"{self.dtype} does not apply; leave --dtype auto or give bfloat16")
        if self.fp8_kv_cache and self.backend == "cpu":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} runs on the GPU backends (float8_e4m3fn, "
                             "sm_89 and later); the CPU backend's KV cache has its own dtype (fp16 with --dtype auto): "
                             "drop the flag there")
        if self.max_model_len == 1:
            raise ValueError("--max-model-len must be >= 2 (one prompt token and one output token)")
        if self.model is not None and not Path(self.model).exists():
            raise ValueError(f"--model: path {self.model} does not exist")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineConfig:
        """The config from arguments parsed by a parser that ``add_engine_arguments`` filled; a flag of
        DERIVED_DEFAULTS left out takes `left_out`'s value."""
        flags = engine_flags()
        geo = {fl.name: getattr(ns, fl.name) for fl in flags if fl.in_geometry}
        rest = {fl.name: getattr(ns, fl.name) for fl in flags if not fl.in_geometry}
        if rest["max_batch"] is not None and rest["max_batch"] < 1:  # 0 would read as left out
            raise ValueError(f"--max-num-seqs must be >= 1, got {rest['max_batch']}")
        if rest["max_batch"] is not None and geo["num_slots"] is not None and geo["num_slots"] < rest["max_batch"]:
            # both given: a sequence runs in a ring slot, so the smaller would silently bound the larger
            raise ValueError(f"--num-slots {geo['num_slots']} holds fewer requests than --max-num-seqs "
                             f"{rest['max_batch']} runs at once: give --num-slots of at least {rest['max_batch']}, "
                             "or leave it out (it follows --max-num-seqs)")
        if rest["max_batch"] is None:
            rest["max_batch"] = default_max_batch(rest["backend"], geo["num_slots"])
        for values, name in ((geo, "max_prompt_tokens"), (geo, "num_slots")):
            if values[name] is None:
                values[name] = left_out(name, ns.max_model_len, rest["max_batch"])
        return cls(geometry=RingGeometry(**geo), **rest)

    def to_argv(self) -> list[str]:
        """Engine flags that parse back to this config: those whose value is not the default, plus those
        whose default comes from the environment (the child's environment need not be this one's)."""
        argv: list[str] = []
        for fl in engine_flags():
            value = getattr(self.geometry if fl.in_geometry else self, fl.name)
            if fl.name == "max_batch":  # left out only where the child derives the same whatever its host
                slots = self.geometry.num_slots
                given = None if slots == left_out("num_slots", self.max_model_len, self.max_batch) else slots
                if self.backend != "auto" and value == default_max_batch(self.backend, given):
                    continue
            elif fl.name in DERIVED_DEFAULTS:  # left out, it parses back to what the others derive
                if value == left_out(fl.name, self.max_model_len, self.max_batch):
                    continue
            elif value == fl.default and not fl.default_from_env:
                continue
            argv += [fl.flag] if isinstance(value, bool) else [fl.flag, str(value)]
        return argv


PROMPT_TOKENS_DEFAULT = RingGeometry().max_prompt_tokens
SLOTS_DEFAULT = RingGeometry().num_slots


def gpu_visible() -> bool:
    """Whether this process sees an NVIDIA GPU (a /dev/nvidiaN device node, and CUDA_VISIBLE_DEVICES does not hide
    them all), read without importing torch: where one is, --backend auto runs a GPU backend (the engine decides it
    with torch, ``gpu_engine.backend.resolve_backend``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(re.fullmatch(r"nvidia\d+", p.name) for p in Path("/dev").glob("nvidia*"))


def default_max_batch(backend: str, slots: int | None = None) -> int:
    """--max-num-seqs left out: `DEFAULT_MAX_NUM_SEQS` of the backend's kind (under --backend auto, a GPU's
    where ``gpu_visible``), at most a given --num-slots (a ring of N slots runs at most N sequences). The
    supervisor passes the value it derived under --backend auto (`EngineConfig.to_argv`), so its engines and
    their ring agree whatever they see."""
    on_cpu = backend == "cpu" or (backend == "auto" and not gpu_visible())
    kind = DEFAULT_MAX_NUM_SEQS["cpu" if on_cpu else "gpu"]
    return kind if slots is None else min(kind, slots)


def slots_for(max_batch: int) -> int:
    """--num-slots left out: a ring slot for each sequence a step runs and a quarter more for prompts waiting on
    the device (admitted as rows finish, without a trip through the frontend), at least 256; the quarter only up
    to the slots the header's flip bits cover (`FLIP_SLOTS`: past them the engine scans every slot for new
    prompts). The ring grows with them: 90 MiB at 256 slots, 450 MiB at 1,280 (mostly the top-log-prob arena)."""
    return max(SLOTS_DEFAULT, max_batch, min(max_batch + max_batch // 4, FLIP_SLOTS))


def left_out(name: str, max_model_len: int, max_batch: int) -> Any:
    """What DERIVED_DEFAULTS' flag ``name`` (but --max-num-seqs: `default_max_batch`) is when it is not given,
    from the flags it follows: what `EngineConfig.from_namespace` takes for it and `EngineConfig.to_argv` leaves
    out."""
    if name == "num_slots":
        return slots_for(max_batch)
    return max_model_len - 1 if max_model_len > 1 else PROMPT_TOKENS_DEFAULT


# The flags whose default follows other flags: they parse to None when left out, and `from_namespace` derives them.
DERIVED_DEFAULTS = {"max_prompt_tokens": f"--max-model-len - 1 when that is given, else {PROMPT_TOKENS_DEFAULT}: the "
                                         f"default context, {DEFAULT_MAX_MODEL_LEN}, less one",
                    "num_slots": f"{SLOTS_DEFAULT}, or --max-num-seqs and a quarter more where that is larger: a "
                                 "slot for each running sequence, and prompts waiting on the device",
                    "max_batch": f"{DEFAULT_MAX_NUM_SEQS['gpu']} on a GPU, {DEFAULT_MAX_NUM_SEQS['cpu']} on the CPU "
                                 "(--backend auto: a GPU's where one is visible), at most a given --num-slots"}


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """One engine flag, derived from a field of ``EngineConfig`` or of its ``RingGeometry``."""

    name: str                  # field name, also the argparse dest
    flag: str                  # e.g. --max-batch
    default: Any
    help: str
    choices: tuple[str, ...]
    minimum: float | None
    in_geometry: bool
    default_from_env: bool
    aliases: tuple[str, ...] = ()
    kind: type | None = None   # the value's type where the default (None) does not tell

    def check(self, value: Any) -> None:
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.flag} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.minimum is not None and value is not None and value < self.minimum:
            raise ValueError(f"{self.flag} must be >= {self.minimum}, got {value}")

    @property
    def help_with_default(self) -> str:
        """The help text, with the default where there is one to show (argparse fills it in)."""
        if self.name in DERIVED_DEFAULTS:
            return f"{self.help} (default: {DERIVED_DEFAULTS[self.name]})"
        if self.default is None or isinstance(self.default, bool) or "(default:" in self.help:
            return self.help
        return f"{self.help} (default: %(default)s)"


def _to_flag(f: dataclasses.Field[Any], in_geometry: bool) -> Flag:
    meta = f.metadata
    from_env = f.default is dataclasses.MISSING
    default = f.default_factory() if from_env else f.default  # type: ignore[misc,operator]
    if isinstance(default, bool) and default:
        raise TypeError(f"flag field {f.name} must default to False (flags can only switch it on)")
    return Flag(f.name, meta.get("flag") or "--" + f.name.replace("_", "-"), default, meta["help"],
                meta.get("choices", ()), meta.get("minimum"), in_geometry, from_env, meta.get("aliases", ()),
                meta.get("kind"))


def engine_flags() -> tuple[Flag, ...]:
    """Every engine flag, in declaration order; geometry's fields where ``geometry`` stands."""
    out: list[Flag] = []
    for f in dataclasses.fields(EngineConfig):
        if f.metadata.get("fields_are_flags"):
            out += [_to_flag(g, True) for g in dataclasses.fields(RingGeometry)]
        else:
            out.append(_to_flag(f, False))
    return tuple(out)


class ArgumentAdder(Protocol):
    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


def add_engine_arguments(ap: ArgumentAdder) -> None:
    """Declare every engine flag on a parser or argument group, with its help text and default."""
    for fl in engine_flags():
        names = (fl.flag, *fl.aliases)
        if isinstance(fl.default, bool):
            ap.add_argument(*names, dest=fl.name, action="store_true", help=fl.help)
            continue
        kind = fl.kind or (str if fl.default is None else type(fl.default))
        metavar = None if fl.choices else "N" if kind is int else fl.flag.lstrip("-").upper()
        # --max-prompt-tokens, --num-slots and --max-num-seqs parse to None when left out: others derive from them
        default = None if fl.name in DERIVED_DEFAULTS else fl.default
        ap.add_argument(*names, dest=fl.name, type=kind, default=default, choices=fl.choices or None,
                        metavar=metavar, help=fl.help_with_default)


def given_engine_flags(ns: argparse.Namespace) -> list[str]:
    """The engine flags a command line gave (``add_engine_arguments``' parse): each whose parsed value is not the
    parser's default."""
    out = []
    for fl in engine_flags():
        default = None if fl.name in DERIVED_DEFAULTS else fl.default
        if getattr(ns, fl.name, default) != default:
            out.append(fl.flag)
    return out


def engine_config_from(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> EngineConfig:
    """``EngineConfig.from_namespace``; a bad value ends the program with the parser's usage error."""
    try:
        return EngineConfig.from_namespace(ns)
    except ValueError as exc:
        ap.error(str(exc))
