"""Shared helpers for tests that start ``laneserve serve`` on 127.0.0.1 (see
:mod:`laneserve.bench.live_server`)."""

from laneserve.bench.live_server import TIMEOUT, Server, free_port, serving, wait_all_free, wait_for  # noqa: F401

#: two tools for the tool-call tests: a weather lookup (arguments constrained by a schema) and a ping;
#: closed objects (``additionalProperties: false``, as OpenAI's strict mode asks): JSON Schema lets an
#: open object take any further keys, which a random-weight model would fill with noise
WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"],
        "additionalProperties": False}}},
]
