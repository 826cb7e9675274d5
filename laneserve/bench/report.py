"""Run reports: JSON + markdown + plot files, and console tables (docs/design.md, "Measuring").

A report compares *runs*: flat dicts, typically a :func:`laneserve.measure.metrics.summarize` result
plus the run's parameters (``policy``, ``rate``, ``slo_scale`` …). :func:`write_report` writes

- ``<name>.json`` — every row (through :func:`laneserve.bench.results.write_result`, so it carries
  the command and machine like every other result),
- ``<name>.md``   — one table row per (group, x) with the key metrics,
- ``<name>.png``  — attainment against rate, one line per group, the 90% target dashed, as in the
  papers' figures; one subplot per y key.

matplotlib is imported inside the plotting function (through the object API with the Agg canvas,
never pyplot), so importing ``laneserve.bench`` stays cheap and headless.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laneserve.bench.results import markdown_table, write_result

DEFAULT_METRIC_COLUMNS = ("attainment_ttft", "attainment_tpot", "attainment_both", "p90_ttft_ms",
                          "p99_ttft_ms", "p90_tpot_ms", "request_throughput", "output_throughput")


def _sort_key(row: Mapping[str, Any], group_key: str, x_key: str) -> tuple:
    x = row.get(x_key)
    return (str(row.get(group_key, "")), x if isinstance(x, (int, float)) else math.inf)


def best_x_meeting(rows: Sequence[Mapping[str, Any]], x_key: str, y_key: str,
                   target: float) -> float | None:
    """The largest ``x`` among ``rows`` whose ``y`` is at least ``target`` (None if none is)."""
    ok = [r[x_key] for r in rows
          if isinstance(r.get(y_key), (int, float)) and r[y_key] >= target and x_key in r]
    return max(ok) if ok else None


def write_report(outdir: Path | str, name: str, runs: Sequence[Mapping[str, Any]], *,
                 x_key: str = "rate", y_keys: Sequence[str] = ("attainment_both",),
                 group_key: str = "policy", title: str | None = None, target: float = 0.9,
                 columns: Sequence[str] | None = None, command: str | None = None,
                 plot: bool = True) -> dict[str, Path]:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` into ``outdir``; returns their paths."""
    outdir = Path(outdir)
    rows = sorted((dict(r) for r in runs), key=lambda r: _sort_key(r, group_key, x_key))
    title = title or name
    groups = list(dict.fromkeys(str(r.get(group_key, "")) for r in rows))
    headline: dict[str, Any] = {}
    for g in groups:
        best = best_x_meeting([r for r in rows if str(r.get(group_key, "")) == g],
                              x_key, y_keys[0], target)
        headline[f"{g}: max {x_key} with {y_keys[0]} >= {target:g}"] = (
            best if best is not None else "not met")
    if columns is None:
        wanted = [group_key, x_key, *DEFAULT_METRIC_COLUMNS,
                  *(y for y in y_keys if y not in DEFAULT_METRIC_COLUMNS)]
        columns = [c for c in wanted if any(c in r for r in rows)]
    table = f"## {title}\n\n" + markdown_table(rows, columns)
    paths = {"json": write_result(name, headline, markdown=table, command=command,
                                  results_dir=outdir,
                                  extra={"title": title, "x_key": x_key, "y_keys": list(y_keys),
                                         "group_key": group_key, "target": target, "rows": rows})}
    paths["md"] = outdir / f"{name}.md"
    if plot:
        png = outdir / f"{name}.png"
        plot_curves(png, rows, x_key=x_key, y_keys=y_keys, group_key=group_key, title=title,
                    target=target)
        paths["png"] = png
    return paths


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def plot_curves(path: Path | str, rows: Sequence[Mapping[str, Any]], *, x_key: str,
                y_keys: Sequence[str], group_key: str, title: str = "",
                target: float | None = 0.9) -> Path:
    """y against x, one line per group, one subplot per y key; attainment axes get the target."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    fig = Figure(figsize=(4.6 * len(y_keys), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(y_keys), squeeze=False)[0]
    groups = list(dict.fromkeys(str(r.get(group_key, "")) for r in rows))
    markers = "osD^vP*X<>"
    for ax, y_key in zip(axes, y_keys):
        for k, g in enumerate(groups):
            pts = sorted((_num(r.get(x_key)), _num(r.get(y_key))) for r in rows
                         if str(r.get(group_key, "")) == g and not math.isnan(_num(r.get(x_key))))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[k % len(markers)],
                        markersize=4, label=g)
        if y_key.startswith("attainment"):
            if target is not None:
                ax.axhline(target, color="grey", linestyle="--", linewidth=1)
            ax.set_ylim(0.0, 1.02)
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlabel(x_key)
        ax.set_ylabel(y_key)
        ax.grid(True, alpha=0.3)
    if groups:
        axes[0].legend(fontsize="small")
    if title:
        import textwrap
        fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize="medium")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return Path(path)


def _cell(v: Any, floatfmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, floatfmt)
    return str(v)


def format_console_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *,
                         floatfmt: str = ".4g") -> str:
    """Aligned plain-text columns (numbers right-aligned) for the CLI's comparisons."""
    cells = [[_cell(r.get(c), floatfmt) for c in columns] for r in rows]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows)
               for c in columns]
    widths = [max([len(c), *(len(row[k]) for row in cells)]) for k, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\n".join(out) + "\n"


_WIDTH = 50
_SECTIONS = (("ttft", "Time to First Token", "TTFT"),
             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"),
             ("e2el", "End-to-end Latency", "E2EL"),
             ("queue", "Queueing Time", "Queue"))


def _kv(label: str, value: Any, fmt: str = ".2f") -> str:
    text = "-" if value is None else (format(value, fmt) if isinstance(value, float) else str(value))
    return f"{label:<40} {text}"


def format_serving_block(summary: Mapping[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A ``vllm bench serve``-style result block, plus laneserve's SLO attainment section."""
    s = summary
    lines = [f" {title} ".center(_WIDTH, "="),
             _kv("Successful requests:", s.get("completed")),
             _kv("Failed requests:", s.get("failed")),
             _kv("Benchmark duration (s):", s.get("duration")),
             _kv("Total input tokens:", s.get("total_input_tokens")),
             _kv("Total generated tokens:", s.get("total_output_tokens")),
             _kv("Request throughput (req/s):", s.get("request_throughput")),
             _kv("Request goodput (req/s):", s.get("request_goodput")),
             _kv("Output token throughput (tok/s):", s.get("output_throughput")),
             _kv("Total Token throughput (tok/s):", s.get("total_token_throughput"))]
    for key, header, short in _SECTIONS:
        if f"mean_{key}_ms" not in s:
            continue
        lines.append(f"{header}".center(_WIDTH, "-"))
        lines.append(_kv(f"Mean {short} (ms):", s.get(f"mean_{key}_ms")))
        lines.append(_kv(f"Median {short} (ms):", s.get(f"median_{key}_ms")))
        pcts = sorted((float(m.group(1)), k) for k in s
                      if (m := re.fullmatch(rf"p(\d+(?:\.\d+)?)_{key}_ms", k)))
        lines += [_kv(f"P{k[1:].split('_')[0]} {short} (ms):", s[k]) for _, k in pcts]
    lines.append(" SLO Attainment ".center(_WIDTH, "-"))
    for key, label in (("attainment_ttft", "TTFT"), ("attainment_tpot", "TPOT"),
                       ("attainment_both", "TTFT and TPOT")):
        v = s.get(key)
        lines.append(_kv(f"{label} attainment (%):", None if v is None else 100.0 * v))
    for cls, m in (s.get("per_class") or {}).items():
        v = m.get("attainment_both")
        lines.append(_kv(f"  [{cls}] both attainment (%):", None if v is None else 100.0 * v))
    lines.append("=" * _WIDTH)
    return "\n".join(lines) + "\n"
