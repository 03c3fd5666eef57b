"""The peer study's results file: merging runs, the plateaus, the BENCHMARKS table and the plots.

    python -m bench.peers.report bench/results/peers.json [--blink blink-persistent] [--peer vllm] [--plot PREFIX]

prints the Markdown table (Blink beside the peer per co-tenant level and rate, with the Blink/peer ratio of
each metric, the plateaus, and each system's heavy/isolated ratios) and, with ``--plot``, redraws the plots.

Every record carries its setup: ``config`` (``tuned128``: both systems at --max-num-seqs 128, the default and
what records without the key ran with; ``defaults``: each system's own defaults) and ``response_format`` (None,
or the constraint of a constrained load). Records of different setups stand side by side in one file and the
tables come one setup at a time, Blink beside the peer of the same setup.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.peers.measure import keeps_up

LEVEL_ORDER = {"none": 0, "moderate": 1, "heavy": 2}
RESOLUTION = 1.0  # req/s: the plateau is bracketed this tightly
METRICS = (("TPOT p50 (ms)", ("tpot_ms", "p50"), ".1f"), ("TPOT p99 (ms)", ("tpot_ms", "p99"), ".1f"),
           ("TTFT p99 (ms)", ("ttft_ms", "p99"), ".0f"), ("sustained req/s", ("sustained_req_s",), ".2f"),
           ("sustained tok/s", ("sustained_out_tok_s",), ".0f"),
           ("prefix hit rate", ("prefix_cache", "hit_rate"), ".3f"))


DEFAULT_CONFIG = "tuned128"
CONFIGS = ("tuned128", "defaults")


# ---------------------------------------------------------------------- records and plateaus
def setup_of(rec: dict[str, Any]) -> tuple[str, str]:
    """(config, response format or "") of a record or plateau; records written before the keys were
    tuned128 and unconstrained."""
    return rec.get("config") or DEFAULT_CONFIG, rec.get("response_format") or ""


def setup_rank(setup: tuple[str, str]) -> tuple[int, str, str]:
    config, fmt = setup
    return (CONFIGS.index(config) if config in CONFIGS else len(CONFIGS)), config, fmt


def system_key(name: str, config: str) -> str:
    """A system's entry in ``systems`` and ``errors``: its name, with ``@CONFIG`` beyond tuned128 (the same
    server runs constrained and unconstrained loads alike)."""
    return name if config == DEFAULT_CONFIG else f"{name}@{config}"


def point_key(rec: dict[str, Any]) -> tuple[str, str, float]:
    """(system, co-tenant, rate): unique within one setup."""
    return rec["system"], rec["cotenant"], float(rec["rate"])


def record_key(rec: dict[str, Any]) -> tuple[str, str, float, str, str]:
    return (*point_key(rec), *setup_of(rec))


def sort_key(rec: dict[str, Any], systems: list[str]) -> tuple:
    order = systems.index(rec["system"]) if rec["system"] in systems else len(systems)
    return (setup_rank(setup_of(rec)), order, rec["system"], LEVEL_ORDER.get(rec["cotenant"], 9), rec["cotenant"],
            float(rec["rate"]))


def bracket(records: Iterable[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(highest rate that keeps up below every rate that does not, lowest rate that does not)."""
    judged = sorted((float(r["rate"]), keeps_up(r)[0]) for r in records)
    hi = min((rate for rate, ok in judged if not ok), default=None)
    lo = max((rate for rate, ok in judged if ok and (hi is None or rate < hi)), default=None)
    return lo, hi


def plateau_of(system: str, cotenant: str, records: list[dict[str, Any]],
               setup: tuple[str, str] = (DEFAULT_CONFIG, "")) -> dict[str, Any]:
    """The plateau of one (system, co-tenant) of one setup: the highest offered rate at which the queue does
    not grow and TTFT p50 stays under 1 s, as far as the measured rates bracket it."""
    lo, hi = bracket(records)
    vllm_def = [r["vllm_def_req_s"] for r in records if r.get("vllm_def_req_s") is not None]
    return {"system": system, "cotenant": cotenant, "config": setup[0], "response_format": setup[1] or None,
            "plateau_req_s": lo, "bracket": [lo, hi],
            "resolved": lo is not None and hi is not None and hi - lo <= RESOLUTION,
            "rates": sorted(float(r["rate"]) for r in records),
            "vllm_def_max_req_s": max(vllm_def) if vllm_def else None}


def plateaus(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, tuple[str, str]], list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["system"], rec["cotenant"], setup_of(rec)), []).append(rec)
    return [plateau_of(s, c, rs, setup) for (s, c, setup), rs in groups.items()]


def next_probe(lo: float | None, hi: float | None, low: float, high: float) -> float | None:
    """The next rate of the plateau's bisection within [low, high], or None once it is bracketed to
    ``RESOLUTION`` (or lies outside the range)."""
    if lo is None:
        if hi is None or hi > low:
            return low
        return None if hi / 2 < RESOLUTION / 4 else round(hi / 2, 2)
    if hi is None:
        return None if lo >= high else high
    if hi - lo <= RESOLUTION:
        return None
    return round((lo + hi) / 2 * 4) / 4


# ---------------------------------------------------------------------- merging
def merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s records replace ``old``'s of the same (system, co-tenant, rate, setup); every other record is kept.
    Systems' descriptions and errors: the newer per system. The plateaus are recomputed from all records."""
    old = old or {}
    records = {record_key(r): r for r in old.get("records", [])}
    records.update({record_key(r): r for r in new.get("records", [])})
    measured = {record_key(r) for r in new.get("records", [])}
    order = [*old.get("order", []), *(s for s in new.get("order", []) if s not in old.get("order", []))]
    doc = {**old, **{k: v for k, v in new.items() if k not in ("records", "systems", "errors", "skipped", "order")}}
    doc["order"] = order
    doc["records"] = sorted(records.values(), key=lambda r: sort_key(r, order))
    doc["systems"] = {**old.get("systems", {}), **new.get("systems", {})}
    ran = set(new.get("systems", {})) | set(new.get("errors", {}))
    doc["errors"] = {**{s: e for s, e in old.get("errors", {}).items() if s not in ran}, **new.get("errors", {})}
    kept = [s for s in old.get("skipped", []) if record_key(s) not in measured
            and system_key(s["system"], setup_of(s)[0]) not in ran]
    doc["skipped"] = kept + new.get("skipped", [])
    doc["plateau"] = sorted(plateaus(doc["records"]), key=lambda p: sort_key({**p, "rate": 0}, order))
    return doc


def compatible(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why ``old``'s records cannot stand beside ``new``'s (None when they can)."""
    # one file, one machine and one precision: figures of two cards, or of bf16 and FP8, never mix (a file from
    # before the precision was recorded is bf16's)
    old = {"precision": {"weights": "none", "kv_cache": "auto"}, **old}
    new = {"precision": {"weights": "none", "kv_cache": "auto"}, **new}
    for key in ("model", "workload", "window", "device", "precision"):
        if old.get(key) != new.get(key):
            return f"its {key} differs: {json.dumps(old.get(key))} vs {json.dumps(new.get(key))}"
    return None


# ---------------------------------------------------------------------- the table
def value(rec: dict[str, Any] | None, path: tuple[str, ...]) -> float | None:
    out: Any = rec
    for part in path:
        out = out.get(part) if isinstance(out, dict) else None
    return out if isinstance(out, int | float) else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def metric_rows(doc: dict[str, Any], blink: str, peer: str) -> list[str]:
    by_key = {point_key(r): r for r in doc.get("records", [])}
    systems = [s for s in doc.get("order", []) if any(r["system"] == s for r in doc.get("records", []))]
    levels = sorted({r["cotenant"] for r in doc.get("records", [])}, key=lambda c: (LEVEL_ORDER.get(c, 9), c))
    head = "| co-tenant | rate (req/s) | system | " + " | ".join(m[0] for m in METRICS) + " | keeps up |"
    lines = [head, "|" + " --- |" * (4 + len(METRICS))]
    for level in levels:
        rates = sorted({float(r["rate"]) for r in doc["records"] if r["cotenant"] == level})
        for rate in rates:
            for system in systems:
                rec = by_key.get((system, level, rate))
                if rec is not None:
                    cells = [fmt(value(rec, path), spec) for _, path, spec in METRICS]
                    lines.append(f"| {level} | {rate:g} | {system} | " + " | ".join(cells)
                                 + f" | {'yes' if keeps_up(rec)[0] else 'no'} |")
            a, b = by_key.get((blink, level, rate)), by_key.get((peer, level, rate))
            if a is not None and b is not None:
                cells = [ratio(value(a, path), value(b, path)) for _, path, _ in METRICS]
                lines.append(f"| {level} | {rate:g} | {blink} / {peer} | " + " | ".join(cells) + " | |")
    return lines


def plateau_rows(doc: dict[str, Any], blink: str, peer: str) -> list[str]:
    found = {(p["system"], p["cotenant"]): p for p in doc.get("plateau", [])}
    levels = sorted({c for _, c in found}, key=lambda c: (LEVEL_ORDER.get(c, 9), c))
    systems = [s for s in doc.get("order", []) if any(k[0] == s for k in found)]

    both = blink in systems and peer in systems
    lines = ["| co-tenant | " + " | ".join(f"{s} plateau (req/s)" for s in systems)
             + (f" | {blink} / {peer} |" if both else " |"), "|" + " --- |" * (1 + len(systems) + both)]
    for level in levels:
        cells = [plateau_cell(found.get((s, level))) for s in systems]
        if both:
            a, b = found.get((blink, level)), found.get((peer, level))
            cells.append(ratio(a and a["plateau_req_s"], b and b["plateau_req_s"]))
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return lines


def plateau_cell(p: dict[str, Any] | None) -> str:
    """``12 (12-13)`` when bracketed to the resolution, ``12 (12-16, open)`` when not yet, ``< 8`` or ``>= 32``."""
    if p is None:
        return "-"
    lo, hi = p["bracket"]
    if lo is None:
        return f"< {hi:g}"
    if hi is None:
        return f">= {lo:g}"
    return f"{lo:g} ({lo:g}-{hi:g}{'' if p['resolved'] else ', open'})"


def contention_rows(doc: dict[str, Any], level: str = "heavy") -> list[str]:
    """Each system's metrics under ``level`` over its own isolated ones, rate by rate, and its plateau's."""
    by_key = {point_key(r): r for r in doc.get("records", [])}
    found = {(p["system"], p["cotenant"]): p for p in doc.get("plateau", [])}
    lines = ["| system | rate (req/s) | " + " | ".join(f"{m[0]} {level}/none" for m in METRICS) + " |",
             "|" + " --- |" * (2 + len(METRICS))]
    for (system, cotenant, rate), rec in sorted(by_key.items(), key=lambda kv: sort_key(kv[1], doc.get("order", []))):
        iso = by_key.get((system, "none", rate))
        if cotenant == level and iso is not None:
            lines.append(f"| {system} | {rate:g} | " + " | ".join(ratio(value(rec, p), value(iso, p))
                                                              for _, p, _ in METRICS) + " |")
    for system in doc.get("order", []):
        a, b = found.get((system, level)), found.get((system, "none"))
        if a is not None and b is not None:
            lines.append(f"| {system} | plateau | {ratio(a['plateau_req_s'], b['plateau_req_s'])} |"
                         + " |" * (len(METRICS) - 1))
    return lines


def setups(doc: dict[str, Any]) -> list[tuple[str, str]]:
    found = {setup_of(r) for r in doc.get("records", [])} | {setup_of(p) for p in doc.get("plateau", [])}
    return sorted(found, key=setup_rank)


def of_setup(doc: dict[str, Any], setup: tuple[str, str]) -> dict[str, Any]:
    """``doc`` with only the records and plateaus of one setup."""
    return {**doc, "records": [r for r in doc.get("records", []) if setup_of(r) == setup],
            "plateau": [p for p in doc.get("plateau", []) if setup_of(p) == setup]}


def setup_title(setup: tuple[str, str]) -> str:
    config, response_format = setup
    return f"Config {config}" + (f", response_format {response_format}" if response_format else "") + ":"


def check_rows(doc: dict[str, Any]) -> list[str]:
    """The constrained answers' check per record (none without a constraint)."""
    checked = [r for r in doc.get("records", []) if r.get("output_check")]
    lines = ["| co-tenant | rate (req/s) | system | stopped | cut at length | invalid |", "|" + " --- |" * 6]
    for rec in checked:
        c = rec["output_check"]
        lines.append(f"| {rec['cotenant']} | {float(rec['rate']):g} | {rec['system']} | {c['stop']} | {c['length']} | "
                     f"{rec.get('invalid_outputs', c['invalid'])} |")
    return lines if checked else []


def setup_lines(doc: dict[str, Any], blink: str, peer: str) -> list[str]:
    """One setup's tables: the metrics with the Blink/peer ratios, the plateaus, the heavy/isolated ratios and
    the constraint's check."""
    lines = [*metric_rows(doc, blink, peer), "",
             "Plateau: the highest offered rate at which the waiting queue does not grow over the window and TTFT "
             "p50 stays under 1 s (the bracket of measured rates in brackets).", "", *plateau_rows(doc, blink, peer)]
    heavy = contention_rows(doc)
    if len(heavy) > 2:
        lines += ["", "Under the heavy co-tenant, over the same system isolated:", "", *heavy]
    checks = check_rows(doc)
    if checks:
        lines += ["", "Constrained answers (invalid: stopped but breaking the constraint, or cut at the length limit "
                  "without beginning as an object):", "", *checks]
    return lines


def kv_size(settings: dict[str, Any]) -> str:
    """" (KV cache: N tokens, G GiB)" as a system's start-up said (vLLM's log, Blink's ``KV cache`` event), or ""."""
    tokens, gib = settings.get("kv_cache_tokens"), settings.get("kv_cache_gib")
    if not isinstance(tokens, int):
        return ""
    return f" (KV cache: {tokens:,} tokens{f', {gib:g} GiB' if isinstance(gib, int | float) else ''})"


def format_table(doc: dict[str, Any], blink: str = "blink-persistent", peer: str = "vllm") -> str:
    """The BENCHMARKS table: every system per co-tenant level and rate with the Blink/peer ratios, the
    plateaus, and each system's heavy/isolated ratios; one setup after another when the file holds several."""
    window = doc.get("window", {})
    versions = "; ".join(f"{s} {d.get('version') or '?'}{kv_size(d.get('settings') or {})}"
                         for s, d in doc.get("systems", {}).items())
    lines = [f"Steady state: {doc.get('model', '?')} on {doc.get('device', '?')}; workload "
             f"{doc.get('workload', {}).get('name', '?')}; {fmt(window.get('window_s'), 'g')} s windows after "
             f"{fmt(window.get('warmup_s'), 'g')} s of warm-up; {versions}."]
    found = setups(doc) or [(DEFAULT_CONFIG, "")]
    for setup in found:
        titled = found != [(DEFAULT_CONFIG, "")]
        lines += ["", *([setup_title(setup), ""] if titled else []), *setup_lines(of_setup(doc, setup), blink, peer)]
    for s in doc.get("skipped", []):
        lines.append(f"\nSkipped: {s['system']} {s['cotenant']} rate {s['rate']:g} ({s['reason']})")
    for system, err in doc.get("errors", {}).items():
        lines.append(f"\nError in {system}: {err}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- plots
LATENCY = (("ttft_p50_ms", "TTFT P50 (ms)"), ("ttft_p99_ms", "TTFT P99 (ms)"),
           ("tpot_p50_ms", "TPOT P50 (ms)"), ("tpot_p99_ms", "TPOT P99 (ms)"))
THROUGHPUT = (("sustained_req_s", "sustained requests/s (in the window)"),
              ("sustained_out_tok_s", "sustained output tokens/s (in the window)"))


def flat(rec: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in rec.items() if not isinstance(v, dict)}
    for name in ("ttft", "tpot", "itl"):
        out.update({f"{name}_{p}_ms": v for p, v in rec[f"{name}_ms"].items()})
    return out


def plot(doc: dict[str, Any], prefix: Path) -> list[Path]:
    """Latency and throughput against offered rate: a colour per system, a line style per co-tenant level."""
    from bench.plots import plot_results

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rec in doc.get("records", []):
        setup = setup_of(rec)
        tag = "" if setup == (DEFAULT_CONFIG, "") else f" [{', '.join(filter(None, setup))}]"
        label = rec["system"] + tag
        groups.setdefault((label, rec["cotenant"]), []).append(flat(rec))
    entries = [({"runs": runs}, system, level) for (system, level), runs in groups.items()]
    return plot_results(entries, prefix, LATENCY, THROUGHPUT) if entries else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="?", default=Path("bench/results/peers.json"))
    ap.add_argument("--blink", default="blink-persistent", help="the Blink system of the ratios")
    ap.add_argument("--peer", default="vllm", help="the peer of the ratios")
    ap.add_argument("--plot", type=Path, default=None, help="PNG prefix to redraw the plots")
    args = ap.parse_args(argv)
    doc = json.loads(args.results.read_text())
    print(format_table(doc, args.blink, args.peer), end="")
    for path in plot(doc, args.plot) if args.plot else []:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
