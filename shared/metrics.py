"""Prometheus metrics of the frontend: vLLM's series (``vllm:``) as vLLM defines them, and Blink's own (``blink:``).

One ``FrontendMetrics`` per gateway process. Under ``blink serve`` every gateway writes its values to
files in one folder (prometheus_client's multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR``, which the
supervisor sets to ``RUN_DIR/metrics``), and a scrape of any gateway sums them, so ``--gateways N``
shows every request once.

The ``vllm:`` series carry vLLM's names, types, labels (``model_name`` and ``engine``, the engine's
index: ``"0"`` with one engine, ``0 .. N-1`` under ``--data-parallel-size N``), bucket boundaries and
meanings (vllm/v1/metrics/loggers.py), so that vLLM's Grafana dashboards read them unchanged
(tests/test_grafana_metrics.py checks every query of theirs that Blink serves; docs/API.md lists them):

* observed by the gateway as requests run, under the engine that ran the request: time to first token,
  inter-token latency, per-request time per output token, end-to-end latency, the request's phases from the
  ring slot's clocks, each measured on one machine's clock (queue: handed to the tracker until it sat in a ring
  slot, on the gateway's clock, plus claimed by the engine until its first prompt chunk was scheduled, on the
  engine's; prefill: until its first token; decode: first to last token; inference: prefill plus decode), its
  prompt, generated and allowed (``max_tokens``) token counts, ``n`` and the most tokens one of its ``n``
  choices generated, the prompt and generated token counters (prompt tokens by source: computed or found in the
  prefix cache), and finished requests by ``finished_reason`` (``stop``, ``length``, ``abort``, and ``error``
  for an engine failure answered with a 5xx);
* read from each engine's ring header at the scrape: running and waiting requests (waiting by reason),
  KV cache usage, preemptions, the prefix cache's queries and hits, and ``vllm:cache_config_info``;
* the HTTP server's ``http_requests_total`` and ``http_request_duration_seconds`` (prometheus-fastapi-
  instrumentator's, which vLLM serves), without the probe and scrape paths.

The ``blink:`` series keep their meaning: the gateway's latency histograms and token counters, totals over
the engines of the gauges and of the engine's own counters (steps, tokens, preemptions, scheduler tail
launches, step budget use, prefix cache), ring slots in use, and what the connection limits did
(``http_connections``, dpu_gateway/connguard.py). Per engine, where vLLM has no series: ``blink:dp_engine_up``
(1 while it serves), ``blink:dp_slots_in_use`` and ``blink:dp_engine_<counter>`` for steps, prompt and output
tokens and tail launches.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from shared import ring_layout as L
from shared.ring import STEP_FILL_BOUNDS

# Blink's own latency histograms (blink:*)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)

# vLLM's boundaries (vllm/v1/metrics/buckets.py): its dashboards' SLO tiles select one of them by `le`.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
HTTP_DURATION_BUCKETS = (0.1, 0.5, 1.0)  # prometheus-fastapi-instrumentator's http_request_duration_seconds
HTTP_UNCOUNTED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})  # as vLLM's

VLLM_LABELS = ["model_name", "engine"]
FINISHED_REASONS = ("stop", "length", "abort", "error")  # what a Blink request can end with (vLLM's names)
# vLLM's prompt token sources; external_kv_transfer stays 0: Blink has no KV connector bringing in computed KV
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's reasons a request waits; deferred stays 0: Blink holds no request back for a LoRA budget or a KV
# transfer, every waiting request waits for batch rows, KV blocks, the step's token budget or a ring slot
WAITING_REASONS = ("capacity", "deferred")

# the prefix cache's counters (ring header, since schema minor 4), as counters named blink:NAME
PREFIX_CACHE_COUNTERS = {"prefix_cache_queries": "Prompt tokens looked up in the prefix cache at admissions.",
                         "prefix_cache_hits": "Prompt tokens found in the prefix cache at admissions.",
                         "prefix_cache_evictions": "Cached KV blocks evicted from the prefix cache."}
# the steps' tokens and their graphs' padding (ring header, since schema minor 7), as counters named blink:NAME
STEP_TOKEN_COUNTERS = {"step_tokens": "Tokens the engine's steps carried (prompt chunks and decodes).",
                       "padded_tokens": "Tokens the engine's step graphs computed past the steps' own (padding "
                                        "up to the captured shape)."}
# the engine's counters in the ring header (EngineStats), as counters named blink:engine_NAME
ENGINE_COUNTERS = {"steps": "Decode steps the engine ran.", "prompt_tokens": "Prompt tokens the engine prefilled.",
                   "output_tokens": "Tokens the engine generated.", "preemptions": "Requests preempted.",
                   "window_relaunches": "Persistent scheduler tail launches."}
ENGINE_GAUGES = {"kv_blocks_total": "KV cache blocks.", "kv_blocks_free": "KV cache blocks free.",
                 "token_budget": "Tokens one engine step may carry (--max-num-batched-tokens)."}
PER_ENGINE_COUNTERS = ("steps", "prompt_tokens", "output_tokens", "window_relaunches")  # blink:dp_engine_*
KV_DTYPE_NAMES: dict[int, str] = {L.KvCacheDtype.FLOAT32: "float32", L.KvCacheDtype.FLOAT16: "float16",
                                  L.KvCacheDtype.BFLOAT16: "bfloat16", L.KvCacheDtype.FLOAT8_E4M3: "fp8_e4m3"}
PREFIX_HASH_NAMES: dict[int, str] = {L.PrefixHash.BLAKE2B_64: "blake2b_64", L.PrefixHash.SPLITMIX64: "splitmix64"}


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """vLLM's token-count boundaries: 1, 2, 5, 10, 20, 50, ... up to ``limit`` (its max_model_len)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
    """An engine's KV cache as its ring header says (schema minor 6), for ``vllm:cache_config_info``."""

    block_size: int
    kv_dtype: str
    prefix_caching: bool
    prefix_hash: str
    gpu_memory_utilization: float | None  # None: the cache is not sized by GPU memory (the CPU backend)
    num_blocks: int

    @classmethod
    def of_header(cls, header: Any, num_blocks: int) -> CacheConfig | None:
        """From the ring header's record (or a mapping of its words); None for an engine that wrote none (a
        schema minor below 6, or one that does not say)."""
        block_size = int(header["kv_block_size"])
        if not block_size:
            return None
        fraction = float(header["gpu_memory_utilization"])
        return cls(block_size, KV_DTYPE_NAMES.get(int(header["kv_cache_dtype"]), "unknown"),
                   bool(int(header["cache_features"]) & L.CacheFeatures.PREFIX_CACHING),
                   PREFIX_HASH_NAMES.get(int(header["prefix_hash"]), "unknown"),
                   round(fraction, 6) if fraction > 0 else None, num_blocks)

    def labels(self) -> dict[str, str]:
        """The labels vLLM's dashboards read, each the text of the value (vLLM writes ``str(value)``): CPU
        blocks and KV offloading are ``None`` because Blink keeps no KV blocks off the device."""
        return {"num_gpu_blocks": str(self.num_blocks), "block_size": str(self.block_size),
                "cache_dtype": self.kv_dtype, "gpu_memory_utilization": str(self.gpu_memory_utilization),
                "enable_prefix_caching": str(self.prefix_caching), "prefix_caching_hash_algo": self.prefix_hash,
                "num_cpu_blocks": "None", "kv_offloading_backend": "None", "kv_offloading_size": "None"}


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSample:
    """One engine's values at a scrape: the ``vllm:`` engine series and the ``blink:dp_*`` ones."""

    engine: int
    up: bool
    running: int
    waiting: int
    slots_in_use: int
    kv_usage: float
    counters: Mapping[str, int]  # ENGINE_COUNTERS' and PREFIX_CACHE_COUNTERS' names
    cache: CacheConfig | None = None
    attached: bool = True  # a ring is attached (the engine runs, or is starting); else its values are zeros


@dataclasses.dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request (a choice of an ``n > 1`` request is one) as vLLM's per-request series see it.
    Phase times in seconds; None where the clocks that bound them are not known."""

    engine: int
    finished_reason: str
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    max_tokens: int
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None


def phase_times(admit_ns: int, schedule_ns: int, first_token_ns: int, last_token_ns: int,
                ring_wait_s: float | None = None) -> tuple[float | None, float | None, float | None]:
    """(queue, prefill, decode) seconds from the ring slot's clocks (ns, all of the engine's one clock: its
    CLOCK_REALTIME, or the GPU's timer set to it; 0: not known), each a span between two of them, never between
    two machines' clocks: queue from the engine claiming the request (vLLM's queued) to scheduling its first prompt
    chunk, plus ``ring_wait_s``, the request's wait before it reached the ring, measured on the gateway's own
    clock; prefill from its first chunk's step to its first token; decode from the first token to the last."""

    def span(a: int, b: int) -> float | None:
        return max(b - a, 0) / 1e9 if a and b else None

    queue = span(admit_ns, schedule_ns)
    if queue is not None and ring_wait_s is not None:
        queue += max(ring_wait_s, 0.0)
    return queue, span(schedule_ns, first_token_ns), span(first_token_ns, last_token_ns)


PER_ENGINE_GAUGES = {"engine_up": ("1 while the engine serves (fresh heartbeat, READY), else 0.", "up"),
                     "slots_in_use": ("This engine's ring slots not EMPTY.", "slots_in_use")}


def per_engine_families(model_name: str, samples: Sequence[EngineSample]) -> list[Metric]:
    """The ``blink:dp_*`` families, one sample per engine (label ``engine``)."""
    if not samples:
        return []
    labels = ["model_name", "engine"]
    out: list[Metric] = []
    for name, (doc, attr) in PER_ENGINE_GAUGES.items():
        gauge = GaugeMetricFamily(f"blink:dp_{name}", doc, labels=labels)
        for s in samples:
            gauge.add_metric([model_name, str(s.engine)], float(getattr(s, attr)))
        out.append(gauge)
    for name in PER_ENGINE_COUNTERS:
        family = CounterMetricFamily(f"blink:dp_engine_{name}", f"{ENGINE_COUNTERS[name]} (per engine)",
                                     labels=labels)
        for s in samples:
            family.add_metric([model_name, str(s.engine)], float(s.counters.get(name, 0)))
        out.append(family)
    return out


def vllm_engine_families(model_name: str, samples: Sequence[EngineSample]) -> list[Metric]:
    """vLLM's engine series, one sample per engine with a ring (labels ``model_name``, ``engine``)."""
    present = [s for s in samples if s.attached]
    if not present:
        return []

    def gauge(name: str, doc: str, value: Callable[[EngineSample], float]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
        for s in present:
            family.add_metric([model_name, str(s.engine)], value(s))
        return family

    def counter(name: str, doc: str, key: str) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
        for s in present:
            family.add_metric([model_name, str(s.engine)], float(s.counters.get(key, 0)))
        return family

    by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Requests waiting, by why they wait: "
                                  "capacity (batch rows, KV blocks, the step's token budget, a ring slot); deferred "
                                  "is always 0, Blink defers no request (no LoRA budget, no KV transfer).",
                                  labels=[*VLLM_LABELS, "reason"])
    for s in present:
        by_reason.add_metric([model_name, str(s.engine), "capacity"], float(s.waiting))
        by_reason.add_metric([model_name, str(s.engine), "deferred"], 0.0)
    out: list[Metric] = [
        gauge("vllm:num_requests_running", "Requests in the engine's running batch.", lambda s: float(s.running)),
        gauge("vllm:num_requests_waiting", "Requests waiting for the engine: claimed and not running (queued or "
              "preempted), published to its ring and not yet claimed, and with one engine those the gateway holds "
              "until a ring slot frees.", lambda s: float(s.waiting)),
        by_reason,
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage: the engine's KV blocks in use / its blocks (1 means 100 "
              "percent).", lambda s: s.kv_usage),
        counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine (running requests whose "
                "KV blocks it freed to make room, resumed later by recomputing them).", "preemptions"),
        counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                "prefix_cache_queries"),
        counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                "prefix_cache_hits"),
    ]
    configured = [s for s in present if s.cache is not None]
    if configured:
        names = [*configured[0].cache.labels(), "engine"]  # type: ignore[union-attr]
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the engine's KV cache (the ring header's "
                                 "words, schema minor 6); always 1.", labels=names)
        for s in configured:
            info.add_metric([*s.cache.labels().values(), str(s.engine)], 1.0)  # type: ignore[union-attr]
        out.append(info)
    return out


# The files prometheus_client maps for one process's values (FILE_KIND_PID.db; a gauge's kind names its mode), and
# the size each is given up front. The library creates them sparse and writes through a mapping, so on a full
# filesystem the first write to a page is a SIGBUS; allocated here first (posix_fallocate), the library keeps them
# at that size, and a full filesystem is an OSError at start-up instead.
METRIC_FILE_KINDS = ("counter", "histogram", "gauge_livemostrecent", "gauge_livesum")
METRIC_FILE_BYTES = 1 << 20


class MetricsSpaceError(OSError):
    """The metrics files could not be allocated (a full or read-only run-dir filesystem)."""


def preallocate_metric_files(folder: Path, pid: int) -> None:
    """Allocate this process's metrics files in ``folder`` before prometheus_client maps them."""
    for kind in METRIC_FILE_KINDS:
        path = folder / f"{kind}_{pid}.db"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, METRIC_FILE_BYTES)
            finally:
                os.close(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise MetricsSpaceError(exc.errno, f"cannot allocate the metrics file {path} ({METRIC_FILE_BYTES} "
                                    f"bytes): {exc.strerror}") from None


TOKEN_FLUSH_S = 0.1  # the most a gateway's per-token observations wait before they reach the shared values


class TokenGaps:
    """One histogram's per-token observations, counted in the process and written to its values at each ``flush``
    (the gateway's every ``TOKEN_FLUSH_S``). Under ``blink serve`` each value is a memory-mapped file (a scrape sums
    the gateways'), and an ``observe`` writes two of them (the sum and a bucket), each write checking the process
    id: observed token by token, three histograms took about a fifth of a gateway's CPU. The bucket is the one
    ``observe`` picks (the first upper bound at or above the amount); the counts are added as prometheus_client's
    own ``observe`` adds them (its ``_sum`` and ``_buckets`` values, as in the pinned version)."""

    __slots__ = ("child", "bounds", "counts", "total")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds: list[float] = list(child._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, amount: float, n: int) -> None:
        self.counts[min(bisect.bisect_left(self.bounds, amount), len(self.bounds) - 1)] += n
        self.total += amount * n

    def flush(self) -> None:
        if not any(self.counts):
            return
        self.child._sum.inc(self.total)
        for i, count in enumerate(self.counts):
            if count:
                self.child._buckets[i].inc(count)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0


class FrontendMetrics:
    def __init__(self, model_name: str, multiprocess_dir: Path | None = None, engines: int = 1) -> None:
        """``multiprocess_dir``: the folder every gateway's values go to (None: this process only). It
        must be the ``PROMETHEUS_MULTIPROC_DIR`` this process started with. MetricsSpaceError when its
        files cannot be allocated there. ``engines``: the engines' count, whose ``vllm:`` series are made
        at once (at zero) as vLLM makes its own."""
        self.multiprocess_dir = multiprocess_dir
        if multiprocess_dir is not None:
            preallocate_metric_files(multiprocess_dir, os.getpid())
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.engines = tuple(str(e) for e in range(max(engines, 1)))
        # the context one request may use (prompt + output), 0 while no engine has said; set by the app
        self.context: Callable[[], int] = lambda: 0
        r, label = self.registry, ["model_name"]
        self.ttft = Histogram("blink:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("blink:time_per_output_token_seconds", "Mean time per output token of a request.",
                              label, buckets=TOKEN_GAP_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("blink:inter_token_latency_seconds", "Gap between consecutive output tokens.",
                             label, buckets=TOKEN_GAP_BUCKETS, registry=r).labels(model_name)
        self._itl_gaps = TokenGaps(self.itl)
        self.e2e = Histogram("blink:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             label, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.running = Gauge("blink:num_requests_running", "Requests in the engine's decode batch.", label,
                             registry=r, multiprocess_mode="livemostrecent").labels(model_name)
        self.waiting = Gauge("blink:num_requests_waiting", "Requests waiting for the engine or for a slot.",
                             label, registry=r, multiprocess_mode="livemostrecent").labels(model_name)
        self.kv_usage = Gauge("blink:kv_cache_usage_perc", "KV cache usage (1 means 100 percent).", label,
                              registry=r, multiprocess_mode="livemostrecent").labels(model_name)
        self.slots_in_use = Gauge("blink:slots_in_use", "Ring slots not EMPTY.", label,
                                  registry=r, multiprocess_mode="livemostrecent").labels(model_name)
        self.prompt_tokens = Counter("blink:prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("blink:generation_tokens", "Generated tokens.", label,
                                         registry=r).labels(model_name)
        self.requests = Counter("blink:request_success", "Finished requests by finish reason.",
                                label + ["finished_reason"], registry=r)
        self.connections_open = Gauge("blink:http_connections_open", "HTTP connections open now.", label,
                                      registry=r, multiprocess_mode="livesum").labels(model_name)
        self.connections_refused = Counter("blink:http_connections_refused",
                                           "Connections answered 503 because the gateway held its maximum.",
                                           label, registry=r).labels(model_name)
        self.timeouts = Counter("blink:http_connections_timed_out",
                                "Connections ended because a request head or body came too slowly.",
                                label + ["phase"], registry=r)
        self.failures = Counter("blink:request_failures", "Requests answered with an error status (4xx: "
                                "refused, 5xx: failed), by status.", label + ["status"], registry=r)
        self._vllm_series()
        self.http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                     ["method", "status", "handler"], registry=r)
        self.http_duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by "
                                       "handler. Made to be only used if aggregation by handler is important.",
                                       ["handler", "method"], buckets=HTTP_DURATION_BUCKETS, registry=r)

    def _vllm_series(self) -> None:
        """vLLM's series the gateway observes, each made at zero for every engine."""
        r, labels = self.registry, VLLM_LABELS

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.v_ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds: "
                           "arrival at the gateway to the first output token.", TTFT_BUCKETS)
        self.v_itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds: the gap "
                          "between consecutive output tokens at the gateway.", INTER_TOKEN_BUCKETS)
        self.v_tpot_gaps = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                "seconds (vLLM's former name of the inter-token latency; the same observations).",
                                INTER_TOKEN_BUCKETS)
        self.v_request_tpot = hist("vllm:request_time_per_output_token_seconds", "Histogram of "
                                   "time_per_output_token_seconds per request: its decode time over its output "
                                   "tokens after the first (0 for a request of one token).", INTER_TOKEN_BUCKETS)
        self.v_e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds: arrival "
                          "at the gateway to the request's end.", REQUEST_LATENCY_BUCKETS)
        self.v_queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                            "request: its wait for a ring slot (the gateway's clock) plus its wait in the engine, "
                            "claimed until its first prompt chunk was scheduled (the engine's clock).",
                            REQUEST_LATENCY_BUCKETS)
        self.v_prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                              "request: first scheduled to its first token (the engine's clock).",
                              REQUEST_LATENCY_BUCKETS)
        self.v_decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                             "request: its first token to its last (the engine's clock; for a request the gateway "
                             "ended at a stop string, the arrivals of those tokens at the gateway).",
                             REQUEST_LATENCY_BUCKETS)
        self.v_inference = hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase "
                                "for request: prefill plus decode.", REQUEST_LATENCY_BUCKETS)
        self.v_params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        self.v_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed: each request's prompt, "
                                "counted when its prefill completed (cached tokens included).", labels, registry=r)
        self.v_prompt_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source: "
                                       "local_compute (computed), local_cache_hit (the prefix cache); "
                                       "external_kv_transfer is always 0, Blink has no KV connector.",
                                       [*labels, "source"], registry=r)
        self.v_prompt_cached = Counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (the prefix "
                                       "cache's).", labels, registry=r)
        self.v_prompt_cached_source = Counter("vllm:prompt_tokens_cached_by_source", "Number of cached prompt tokens "
                                              "by the tier that held them: device (the engine's own KV cache, the "
                                              "only tier Blink has).", [*labels, "source"], registry=r)
        self.v_generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                    registry=r)
        self._per_engine: dict[int, tuple[TokenGaps, TokenGaps, Any]] = {}  # _token_children's
        self._generated: dict[int, int] = {}  # output tokens by engine not yet added to vllm:generation_tokens
        self.v_success = Counter("vllm:request_success", "Count of finished requests by finished_reason: stop (EOS, "
                                 "a stop token or string), length (max_tokens or the context), abort (cancelled), "
                                 "error (the engine failed it: a 5xx).", [*labels, "finished_reason"], registry=r)
        self._token_hists: dict[str, Histogram] = {}
        for engine in self.engines:
            for family in (self.v_ttft, self.v_itl, self.v_tpot_gaps, self.v_request_tpot, self.v_e2e, self.v_queue,
                           self.v_prefill, self.v_decode, self.v_inference, self.v_params_n, self.v_prompt,
                           self.v_prompt_cached, self.v_generation):
                family.labels(self.model_name, engine)
            for source in PROMPT_SOURCES:
                self.v_prompt_source.labels(self.model_name, engine, source)
            self.v_prompt_cached_source.labels(self.model_name, engine, "device")
            for reason in FINISHED_REASONS:
                self.v_success.labels(self.model_name, engine, reason)

    TOKEN_HISTOGRAMS = {
        "vllm:request_prompt_tokens": "Number of prefill tokens processed: each finished request's prompt.",
        "vllm:request_generation_tokens": "Number of generation tokens processed: each finished request's output.",
        "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens: of "
                                                  "a request's n choices, the most tokens one generated.",
        "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter (as the gateway resolved "
                                          "it: the context left when the request gave none).",
        "vllm:request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill (excluding "
                                                   "cached tokens).",
    }

    def token_histograms(self) -> dict[str, Histogram]:
        """vLLM's token-count histograms, whose boundaries are its 1-2-5 series up to the context (max_model_len):
        made once an engine has said its context (empty before)."""
        if not self._token_hists:
            context = self.context()
            if context > 0:
                buckets = buckets_1_2_5(context)
                for name, doc in self.TOKEN_HISTOGRAMS.items():
                    hist = Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=self.registry)
                    for engine in self.engines:
                        hist.labels(self.model_name, engine)
                    self._token_hists[name] = hist
        return self._token_hists

    # ------------------------------------------------------------ observations
    def failed(self, status: int) -> None:
        """One request answered with ``status`` (>= 400)."""
        self.failures.labels(self.model_name, str(status)).inc()

    def timed_out(self, phase: str) -> None:
        """One connection ended for taking too long; ``phase`` is ``header``, ``body`` or ``idle`` (closed to make
        room at the connection cap)."""
        self.timeouts.labels(self.model_name, phase).inc()

    def finished(self, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()

    def first_token(self, engine: int, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.v_ttft.labels(self.model_name, str(engine)).observe(ttft_s)

    def _token_children(self, engine: int) -> tuple[TokenGaps, TokenGaps, Any]:
        """The per-token series of one engine, labelled once (they are touched for every token batch)."""
        children = self._per_engine.get(engine)
        if children is None:
            name, e = self.model_name, str(engine)
            children = self._per_engine[engine] = (TokenGaps(self.v_itl.labels(name, e)),
                                                   TokenGaps(self.v_tpot_gaps.labels(name, e)),
                                                   self.v_generation.labels(name, e))
        return children

    def token_gaps(self, engine: int, gap_s: float, n: int) -> None:
        """``n`` output tokens that came ``gap_s`` apart on average since the previous ones (each counted as one
        observation of ``gap_s``, written out at the next ``flush_tokens``)."""
        itl, tpot, _ = self._token_children(engine)
        self._itl_gaps.observe(gap_s, n)
        itl.observe(gap_s, n)
        tpot.observe(gap_s, n)

    def flush_tokens(self) -> None:
        """Write the per-token observations and counts kept so far (the gateway every ``TOKEN_FLUSH_S``, a
        request's end and every scrape)."""
        self._itl_gaps.flush()
        for itl, tpot, _ in self._per_engine.values():
            itl.flush()
            tpot.flush()
        generated, self._generated = self._generated, {}
        for engine, n in generated.items():
            self._token_children(engine)[2].inc(n)

    def prefilled(self, engine: int, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's prompt was computed (its first token came, or its end before any)."""
        e, cached = str(engine), min(max(cached_tokens, 0), prompt_tokens)
        self.v_prompt.labels(self.model_name, e).inc(prompt_tokens)
        self.v_prompt_cached.labels(self.model_name, e).inc(cached)
        self.v_prompt_cached_source.labels(self.model_name, e, "device").inc(cached)
        self.v_prompt_source.labels(self.model_name, e, "local_compute").inc(prompt_tokens - cached)
        self.v_prompt_source.labels(self.model_name, e, "local_cache_hit").inc(cached)

    def generated(self, engine: int, n: int) -> None:
        """``n`` output tokens of ``engine``, added to vllm:generation_tokens at the next ``flush_tokens``."""
        if n > 0:
            self._generated[engine] = self._generated.get(engine, 0) + n

    def request_finished(self, req: FinishedRequest) -> None:
        """vLLM's per-request series of one finished request."""
        name, e = self.model_name, str(req.engine)
        self.v_success.labels(name, e, req.finished_reason).inc()
        self.v_e2e.labels(name, e).observe(req.e2e_s)
        for hist, value in ((self.v_queue, req.queue_s), (self.v_prefill, req.prefill_s),
                            (self.v_decode, req.decode_s)):
            if value is not None:
                hist.labels(name, e).observe(value)
        if req.prefill_s is not None and req.decode_s is not None:
            self.v_inference.labels(name, e).observe(req.prefill_s + req.decode_s)
        if req.generation_tokens > 1 and req.decode_s is not None:
            self.v_request_tpot.labels(name, e).observe(req.decode_s / (req.generation_tokens - 1))
        elif req.generation_tokens == 1:
            self.v_request_tpot.labels(name, e).observe(0.0)
        hists = self.token_histograms()
        if hists:
            cached = min(max(req.cached_tokens, 0), req.prompt_tokens)
            for key, value in (("vllm:request_prompt_tokens", req.prompt_tokens),
                               ("vllm:request_generation_tokens", req.generation_tokens),
                               ("vllm:request_params_max_tokens", req.max_tokens),
                               ("vllm:request_prefill_kv_computed_tokens", req.prompt_tokens - cached)):
                hists[key].labels(name, e).observe(value)

    def choices_finished(self, engine: int, n: int, most_generated: int) -> None:
        """Every choice of a request of ``n`` choices finished; ``most_generated``: the most tokens one generated."""
        e = str(engine)
        self.v_params_n.labels(self.model_name, e).observe(n)
        hists = self.token_histograms()
        if hists:
            hists["vllm:request_max_num_generation_tokens"].labels(self.model_name, e).observe(most_generated)

    def http_request(self, handler: str, method: str, status: int, duration_s: float) -> None:
        """One answered HTTP request (prometheus-fastapi-instrumentator's series; probes and scrapes not counted)."""
        if handler in HTTP_UNCOUNTED:
            return
        self.http_requests.labels(method, f"{status // 100}xx", handler).inc()
        self.http_duration.labels(handler, method).observe(duration_s)

    def render(self, engine_stats: Mapping[str, Any] | None = None, per_engine: Sequence[EngineSample] = ()) -> bytes:
        """The text of a scrape: every gateway's series (summed), the engines' totals from ``engine_stats`` (the
        ring headers' EngineStats summed; None: no engine now) and each engine's from ``per_engine``."""
        self.token_histograms()  # at zero once the context is known, as vLLM's are from its start
        self.flush_tokens()
        source = self.registry
        if self.multiprocess_dir is not None:
            source = CollectorRegistry()
            MultiProcessCollector(source, str(self.multiprocess_dir))
        families = [*source.collect(), *engine_families(self.model_name, engine_stats),
                    *per_engine_families(self.model_name, per_engine),
                    *vllm_engine_families(self.model_name, per_engine)]
        return generate_latest(_Families(families))


class _Families:
    """A ready list of metric families, in the shape ``generate_latest`` collects from."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def engine_families(model_name: str, stats: Mapping[str, Any] | None) -> list[Metric]:
    if stats is None:
        return []
    out: list[Metric] = []
    for name, doc in ENGINE_COUNTERS.items():
        family = CounterMetricFamily(f"blink:engine_{name}", doc, labels=["model_name"])
        family.add_metric([model_name], float(stats[name]))
        out.append(family)
    for name, doc in ENGINE_GAUGES.items():
        gauge = GaugeMetricFamily(f"blink:engine_{name}", doc, labels=["model_name"])
        gauge.add_metric([model_name], float(stats[name]))
        out.append(gauge)
    return [*out, *step_fill_families(model_name, stats), *header_families(model_name, stats, STEP_TOKEN_COUNTERS),
            *header_families(model_name, stats, PREFIX_CACHE_COUNTERS)]


def header_families(model_name: str, stats: Mapping[str, Any], counters: Mapping[str, str]) -> list[Metric]:
    """Counters named blink:NAME from the ring header's words beside EngineStats (the prefix cache's, the
    steps' tokens; 0 when absent)."""
    out: list[Metric] = []
    for name, doc in counters.items():
        try:
            value = float(stats[name])
        except (KeyError, ValueError):  # a mapping or an EngineStats record without the header's words
            value = 0.0
        family = CounterMetricFamily(f"blink:{name}", doc, labels=["model_name"])
        family.add_metric([model_name], value)
        out.append(family)
    return out


def step_fill_families(model_name: str, stats: Mapping[str, Any]) -> list[Metric]:
    """The engine's steps by how much of the token budget they used: a histogram of tokens / budget
    (no _sum: the engine counts steps per bucket only) and the count of steps that filled it."""
    counts = [int(c) for c in stats["step_fill"]]
    hist = HistogramMetricFamily("blink:engine_step_budget_use", "Engine steps by tokens / token budget.",
                                 labels=["model_name"])
    cumulative = [sum(counts[: k + 1]) for k in range(5)] + [sum(counts)]
    buckets = [(repr(b), float(c)) for b, c in zip(STEP_FILL_BOUNDS, cumulative, strict=True)]
    hist.add_metric([model_name], [*buckets, ("+Inf", float(sum(counts)))], None)
    full = CounterMetricFamily("blink:engine_steps_budget_full", "Engine steps that used the whole token budget.",
                               labels=["model_name"])
    full.add_metric([model_name], float(counts[6]))
    return [hist, full]
