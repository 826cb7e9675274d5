"""Token masks for structured output with outlines-core (issue 14, item 3).

:func:`compile_constraint` turns a :class:`StructuredSpec` and a tokenizer into a
:class:`Constraint`: outlines-core's ``Index``, a DFA over token ids built from the spec's regex
(the expensive part — milliseconds to tens of seconds by schema and vocabulary, see
``benchmarks/structured_output.py``; outlines-core releases the GIL meanwhile, so a worker thread
can compile without stalling the step loop), kept in a bounded LRU keyed by (spec, vocabulary
fingerprint). Each request holds a cheap :class:`ConstraintState` — an outlines-core ``Guide``, a
cursor into the shared DFA — and the sampler masks logits with :func:`apply` before it samples.

Per-state masks are cached on the constraint (an LRU bounded by bytes) as index tensors on the
logits' device: the token ids allowed, or — where more than half the vocabulary is allowed (inside
a JSON string) — the ids forbidden, so one masking costs at most half a vocabulary of writes. A
state's first mask comes from the Guide's bitmask (written by outlines-core in Rust), unpacked
once. :func:`apply` gathers the rows of a batch into one ``index_fill_`` (forbidden lists) plus one
save/fill/restore (allowed lists) over the flattened logits: a fixed number of torch calls per batch.

EOS (every id of the vocabulary's EOS list) is allowed exactly in accepting states. After EOS the
state is *terminated*: only EOS stays allowed (so the row can still be sampled) and the request
must end (with ``ignore_eos`` the caller ends it: ``is_terminated()``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from laneserve.core.structured import StructuredSpec, UnsupportedSpec
from laneserve.engine.structured.vocab import TokenVocabulary, token_vocabulary

_TERMINATED = -1                       # the mask-cache key of a state after EOS
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
DEFAULT_CACHE_SIZE = 64                # compiled constraints kept per process
DEFAULT_MASK_CACHE_BYTES = 16 << 20    # per constraint: cached per-state index tensors (LRU)


class ConstraintViolation(ValueError):
    """A token the constraint does not allow was fed to a state (the mask was not applied)."""


@dataclass(slots=True)
class _StateMask:
    keep: bool               # True: ids are the allowed tokens; False: ids are the forbidden ones
    ids: torch.Tensor        # int64, on the logits' device


class Constraint:
    """A compiled spec for one vocabulary. Shared by every request with the same spec; read-only
    apart from its mask cache."""

    __slots__ = ("spec", "vocab", "index", "compile_seconds", "_words", "_eos", "_masks", "_mask_bytes",
                 "max_mask_bytes", "_lock")

    def __init__(self, spec: StructuredSpec, vocab: TokenVocabulary,
                 max_mask_bytes: int = DEFAULT_MASK_CACHE_BYTES) -> None:
        from outlines_core import Index

        regex = spec.to_regex()
        t0 = time.perf_counter()
        try:
            self.index = Index(regex, vocab.outlines_vocabulary())
        except (ValueError, TypeError) as exc:
            raise UnsupportedSpec(f"cannot compile the {spec.kind} constraint: {str(exc).splitlines()[0]}") from exc
        self.compile_seconds = time.perf_counter() - t0
        self.spec = spec
        self.vocab = vocab
        self._words = (vocab.size + 31) // 32
        self._eos = vocab.eos_token_ids
        self._masks: OrderedDict[tuple[int, int, str], _StateMask] = OrderedDict()
        self._mask_bytes = 0
        self.max_mask_bytes = max_mask_bytes
        self._lock = threading.Lock()

    def new_state(self) -> ConstraintState:
        return ConstraintState(self)

    def _mask(self, st: ConstraintState, vocab_size: int, device: torch.device) -> _StateMask:
        state = _TERMINATED if st.terminated else st.guide.get_state()
        key = (state, vocab_size, str(device))
        with self._lock:
            hit = self._masks.get(key)
            if hit is not None:
                self._masks.move_to_end(key)
                return hit
        allowed = torch.zeros(max(vocab_size, self._words * 32), dtype=torch.bool)
        eos = [t for t in self._eos if t < allowed.numel()]
        if st.terminated:
            allowed[eos] = True
        else:
            # outlines-core writes the state's allowed tokens as a bitmask (EOS included when accepting)
            words = torch.zeros(self._words, dtype=torch.int32)
            st.guide.write_mask_into(words.data_ptr(), self._words, 4)
            allowed[:self._words * 32] = ((words.unsqueeze(-1) >> _BIT_SHIFTS) & 1).bool().view(-1)
            if st.guide.is_finished():
                allowed[eos] = True
        allowed = allowed[:vocab_size]
        if int(allowed.sum()) * 2 <= vocab_size:
            mask = _StateMask(True, allowed.nonzero().flatten().to(device))
        else:
            mask = _StateMask(False, (~allowed).nonzero().flatten().to(device))
        size = mask.ids.numel() * mask.ids.element_size()
        with self._lock:
            if key in self._masks:             # another thread built it meanwhile
                return self._masks[key]
            self._masks[key] = mask
            self._mask_bytes += size
            while self._mask_bytes > self.max_mask_bytes and len(self._masks) > 1:
                _, old = self._masks.popitem(last=False)
                self._mask_bytes -= old.ids.numel() * old.ids.element_size()
        return mask


class ConstraintState:
    """One request's position in its constraint (an outlines-core ``Guide``): feed it every output
    token (``advance``, or ``sync`` with the request's output list) and mask each next token with it."""

    __slots__ = ("constraint", "guide", "terminated", "num_tokens")

    def __init__(self, constraint: Constraint) -> None:
        from outlines_core import Guide

        self.constraint = constraint
        self.guide = Guide(constraint.index, max_rollback=0)
        self.terminated = False
        self.num_tokens = 0

    def is_terminated(self) -> bool:
        """EOS was consumed: the output is complete and nothing but EOS may follow."""
        return self.terminated

    def accepts(self) -> bool:
        """The text so far is a complete match (EOS is allowed now)."""
        return self.terminated or self.guide.is_finished()

    def advance(self, token_id: int) -> None:
        """Consume one sampled token; raises :class:`ConstraintViolation` for a forbidden one."""
        kind = self.constraint.spec.kind
        if token_id in self.constraint._eos:
            if not self.accepts():
                raise ConstraintViolation(f"EOS before the {kind} output is complete")
            self.terminated = True
        elif self.terminated:
            raise ConstraintViolation(f"token {token_id} after EOS")
        else:
            try:
                self.guide.advance(token_id, False)
            except ValueError:
                raise ConstraintViolation(f"token {token_id} is not allowed by the {kind} constraint here") from None
        self.num_tokens += 1

    def replay(self, tokens: Sequence[int]) -> ConstraintState:
        """Rebuild the state from the start over ``tokens`` (a request that arrives with output
        tokens, e.g. on a decode instance after prefill sampled its first token)."""
        self.guide.reset()
        self.terminated = False
        self.num_tokens = 0
        for t in tokens:
            self.advance(t)
        return self

    def sync(self, tokens: Sequence[int]) -> ConstraintState:
        """Catch up with a request's output list: advance over the tokens not consumed yet (or
        replay it if it is shorter than what was consumed)."""
        if len(tokens) < self.num_tokens:
            return self.replay(tokens)
        for t in tokens[self.num_tokens:]:
            self.advance(t)
        return self

    def allowed_mask(self, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[vocab_size]`` bool: True where the next token is allowed."""
        m = self.constraint._mask(self, vocab_size, torch.device(device or "cpu"))
        out = torch.full((vocab_size,), not m.keep, dtype=torch.bool, device=m.ids.device)
        out[m.ids] = m.keep
        return out


def apply(logits: torch.Tensor, states: Sequence[ConstraintState | None]) -> None:
    """Mask ``logits`` ``[rows, vocab]`` in place: ``-inf`` where row i's state forbids the token.
    Rows whose state is ``None`` are untouched."""
    if logits.dim() != 2 or len(states) != logits.shape[0]:
        raise ValueError(f"apply needs [rows, vocab] logits and one state per row, got {tuple(logits.shape)} "
                         f"and {len(states)} states")
    if not any(s is not None for s in states):
        return
    if not logits.is_contiguous():
        work = logits.contiguous()
        apply(work, states)
        logits.copy_(work)
        return
    vocab_size, device = logits.shape[1], logits.device
    keep_rows: list[int] = []
    keep_ids: list[torch.Tensor] = []
    drop_ids: list[torch.Tensor] = []
    for row, st in enumerate(states):
        if st is None:
            continue
        m = st.constraint._mask(st, vocab_size, device)
        flat = m.ids + row * vocab_size if row else m.ids
        if m.keep:
            keep_rows.append(row)
            keep_ids.append(flat)
        else:
            drop_ids.append(flat)
    flat_logits = logits.view(-1)
    neg_inf = float("-inf")
    if drop_ids:
        flat_logits.index_fill_(0, torch.cat(drop_ids) if len(drop_ids) > 1 else drop_ids[0], neg_inf)
    if keep_rows:
        ids = torch.cat(keep_ids) if len(keep_ids) > 1 else keep_ids[0]
        kept = flat_logits.index_select(0, ids)
        if len(keep_rows) == 1:
            logits[keep_rows[0]].fill_(neg_inf)
        else:
            logits.index_fill_(0, torch.tensor(keep_rows, device=device), neg_inf)
        flat_logits.index_copy_(0, ids, kept)


class ConstraintCache:
    """A bounded LRU of compiled constraints keyed by (spec, vocabulary fingerprint)."""

    def __init__(self, maxsize: int = DEFAULT_CACHE_SIZE) -> None:
        if maxsize < 1:
            raise ValueError("the constraint cache needs room for at least one entry")
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[StructuredSpec, str], Constraint] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: StructuredSpec, vocab: TokenVocabulary) -> Constraint:
        key = (spec, vocab.fingerprint)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        compiled = Constraint(spec, vocab)          # outside the lock: compiling can take seconds
        with self._lock:
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return compiled


DEFAULT_CACHE = ConstraintCache()


def compile_constraint(spec: StructuredSpec, tokenizer: Any, *, eos_token_ids: Sequence[int] = (),
                       cache: ConstraintCache | None = None) -> Constraint:
    """The compiled constraint for ``spec`` over ``tokenizer`` (a Hugging Face fast tokenizer or a
    :class:`TokenVocabulary`); ``eos_token_ids`` adds ids that end generation besides the
    tokenizer's EOS. Raises :class:`UnsupportedSpec` for what cannot be compiled."""
    vocab = tokenizer if isinstance(tokenizer, TokenVocabulary) else token_vocabulary(tokenizer, eos_token_ids)
    return (cache if cache is not None else DEFAULT_CACHE).get(spec, vocab)
