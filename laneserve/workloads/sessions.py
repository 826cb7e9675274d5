"""Multi-turn sessions → requests with re-prefill prefixes (LAPS §1–2: "re-prefill").

Each conversation is a list of turns ``(new_tokens, output_tokens)``: the user's new message (plus
a system prompt on the first turn) and the assistant's reply. Turn ``k`` becomes one request whose
prompt is the whole history plus the new message::

    prompt_len(k) = Σ_{j<k} (new_j + output_j) + new_k
    prefix_len(k) = Σ_{j<k} (new_j + output_j)        # history: the re-prefill's KV context H
    output_len(k) = output_k

Timing (kept simple on purpose): conversations start by a Poisson process at ``rate``
conversations/s; turn ``k+1`` arrives ``reply_time · output_k`` (the reply streaming at that many
seconds per token; 0 by default) plus an exponential think time (mean ``think_time`` s) after turn
``k``'s *arrival*. The next turn can therefore arrive before the previous reply would have finished
on an overloaded system; closed-loop replay is a job for the load generator, not the workload.
Rescaling a workload's rate (``Workload.with_rate``) compresses these gaps too: for studies where a
turn must find its predecessor's KV (per-instance prefix caches), build the workload at the rate
instead, with a ``reply_time``.

Context cap: a turn whose ``prompt_len + output_len`` exceeds ``max_context`` is dropped together
with every later turn of its conversation (histories only grow).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from laneserve.core.request import RequestSpec
from laneserve.core.slo import SLO
from laneserve.workloads.arrivals import poisson_arrivals

Turn = tuple[int, int]


def build_sessions(conversations: Sequence[Sequence[Turn]], *, rate: float, think_time: float,
                   seed: int, slo: SLO, slo_class: str = "default",
                   max_context: int | None = None, reply_time: float = 0.0) -> tuple[list[RequestSpec], dict]:
    """Requests (unsorted, ids unset) for ``conversations`` and a meta dict of what was dropped."""
    if think_time < 0:
        raise ValueError(f"think_time must be >= 0 seconds, got {think_time}")
    if reply_time < 0:
        raise ValueError(f"reply_time must be >= 0 seconds per token, got {reply_time}")
    if max_context is not None and max_context < 2:
        raise ValueError(f"max_context must be >= 2 tokens, got {max_context}")
    rng = np.random.default_rng(seed)
    kept: list[list[tuple[int, int, int]]] = []   # per conversation: (prompt, prefix, output)
    dropped_turns = 0
    for conv in conversations:
        history, turns = 0, []
        for k, (new, out) in enumerate(conv):
            new, out = max(int(new), 1), max(int(out), 1)
            if max_context is not None and history + new + out > max_context:
                dropped_turns += len(conv) - k
                break
            turns.append((history + new, history, out))
            history += new + out
        if turns:
            kept.append(turns)
    starts = poisson_arrivals(len(kept), rate, seed=int(rng.integers(2**63)))
    specs: list[RequestSpec] = []
    for session_id, (turns, start) in enumerate(zip(kept, starts)):
        gaps = rng.exponential(think_time, size=len(turns) - 1) if think_time > 0 else np.zeros(len(turns) - 1)
        t = float(start)
        for turn, (prompt, prefix, out) in enumerate(turns):
            if turn:
                t += float(gaps[turn - 1]) + reply_time * turns[turn - 1][2]
            specs.append(RequestSpec(request_id=len(specs), arrival_time=t, prompt_len=prompt,
                                     output_len=out, slo=slo, slo_class=slo_class,
                                     prefix_len=prefix, session_id=session_id, turn=turn))
    meta = {"conversations": len(kept), "dropped_conversations": len(conversations) - len(kept),
            "dropped_turns": dropped_turns, "conversation_rate": rate, "think_time_mean": think_time,
            "reply_time_per_token": reply_time,
            "max_context": max_context}
    return specs, meta
