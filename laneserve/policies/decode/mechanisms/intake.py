"""Which offered KV transfer a decode instance takes in next when its memory frees (adaptive
decode's intake rule; every other policy takes the oldest, vLLM's order).

A finished prefill whose KV does not fit the decode instance waits as an *offer* (its first token
is out, its KV still on the prefill instance). Every second it waits counts against its TPOT
target: TPOT = (end − first token) / (n − 1), so a request of ``n`` output tokens decoding at
``s`` seconds a step meets target ``τ`` only if it waited at most ``(n − 1)(τ − s)``. When the
decode memory is the bottleneck, taking the oldest offer first gives every request about the same
wait, which in a long backlog breaks the target of every short output; taking the newest first
keeps most waits near zero and lets a few grow long, which in a short backlog breaks targets
that the oldest-first order would have met (measured: 0.95 against 0.99 TPOT attainment in
``tests/test_adaptive.py``'s memory-bound case). So the rule follows FlowPrefill's S-EDF (serve
what can still make its target first) and switches on the backlog:

- while the oldest offer has waited less than its *allowance* ``(n_q − 1)(τ − ŝ)`` — ``n_q`` the
  ``quantile`` (0.1) of the output lengths and ``ŝ`` the median seconds per output token of the
  last ``window`` requests this instance finished, i.e. the wait that would break the shortest
  tenth of typical requests — oldest first (vLLM's order);
- once it has waited longer, newest first, so the old offers wait until the backlog is gone
  (S-EDF's negative-slack requests, last);
- an offer that has waited ``max_wait`` seconds since its first token goes first regardless (the
  bound on every wait); before any request has finished, oldest first.

With the median instead of the tenth quantile the switch came too late to matter on ShareGPT (the
wait that breaks a median-length output is already past most short ones'); always newest first
gained more there (+14% goodput against +9%) but lost where the backlog is short, as above.

The figures come from finished requests only, so the simulator's macro-stepped decode runs (which
end at every finish) decide exactly as the step-by-step loop. Cost: O(1) per decision,
O(``window``) memmove per finish.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from laneserve.core.request import Request
from laneserve.core.sorted_window import SortedWindow


class OfferIntake:
    """The rule above for one decode instance: feed it every finished request (:meth:`finished`),
    ask it which end of the offers to take (:meth:`end`)."""

    def __init__(self, mode: str = "slack", max_wait: float = 30.0, window: int = 256,
                 quantile: float = 0.1) -> None:
        self.mode = mode
        self.quantile = quantile
        self.max_wait = max_wait
        self.outputs = SortedWindow(window)      # output tokens of finished requests
        self.per_token = SortedWindow(window)    # their seconds per output token after the first
        self.newest_first = 0                    # decisions that took the newest offer

    def finished(self, req: Request) -> None:
        if req.finish_reason not in ("length", "stop"):
            return                              # aborted or failed: not a length it would have had
        t, n = req.times, req.num_output_tokens
        start = t.decode_start if t.decode_start is not None else t.first_token
        if n < 2 or t.finished is None or start is None:
            return
        self.outputs.add(n)
        self.per_token.add((t.finished - start) / (n - 1))

    def allowance(self, req: Request) -> float:
        """Seconds ``req`` may wait and still meet its TPOT target at the typical length and pace."""
        tpot = req.slo.tpot
        if tpot is None or not self.outputs:
            return math.inf
        return (self.outputs.quantile(self.quantile) - 1) * (tpot - self.per_token.median())

    def end(self, pending: Sequence[tuple[Request, Any]], now: float) -> int:
        if self.mode == "oldest" or len(pending) == 1:
            return 0
        oldest = pending[0][0]
        first = oldest.times.first_token
        if first is None:
            return 0
        waited = now - first
        if waited >= self.max_wait:
            return 0
        if self.mode == "slack" and waited < self.allowance(oldest):
            return 0
        self.newest_first += 1
        return -1
