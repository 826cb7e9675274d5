"""A step's plan as the other ranks need it, sent as a diff against what they already hold.

Ranks 1..N-1 run the same forward as rank 0 but never sample and never schedule, so they need
per sequence only: its request id, first position, token count, whether it is sampled (its
logits row) or a decode, and its prompt-logprob rows; plus the tokens and block tables behind
those ids. A request's known tokens are sent once (prompt, then each new output token as it is
processed); a block table when it changed (only the appended blocks when it grew); the ids of
requests that left the KV cache so the mirrors drop them. A decode step of batch B thus carries
about B ids and B new tokens.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from laneserve.engine.runner import SeqInput


@dataclass(slots=True)
class StepMessage:
    plan_id: int
    preemptible: bool
    granularity: str
    check: bool                                   # rank 0 asks "stop here?" at the boundaries
    padded_shape: tuple[int, int] | None
    #: the sequences as columns: request ids, starts, token counts, flags (1: sampled, 2: decode)
    rids: array
    starts: array
    counts: array
    flags: bytes
    #: request id -> tokens to append to its known tokens (int32)
    tokens: dict[int, array] = field(default_factory=dict)
    #: request id -> (keep, blocks): keep the first ``keep`` blocks of the mirrored table, append ``blocks``
    tables: dict[int, tuple[int, array]] = field(default_factory=dict)
    gone: list[int] = field(default_factory=list)
    #: index of a sequence -> (first position, count) of prompt-logprob rows
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)


def _ids(values) -> array:
    return array("i", values)      # token ids, positions and block ids fit 32 bits


class StepEncoder:
    """Rank 0's side: what it has sent so far, and the next step's diff."""

    def __init__(self) -> None:
        self._sent_tokens: dict[int, int] = {}
        self._sent_tables: dict[int, list[int]] = {}

    def encode(self, plan, seqs: list[SeqInput], prompt_rows, kv, check: bool) -> StepMessage:
        msg = StepMessage(plan.plan_id, plan.preemptible, plan.preempt_granularity, check,
                          plan.padded_shape, array("q", (s.request.request_id for s in seqs)),
                          _ids(s.start for s in seqs),
                          _ids(len(s.token_ids) for s in seqs),
                          bytes(int(s.sample) | 2 * int(s.is_decode) for s in seqs))
        live = kv.tables
        msg.gone = [rid for rid in self._sent_tables if rid not in live]
        for rid in msg.gone:
            self._sent_tables.pop(rid, None)
            self._sent_tokens.pop(rid, None)
        index_of = {}
        for i, s in enumerate(seqs):
            req = s.request
            rid = req.request_id
            index_of[id(s)] = i
            need = s.start + len(s.token_ids)
            have = self._sent_tokens.get(rid, 0)
            if need > have:
                prompt, outputs = req.prompt_token_ids, req.output_token_ids or []
                np = len(prompt)
                new = list(prompt[have:need]) + list(outputs[max(have - np, 0):max(need - np, 0)])
                msg.tokens[rid] = _ids(new)
                self._sent_tokens[rid] = need
            table = kv.table(rid)
            sent = self._sent_tables.get(rid)
            if sent is None or sent != table:
                keep = len(sent) if sent is not None and table[:len(sent)] == sent else 0
                msg.tables[rid] = (keep, _ids(table[keep:]))
                self._sent_tables[rid] = list(table)
        msg.prompt_rows = [(index_of[id(s)], first, count) for s, first, count in prompt_rows]
        return msg


class _MirrorRequest:
    __slots__ = ("request_id",)

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id


class StepMirror:
    """A follower rank's copy of the tokens and block tables; also the ``kv_manager`` its
    :class:`~laneserve.engine.runner.ModelRunner` reads tables from."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}

    def table(self, request_id: int) -> list[int]:
        return self.tables[request_id]

    def apply(self, msg: StepMessage) -> tuple[list[SeqInput], list[tuple[SeqInput, int, int]]]:
        """Update the mirror; returns the step's sequences and prompt-logprob rows."""
        for rid in msg.gone:
            self.tokens.pop(rid, None)
            self.tables.pop(rid, None)
        for rid, new in msg.tokens.items():
            self.tokens.setdefault(rid, []).extend(new)
        for rid, (keep, blocks) in msg.tables.items():
            self.tables[rid] = self.tables.get(rid, [])[:keep] + list(blocks)
        seqs = [SeqInput(_MirrorRequest(rid), self.tokens[rid][start:start + n], start, bool(f & 1), bool(f & 2))  # type: ignore[arg-type]
                for rid, start, n, f in zip(msg.rids, msg.starts, msg.counts, msg.flags)]
        return seqs, [(seqs[i], first, count) for i, first, count in msg.prompt_rows]
