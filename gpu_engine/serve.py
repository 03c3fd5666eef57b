"""``python -m gpu_engine.serve`` / ``blink engine``: load a model, create the ring, serve it.

The engine process owns the ring segment: it creates it (replacing one left by a dead engine),
serves until the header's shutdown flag or SIGTERM/SIGINT, drains, then unlinks it. An engine that
fails (a device hang or launch failure, or any error while serving) first ends every request the ring
holds for it with ``ENGINE_FAILURE``, then unlinks the ring and exits non-zero, for a restart.

``--rdma-listen ADDR:PORT`` exports the ring to a frontend on another host (a DPU: docs/RDMA.md): the ring is
registered with the RDMA device and a thread answers each frontend's connection exchange, after which the
frontends' reads, writes and atomics reach the ring through the NIC, never through this process. What the
export needs (pyverbs, a device with atomics, the port) is checked before the model loads.

``--standby`` makes a spare, which ``blink serve`` keeps beside the live engine so that a restart skips
the interpreter, the imports and (on the CPU) the weights: it does that much, then waits for the go on
stdin; from there it is the engine it replaces, started the same way (same ring creation, owner checks
and environment).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import numpy as np
import torch

from gpu_engine.backend import Backend, CpuFormats, Servable, kv_blocks_for, resolve_backend
from gpu_engine.engine import RingEngine
from gpu_engine.faults import EXIT_ENGINE_FAILURE, DeviceFailure, Fault, FaultyRunner, arm, parse_faults
from gpu_engine.kernels.cpu_linear import KernelThreads, quant_kernels_available
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.cpu_pack import move_to_huge_pages, pack_for_cpu, release_freed_memory
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.gguf_loader import GGUFSource
from gpu_engine.models.loader import default_model_path, load_model
from gpu_engine.models.shared_weights import identity_of, share
from gpu_engine.policy import Policy
from gpu_engine.runner import Runner, TorchRunner
from shared import env
from shared import ring_layout as L
from shared.config import EngineConfig, add_engine_arguments, engine_config_from
from shared.engine_slots import SlotEngine
from shared.log import get_logger, setup_logging
from shared.remote_ring import ExportServer, is_remote
from shared.ring import Ring, create_shm_ring
from shared.standby import BadGo, wait_for_go
from shared.transport import RingError, SegmentTaken
from shared.transport.rdma import VerbsConfig

log = get_logger("engine")
COLLECT_S = 2.0  # after a failure: how long the engine waits for the frontend to read the failed requests


def build_parser() -> argparse.ArgumentParser:
    """The engine's command line, derived from ``shared.config.EngineConfig``, and ``--standby``."""
    ap = argparse.ArgumentParser(prog="blink engine", description=__doc__.splitlines()[0])
    add_engine_arguments(ap)
    ap.add_argument("--standby", action="store_true",
                    help="a spare engine (blink serve keeps one): do what touches neither the ring nor a GPU, then "
                    "wait for the go on stdin (the ring of the engine it replaces) and go on as that engine")
    ap.add_argument("--standby-gpu-known", action="store_true",
                    help="with --standby: the spare's environment already names the GPU that any go will give it "
                    "(blink serve with one engine), so a spare of a GPU backend makes its CUDA context, with every "
                    "module loaded, before the go; no kernel runs before the go")
    rdma = ap.add_argument_group("RDMA export (a frontend on another host: docs/RDMA.md)")
    rdma.add_argument("--rdma-listen", default=None, metavar="ADDR:PORT",
                      help="export the ring over RDMA: answer frontends' connection exchanges on this TCP address "
                      "(listen on the interface facing the DPU); they name the ring rdma://HOST:PORT/RING")
    rdma.add_argument("--rdma-device", default=None, metavar="NAME",
                      help="the RDMA device to register the ring with (default: the first in /sys/class/infiniband)")
    rdma.add_argument("--rdma-gid-index", type=int, default=0, metavar="N",
                      help="the GID index of the device's port (RoCE: the one of the address the DPU reaches)")
    return ap


def rdma_export(ns: argparse.Namespace, ring_name: str) -> ExportServer | None:
    """The export ``--rdma-listen`` asks for, checked and bound now (before the model loads); None without it.
    ValueError or RingError (RdmaUnavailable: pyverbs or a device missing) saying what is wrong."""
    if is_remote(ring_name):
        raise ValueError(f"--ring {ring_name}: the engine creates its ring under a local name; a frontend on another "
                         "host names it rdma://THIS_HOST:PORT/NAME, the port being this engine's --rdma-listen")
    if ns.rdma_listen is None:
        if ns.rdma_device is not None:
            raise ValueError("--rdma-device applies to an exported ring: give --rdma-listen ADDR:PORT too")
        return None
    return ExportServer(ns.rdma_listen, VerbsConfig(device=ns.rdma_device, gid_index=ns.rdma_gid_index))


def parse_args(argv: list[str] | None) -> EngineConfig:
    ap = build_parser()
    return engine_config_from(ap, ap.parse_args(argv))


def with_fault(runner: Runner, fault: Fault | None) -> Runner:
    """The runner, injecting ``fault`` (BLINK_FAULT) when one is armed."""
    return runner if fault is None else FaultyRunner(runner, fault, env.env().step_timeout_s)


def armed_fault() -> Fault | None:
    """The fault this engine injects (BLINK_FAULT, BLINK_FAULT_ONCE_DIR), logged; ValueError on a bad spec."""
    e = env.env()
    fault = arm(parse_faults(e.fault), e.fault_once_dir)
    if fault is not None:
        log.warning("fault injection armed", kind=fault.kind, at_step=fault.at_step)
    return fault


@dataclasses.dataclass(frozen=True, slots=True)
class CpuWeights:
    """The CPU backend's model, loaded and packed: what a spare engine holds before its go."""

    model: CausalLM
    config: ModelConfig
    formats: CpuFormats
    threads: int
    path: Path


def load_cpu_weights(cfg: EngineConfig) -> CpuWeights:
    """Load the model for the CPU backend (and its kernels' threads): the ring and the KV cache come after."""
    fmt = CpuFormats.for_dtype(cfg.dtype)
    path = Path(cfg.model) if cfg.model else default_model_path()
    torch.manual_seed(cfg.seed)
    own_pool = fmt.packed and cfg.cpu_weights in ("auto", "int8act") and quant_kernels_available()
    # The quantized kernels split their products over their own pool, by default on every core: its workers
    # sleep while the engine idles, and it runs on one thread while the cores are contended (measured on 2
    # cores beside llama.cpp: every speed row better than one thread, docs/benchmarks-history.md). torch keeps one
    # thread then: its OpenMP workers, spinning after every op, took the pool's core (a decode step of 21.6 ms with
    # both on two threads, 17.6 ms with the pool alone).
    threads = (cfg.threads or len(os.sched_getaffinity(0))) if own_pool else cfg.cpu_threads
    KernelThreads.count = threads if own_pool else 0
    torch.set_num_threads(1 if own_pool else threads)
    log.info("loading weights", model=str(path), dtype=cfg.dtype, device="cpu")
    # A Q4_1 GGUF's packed linears are its own blocks: the file is opened once, and those weights are neither
    # dequantized nor written (their parameters stay untouched memory until the packed forms replace them).
    gguf = GGUFSource(path) if path.suffix == ".gguf" and path.is_file() else None
    blocks = None
    if gguf is not None and own_pool and not cfg.random_weights:  # own_pool: the forms that take Q4_1 blocks
        blocks = gguf.q4_1_linears(gguf.config)
    model, mcfg = load_model(path, dtype=fmt.weight_dtype, device="cpu", random_weights=cfg.random_weights,
                             seed=cfg.seed, gguf=gguf, placeholders=blocks or ())
    folder = env.env().cpu_weights_dir
    if folder is not None and not path.is_file():
        log.warning("weights not shared", reason="BLINK_CPU_WEIGHTS_DIR shares a model file's weights, not a folder's",
                    model=str(path))
        folder = None
    if fmt.packed:  # shared weights stay off huge pages: they go into the shared file next
        pack_for_cpu(model, int4_layers=cfg.cpu_weights == "int4", keep_quantized=cfg.cpu_weights != "fp16",
                     int8_activations=cfg.cpu_weights == "int8act", blocks=blocks, huge_pages=folder is None)
    del blocks, gguf  # the file's blocks (copies the packed forms replaced): freed with them, then trimmed
    if folder is not None:
        # one copy for the live engine and the standby (shared_weights); the file's name is of what was loaded
        try:
            got = share(model, folder, identity_of(path, cfg.dtype, cfg.cpu_weights, cfg.random_weights, cfg.seed))
        except OSError as exc:  # a folder that is not private, or full: the engine's own copy, as without it
            log.warning("weights not shared", reason=str(exc), folder=str(folder))
            if fmt.packed:
                move_to_huge_pages(model)
        else:
            log.info("weights shared", file=str(got.path), mib=got.shared_bytes >> 20, wrote=got.written,
                     kept_mib=got.kept_bytes >> 20)
    release_freed_memory()
    return CpuWeights(model, mcfg, fmt, threads, path)


def build_cpu_backend(cfg: EngineConfig, fault: Fault | None = None, weights: CpuWeights | None = None) -> Backend:
    """KV cache, policy and runner on the CPU, around ``weights`` (loaded here when not given)."""
    w = weights or load_cpu_weights(cfg)
    mcfg, fmt = w.config, w.formats
    kv = KVCache(mcfg, kv_blocks_for(cfg, mcfg, fmt.kv_dtype), cfg.block_size, dtype=fmt.kv_dtype, device="cpu")
    max_context = cfg.context_limit(mcfg.max_position_embeddings)
    policy = Policy(kv.allocator, cfg.block_size, cfg.max_batch, cfg.token_budget(gpu=False) or max(2048, max_context),
                    chunked=cfg.chunked_prefill, prefix_caching=cfg.prefix_caching)
    log.info("model loaded", model=str(w.path), family=mcfg.family, kv_blocks=kv.num_blocks, threads=w.threads,
             weights=f"{cfg.cpu_weights} packed" if fmt.packed else str(fmt.weight_dtype), kv_dtype=str(fmt.kv_dtype),
             block_size=cfg.block_size, max_context=max_context, chunked_prefill=policy.chunked,
             prefix_caching=policy.prefix_caching, token_budget=policy.token_budget)
    runner = with_fault(TorchRunner(w.model, kv), fault)
    return Backend(runner, policy, tuple(mcfg.eos_token_ids), max_context, mcfg.vocab_size)


def build_backend(cfg: EngineConfig, fault: Fault | None = None, weights: CpuWeights | None = None) -> Backend:
    if cfg.backend == "cpu":
        return build_cpu_backend(cfg, fault, weights)
    from gpu_engine.gpu.serve_gpu import build_gpu_backend  # noqa: PLC0415 - needs CUDA

    return build_gpu_backend(cfg, fault)


def fail_requests(ring: Ring, exc: BaseException) -> None:
    """The engine failed: end every request the ring holds for it with ENGINE_FAILURE and give the frontend
    up to ``COLLECT_S`` to read them (so clients get this error, not a lost ring's), then say FAILED."""
    slots = SlotEngine(ring)
    failed = slots.fail_in_flight()
    log.error("engine failed", error=str(exc) or type(exc).__name__, kind=type(exc).__name__,
              requests_failed=len(failed))
    slots.wait_collected(failed, COLLECT_S)
    ring.header_store32("engine_state", L.EngineState.FAILED)


def serve(cfg: EngineConfig, backend: Backend, export: ExportServer | None = None) -> None:
    """Create the ring, serve it until shutdown, unlink it; with ``export``, the ring is exported from its
    creation until it is unlinked."""
    geometry = cfg.geometry
    if not backend.prompt_logprobs:  # no prompt log-probs computed: no arenas
        geometry = dataclasses.replace(geometry, max_prompt_logprobs_tokens=0)
    ring = create_shm_ring(cfg.ring_name, geometry)
    if export is not None:
        try:
            export.start(ring)  # registered before READY: a frontend that attaches sees the engine start
        except BaseException:
            export.close()
            ring.transport.unlink()  # type: ignore[attr-defined]
            ring.close()
            raise

    def on_signal(signum: int, frame: FrameType | None) -> None:
        ring.header_store32("shutdown", 1)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        ring.header_store32("vocab_size", backend.vocab_size)
        ring.header_store32("max_context", backend.max_context)
        write_cache_config(ring, cfg, backend)
        engine: Servable
        if backend.make_engine is not None:
            engine = backend.make_engine(ring)
        else:
            assert backend.runner is not None
            engine = RingEngine(ring, backend.runner, backend.policy, backend.eos_ids, backend.max_context,
                                backend.vocab_size)
        log.info("engine ready", ring=cfg.ring_name, backend=cfg.backend, slots=cfg.geometry.num_slots,
                 max_model_len=backend.max_context)
        engine.serve()
    except BaseException as exc:
        fail_requests(ring, exc)
        raise
    finally:
        if export is not None:
            export.close()  # every frontend's lease ends, then the ring is deregistered, before it is unmapped
        ring.transport.unlink()  # type: ignore[attr-defined]
        ring.close()


KV_DTYPES = {"float32": L.KvCacheDtype.FLOAT32, "float16": L.KvCacheDtype.FLOAT16,
             "bfloat16": L.KvCacheDtype.BFLOAT16, "float8_e4m3fn": L.KvCacheDtype.FLOAT8_E4M3}


def kv_dtype_name(cfg: EngineConfig) -> str:
    """The KV cache's torch dtype name (``cfg.backend`` resolved): the CPU backend's format, FP8 under
    --kv-cache-dtype fp8 on a GPU, else the model's GPU dtype."""
    if cfg.backend == "cpu":
        return str(CpuFormats.for_dtype(cfg.dtype).kv_dtype).removeprefix("torch.")
    return cfg.gpu_kv_dtype_name()


def write_cache_config(ring: Ring, cfg: EngineConfig, backend: Backend) -> None:
    """The KV cache's configuration in the ring header (schema minor 6), for the frontend's
    ``vllm:cache_config_info``: block size, element type, prefix caching and its block hash, and on a GPU
    the fraction of free memory the cache is sized by (``cfg.backend`` is resolved here)."""
    on_cpu = cfg.backend == "cpu"
    ring.header_store32("kv_block_size", cfg.block_size)
    ring.header_store32("kv_cache_dtype", KV_DTYPES.get(kv_dtype_name(cfg), L.KvCacheDtype.UNKNOWN))
    ring.header_store32("cache_features", L.CacheFeatures.PREFIX_CACHING if backend.policy.prefix_caching else 0)
    persistent = backend.make_engine is not None  # the CUDA scheduler's own prefix cache (sched_prefix.cuh)
    ring.header_store32("prefix_hash", L.PrefixHash.SPLITMIX64 if persistent else L.PrefixHash.BLAKE2B_64)
    fraction = 0.0 if on_cpu else cfg.kv_memory_fraction
    ring.header_store32("gpu_memory_utilization", int(np.float32(fraction).view(np.uint32)))
    ring.header_store64("grammar_arena_bytes", 0)  # minor 7: the persistent engine writes its arena's size


def runs_on_cpu(cfg: EngineConfig) -> bool:
    """Whether the engine runs on the CPU, known without a CUDA call: --backend cpu, or auto with a torch built
    without CUDA. A spare may load weights only then: beside a live GPU engine it holds no weights in GPU memory."""
    return cfg.backend == "cpu" or (cfg.backend == "auto" and not torch.backends.cuda.is_built())


def early_context() -> bool:
    """A spare whose GPU is known makes its CUDA context now (every module loaded: CUDA_MODULE_LOADING=EAGER), so
    that the go skips it. It launches nothing, so it has no work to time-slice with a live persistent kernel (its
    effect on serving beside one: RELIABILITY.md, "On the GPU machine"); the context's memory comes out of what
    the live engine left free (--gpu-memory-utilization). False when the context cannot be made (no GPU, the
    memory taken): the go then makes it as a cold start does."""
    try:
        torch.empty(1, device="cuda")  # the first allocation makes the context; nothing is launched
    except (RuntimeError, AssertionError) as exc:  # torch's error for a failed cuInit or context
        log.warning("standby engine: no CUDA context before the go", error=str(exc))
        return False
    return True


def stand_by(cfg: EngineConfig, gpu_known: bool = False) -> tuple[EngineConfig, CpuWeights | None] | None:
    """A spare engine: load what needs neither the ring nor a GPU (the CPU backend's weights; the GPU backends'
    modules, and with ``gpu_known`` the CUDA context), then block until blink serve's go (``shared.standby``).
    The replaced engine's config and the weights; None when the pipe closed first (the supervisor stopped or
    died)."""
    weights, context = None, False
    if runs_on_cpu(cfg):
        cfg = resolve_backend(cfg)
        weights = load_cpu_weights(cfg)
    else:
        import gpu_engine.gpu.serve_gpu  # noqa: F401, PLC0415 - its imports only: no kernel before the go
        context = gpu_known and early_context()
    rss_mib = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    log.info("standby engine ready", pid=os.getpid(), weights_loaded=weights is not None, cuda_context=context,
             rss_mib=rss_mib)
    go = wait_for_go(sys.stdin.buffer)
    if go is None:
        return None
    if context and any(os.environ.get(k) != v for k, v in go.env.items()):
        raise BadGo(f"the go names another GPU ({go.env}) than the spare's context was made on")
    os.environ.update(go.env)  # before any CUDA call (without a context yet): the replaced engine's GPU
    return dataclasses.replace(cfg, ring_name=go.ring), weights


def main(argv: list[str] | None = None) -> int:
    setup_logging("engine")
    ap = build_parser()
    ns = ap.parse_args(argv)
    cfg = engine_config_from(ap, ns)
    if cfg.backend != "cpu":
        # Load every CUDA module up front: lazy loading stalls while the persistent kernel runs.
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    try:
        export = rdma_export(ns, cfg.ring_name)
    except (ValueError, RingError) as exc:  # before anything loads: no pyverbs, no device, the port taken
        log.error("rdma export refused", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        weights = None
        if ns.standby:
            if (taken := stand_by(cfg, ns.standby_gpu_known)) is None:
                return 0
            cfg, weights = taken
        cfg = resolve_backend(cfg)
        backend = build_backend(cfg, armed_fault(), weights)
    except BadGo as exc:
        log.error("standby go refused", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a flag the resolved backend cannot honour (--max-model-len, ...)
        log.error("engine config refused", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModelLoadError as exc:
        log.error("model load failed", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        serve(cfg, backend, export)
    except SegmentTaken as exc:  # another user holds the ring's name: say so, no traceback
        log.error("ring name taken", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RingError as exc:  # the ring could not be made or exported (an RDMA registration refused, ...)
        log.error("ring not served", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DeviceFailure as exc:
        # The device may still run the hung work: leave at once, without the interpreter's teardown.
        log.error("device failure: the engine exits to be restarted", error=str(exc), code=EXIT_ENGINE_FAILURE)
        sys.stderr.flush()
        os._exit(EXIT_ENGINE_FAILURE)
    log.info("engine stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
