"""Schemathesis against a live server's ``/openapi.json``: schema-valid and schema-violating requests.

Every response is checked by schemathesis (no 5xx, status code, content type and body conform to the
document, schema-violating data rejected with a 4xx) and by ``openai_error_shape`` (every error body
is ``{"error": {"message", "type", "param", "code"}}``). Failures are collected, not raised, so one
run reports all of them without Hypothesis stopping to shrink the first.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi import checks as oc

CHECKS = [not_a_server_error, oc.status_code_conformance, oc.content_type_conformance,
          oc.response_schema_conformance, oc.response_headers_conformance, oc.negative_data_rejection]
ERROR_KEYS = {"message", "type", "param", "code"}


def error_shape_problem(status: int, body: bytes) -> str | None:
    """Why an error response is not in the OpenAI shape, or None when it is (or is no error)."""
    if status < 400:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:200]!r}"
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or set(err) != ERROR_KEYS:
        return f"{status} body is not {{'error': {{message, type, param, code}}}}: {body[:200]!r}"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return f"{status} error message/type are not strings: {body[:200]!r}"
    return None


@dataclasses.dataclass
class FuzzReport:
    requests: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_operation: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "statuses": dict(sorted(self.statuses.items())),
                "per_operation": dict(self.per_operation), "failures": len(self.failures)}


def _run_one(case: Any, base_url: str, session: requests.Session, report: FuzzReport, label: str) -> None:
    try:
        response = case.call(base_url=base_url, session=session, timeout=120)
    except requests.RequestException as exc:
        report.failures.append(f"{label}: no response ({exc!r}); {case.as_curl_command()}")
        return
    report.requests += 1
    report.statuses[response.status_code] += 1
    report.per_operation[label] += 1
    problem = error_shape_problem(response.status_code, response.content)
    if problem:
        report.failures.append(f"{label}: {problem}; {case.as_curl_command()}")
    try:
        case.validate_response(response, checks=CHECKS)
    except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup: every failed check
        report.failures.append(f"{label}: {str(exc)[:3000]}")


def fuzz_operation(operation: Any, mode: GenerationMode, examples: int, base_url: str, session: requests.Session,
                   report: FuzzReport, seed: int) -> None:
    label = f"{mode.value} {operation.method.upper()} {operation.path}"

    @hypothesis.seed(seed)  # reproducible runs
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        _run_one(case, base_url, session, report, label)

    run()


def _fuzz_pair(base_url: str, path: str, method: str, mode: str, examples: int, seed: int) -> FuzzReport:
    """One (operation, mode) in its own process."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    operation = schema[path][method]
    report = FuzzReport()
    with requests.Session() as session:
        fuzz_operation(operation, GenerationMode(mode), examples, base_url, session, report, seed)
    return report


def fuzz(base_url: str, examples: dict[str, int], seed: int = 0, workers: int = 4) -> FuzzReport:
    """``examples``: per operation path, how many cases to draw in each mode (positive, and negative for
    operations with a body). The pairs run in ``workers`` processes, so the engine sees concurrent
    requests (and batches them) as it would in service."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    jobs = []
    for result in schema.get_all_operations():
        op = result.ok()
        modes = ["positive"] if op.method.upper() in ("GET", "HEAD") else ["positive", "negative"]
        jobs += [(base_url, op.path, op.method, mode, examples[op.path], seed)
                 for mode in modes if examples.get(op.path)]
    report = FuzzReport()
    pool = multiprocessing.get_context("spawn").Pool(workers)
    try:
        for part in pool.starmap(_fuzz_pair, jobs):
            report.requests += part.requests
            report.statuses.update(part.statuses)
            report.per_operation.update(part.per_operation)
            report.failures += part.failures
    finally:
        pool.terminate()  # also when the test is interrupted or times out: no worker outlives it
        pool.join()
    return report
