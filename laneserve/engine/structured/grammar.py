"""Structured-output grammars checked against a budget, without torch: what the API process runs
on every constrained request before admitting it, and what each instance builds a request's
matcher from.

The grammar engine is llguidance (a lazy lexer over derivatives of regexes and an Earley parser):
nothing is compiled up front, so the cost of a constraint does not grow with ``maxLength``, a
counted repetition or nesting; every piece of work it does is bounded by :class:`GrammarLimits`
(llguidance's "fuel" and size limits), per request and per generated token. A constraint that
hits a limit while the API checks it is refused with a 400 that names the limit; one that hits a
limit while generating fails that request alone.

:class:`GrammarCache` keeps checked grammars by spec and vocabulary, bounded by the bytes of the
grammars it holds (a grammar is the serialised schema or pattern: no automaton is cached).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from laneserve.core.structured import StructuredSpec, UnsupportedSpec
from laneserve.engine.structured.vocab import TokenVocabulary

MAX_SPEC_BYTES = 128 << 10            # a schema, pattern or grammar longer than this is refused
DEFAULT_CACHE_BYTES = 32 << 20        # checked grammars kept per process, by their bytes


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Bounds on what one request's constraint may cost (llguidance's ``LLParserLimits``). Fuel
    runs at roughly 50K units per ms when the lexer is built and 14K per ms per mask; a lexer state
    takes 1-2 KB. The defaults keep a mask under ~15 ms and a request's lexer under ~40 MB."""

    max_grammar_size: int = 200_000       # symbols in the grammar's productions
    initial_lexer_fuel: int = 1_000_000   # building the lexer's regexes (~20 ms)
    step_lexer_fuel: int = 200_000        # one token mask (~15 ms)
    step_max_items: int = 50_000          # Earley items per token mask
    max_lexer_states: int = 20_000        # lexer states built over the request's life
    max_items_in_row: int = 2_000         # alternatives in one grammar row

    def to_llguidance(self):
        from llguidance import LLParserLimits

        return LLParserLimits(max_items_in_row=self.max_items_in_row, initial_lexer_fuel=self.initial_lexer_fuel,
                              step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
                              max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
                              verbose_errors=False)


DEFAULT_LIMITS = GrammarLimits()


@dataclass(frozen=True, slots=True)
class CheckedGrammar:
    """A spec's grammar, known to build within ``limits`` over ``vocab``."""

    spec: StructuredSpec
    vocab: TokenVocabulary
    grammar: str
    limits: GrammarLimits

    def new_matcher(self):
        """A fresh ``llguidance.LLMatcher`` (per request: it holds the request's parse state)."""
        from llguidance import LLMatcher

        return LLMatcher(self.vocab.llg_tokenizer(), self.grammar, log_level=0,
                         limits=self.limits.to_llguidance())


def check_grammar(spec: StructuredSpec, vocab: TokenVocabulary,
                  limits: GrammarLimits = DEFAULT_LIMITS) -> CheckedGrammar:
    """``spec``'s grammar over ``vocab``, built once to check it: raises :class:`UnsupportedSpec`
    with a client-facing message for a schema keyword that cannot be enforced, an unsupported
    regex feature, a bad grammar or a constraint over budget."""
    if len(spec.value.encode()) > MAX_SPEC_BYTES:
        raise UnsupportedSpec(f"the {spec.kind} constraint is {len(spec.value.encode())} bytes, over the "
                              f"limit of {MAX_SPEC_BYTES} bytes")
    grammar = spec.to_grammar()
    checked = CheckedGrammar(spec, vocab, grammar, limits)
    matcher = checked.new_matcher()
    if matcher.is_error():
        raise UnsupportedSpec(client_message(spec, matcher.get_error()))
    probe(checked, matcher)
    return checked


PROBE_STEPS = 4        # tokens the admission check generates under a constraint before admitting it


def probe(checked: CheckedGrammar, matcher, steps: int = PROBE_STEPS) -> None:
    """Run ``matcher`` (fresh, of ``checked``) for the first ``steps`` tokens, each time taking
    the lowest allowed token that is not EOS: building the matcher checks only the grammar, while
    what llguidance refuses per step (a self-referencing schema with nothing to expand, too many
    Earley items, a row with too many alternatives) shows on the first masks and tokens. Raises
    :class:`UnsupportedSpec` naming the limit or the reason."""
    eos = set(checked.vocab.eos_token_ids)
    for _ in range(steps):
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            raise UnsupportedSpec(client_message(checked.spec, matcher.get_error()))
        token = _first_allowed(memoryview(mask).cast("I"), eos)
        if token is None:                   # only EOS (complete) or nothing: nothing more to probe
            return
        if not matcher.consume_token(token) or matcher.is_error():
            raise UnsupportedSpec(client_message(checked.spec, matcher.get_error() or "a step failed"))


def _first_allowed(words, eos: set[int]) -> int | None:
    for w, bits in enumerate(words):
        while bits:
            low = bits & -bits
            token = w * 32 + low.bit_length() - 1
            if token not in eos:
                return token
            bits ^= low
    return None


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def client_message(spec: StructuredSpec, error: str) -> str:
    """llguidance's error as a 400 message: the keyword refused, or the limit exceeded."""
    first = " ".join(error.split())[:300] or "unknown error"      # one line (regex errors span several)
    keys = _UNIMPLEMENTED.search(error)
    if keys:
        names = ", ".join(k.strip().strip('"') for k in keys.group(1).split(","))
        return (f"JSON schema keyword(s) {names} cannot be enforced by the grammar engine; remove them "
                "(they are refused rather than silently ignored)")
    if "Unknown format" in error:
        return f"{first} (string formats that can be enforced: date-time, date, time, email, uri, uuid, ipv4, ipv6...)"
    if "NoExtensionBias" in error:
        return (f"the {spec.kind} constraint refers to itself without ever producing text (a schema or rule "
                "defined only by itself, directly or through others, cannot be generated)")
    if any(word in error.lower() for word in ("too big", "too many", "fuel", "limit", "too complex", "too large",
                                              "max is")):
        return f"the {spec.kind} constraint exceeds the structured-output budget: {first}"
    return f"the {spec.kind} constraint cannot be compiled: {first}"


class GrammarCache:
    """Checked grammars by (spec, vocabulary), least recently used first out once the grammars held
    pass ``max_bytes``. Refusals are not cached (they are cheap to find again)."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError("the grammar cache needs a positive byte budget")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[StructuredSpec, str, GrammarLimits], CheckedGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: StructuredSpec, vocab: TokenVocabulary,
            limits: GrammarLimits = DEFAULT_LIMITS) -> CheckedGrammar:
        key = (spec, vocab.fingerprint, limits)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        checked = check_grammar(spec, vocab, limits)
        size = _size(checked)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= _size(old)
            if size <= self.max_bytes:
                self._entries[key] = checked
                self.bytes += size
            while self.bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= _size(evicted)
        return checked


def _size(checked: CheckedGrammar) -> int:
    return len(checked.grammar) + len(checked.spec.value)


DEFAULT_GRAMMARS = GrammarCache()
