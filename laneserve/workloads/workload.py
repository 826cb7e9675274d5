"""A workload: an immutable, arrival-ordered tuple of :class:`RequestSpec` plus metadata.

Every transformation returns a new :class:`Workload` whose requests are sorted by arrival time and
numbered ``0..n-1`` in that order (docs/design.md, "Measuring": goodput searches the request rate,
SLO-scale sweeps scale the targets, so rate and SLO are transformations, not generator options).

Time conventions: arrival times are seconds from the start of the workload; loaders and
generators put the first request at 0. ``duration`` is the last arrival time minus the first and
``mean_rate`` is ``1 / mean inter-arrival gap`` = ``(n - 1) / duration``.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from laneserve.core.request import RequestSpec
from laneserve.core.slo import SLO
from laneserve.workloads.arrivals import arrival_times

_PERCENTILES = (50, 90, 99)


def _open_text(path: str | Path, mode: str = "rt"):
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, mode, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _summary(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    pct = np.percentile(values, _PERCENTILES)
    return {"mean": float(values.mean()), **{f"p{p}": float(v) for p, v in zip(_PERCENTILES, pct)},
            "max": float(values.max())}


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests in arrival order (``request_id == index``) with free-form ``meta`` (source, options,
    notes such as clamped rows). Build with :meth:`from_specs` to sort and renumber."""

    name: str
    specs: tuple[RequestSpec, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        prev = -np.inf
        for i, s in enumerate(self.specs):
            if s.request_id != i or s.arrival_time < prev:
                raise ValueError(f"workload {self.name!r}: specs must be sorted by arrival with "
                                 f"request_id == index (use Workload.from_specs); bad at index {i}")
            prev = s.arrival_time

    @classmethod
    def from_specs(cls, name: str, specs, meta: dict[str, Any] | None = None) -> Workload:
        """Sort ``specs`` by arrival (stable) and renumber them ``0..n-1``."""
        ordered = sorted(specs, key=lambda s: s.arrival_time)
        renumbered = tuple(s if s.request_id == i else replace(s, request_id=i)
                           for i, s in enumerate(ordered))
        return cls(name, renumbered, dict(meta or {}))

    # ---- basic views ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self):
        return iter(self.specs)

    def __getitem__(self, i: int) -> RequestSpec:
        return self.specs[i]

    @property
    def arrivals(self) -> np.ndarray:
        return np.fromiter((s.arrival_time for s in self.specs), dtype=np.float64, count=len(self))

    @property
    def duration(self) -> float:
        """Seconds between the first and the last arrival."""
        return self.specs[-1].arrival_time - self.specs[0].arrival_time if self.specs else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second = 1 / mean inter-arrival gap (0 for fewer than 2 requests or a
        zero-length span)."""
        d = self.duration
        return (len(self) - 1) / d if len(self) >= 2 and d > 0 else 0.0

    def _derive(self, specs, note: str | None = None, **meta) -> Workload:
        new_meta = {**self.meta, **meta}
        if note:
            new_meta["transforms"] = [*self.meta.get("transforms", []), note]
        return Workload.from_specs(self.name, specs, new_meta)

    # ---- time transformations ------------------------------------------------------------
    def scale_time(self, factor: float) -> Workload:
        """Multiply every arrival time by ``factor`` (> 1 stretches, i.e. lowers the rate)."""
        if not (factor > 0 and np.isfinite(factor)):
            raise ValueError(f"time scale factor must be a finite number > 0, got {factor!r}")
        return self._derive((replace(s, arrival_time=s.arrival_time * factor) for s in self.specs),
                            f"scale_time({factor:g})")

    def with_rate(self, rate: float) -> Workload:
        """Rescale inter-arrival times so that :attr:`mean_rate` becomes ``rate`` req/s; the shape
        of the arrival pattern (bursts, think times) is kept."""
        if not (rate > 0 and np.isfinite(rate)):
            raise ValueError(f"rate must be a finite number > 0 req/s, got {rate!r}")
        if self.mean_rate == 0:
            raise ValueError(f"workload {self.name!r} has no arrival span to rescale")
        return self.scale_time(self.mean_rate / rate)._with_meta(rate=rate)

    def with_arrivals(self, process: str = "poisson", rate: float = 1.0, *, cv: float = 1.0,
                      seed: int = 0) -> Workload:
        """Replace the arrival times by a fresh process (``"poisson"`` or ``"gamma"`` with ``cv``);
        requests keep their current order. Multi-turn spacing is not preserved."""
        times = arrival_times(process, len(self), rate, cv=cv, seed=seed)
        specs = (replace(s, arrival_time=float(t)) for s, t in zip(self.specs, times))
        return self._derive(specs, f"with_arrivals({process}, rate={rate:g}, cv={cv:g}, seed={seed})",
                            rate=rate)

    def spread_ticks(self, tick: float, *, seed: int = 0) -> Workload:
        """Undo a trace's timestamp quantisation: move every request to a uniformly random time in
        ``[t, t + tick)`` from its recorded ``t`` (seeded), then order by the new times (and
        renumber, as every workload is). Mooncake's conversation trace, for one, records arrivals in ~3 s ticks; the
        recorded burst structure between ticks is kept, the fake simultaneity inside one is not."""
        if not (tick > 0 and np.isfinite(tick)):
            raise ValueError(f"tick must be a finite number > 0 seconds, got {tick!r}")
        rng = np.random.default_rng(seed)
        offsets = rng.uniform(0.0, tick, size=len(self))
        specs = [replace(s, arrival_time=s.arrival_time + float(o)) for s, o in zip(self.specs, offsets)]
        return self._derive(specs, f"spread_ticks({tick:g}, seed={seed})")

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        if n < 0:
            raise ValueError(f"head(n) needs n >= 0, got {n}")
        return self._derive(self.specs[:n], f"head({n})")

    def window(self, t0: float, t1: float) -> Workload:
        """Requests arriving in ``[t0, t1)``, with times shifted so that ``t0`` becomes 0.
        ``prefix_len`` is kept even when the earlier request it refers to falls outside."""
        if not t1 > t0:
            raise ValueError(f"window needs t1 > t0, got [{t0}, {t1})")
        specs = [replace(s, arrival_time=s.arrival_time - t0)
                 for s in self.specs if t0 <= s.arrival_time < t1]
        return self._derive(specs, f"window({t0:g}, {t1:g})")

    # ---- SLOs ----------------------------------------------------------------------------
    def with_slo(self, slo: SLO | dict[str, SLO]) -> Workload:
        """Set every request's SLO, or per ``slo_class`` from a dict (classes absent from the dict
        keep their SLO)."""
        if isinstance(slo, SLO):
            specs = (replace(s, slo=slo) for s in self.specs)
            return self._derive(specs, f"with_slo({slo})")
        if isinstance(slo, dict):
            bad = [k for k, v in slo.items() if not isinstance(v, SLO)]
            if bad:
                raise ValueError(f"with_slo: values must be SLO objects (classes {bad})")
            specs = (replace(s, slo=slo[s.slo_class]) if s.slo_class in slo else s
                     for s in self.specs)
            return self._derive(specs, f"with_slo(by class: {', '.join(sorted(slo))})")
        raise ValueError(f"with_slo expects an SLO or a dict[str, SLO], got {type(slo).__name__}")

    def scale_slo(self, factor: float) -> Workload:
        """Multiply every TTFT and TPOT target by ``factor`` (SLO-scale sweeps)."""
        specs = [replace(s, slo=s.slo.scaled(factor)) for s in self.specs]
        return self._derive(specs, f"scale_slo({factor:g})")

    def _with_meta(self, **meta) -> Workload:
        return Workload(self.name, self.specs, {**self.meta, **meta})

    # ---- summaries -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counts, prompt/output/prefix length summaries (mean, p50, p90, p99, max) and rate."""
        prompt = np.fromiter((s.prompt_len for s in self.specs), dtype=np.float64, count=len(self))
        output = np.fromiter((s.output_len for s in self.specs), dtype=np.float64, count=len(self))
        prefix = np.fromiter((s.prefix_len for s in self.specs), dtype=np.float64, count=len(self))
        classes: dict[str, int] = {}
        for s in self.specs:
            classes[s.slo_class] = classes.get(s.slo_class, 0) + 1
        sessions = {s.session_id for s in self.specs if s.session_id is not None}
        return {"name": self.name, "requests": len(self), "duration_s": self.duration,
                "rate": self.mean_rate, "classes": classes, "sessions": len(sessions),
                "prompt_len": _summary(prompt), "output_len": _summary(output),
                "prefix_len": _summary(prefix),
                "new_prompt_tokens": float((prompt - prefix).sum())}

    # ---- persistence ---------------------------------------------------------------------
    @classmethod
    def from_jsonl(cls, path: str | Path) -> Workload:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"workload file not found: {path}")
        with _open_text(path) as f:
            header = json.loads(f.readline() or "{}")
            if "workload" not in header:
                raise ValueError(f"{path}:1: not a laneserve workload file (missing header line)")
            specs = []
            for lineno, line in enumerate(f, start=2):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    specs.append(RequestSpec(
                        request_id=r["request_id"], arrival_time=r["arrival_time"],
                        prompt_len=r["prompt_len"], output_len=r["output_len"],
                        slo=SLO(r.get("ttft"), r.get("tpot")), slo_class=r.get("slo_class", "default"),
                        priority=r.get("priority", 0), prefix_len=r.get("prefix_len", 0),
                        session_id=r.get("session_id"), turn=r.get("turn", 0),
                        prompt_token_ids=tuple(r["prompt_token_ids"]) if "prompt_token_ids" in r else None,
                        hash_ids=tuple(r["hash_ids"]) if "hash_ids" in r else None))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: malformed request row: {e}") from None
        return cls.from_specs(header["workload"], specs, header.get("meta", {}))

    def __repr__(self) -> str:
        return (f"Workload({self.name!r}, requests={len(self)}, duration={self.duration:.1f}s, "
                f"rate={self.mean_rate:.3g}/s)")
