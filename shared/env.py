"""Every environment variable Blink reads, typed, in one place; read once at start-up.

Each field of ``Env`` names its variable, how its text is parsed and what it means; an unset or empty
variable keeps the field's default. No other product module reads a ``BLINK_*`` variable.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def default_run_dir() -> Path:
    """Where the services' Unix sockets live unless BLINK_RUN_DIR or --run-dir says otherwise:
    ``$XDG_RUNTIME_DIR/blink`` when that folder is this user's and closed to others, else ``/tmp/blink-UID``.
    Either way the services create it with mode 0700 and refuse it when it is not private
    (``shared.ipc.run_dir_problem``): a name in /tmp can be guessed and taken by another user."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return Path(xdg) / "blink"
    return Path(f"/tmp/blink-{os.geteuid()}")


# The one default of BLINK_HEARTBEAT_TIMEOUT_S, which every service's config and the container probe take:
# far above the longest silence of a live CPU engine measured beside a co-tenant that loads both cores
# (bench/beat_gaps.py; RELIABILITY.md, "False outages"), so a busy host makes Blink slower, never down.
HEARTBEAT_TIMEOUT_S = 10.0


def _var(name: str, default: Any, meaning: str, parse: Callable[[str], Any] = str,
         factory: Callable[[], Any] | None = None) -> Any:
    meta = {"var": name, "parse": parse, "help": meaning}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True, slots=True)
class Env:
    """Values from the environment. Names and meanings are also listed in the README."""

    log_level: str = _var("BLINK_LOG_LEVEL", "info", "log level of every process", str.lower)
    log_json: bool | None = _var("BLINK_LOG_JSON", None, "force JSON logs on or off "
                                 "(default: JSON when stderr is not a terminal)", _bool)
    run_dir: Path = _var("BLINK_RUN_DIR", None, "Unix sockets of the services", Path, factory=default_run_dir)
    ring_name: str = _var("BLINK_RING_NAME", "blink-ring", "shared-memory segment name")
    api_key: str | None = _var("BLINK_API_KEY", None, "same as --api-key")
    heartbeat_timeout_s: float = _var("BLINK_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S,
                                      "engine considered down (its streams failed, new requests refused, and "
                                      "blink serve replacing it as hung) after this much heartbeat silence, on "
                                      "each observer's own clock (RELIABILITY.md, 'False outages')", float)
    sched_yield_all: bool = _var("BLINK_SCHED_YIELD_ALL", False,
                                 "the persistent scheduler leaves its SM every step", _bool)
    sched_plain_claim: bool = _var("BLINK_SCHED_PLAIN_CLAIM", False,
                                   "claim slots by a store, not a PCIe compare-and-swap", _bool)
    sched_full_scan: bool = _var("BLINK_SCHED_FULL_SCAN", False,
                                 "read every slot's state word at each doorbell", _bool)
    step_timeout_s: float = _var("BLINK_STEP_TIMEOUT_S", 5.0, "a GPU step not complete after this long is a device "
                                 "hang: the engine fails its requests with ENGINE_FAILURE and exits", float)
    fault: str = _var("BLINK_FAULT", "", "debug: faults the engine injects, KIND@STEP[,KIND@STEP...], KIND hang "
                      "or launch (gpu_engine/faults.py)")
    fault_once_dir: Path | None = _var("BLINK_FAULT_ONCE_DIR", None, "debug: each BLINK_FAULT entry fires once "
                                       "per folder (an engine arms the first one whose marker it creates)", Path)
    cuda_build_dir: Path | None = _var("BLINK_CUDA_BUILD_DIR", None,
                                       "where the scheduler library is built (default: gpu_engine/csrc/build)", Path)
    metrics_dir: Path | None = _var("PROMETHEUS_MULTIPROC_DIR", None, "folder where every gateway's metrics are "
                                    "summed (blink serve sets it to RUN_DIR/metrics)", Path)
    device_processors: bool = _var("BLINK_DEVICE_PROCESSORS", True, "the persistent scheduler applies the "
                                   "penalties, logit_bias and min_tokens on the device (0: left out of its graphs, "
                                   "and those fields refused with a 400 on that backend)", _bool)
    device_prompt_logprobs: bool = _var("BLINK_DEVICE_PROMPT_LOGPROBS", True, "the persistent scheduler computes "
                                        "prompt log-probs through a score graph (0: no score graph, and "
                                        "prompt_logprobs and echo with logprobs refused with a 400 on that backend)",
                                        _bool)
    device_prefix_cache: bool = _var("BLINK_DEVICE_PREFIX_CACHE", True, "the persistent scheduler caches prefixes "
                                     "on the device where the policy does (0: not on that backend, whatever "
                                     "--enable-prefix-caching says)", _bool)
    skinny_matmul: str = _var("BLINK_SKINNY_MATMUL", "", "GPU backends: the dense linears of steps of up to 8 rows "
                              "(ROWS with NAME:ROWS) through this configuration of the skinny matmul (a "
                              "gpu_engine.kernels.gemv.GEMV_CONFIGS name) instead of cuBLAS; unset: cuBLAS at "
                              "every step size")
    tiled_linear: str = _var("BLINK_TILED_LINEAR", "auto", "GPU backends: the dense linears of steps of up to "
                             "128 rows (past the skinny ones with BLINK_SKINNY_MATMUL) through the tiled linear where "
                             "this plan (a gpu_engine.kernels.tiled_linear.TILED_PLANS name) takes their weight's "
                             "shape and the step's size, or through this configuration (a TILED_CONFIGS name), "
                             "cuBLAS for the rest; auto: the plan measured on this GPU (h200+fused on an NVIDIA "
                             "H200; cuBLAS elsewhere); off: cuBLAS. NAME+fused (or +fused:ROWS) also fuses the "
                             "kernels around the products it takes (RMSNorm, up to ROWS rows where given, SiLU, "
                             "residual add, q/k norms + RoPE + KV write) and, at one row, folds decode attention in "
                             "one launch; measured faster than NAME alone on the H200 (BENCHMARKS.md)")
    one_launch: str = _var("BLINK_ONE_LAUNCH", "", "GPU backends, with a +fused BLINK_TILED_LINEAR: parts of the "
                           "decode step run as phases of one launch each (the same bits): attention (qkv with its "
                           "norm and q/k/v preparation, decode attention, o with its residual add, where the fused "
                           "forms take them all through 4-warp configurations), mlp (a dense layer's gate_up with its "
                           "norm and SiLU, down with its add, through configurations of equal warps, e.g. the "
                           "h200_4w plan), layer (both halves of a dense layer in one launch, every product at 4 "
                           "warps), moe (an MoE layer's router, gate_up and down in steps of at most 64 token-expert "
                           "pairs); comma-separated, or all; not yet measured on a GPU, so none by default")
    pdl: bool = _var("BLINK_PDL", False, "GPU backends: the decode step's Triton kernels (norms, q/k/v preparation, "
                     "decode attention, SiLU, tiled linears, MoE routing and sort-free experts) launched with "
                     "programmatic dependent launch, each "
                     "scheduled while the one before it finishes; measured slower on the H200 (bench/roofline.py "
                     "--pdl, BENCHMARKS.md), so off by default", _bool)
    decode_walk: str = _var("BLINK_DECODE_WALK", "", "GPU backends: in decode steps of at least 33 rows (BATCH "
                            "with N:BATCH), decode attention walks each row of at most N splits of 256 tokens in one "
                            "program and splits the longer ones (the same bits); measured slower than splitting every "
                            "row on the H200 (BENCHMARKS.md), so off by default")
    decode_lanes: str = _var("BLINK_DECODE_LANES", "", "GPU backends: in decode steps of at least 33 rows (BATCH "
                             "with P:BATCH), decode attention's split launch runs P programs a row and KV head, each "
                             "taking every P-th split, instead of a program a split of the block table (those past a "
                             "row's context exit at once); the same bits; measured faster with equal short contexts "
                             "but slower on served ones on the H200 (BENCHMARKS.md), so off by default")
    rank_plan_cache: bool = _var("BLINK_RANK_PLAN_CACHE", True, "keep the tokenizer's checked rank plans in "
                                 "$XDG_CACHE_HOME/blink/rank-plans (0: check the merges at every start)", _bool)
    cpu_weights_dir: Path | None = _var("BLINK_CPU_WEIGHTS_DIR", None, "the CPU backend keeps its loaded weights "
                                        "in a file there that every engine loading them the same way maps (the "
                                        "live and the standby engine: held once, not on huge pages; unset: each "
                                        "engine its own copy)", Path)
    tokenizer_assets: Path = _var("BLINK_TOKENIZER_ASSETS", None, "tokenizer files of other model families "
                                  "for the tests", Path, factory=lambda: Path.home() / ".cache/blink/tokenizer-assets")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Env:
        e = os.environ if environ is None else environ
        given: dict[str, Any] = {}
        try:
            for f in dataclasses.fields(cls):
                raw = e.get(f.metadata["var"], "")
                if raw != "":
                    given[f.name] = f.metadata["parse"](raw)
        except ValueError as exc:
            raise SystemExit(f"bad environment variable {f.metadata['var']}: {exc}") from None
        return cls(**given)

    @staticmethod
    def variables() -> dict[str, str]:
        """Every variable read, with its meaning."""
        return {f.metadata["var"]: f.metadata["help"] for f in dataclasses.fields(Env)}


_ENV: Env | None = None


def env() -> Env:
    """The process's environment, read on first use and frozen afterwards."""
    global _ENV
    if _ENV is None:
        _ENV = Env.from_environ()
    return _ENV
