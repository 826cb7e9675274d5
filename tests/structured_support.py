"""Shared by the structured-output tests: a real JSON Schema validator for what the engine returns."""

from __future__ import annotations

import jsonschema


def validating(schema):
    """A validator for ``schema`` (its draft, the latest by default) that checks formats with the
    draft's own format checker (``date-time``/``time`` through rfc3339-validator)."""
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)
