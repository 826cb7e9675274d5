"""Token masks for structured output.

:func:`compile_constraint` turns a :class:`StructuredSpec` and a tokenizer into a
:class:`Constraint`: the spec's grammar, checked once within its :class:`GrammarLimits`
(``grammar.py``; cached by bytes per process). Each request holds a :class:`ConstraintState`, an
``llguidance.LLMatcher`` built from that grammar (lazily: it builds lexer states as the text
grows, each step bounded by the limits), and the sampler masks logits with :func:`apply`.

A mask is one bit per token id, written by llguidance into an int32 row (the GIL released);
:func:`apply` writes the rows of a batch into one buffer, unpacks them with one shift-and-mask
on the logits' device and fills ``-inf`` where a bit is clear, so a batch costs a fixed number of
torch calls. A state's mask is computed once per position (:meth:`ConstraintState.fill_mask`,
which the executor calls before the forward so a budget overrun fails the request there).

EOS (every id of the vocabulary's EOS list) is allowed exactly in accepting states. After EOS the
state is *terminated*: only EOS stays allowed (so the row can still be sampled) and the request
must end (with ``ignore_eos`` the caller ends it: ``is_terminated()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from laneserve.core.structured import StructuredSpec, UnsupportedSpec
from laneserve.engine.structured.grammar import (DEFAULT_GRAMMARS, DEFAULT_LIMITS, CheckedGrammar, GrammarCache,
                                                 GrammarLimits, client_message)
from laneserve.engine.structured.vocab import TokenVocabulary, token_vocabulary

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class ConstraintViolation(ValueError):
    """A token the constraint does not allow was fed to a state (the mask was not applied), or the
    constraint ran past its budget while generating."""


class Constraint:
    """A checked grammar for one vocabulary, shared by every request with the same spec."""

    __slots__ = ("checked", "_eos", "_words")

    def __init__(self, checked: CheckedGrammar) -> None:
        self.checked = checked
        self._eos = frozenset(checked.vocab.eos_token_ids)
        self._words = (checked.vocab.size + 31) // 32

    @property
    def spec(self) -> StructuredSpec:
        return self.checked.spec

    @property
    def vocab(self) -> TokenVocabulary:
        return self.checked.vocab

    def first_tokens(self) -> frozenset[int]:
        """The token ids (EOS included) the constraint allows as the first output token."""
        mask = self.checked.new_matcher().compute_bitmask()
        return frozenset(w * 32 + b for w, bits in enumerate(memoryview(mask).cast("I")) if bits
                         for b in range(32) if bits >> b & 1)

    def new_state(self) -> ConstraintState:
        return ConstraintState(self)


class ConstraintState:
    """One request's position in its constraint: feed it every output token (``advance``, or
    ``sync`` with the request's output list) and mask each next token with it."""

    __slots__ = ("constraint", "matcher", "terminated", "num_tokens", "_mask", "_mask_at")

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.matcher = constraint.checked.new_matcher()
        if self.matcher.is_error():
            raise UnsupportedSpec(client_message(constraint.spec, self.matcher.get_error()))
        self.terminated = False
        self.num_tokens = 0
        self._mask: torch.Tensor | None = None       # int32 [words]: the mask at position _mask_at
        self._mask_at = -1

    def is_terminated(self) -> bool:
        """EOS was consumed: the output is complete and nothing but EOS may follow."""
        return self.terminated

    def accepts(self) -> bool:
        """The text so far is a complete match (EOS is allowed now)."""
        return self.terminated or self.matcher.is_accepting()

    def advance(self, token_id: int) -> None:
        """Consume one sampled token; raises :class:`ConstraintViolation` for a forbidden one."""
        kind = self.constraint.spec.kind
        if token_id in self.constraint._eos:
            if not self.accepts():
                raise ConstraintViolation(f"EOS before the {kind} output is complete")
            self.terminated = True
        elif self.terminated:
            raise ConstraintViolation(f"token {token_id} after EOS")
        elif self.matcher.validate_tokens([token_id]) != 1 or not self.matcher.consume_token(token_id):
            # validated first: a refused token leaves the state usable (consume_token would not)
            raise ConstraintViolation(f"token {token_id} is not allowed by the {kind} constraint here")
        self.num_tokens += 1

    def replay(self, tokens: Sequence[int]) -> ConstraintState:
        """Rebuild the state from the start over ``tokens`` (a request that arrives with output
        tokens, e.g. on a decode instance after prefill sampled its first token)."""
        self.matcher.reset()
        self.terminated = False
        self.num_tokens = 0
        self._mask_at = -1
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

    def fill_mask(self) -> torch.Tensor:
        """The allowed-token bits at the current position (int32 ``[words]``, computed once per
        position); raises :class:`ConstraintViolation` when the constraint runs past its budget."""
        if self._mask_at == self.num_tokens and self._mask is not None:
            return self._mask
        c = self.constraint
        words = torch.zeros(c._words, dtype=torch.int32)
        if self.terminated:
            for t in c._eos:
                words[t >> 5] |= _bit(t & 31)
        else:
            self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), c._words * 4)
            if self.matcher.is_error():
                raise ConstraintViolation(f"the {c.spec.kind} constraint failed: "
                                          + client_message(c.spec, self.matcher.get_error()))
        self._mask, self._mask_at = words, self.num_tokens
        return words

    def allowed_mask(self, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[vocab_size]`` bool: True where the next token is allowed."""
        return _unpack(self.fill_mask().unsqueeze(0), vocab_size, torch.device(device or "cpu"))[0]


def _bit(k: int) -> int:
    """Bit ``k`` of an int32 word as a Python int that fits int32 (bit 31 is the sign)."""
    return -(1 << 31) if k == 31 else 1 << k


def _unpack(words: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """int32 ``[rows, words]`` bits -> bool ``[rows, vocab_size]`` on ``device`` (ids past the
    tokenizer's vocabulary, as a model's padded embedding has, are never allowed)."""
    words = words.to(device, non_blocking=True)
    bits = ((words.unsqueeze(-1) >> _BIT_SHIFTS.to(device)) & 1).bool().view(words.shape[0], -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(words.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=device)
    return torch.cat([bits, pad], dim=1)


def apply(logits: torch.Tensor, states: Sequence[ConstraintState | None]) -> None:
    """Mask ``logits`` ``[rows, vocab]`` in place: ``-inf`` where row i's state forbids the token.
    Rows whose state is ``None`` are untouched."""
    if logits.dim() != 2 or len(states) != logits.shape[0]:
        raise ValueError(f"apply needs [rows, vocab] logits and one state per row, got {tuple(logits.shape)} "
                         f"and {len(states)} states")
    rows = [row for row, st in enumerate(states) if st is not None]
    if not rows:
        return
    words = max(states[r].constraint._words for r in rows)
    bits = torch.zeros(len(rows), words, dtype=torch.int32)
    for k, row in enumerate(rows):
        mask = states[row].fill_mask()
        bits[k, :mask.shape[0]] = mask
    allowed = _unpack(bits, logits.shape[1], logits.device)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


class ConstraintCache:
    """Compiled constraints by (spec, vocabulary content), bounded by bytes (a
    :class:`GrammarCache` underneath)."""

    def __init__(self, max_bytes: int = 32 << 20, grammars: GrammarCache | None = None) -> None:
        self.grammars = grammars if grammars is not None else GrammarCache(max_bytes)

    def __len__(self) -> int:
        return len(self.grammars)

    @property
    def hits(self) -> int:
        return self.grammars.hits

    @property
    def misses(self) -> int:
        return self.grammars.misses

    def get(self, spec: StructuredSpec, vocab: TokenVocabulary, limits: GrammarLimits = DEFAULT_LIMITS) -> Constraint:
        return Constraint(self.grammars.get(spec, vocab, limits))


DEFAULT_CACHE = ConstraintCache(grammars=DEFAULT_GRAMMARS)


def compile_constraint(spec: StructuredSpec, tokenizer: Any, *, eos_token_ids: Sequence[int] = (),
                       cache: ConstraintCache | None = None, limits: GrammarLimits = DEFAULT_LIMITS) -> Constraint:
    """The checked constraint for ``spec`` over ``tokenizer`` (a Hugging Face fast tokenizer or a
    :class:`TokenVocabulary`); ``eos_token_ids`` adds ids that end generation besides the
    tokenizer's EOS. Raises :class:`UnsupportedSpec` for what cannot be enforced within ``limits``."""
    vocab = tokenizer if isinstance(tokenizer, TokenVocabulary) else token_vocabulary(tokenizer, eos_token_ids)
    return (cache if cache is not None else DEFAULT_CACHE).get(spec, vocab, limits)
