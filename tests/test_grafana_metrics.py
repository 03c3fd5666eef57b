"""vLLM's Grafana dashboards against a live Blink.

A real ``blink serve`` (the CPU engine and the embedded SmolLM2-135M) answers requests sent with the official
``openai`` client; then every query of vLLM's dashboards (tests/data/vllm_grafana_queries.json, copied from
vLLM's repository) finds its series in ``/metrics`` with vLLM's name, type, labels and bucket boundaries
(tests/helpers/grafana.py), and the values mean what vLLM's do: counts of the requests just made, their token
counts from the answers' ``usage``, the engine's own counters and KV cache configuration.
The ``-dp 2`` side is tests/test_data_parallel.py's (one series per engine, under ``engine``).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from helpers.e2e import FRANCE, start_real_stack, sync_client, wait_for
from helpers.grafana import load, problems, scrape
from helpers.stack import MODEL, Stack, stop_stack

MAX_TOKENS = (3, 5, 4)  # the three completions' max_tokens; with ignore_eos each makes exactly that many tokens
N = 2  # choices of the last completion
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_real_stack(tmp_path_factory.mktemp("grafana"))
    yield stack
    stop_stack(stack)


def page(stack: Stack) -> str:
    status, body = stack.get("/metrics")
    assert status == 200
    return body.decode()


def total(text: str, sample: str, **labels: str) -> float:
    """The sum of ``sample``'s values over the series carrying ``labels``."""
    return sum(s.value for fam in scrape(text).values() for s in fam.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def idle(stack: Stack) -> None:
    wait_for(lambda: stack.metric("blink:slots_in_use") == 0 and stack.metric("blink:num_requests_running") == 0, 30,
             0.1)


def run_requests(client: openai.OpenAI) -> list[tuple[int, int, int]]:
    """A chat completion, a streamed completion and a completion of ``N`` choices, each choice making exactly its
    max_tokens (ignore_eos): (prompt tokens, max_tokens, choices) of each request."""
    done = []
    chat = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=MAX_TOKENS[0], temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == MAX_TOKENS[0]
    done.append((chat.usage.prompt_tokens, MAX_TOKENS[0], 1))
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS[1], temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.completion_tokens == MAX_TOKENS[1]
    done.append((usage.prompt_tokens, MAX_TOKENS[1], 1))
    several = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS[2], n=N, temperature=0.8,
                                        seed=3, extra_body={"ignore_eos": True})
    assert len(several.choices) == N and several.usage.completion_tokens == N * MAX_TOKENS[2]
    done.append((several.usage.prompt_tokens, MAX_TOKENS[2], N))
    return done


def test_every_dashboard_query_finds_its_series(real: Stack) -> None:
    run_requests(sync_client(real))
    idle(real)
    assert problems(page(real), MODEL) == []


def test_a_page_without_a_queried_series_fails_the_check(real: Stack) -> None:
    """The check itself: a page missing a series, or with one of another type, is reported."""
    text = page(real)
    lines = text.splitlines()
    without = "\n".join(line for line in lines if "vllm:request_queue_time_seconds" not in line) + "\n"
    assert any("no vllm:request_queue_time_seconds" in p for p in problems(without, MODEL))
    retyped = text.replace("# TYPE vllm:num_requests_waiting gauge", "# TYPE vllm:num_requests_waiting counter")
    assert any("vllm:num_requests_waiting is a counter" in p for p in problems(retyped, MODEL))


def test_the_series_mean_what_vllm_s_do(real: Stack) -> None:
    client = sync_client(real)
    idle(real)
    before = page(real)
    done = run_requests(client)
    idle(real)
    after = page(real)

    def grew(sample: str, **labels: str) -> float:
        return total(after, sample, **labels) - total(before, sample, **labels)

    choices = sum(n for _, _, n in done)
    prompt_tokens = sum(p * n for p, _, n in done)  # every choice is a request with the whole prompt
    output_tokens = sum(m * n for _, m, n in done)
    e = {"engine": "0", "model_name": MODEL}
    # finished requests and their token counts
    assert grew("vllm:request_success_total", **e, finished_reason="length") == choices
    assert grew("vllm:request_success_total", **e) == choices
    assert grew("vllm:request_prompt_tokens_count", **e) == choices
    assert grew("vllm:request_prompt_tokens_sum", **e) == prompt_tokens
    assert grew("vllm:request_generation_tokens_sum", **e) == output_tokens
    assert grew("vllm:request_params_max_tokens_sum", **e) == output_tokens  # each made exactly its max_tokens
    assert grew("vllm:prompt_tokens_total", **e) == prompt_tokens
    assert grew("vllm:generation_tokens_total", **e) == output_tokens
    # the prompt tokens by where their KV came from: computed or found in the prefix cache, nothing transferred
    computed = grew("vllm:prompt_tokens_by_source_total", **e, source="local_compute")
    cached = grew("vllm:prompt_tokens_by_source_total", **e, source="local_cache_hit")
    assert computed + cached == prompt_tokens and computed > 0
    assert grew("vllm:prompt_tokens_by_source_total", **e, source="external_kv_transfer") == 0
    assert grew("vllm:prompt_tokens_cached_total", **e) == cached
    assert grew("vllm:request_prefill_kv_computed_tokens_sum", **e) == computed
    # one observation per prompt of n and of the most tokens one of its choices made
    assert grew("vllm:request_params_n_count", **e) == len(done)
    assert grew("vllm:request_params_n_sum", **e) == choices
    assert grew("vllm:request_max_num_generation_tokens_sum", **e) == sum(MAX_TOKENS)
    # one latency observation per request, its phases from the ring slot's clocks (the CPU engine writes them all)
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert grew(f"vllm:{name}_count", **e) == choices, name
    inference = grew("vllm:request_inference_time_seconds_sum", **e)
    phases = grew("vllm:request_prefill_time_seconds_sum", **e) + grew("vllm:request_decode_time_seconds_sum", **e)
    assert inference == pytest.approx(phases)
    # each request's output tokens after the first, each with its gap from the one before
    assert grew("vllm:inter_token_latency_seconds_count", **e) == output_tokens - choices
    # the HTTP server's: the three answered requests, the scrapes not counted
    assert grew("http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 2
    assert grew("http_requests_total", handler="/v1/chat/completions", method="POST", status="2xx") == 1
    assert total(after, "http_requests_total", handler="/metrics") == 0


def test_engine_series_are_the_engine_s_own(real: Stack) -> None:
    idle(real)
    text = page(real)
    e = {"engine": "0", "model_name": MODEL}
    assert total(text, "vllm:num_requests_running", **e) == 0
    assert total(text, "vllm:num_requests_waiting", **e) == 0
    assert total(text, "vllm:num_requests_waiting_by_reason", **e, reason="deferred") == 0
    assert 0 <= total(text, "vllm:kv_cache_usage_perc", **e) <= 1
    for vllm_name, blink_name in (("vllm:num_preemptions_total", "blink:engine_preemptions_total"),
                                  ("vllm:prefix_cache_queries_total", "blink:prefix_cache_queries_total"),
                                  ("vllm:prefix_cache_hits_total", "blink:prefix_cache_hits_total")):
        assert total(text, vllm_name, **e) == total(text, blink_name), vllm_name
    info = [s for s in scrape(text)["vllm:cache_config_info"].samples]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels == {
        "engine": "0", "num_gpu_blocks": str(int(total(text, "blink:engine_kv_blocks_total"))), "block_size": "16",
        "cache_dtype": "float16", "gpu_memory_utilization": "None", "enable_prefix_caching": "True",
        "prefix_caching_hash_algo": "blake2b_64", "num_cpu_blocks": "None", "kv_offloading_backend": "None",
        "kv_offloading_size": "None"}


def test_histograms_have_vllm_s_bucket_boundaries(real: Stack) -> None:
    buckets = load()["buckets"]
    status, body = real.get("/v1/models")
    assert status == 200
    import json  # noqa: PLC0415

    max_model_len = json.loads(body)["data"][0]["max_model_len"]
    one_two_five, scale = [], 1
    while True:
        bounds = [m * scale for m in (1, 2, 5) if m * scale <= max_model_len]
        one_two_five += bounds
        if len(bounds) < 3:
            break
        scale *= 10
    families = scrape(page(real))
    for name, family in buckets["histograms"].items():
        bounds = buckets["families"][family]
        want = one_two_five if family == "request_tokens" else bounds
        got = sorted({float(s.labels["le"]) for s in families[name].samples if s.name == f"{name}_bucket"})
        assert got == [*map(float, want), float("inf")], name


def test_a_client_that_disconnects_is_counted_as_abort(real: Stack) -> None:
    """A streamed request of ``N`` choices whose client goes away mid-stream: each choice is a finished request
    with vLLM's ``abort`` reason, with its latency observed, and the prompt's ``n`` is observed once."""
    idle(real)
    before = page(real)
    e = {"engine": "0", "model_name": MODEL}
    stream = sync_client(real).completions.create(model=MODEL, prompt=PROMPT, max_tokens=250, n=N, temperature=0.8,
                                                  seed=5, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += sum(bool(c.text) for c in chunk.choices)
        if got >= 2 * N:
            break
    stream.close()

    def grew(sample: str, text: str | None = None, **labels: str) -> float:
        return total(text or page(real), sample, **labels) - total(before, sample, **labels)

    # the count appears once the gateway saw the connection go (at once here); the guard is for a loaded host
    wait_for(lambda: grew("vllm:request_success_total", **e, finished_reason="abort") == N, 60, 0.1)
    idle(real)
    after = page(real)
    assert grew("vllm:request_success_total", after, **e) == N
    assert grew("vllm:e2e_request_latency_seconds_count", after, **e) == N
    assert grew("vllm:request_params_n_count", after, **e) == 1 and grew("vllm:request_params_n_sum", after, **e) == N
    generated = grew("vllm:generation_tokens_total", after, **e)
    assert grew("vllm:request_generation_tokens_sum", after, **e) == generated >= got
