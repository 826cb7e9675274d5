"""Bookkeeping of AlignedServe decode (§3.4, §4.4): its record on each request, the batches it
forms and the statistics the benchmark reports (switch iterations, evictions, pool waits, the
starvation log)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Aligned:
    """A request's record under AlignedServe decode (``req.policy_state.of(Aligned)``)."""

    batch: int | None = None          # the aligned batch it was picked into
    since: float | None = None        # when it started waiting in the length tree
    prefetch_ready: float = 0.0       # when its staged KV is on the device
    prefetch_staged: int = 0          # KV tokens staged for it


@dataclass(slots=True)
class AlignedBatch:
    batch_id: int
    lo: int                     # KV length window at formation
    hi: int
    size: int
    formed_at: float
    full: bool                  # met n_min
    starving: bool              # formed by the starvation rule
    start_iter: int | None = None
    started_at: float | None = None
    peak: int = 0               # most of its members decoding at once


@dataclass(slots=True)
class AlignedStats:
    decode_steps: int = 0
    mixed_steps: int = 0            # iterations decoding members of two (or more) batches
    batches_formed: int = 0
    full_batches: int = 0
    starvation_batches: int = 0
    switches: int = 0
    evictions: int = 0
    recomputes: int = 0            # evictions that found the host pool full (KV dropped)
    aligned_prefetches: int = 0
    swap_in_tokens: int = 0
    swap_out_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    batch_spans: list[int] = field(default_factory=list)     # hi - lo of each formed batch
    pool_waits: list[float] = field(default_factory=list)    # time each request spent in the tree
    #: (time, oldest pool wait before forming, whether that request joined the batch)
    starvation_log: list[tuple[float, float, bool]] = field(default_factory=list)
    starving_switch_delays: list[float] = field(default_factory=list)

    @property
    def switch_iteration_share(self) -> float:
        return self.mixed_steps / self.decode_steps if self.decode_steps else 0.0
