"""Service-level objectives: per-request TTFT and TPOT targets, and named SLO classes."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request targets in seconds; ``None`` means no target on that metric."""

    ttft: float | None = None
    tpot: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} must be > 0 seconds, got {v!r}")

    def scaled(self, factor: float) -> SLO:
        """The same SLO with both targets multiplied by ``factor`` (SLO-scale sweeps)."""
        if not factor > 0:
            raise ValueError(f"SLO scale must be > 0, got {factor!r}")
        return SLO(None if self.ttft is None else self.ttft * factor,
                   None if self.tpot is None else self.tpot * factor)

    def with_defaults(self, default: SLO) -> SLO:
        return replace(self, ttft=self.ttft if self.ttft is not None else default.ttft,
                       tpot=self.tpot if self.tpot is not None else default.tpot)


@dataclass(frozen=True, slots=True)
class SLOClass:
    """A named class of requests sharing targets (FlowPrefill Table 2, per-class server defaults)."""

    name: str
    slo: SLO
    priority: int = 0
