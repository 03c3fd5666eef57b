"""Prometheus metrics of the frontend, named like vLLM's (prefix ``blink:``), with ``vllm:`` aliases.

One ``FrontendMetrics`` per gateway process. Under ``blink serve`` every gateway writes its values to
files in one folder (prometheus_client's multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR``, which the
supervisor sets to ``RUN_DIR/metrics``), and a scrape of any gateway sums them, so ``--gateways N``
shows every request once. Latency histograms and token counters are observed by the gateway as
requests run; the gauges are set from the ring header's engine stats and a slot count just before each
scrape (every gateway reads the same ring: the most recent value of a live gateway is shown); the
engine's own counters (steps, tokens, preemptions) are read from the ring header at the scrape. The
``http_connections`` series count what the connection limits did (dpu_gateway/connguard.py).

With more than one engine (``--data-parallel-size``) the series above are totals over the engines
(gauges and engine counters summed; KV usage over every engine's blocks), and the ``blink:dp_*``
series give each engine's values under an ``engine`` label (its index): ``dp_engine_up`` (1 while
it serves), ``dp_num_requests_running``, ``dp_num_requests_waiting``, ``dp_slots_in_use``,
``dp_kv_cache_usage_perc`` and ``dp_engine_<counter>`` for each engine counter.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample

from shared.ring import STEP_FILL_BOUNDS

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)


# vLLM's names, shown as copies of Blink's series so that vLLM dashboards and endpoint pickers work
VLLM_ALIASES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
                "generation_tokens", "time_to_first_token_seconds", "time_per_output_token_seconds",
                "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_success",
                "prefix_cache_queries", "prefix_cache_hits")
# the prefix cache's counters (ring header, since schema minor 4), as counters named blink:NAME
PREFIX_CACHE_COUNTERS = {"prefix_cache_queries": "Prompt tokens looked up in the prefix cache at admissions.",
                         "prefix_cache_hits": "Prompt tokens found in the prefix cache at admissions.",
                         "prefix_cache_evictions": "Cached KV blocks evicted from the prefix cache."}
# the engine's counters in the ring header (EngineStats), as counters named blink:engine_NAME
ENGINE_COUNTERS = {"steps": "Decode steps the engine ran.", "prompt_tokens": "Prompt tokens the engine prefilled.",
                   "output_tokens": "Tokens the engine generated.", "preemptions": "Requests preempted.",
                   "window_relaunches": "Persistent scheduler tail launches."}
ENGINE_GAUGES = {"kv_blocks_total": "KV cache blocks.", "kv_blocks_free": "KV cache blocks free.",
                 "token_budget": "Tokens one engine step may carry (--max-num-batched-tokens)."}


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSample:
    """One engine's values at a scrape, for the per-engine ``blink:dp_*`` series."""

    engine: int
    up: bool
    running: int
    waiting: int
    slots_in_use: int
    kv_usage: float
    counters: Mapping[str, int]  # ENGINE_COUNTERS' names


PER_ENGINE_GAUGES = {"engine_up": ("1 while the engine serves (fresh heartbeat, READY), else 0.", "up"),
                     "num_requests_running": ("Requests in this engine's decode batch.", "running"),
                     "num_requests_waiting": ("Requests waiting in this engine or its ring.", "waiting"),
                     "slots_in_use": ("This engine's ring slots not EMPTY.", "slots_in_use"),
                     "kv_cache_usage_perc": ("This engine's KV cache usage (1 means 100 percent).", "kv_usage")}


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
    for name, doc in ENGINE_COUNTERS.items():
        family = CounterMetricFamily(f"blink:dp_engine_{name}", f"{doc} (per engine)", labels=labels)
        for s in samples:
            family.add_metric([model_name, str(s.engine)], float(s.counters.get(name, 0)))
        out.append(family)
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


class FrontendMetrics:
    def __init__(self, model_name: str, multiprocess_dir: Path | None = None) -> None:
        """``multiprocess_dir``: the folder every gateway's values go to (None: this process only). It
        must be the ``PROMETHEUS_MULTIPROC_DIR`` this process started with. MetricsSpaceError when its
        files cannot be allocated there."""
        self.multiprocess_dir = multiprocess_dir
        if multiprocess_dir is not None:
            preallocate_metric_files(multiprocess_dir, os.getpid())
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]
        self.ttft = Histogram("blink:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("blink:time_per_output_token_seconds", "Mean time per output token of a request.",
                              label, buckets=TOKEN_GAP_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("blink:inter_token_latency_seconds", "Gap between consecutive output tokens.",
                             label, buckets=TOKEN_GAP_BUCKETS, registry=r).labels(model_name)
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
        self.model_name = model_name

    def failed(self, status: int) -> None:
        """One request answered with ``status`` (>= 400)."""
        self.failures.labels(self.model_name, str(status)).inc()

    def timed_out(self, phase: str) -> None:
        """One connection ended for taking too long; ``phase`` is ``header``, ``body`` or ``idle`` (closed to make
        room at the connection cap)."""
        self.timeouts.labels(self.model_name, phase).inc()

    def finished(self, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()

    def render(self, engine_stats: Mapping[str, Any] | None = None, per_engine: Sequence[EngineSample] = ()) -> bytes:
        """The text of a scrape: every gateway's series (summed), the engine's from ``engine_stats`` (the
        ring header's EngineStats, summed over the engines; None: no engine now), each engine's from
        ``per_engine``, and the vLLM aliases."""
        source = self.registry
        if self.multiprocess_dir is not None:
            source = CollectorRegistry()
            MultiProcessCollector(source, str(self.multiprocess_dir))
        families = [*source.collect(), *engine_families(self.model_name, engine_stats),
                    *per_engine_families(self.model_name, per_engine)]
        return generate_latest(_Families([*families, *vllm_aliases(families)]))


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
    return [*out, *step_fill_families(model_name, stats), *prefix_cache_families(model_name, stats)]


def prefix_cache_families(model_name: str, stats: Mapping[str, Any]) -> list[Metric]:
    """The prefix cache's counters, from the ring header's words beside EngineStats (0 when absent)."""
    out: list[Metric] = []
    for name, doc in PREFIX_CACHE_COUNTERS.items():
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


def vllm_aliases(families: Iterable[Metric]) -> list[Metric]:
    """Copies of the aliased families under ``vllm:`` names."""
    out = []
    for fam in families:
        short = fam.name.removeprefix("blink:")
        if short not in VLLM_ALIASES:
            continue
        copy = Metric(f"vllm:{short}", fam.documentation, fam.type, fam.unit)
        copy.samples = [Sample(s.name.replace("blink:", "vllm:", 1), s.labels, s.value, s.timestamp, s.exemplar)
                        for s in fam.samples]
        out.append(copy)
    return out
