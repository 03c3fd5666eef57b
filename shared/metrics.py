"""Prometheus metrics of the frontend, named like vLLM's (prefix ``blink:``).

One ``FrontendMetrics`` per gateway process, on its own registry. Latency histograms and
token counters are observed by the gateway as requests run; the gauges are set from the
ring header's engine stats and a slot count just before each scrape. The ``http_connections``
series count what the connection limits did (dpu_gateway/connguard.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)


class FrontendMetrics:
    def __init__(self, model_name: str) -> None:
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
                             registry=r).labels(model_name)
        self.waiting = Gauge("blink:num_requests_waiting", "Requests waiting for the engine or for a slot.",
                             label, registry=r).labels(model_name)
        self.kv_usage = Gauge("blink:kv_cache_usage_perc", "KV cache usage (1 means 100 percent).", label,
                              registry=r).labels(model_name)
        self.slots_in_use = Gauge("blink:slots_in_use", "Ring slots not EMPTY.", label,
                                  registry=r).labels(model_name)
        self.prompt_tokens = Counter("blink:prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("blink:generation_tokens", "Generated tokens.", label,
                                         registry=r).labels(model_name)
        self.requests = Counter("blink:request_success", "Finished requests by finish reason.",
                                label + ["finished_reason"], registry=r)
        self.connections_open = Gauge("blink:http_connections_open", "HTTP connections open now.", label,
                                      registry=r).labels(model_name)
        self.connections_refused = Counter("blink:http_connections_refused",
                                           "Connections answered 503 because the gateway held its maximum.",
                                           label, registry=r).labels(model_name)
        self.timeouts = Counter("blink:http_connections_timed_out",
                                "Connections ended because a request head or body came too slowly.",
                                label + ["phase"], registry=r)
        self.model_name = model_name

    def timed_out(self, phase: str) -> None:
        """One connection ended for taking too long; ``phase`` is ``header`` or ``body``."""
        self.timeouts.labels(self.model_name, phase).inc()

    def finished(self, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
