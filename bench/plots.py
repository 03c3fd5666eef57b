"""Plots of serving-benchmark results: latency and throughput against offered load.

One line per mode label (colour); isolated runs solid, runs under CPU interference dashed (an entry's condition
is a flag, or a co-tenant level's name: ``none`` solid, ``moderate`` dash-dotted, ``heavy`` and any other level
dashed). An infinite offered rate is drawn one step right of the largest finite rate and labelled ``inf``.

    python -m bench.plots persistent.json host.json host-interf.json:host:interference --out bench/results/sweep

Each input is ``FILE[:LABEL[:isolated|interference]]``; what is left out comes from the file's config
(``label`` and ``interference``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Entry = tuple[dict[str, Any], str, bool | str]
SOLID = ("none", "isolated")
STYLES = {"moderate": "-."}
LATENCY_PANELS = (("ttft_p50_ms", "TTFT P50 (ms)"), ("ttft_p99_ms", "TTFT P99 (ms)"),
                  ("tpot_p50_ms", "TPOT P50 (ms)"), ("tpot_p99_ms", "TPOT P99 (ms)"))
THROUGHPUT_PANELS = (("req_per_s", "completed requests/s"), ("out_tok_per_s", "output tokens/s"))


def parse_entry(text: str) -> Entry:
    """``FILE[:LABEL[:isolated|interference]]`` read into (document, label, interference)."""
    path, _, rest = text.partition(":")
    doc = json.loads(Path(path).read_text())
    label, _, flag = rest.partition(":")
    config = doc.get("config", {})
    interf = flag.startswith("interf") if flag else bool(config.get("interference"))
    return doc, label or config.get("label") or Path(path).stem, interf


def rate_value(rate: Any) -> float:
    return math.inf if rate in ("inf", None) else float(rate)


def x_positions(entries: Sequence[Entry]) -> tuple[dict[float, float], bool]:
    """Where each offered rate sits on the x axis, and whether the axis is logarithmic."""
    rates = {rate_value(run["rate"]) for doc, _, _ in entries for run in doc["runs"]}
    finite = sorted(r for r in rates if not math.isinf(r))
    log = len(finite) > 1 and finite[-1] / finite[0] >= 4
    top = finite[-1] if finite else 1.0
    spot = {r: r for r in finite}
    if math.inf in rates:
        spot[math.inf] = top * 2 if log or not finite else top + max(1.0, (top - finite[0]) / max(1, len(finite) - 1))
    return spot, log


def condition_style(cond: bool | str) -> tuple[str, str]:
    """(line style, legend name) of an entry's condition."""
    if isinstance(cond, bool):
        return ("--", "interference") if cond else ("-", "isolated")
    return ("-" if cond in SOLID else STYLES.get(cond, "--")), cond


def _draw(ax: Any, entries: Sequence[Entry], key: str, spot: dict[float, float]) -> list[float]:
    """One line per entry; returns the values drawn."""
    drawn: list[float] = []
    colours: dict[str, str] = {}
    for doc, label, interf in entries:
        if label not in colours:
            colours[label] = f"C{len(colours) % 10}"
        runs = sorted(doc["runs"], key=lambda r: rate_value(r["rate"]))
        pts = [(spot[rate_value(r["rate"])], r[key]) for r in runs if r.get(key) is not None]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        drawn.extend(ys)
        style, name = condition_style(interf)
        ax.plot(xs, ys, color=colours[label], linestyle=style, marker="o", label=f"{label} ({name})")
    return drawn


def _axes_style(ax: Any, spot: dict[float, float], log: bool, ylabel: str) -> None:
    if log:
        ax.set_xscale("log", base=2)
    ticks = sorted(spot.items(), key=lambda kv: kv[1])
    ax.set_xticks([x for _, x in ticks])
    ax.set_xticklabels(["inf" if math.isinf(r) else f"{r:g}" for r, _ in ticks])
    ax.minorticks_off()
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _figure(entries: Sequence[Entry], panels: Sequence[tuple[str, str]], title: str, path: Path,
            ideal_rate: bool = False) -> Path:
    spot, log = x_positions(entries)
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (key, ylabel) in zip(axes.flat, panels, strict=False):
        drawn = [v for v in _draw(ax, entries, key, spot) if v > 0]
        if drawn and max(drawn) >= 30 * min(drawn):  # isolated and interfered runs orders of magnitude apart
            ax.set_yscale("log")
        if ideal_rate and key in ("req_per_s", "sustained_req_s"):
            finite = [(x, r) for r, x in spot.items() if not math.isinf(r)]
            if finite:
                xs, rs = zip(*sorted(finite), strict=True)
                ax.plot(xs, rs, color="grey", linestyle=":", label="offered")
        _axes_style(ax, spot, log, ylabel)
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_results(entries: Sequence[Entry], prefix: Path | str,
                 latency_panels: Sequence[tuple[str, str]] = LATENCY_PANELS,
                 throughput_panels: Sequence[tuple[str, str]] = THROUGHPUT_PANELS) -> list[Path]:
    """Write ``PREFIX_latency.png`` and ``PREFIX_throughput.png``; returns their paths."""
    prefix = Path(prefix)
    base = prefix.parent / prefix.name
    return [
        _figure(entries, latency_panels, "Latency vs offered load", Path(f"{base}_latency.png")),
        _figure(entries, throughput_panels, "Throughput vs offered load", Path(f"{base}_throughput.png"),
                ideal_rate=True),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="FILE[:LABEL[:isolated|interference]]")
    ap.add_argument("--out", type=Path, required=True, help="PNG prefix")
    args = ap.parse_args(argv)
    for path in plot_results([parse_entry(t) for t in args.inputs], args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
