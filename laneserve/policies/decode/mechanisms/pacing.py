"""Token pacing buffer (Kairos §2.3 "Opportunities" and §3.2): tokens a decode instance produces
ahead of their TPOT schedule are held and released at the SLO pace.

A request's first output token (sampled by its prefill) opens its schedule: output token ``k``
(``k = 0`` is the first token) is due at ``first_token + k * tpot``. The pacer releases token
``k`` at

    delivered_k = max(produced_k, first_token + k * tpot)

so a token is never released before it exists, and never held past the later of its production
and its schedule. Both sequences increase with ``k``, so delivery times increase too.

What metrics see. In the simulator (and the engine's records) the request's ``times.token_times``,
``times.last_token``, ``times.max_itl`` and ``times.finished`` carry *delivery* times; the KV,
counters and the scheduler's own state advance at production time (a decode instance frees a
finished request's blocks when its last token is produced, not when it is delivered). Because
``last_delivered = max(last_produced, first + (n - 1) * tpot)``, the delivered mean TPOT is
``max(produced TPOT, tpot)``: pacing never changes TPOT attainment; it caps per-request decode
throughput at ``1 / tpot`` and smooths inter-token gaps (lower max ITL). Offline jobs want tokens
as soon as possible, so pacing is off by default.

The pace is the request's own TPOT target (``slo.tpot``), or ``tpot`` for requests without one;
a request with neither is not paced.
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.core.request import Request


@dataclass(slots=True)
class TokenPacer:
    enabled: bool = False
    #: pace for requests without a TPOT target (seconds per token); None leaves them unpaced
    tpot: float | None = None
    #: override: pace every request at this rate even when it has its own target
    force_tpot: float | None = None
    #: tokens released later than produced (held in the buffer), and their total hold time
    held_tokens: int = 0
    held_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("tpot", "force_tpot"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"TokenPacer.{name} must be > 0, got {value}")

    def pace_of(self, req: Request) -> float | None:
        if self.force_tpot is not None:
            return self.force_tpot
        return req.slo.tpot if req.slo.tpot is not None else self.tpot

    def release_time(self, req: Request, produced_at: float) -> float:
        """Delivery time of the token ``req`` produced at ``produced_at`` (its next output token,
        index ``req.num_output_tokens``), before it is recorded."""
        first = req.times.first_token
        if not self.enabled or first is None:      # the first token is never held
            return produced_at
        pace = self.pace_of(req)
        if pace is None:
            return produced_at
        due = first + req.num_output_tokens * pace
        if due > produced_at:
            self.held_tokens += 1
            self.held_seconds += due - produced_at
            return due
        return produced_at
