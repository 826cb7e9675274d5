"""Slack-gated decoding of TPOT-infeasible requests (adaptive decode, docs/design.md "adaptive:
TPOT-infeasible contexts").

Why: a decode kernel without split-KV walks each context in one block, so a step costs about what
its longest context costs alone (Llama-3.1-8B on H100, analytic: twelve 4K contexts 12 ms a step,
one 49K context alone 51 ms). A request whose step *alone* is over its TPOT target cannot meet it
whatever the scheduler does; decoding it in every step drags every request beside it to its step
time, past their targets. Its TTFT is already met or missed when it reaches the decode instance,
so when it decodes changes nothing for its own attainment, only for the others'.

The rule: a running request is *infeasible* when the predicted step of it alone, at its present
context, is over its TPOT target. Each step, every feasible running request decodes; infeasible
ones join, shortest context first, while the predicted step still leaves each feasible member its
TPOT slack (its due time ``first token + tpot x tokens so far``, less ``reserve`` TPOTs kept back,
is not passed by the step's end). Feasible requests decoding short steps bank slack, and the
infeasible ones spend it: they progress at the rate the others can afford. The bound: an
infeasible request that has not decoded for ``bound`` seconds joins the next step whatever the
slack, so none is starved. With only infeasible requests running, or none, every request decodes;
so it does while an offered transfer waits for decode memory: held back, infeasible contexts pile
up in memory and the requests that could meet their targets wait to get in (measured on
``long_context_mix`` at 1 req/s, holding them while any feasible request runs: decode memory under
5% free half the time, hand-offs waiting 21 s on average, both-SLO attainment 0.54 -> 0.39).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from laneserve.core.request import Request


@dataclass(slots=True)
class Deferred:
    """An infeasible request's record (``req.policy_state.of(Deferred)``): when it last decoded
    (or was first seen), for the starvation bound."""

    since: float | None = None


@dataclass(slots=True)
class GateStats:
    steps: int = 0          # steps with feasible and infeasible requests running together
    deferred: int = 0       # infeasible request-steps left out
    forced: int = 0         # infeasible request-steps let in by the bound
    memory_bound: int = 0   # mixed steps where everyone decoded: an offered transfer waited for memory


#: predicted step of (requests, context sum, longest context); None when it cannot be predicted
StepTime = Callable[[int, int, int], "float | None"]


class InfeasibleGate:
    """Chooses which running requests decode when TPOT-infeasible ones run beside feasible ones."""

    def __init__(self, reserve: float = 1.0, bound: float = 5.0) -> None:
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0 TPOTs, got {reserve!r}")
        if bound <= 0:
            raise ValueError(f"bound must be > 0 seconds, got {bound!r}")
        self.reserve, self.bound = reserve, bound
        self.stats = GateStats()
        self.mixed = False          # the last selection had feasible and infeasible requests running

    @staticmethod
    def infeasible(req: Request, step_time: StepTime) -> bool:
        """Whether ``req``'s step alone, at its present context, is predicted over its TPOT."""
        tpot = req.slo.tpot
        if tpot is None:
            return False
        c = req.context_len
        alone = step_time(1, c, c)
        return alone is not None and alone > tpot

    def split(self, decodes: list[Request], step_time: StepTime) -> tuple[list[Request], list[Request]]:
        """``decodes`` as (feasible, infeasible), each in its order."""
        feasible, infeasible = [], []
        for r in decodes:
            (infeasible if self.infeasible(r, step_time) else feasible).append(r)
        return feasible, infeasible

    def select(self, decodes: list[Request], now: float, step_time: StepTime, *,
               memory_bound: bool = False) -> list[Request]:
        """The requests of ``decodes`` (everyone running) that decode the step starting ``now``;
        ``memory_bound``: an offered transfer waits for decode memory, so everyone decodes (a
        deferred context holds memory that requests meeting their targets wait for)."""
        feasible, infeasible = self.split(decodes, step_time)
        self.mixed = bool(feasible and infeasible)
        if memory_bound and self.mixed:
            self.stats.memory_bound += 1
        if not self.mixed or memory_bound:
            for r in infeasible:
                r.policy_state.of(Deferred).since = now
            return decodes
        self.stats.steps += 1
        chosen = list(feasible)
        n, total = len(chosen), sum(r.context_len for r in chosen)
        longest = max(r.context_len for r in chosen)
        optional = []
        for r in infeasible:
            rec = r.policy_state.of(Deferred)
            if rec.since is None:
                rec.since = now
            if now - rec.since >= self.bound:            # the bound: it joins whatever the slack
                chosen.append(r)
                self.stats.forced += 1
                n, total, longest = n + 1, total + r.context_len, max(longest, r.context_len)
            else:
                optional.append(r)
        limit = self._slack(feasible, now)
        for r in sorted(optional, key=lambda q: (q.context_len, q.request_id)):
            c = r.context_len
            step = step_time(n + 1, total + c, max(longest, c))
            if step is None or step > limit:
                break
            chosen.append(r)
            n, total, longest = n + 1, total + c, max(longest, c)
        self.stats.deferred += len(infeasible) - (len(chosen) - len(feasible))
        picked = {r.request_id for r in chosen}
        for r in infeasible:
            if r.request_id in picked:
                r.policy_state.of(Deferred).since = now
        return [r for r in decodes if r.request_id in picked]     # the running order

    def _slack(self, feasible: list[Request], now: float) -> float:
        """The longest step every feasible request can take and still keep ``reserve`` TPOTs of
        slack: min over them of ``first token + tpot x (tokens so far - reserve) - now``."""
        limit = float("inf")
        for r in feasible:
            tpot, first = r.slo.tpot, r.times.first_token
            if tpot is None or first is None:
                continue
            s = first + tpot * (r.num_output_tokens - self.reserve) - now
            if s < limit:
                limit = s
        return limit
