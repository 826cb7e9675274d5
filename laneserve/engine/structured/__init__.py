"""Structured output (issue 14, item 3): constrain sampling to a JSON schema, a regex, a choice or
a tool call with outlines-core (a CPU automaton over token ids).

Per request: ``state = compile_constraint(spec, tokenizer).new_state()``; per step, before
sampling, ``state.sync(request.output_token_ids)`` and ``apply(logits, states)``. See
``constraint.py`` for the mask, ``laneserve.core.structured`` for what each kind of spec lets the
model write (and ``laneserve.server.structured`` for the OpenAI request fields that ask for one).
"""

from laneserve.engine.structured.constraint import (ConstraintCache, Constraint, ConstraintState,
                                                    ConstraintViolation, apply, compile_constraint)
from laneserve.core.structured import StructuredSpec, ToolCall, UnsupportedSpec, parse_tool_calls
from laneserve.engine.structured.vocab import TokenVocabulary, token_vocabulary

__all__ = ["Constraint", "ConstraintCache", "ConstraintState", "ConstraintViolation", "StructuredSpec",
           "TokenVocabulary", "ToolCall", "UnsupportedSpec", "apply", "compile_constraint", "parse_tool_calls",
           "token_vocabulary"]
