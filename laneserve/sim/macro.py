"""Runs of a stable decode batch, simulated as one event.

A decode instance whose policy declares ``stable_decode_batch`` decodes its whole running set every
step, and that set changes only at an event: a KV transfer arriving, a request finishing, a
growth that does not fit memory (a transfer offered only reserves memory: the run goes on while
its growth still fits). So once the simulator has started a decode-only
step, the steps after it are known: each context grows by one token a step, their durations come
from the cost model, their end times are the same float sums the step-by-step loop makes, and the
KV blocks they grow into are counted against the free blocks now. A run stops at the first step
that finishes a request and before the first growth that would not fit. Its steps are computed in
chunks (:meth:`DecodeRun.extend`: the first ``FIRST_CHUNK`` steps, then as many again as it has,
up to ``MAX_CHUNK``), so a run cut short wastes little; at the end of a chunk the simulator extends
the run with one event instead of one per step.

The simulator pushes only the end of the last computed step. Whatever reads or changes the
instance earlier first brings it to the state the step-by-step loop would show at that time:
:meth:`DecodeRun.grow` makes the block allocations of the steps begun by then, in the loop's order
(step by step, in batch order: the block tables are identical), and :meth:`DecodeRun.count` the
token counters, token times, ITL and busy-time figures of the steps ended. An event that changes
the batch (:meth:`DecodeRun.truncate`) ends the run with the running step; the last step of a run
is ended by the ordinary ``Instance.update`` path.

Ties: the simulator processes step ends of decode instances before other events at the same time
(arrivals come first, as always), so "step ``j`` has ended at ``t``" is ``ends[j] <= t`` here and
in the step-by-step loop alike.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate
from operator import add, sub

from laneserve.core.plan import StepPlan
from laneserve.core.request import Request
from laneserve.costmodel.base import CostModel
from laneserve.runtime import Instance

#: steps computed when a run starts (after its first), and the most added at once (a run adds as many as it has);
#: 128 was the fastest of 8-512 on the Azure trace (4P+4D): a cut run wastes only cheap array steps
FIRST_CHUNK, MAX_CHUNK = 128, 1024


def stable_decode_plan(inst: Instance, plan: StepPlan) -> bool:
    """Whether ``plan`` may start a run: a decode-only step of a decode instance whose policy
    keeps its batch stable."""
    return (inst.scheduler.stable_decode_batch and inst.role == "decode" and bool(plan.decodes)
            and not plan.prefills and not plan.swap_in and not plan.swap_out and not plan.preemptible)


@dataclass(slots=True, eq=False)
class DecodeRun:
    """The steps of one stable decode batch on ``inst`` from step 1 (begun by the ordinary path),
    computed so far, with how far the instance has been brought up to date."""

    inst: Instance
    batch: list[Request]
    contexts: list[int]                    # each request's context in step 1
    total: int                             # their sum
    longest: int                           # and the longest
    firsts: list[int]                      # the step at which each request first needs a new block
    limit: int                             # the step that finishes a request
    ends: list[float]                      # ends[j]: end of step j (ends[0]: start of step 1)
    cycle: list[int]                       # request ids by (first step mod block size, batch index)
    offsets: list[int]                     # offsets[r]: entries of ``cycle`` whose first step mod block size < r
    periodic: int                          # from this step on, step s allocates cycle's class s mod block size
    first: float = 0.0                     # step 1's duration
    pending: int = 0                       # block allocations of the computed steps not made yet
    blocked: bool = False                  # the next step's growth would not fit memory
    cut: bool = False                      # ended early by a change to the batch
    applied: int = 0                       # steps whose tokens are counted
    grown: int = 1                         # steps whose KV growth is allocated (step 1: by the policy)

    @property
    def steps(self) -> int:
        return len(self.ends) - 1

    @property
    def end_time(self) -> float:
        return self.ends[-1]

    @classmethod
    def start(cls, inst: Instance, plan: StepPlan, now: float, cost: CostModel) -> DecodeRun:
        """The run from ``plan`` (step 1, begun at ``now``), its first steps computed (step 1's
        duration is what the executor would charge ``plan``); with one step only it is no run: the
        simulator ends that step the ordinary way."""
        batch = plan.decodes
        kv = inst.scheduler.kv
        tables, bs = kv.tables, kv.block_size
        rids = [r.request_id for r in batch]
        contexts = [r.prompt_len + r.num_output_tokens for r in batch]
        # step j needs a new block when context + j - 1 first exceeds what the table holds
        firsts = [len(tables[rid]) * bs - c + 2 for rid, c in zip(rids, contexts)]
        limit = min([r.max_output_tokens - r.num_output_tokens for r in batch])
        # request i allocates at steps firsts[i] + m * bs: from step 2 on (step 1's growth is the
        # policy's) that is every step of its class firsts[i] mod bs, unless its first comes later
        classes = [f % bs for f in firsts]
        offsets = [0] * (bs + 1)
        for c in classes:
            offsets[c + 1] += 1
        cycle = list(map(rids.__getitem__, sorted(range(len(batch)), key=classes.__getitem__)))
        run = cls(inst, batch, contexts, sum(contexts), max(contexts), firsts, limit, [now],
                  cycle, list(accumulate(offsets)), max(2, max(firsts) - bs + 1))
        run.extend(cost, FIRST_CHUNK + 1)
        return run

    def extend(self, cost: CostModel, steps: int | None = None) -> bool:
        """Compute up to ``steps`` more steps (default: as many as the run has, at most
        ``MAX_CHUNK``), fewer at the run's limit or memory; False when none can be added."""
        k = len(self.ends) - 1
        if self.cut or self.blocked or k >= self.limit:
            return False
        last = min(self.limit, k + (steps or min(k, MAX_CHUNK)))
        free = self.inst.scheduler.kv.num_free_blocks - self.pending   # less what earlier steps take
        grows = max(k + 1, 2)               # the first step whose growth is the run's
        added = self._allocations(grows, last)
        if added > free:                    # a step's growth would not fit: stop before the first such
            lo, hi = k, last - 1            # the last step whose growth (with the ones before) fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._allocations(grows, mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            last, added = lo, self._allocations(grows, lo)
            self.blocked = True
        if last <= k:
            return False
        times = getattr(cost, "decode_step_times", None)
        batch = self.batch
        if times is not None:     # the same floats as decode_step_time, from the summed and longest context
            n = len(batch)
            durations = times(n, self.total + n * k, self.longest + k, last - k)
        else:
            durations = [cost.decode_step_time([c + j for c in self.contexts]) for j in range(k, last)]
        if k == 0:
            self.first = durations[0]
        ends = accumulate(durations, initial=self.ends[-1])   # the loop's float sums
        next(ends)                                            # (the initial, there already)
        self.ends += ends
        self.pending += added
        return True

    def growth_fits(self) -> bool:
        """Whether the block allocations of the computed steps not made yet fit the instance's free
        blocks (asked after a reservation took some: if they do, every step runs as computed)."""
        return self.pending <= self.inst.scheduler.kv.num_free_blocks

    def sync(self, now: float) -> None:
        """Bring the instance to ``now``: the running step's KV grown, the steps ended before it
        counted (the last step is left to ``Instance.update``)."""
        self.grow(now)
        self.count()

    def grow(self, now: float) -> None:
        """Allocate the KV of the step running at ``now`` and of those before it, all that a
        memory figure (``kv_usage``) depends on; their counters can wait for :meth:`count`."""
        step = bisect_right(self.ends, now, self.grown, len(self.ends) - 1)
        if step > self.grown:
            self._grow(step)

    def count(self) -> None:
        """Count the steps before the running one (as of the last :meth:`grow`)."""
        if self.grown - 1 > self.applied:
            self._count(self.grown - 1)

    def truncate(self, now: float) -> bool:
        """End the run with the step running at ``now`` (brought up to date first); True if its
        end moved earlier (the caller pushes the new end)."""
        self.sync(now)
        self.cut = True
        k = self.applied + 1
        if k == self.steps:
            return False
        del self.ends[k + 1:]
        return True

    # ---- catch-up --------------------------------------------------------------------------
    def _count(self, done: int) -> None:
        """Steps ``applied + 1 .. done`` ended: each request got one token at each step's end."""
        ends, a = self.ends, self.applied
        m = done - a
        first, last = ends[a + 1], ends[done]
        gaps = list(map(sub, ends[a + 1:done + 1], ends[a:done]))
        inner = max(gaps[1:]) if m > 1 else None
        for r in self.batch:
            r.num_computed_tokens += m
            r.num_output_tokens += m
            times = r.times
            if times.first_token is None:
                times.first_token = first
            elif first - times.last_token > times.max_itl:
                times.max_itl = first - times.last_token
            if inner is not None and inner > times.max_itl:
                times.max_itl = inner
            times.last_token = last
            if times.token_times is not None:
                times.token_times.extend(ends[a + 1:done + 1])
        inst = self.inst
        if inst.record_decode:          # the last step counted, as Instance.update records it
            b, k = len(self.batch), done - 1
            inst.last_decode = (b, self.total + b * k, self.longest + k, gaps[-1])
        inst.steps += m
        inst.busy_time = reduce(add, gaps, inst.busy_time)   # the loop's float sums, in order
        inst.step_start = last
        self.applied = done

    def _grow(self, step: int) -> None:
        """Allocate the blocks steps ``grown + 1 .. step`` grow into, in the loop's order."""
        rids = self._allocated(self.grown + 1, step)
        if rids:
            self.inst.scheduler.kv.append_blocks(rids)
            self.pending -= len(rids)
        self.grown = step

    # ---- the block allocations of steps ``a .. b`` (``a >= 2``) -----------------------------
    def _allocations(self, a: int, b: int) -> int:
        """How many blocks steps ``a .. b`` allocate."""
        if b < a:
            return 0
        if a < self.periodic:
            return len(self._allocated(a, b))
        bs, n, offsets = len(self.offsets) - 1, len(self.cycle), self.offsets
        b += 1                              # the allocations before step b + 1, less those before step a
        return (b // bs - a // bs) * n + offsets[b % bs] - offsets[a % bs]

    def _allocated(self, a: int, b: int) -> list[int]:
        """The request ids that steps ``a .. b`` allocate a block for, step by step in batch order
        (the order of the step-by-step loop's growth)."""
        bs = len(self.offsets) - 1
        if a < self.periodic:               # a request whose first allocation is still to come
            batch, firsts = self.batch, self.firsts
            early = [r.request_id for s in range(a, min(b, self.periodic - 1) + 1)
                     for r, f in zip(batch, firsts) if s >= f and (s - f) % bs == 0]
            return early + self._allocated(self.periodic, b) if b >= self.periodic else early
        if b < a:
            return []
        # steps a .. b take a window of the cycle repeated: classes a mod bs, a + 1 mod bs, ...
        cycle, offsets, n = self.cycle, self.offsets, len(self.cycle)
        start = offsets[a % bs]
        end = (b + 1) // bs * n + offsets[(b + 1) % bs] - a // bs * n
        return (cycle * -(-end // n))[start:end]
