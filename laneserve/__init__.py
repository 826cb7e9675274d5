"""laneserve: length- and SLO-aware serving for prefill/decode disaggregated LLM deployments."""

__version__ = "0.1.0"
