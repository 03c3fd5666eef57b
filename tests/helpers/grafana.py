"""Check a live ``/metrics`` against the queries of vLLM's Grafana dashboards (tests/data/vllm_grafana_queries.json).

Each query's series selectors (``name{matchers}``, and the metric of each ``label_values`` variable) are read out of
its PromQL; the dashboard's variables are filled in (``$model_name``: the served model; an ``=~`` on a multi-value
variable, which Grafana sends as "All": the label must be there; ``le="$ttft_slo"``: every option of the variable);
``job`` and ``instance`` are left out (Prometheus adds them to every scraped series). A selector then holds when
``/metrics`` has a family of the type its name implies (``_bucket``/``_sum``/``_count``: a histogram, ``_total``: a
counter, else a gauge) with a sample of that name that carries every label the selector names, at the value it
names where that value is one the family always has (``le``, ``finished_reason``, ``source``, ``reason``). The
series the data file lists as not served must be absent, so that the list cannot outlive what it describes.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm_grafana_queries.json"
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^{}]*)\}")
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^{}]*\})?\s*,\s*(\w+)\s*\)")
TARGET_LABELS = frozenset({"job", "instance"})  # Prometheus's own, on every scraped series
CLOSED_LABELS = frozenset({"le", "finished_reason", "source", "reason"})  # values a family always has
KINDS = (("_bucket", "histogram"), ("_sum", "histogram"), ("_count", "histogram"), ("_total", "counter"))


def load() -> dict:
    return json.loads(DATA.read_text())


@dataclasses.dataclass(frozen=True)
class Selector:
    metric: str                                   # as the query names it (with its suffix)
    matchers: tuple[tuple[str, str, str], ...]    # (label, operator, value)
    where: str                                    # dashboard / panel, for messages

    @property
    def family(self) -> tuple[str, str]:
        """The family's name and type, from the sample name's suffix."""
        for suffix, kind in KINDS:
            if self.metric.endswith(suffix):
                return self.metric.removesuffix(suffix), kind
        return self.metric, "gauge"


def selectors(expr: str, where: str) -> list[Selector]:
    out = []
    for name, body in SELECTOR.findall(expr):
        matchers = tuple((m.group(1), m.group(2), m.group(3)) for m in MATCHER.finditer(body))
        assert "".join(m.group(0) for m in MATCHER.finditer(body)).strip() == body.strip(), (where, body)
        out.append(Selector(name, matchers, where))
    return out


def dashboard_selectors(data: dict) -> Iterator[tuple[dict, Selector]]:
    """Every selector of every query and ``label_values`` variable, with its dashboard."""
    for board in data["dashboards"]:
        for panel in board["panels"]:
            for expr in panel["exprs"]:
                for sel in selectors(expr, f"{board['name']} / {panel['title']}"):
                    yield board, sel
        for var, query in board["variables"].items():
            if not isinstance(query, str):
                continue
            got = LABEL_VALUES.search(query)
            if got is None:  # a label_values over every series (the old dashboard's model_name)
                yield board, Selector("vllm:num_requests_running", ((var, "=~", ".+"),), f"{board['name']} / ${var}")
                continue
            name, body, label = got.groups()
            matchers = selectors(f"{name}{body}", "")[0].matchers if body else ()
            yield board, Selector(name, (*matchers, (label, "=~", ".+")), f"{board['name']} / ${var}")


def scrape(text: str) -> dict[str, Metric]:
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


def variable_values(board: dict, name: str, model: str) -> list[str] | None:
    """What Grafana puts for ``$name``: the served model, each option of a custom variable; None for a query
    variable of several values (the selector's label must then merely be there)."""
    if name == "model_name":
        return [model]
    options = board["variables"].get(name)
    return list(options) if isinstance(options, list) else None


def problems(text: str, model: str, data: dict | None = None) -> list[str]:
    """What in ``text`` (a ``/metrics`` page) fails the dashboards' queries; empty when every one holds."""
    data = data or load()
    families, out = scrape(text), []
    not_served = data["not_served"]
    checked: set[tuple] = set()
    for board, sel in dashboard_selectors(data):
        key = (id(board), sel.metric, sel.matchers)
        if key in checked:
            continue
        checked.add(key)
        name, kind = sel.family
        if sel.metric in not_served or name in not_served:
            if name in families:
                out.append(f"{sel.where}: {name} is listed as not served, yet /metrics has it")
            continue
        fam = families.get(name)
        if fam is None:
            out.append(f"{sel.where}: no {name} in /metrics")
            continue
        if fam.type != kind:
            out.append(f"{sel.where}: {name} is a {fam.type}, the query reads a {kind}")
            continue
        out += _match(board, sel, fam, model)
    for board in data["dashboards"]:
        for metric, fields in board.get("table_fields", {}).items():
            fam = families.get(metric)
            have = {k for s in (fam.samples if fam else []) for k in s.labels}
            missing = [f for f in fields if f not in TARGET_LABELS and f not in have]
            if missing:
                out.append(f"{board['name']}: {metric} lacks the labels its table shows: {missing}")
    return out


def _match(board: dict, sel: Selector, fam: Metric, model: str) -> list[str]:
    samples = [s for s in fam.samples if s.name == sel.metric]
    if not samples:
        return [f"{sel.where}: {fam.name} has no {sel.metric} samples"]
    wanted: list[list[tuple[str, str, str]]] = [[]]
    for label, op, value in sel.matchers:
        if label in TARGET_LABELS:
            continue
        var = value[1:] if value.startswith("$") else None
        if var is None:
            options = [value]
        else:
            options = variable_values(board, var, model)
            if options is None:  # a multi-value query variable: any value, but the label must be there
                options = [".+"] if op == "=~" else [value]
                op = "=~"
        wanted = [[*w, (label, op, v)] for w in wanted for v in options]
    out = []
    for conds in wanted:
        hit = [s for s in samples if all(_holds(s.labels, label, op, v) for label, op, v in conds
                                         if label in CLOSED_LABELS or op == "=~" or label == "model_name")]
        if not hit:
            out.append(f"{sel.where}: no {sel.metric} sample with {conds}")
            continue
        names = {label for label, _, _ in conds}
        if not any(names <= set(s.labels) for s in hit):
            out.append(f"{sel.where}: {sel.metric} lacks the labels {sorted(names)}")
    return out


def _holds(labels: dict[str, str], label: str, op: str, value: str) -> bool:
    got = labels.get(label)
    if op == "=":
        return got == value
    if op == "=~":
        return got is not None and re.fullmatch(value, got) is not None
    return True  # != and !~ exclude: a sample without the value is what they keep
