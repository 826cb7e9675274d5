"""Structured output: constrain sampling to a JSON schema, a regex, a choice, a grammar or a tool
call, with llguidance (a lazy lexer and Earley parser over token bytes, every step within a
budget).

Per request: ``state = compile_constraint(spec, tokenizer).new_state()``; per step, before
sampling, ``state.sync(request.output_token_ids)`` and ``apply(logits, states)``. See
``grammar.py`` for the budget and the checks, ``constraint.py`` for the mask,
``laneserve.core.structured`` for what each kind of spec lets the model write (and
``laneserve.server.structured`` for the OpenAI request fields that ask for one).
"""

from laneserve.core.structured import StructuredSpec, ToolCall, UnsupportedSpec, parse_tool_calls
from laneserve.engine.structured.constraint import (Constraint, ConstraintCache, ConstraintState,
                                                    ConstraintViolation, apply, compile_constraint)
from laneserve.engine.structured.grammar import (DEFAULT_LIMITS, GrammarCache, GrammarLimits, check_grammar)
from laneserve.engine.structured.vocab import TokenVocabulary, token_vocabulary

__all__ = ["DEFAULT_LIMITS", "Constraint", "ConstraintCache", "ConstraintState", "ConstraintViolation",
           "GrammarCache", "GrammarLimits", "StructuredSpec", "TokenVocabulary", "ToolCall", "UnsupportedSpec",
           "apply", "check_grammar", "compile_constraint", "parse_tool_calls", "token_vocabulary"]
