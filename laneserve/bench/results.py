"""Committed benchmark outputs: ``benchmarks/results/<name>.json`` plus a markdown table.

Every benchmark script ends with :func:`write_result`, so that all results share one shape:
``{"command": ..., "machine": ..., "metrics": {...}, ...extra}``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def machine_info() -> str:
    """One line that says where a figure was measured."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    parts = [f"{os.cpu_count()} cores", cpu, f"Python {platform.python_version()}", platform.system()]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
    return ", ".join(parts)


def command_line() -> str:
    return " ".join(["python", *sys.argv]) if sys.argv and sys.argv[0] else "python"


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                   floatfmt: str = ".4g") -> str:
    """Render rows of dicts as a GitHub markdown table."""
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_result(name: str, metrics: Mapping[str, Any], *, markdown: str = "",
                 extra: Mapping[str, Any] | None = None, command: str | None = None,
                 results_dir: Path | str | None = None) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` into the results folder; returns the JSON path."""
    out = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"command": command or command_line(), "machine": machine_info(),
                               "metrics": dict(metrics)}
    if extra:
        payload.update(extra)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    header = f"# {name}\n\nCommand: `{payload['command']}`  \nMachine: {payload['machine']}\n\n"
    metric_rows = [{"metric": k, "value": v} for k, v in metrics.items()
                   if isinstance(v, (int, float, str, bool))]
    body = markdown or ""
    (out / f"{name}.md").write_text(header + "## Headline metrics\n\n" + markdown_table(metric_rows)
                                    + ("\n" + body if body else ""))
    return path


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict
        return asdict(obj)
    return str(obj)
