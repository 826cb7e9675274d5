"""Decode-instance policies. Baseline: FCFS continuous batching (vLLM). The paper policies
(Kairos slack-guided decode, AlignedServe aligned batches) register here too.

Each module here is a policy (it registers a name the registry builds), and ``base`` is the
scheduler they all derive from; the parts they compose live in :mod:`.mechanisms`."""

from laneserve.policies.decode.adaptive import AdaptiveDecode  # noqa: F401
from laneserve.policies.decode.alignedserve import AlignedServeDecode  # noqa: F401
from laneserve.policies.decode.base import DecodeScheduler
from laneserve.policies.decode.continuous import ContinuousBatchingDecode
from laneserve.policies.decode.kairos import KairosDecode  # noqa: F401

__all__ = ["ContinuousBatchingDecode", "DecodeScheduler"]
