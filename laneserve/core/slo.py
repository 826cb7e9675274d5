"""Service-level objectives: per-request TTFT and TPOT targets, and named SLO classes. An SLO is
checked once, where it enters (the API edge, a workload, the CLI); a value already checked
elsewhere (the wire codec's typed fields) is carried in with :meth:`SLO.trusted`, not checked again."""

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

    @classmethod
    def trusted(cls, ttft: float | None, tpot: float | None) -> SLO:
        """The SLO of targets already checked (each None or > 0, e.g. by the wire codec's field
        types), built without running the checks again."""
        slo = object.__new__(cls)
        object.__setattr__(slo, "ttft", ttft)
        object.__setattr__(slo, "tpot", tpot)
        return slo

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
