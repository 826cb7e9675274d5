"""A deliberately simple cost model: times linear in tokens. Used for queueing checks (where the
service time must be known exactly), quick what-ifs and tests; not calibrated to any hardware."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from laneserve.costmodel.base import LAYER_OPERATORS, PrefillBatch


@dataclass(slots=True)
class LinearCostModel:
    """prefill = fixed + per_token * new tokens (+ per_cached_token * cached);
    decode step = decode_fixed + decode_per_request * batch + decode_per_context_token * attention
    tokens (padded: batch * longest context, ragged: sum of contexts);
    KV transfer = transfer_fixed + tokens * kv_bytes_per_token / link bandwidth."""

    prefill_fixed: float = 0.0
    prefill_per_token: float = 1e-4
    prefill_per_cached_token: float = 0.0
    decode_fixed: float = 0.01
    decode_per_request: float = 0.0
    decode_per_context_token: float = 0.0
    transfer_fixed: float = 0.0
    link_bandwidth: float = 100e9
    kv_bytes_per_token: int = 131072
    num_layers: int = 4
    attention: str = "ragged"
    kv_capacity: int = 1 << 22
    name: str = "linear"

    def prefill_time(self, batch: PrefillBatch) -> float:
        if not batch:
            return 0.0
        new = sum(n for n, _ in batch)
        cached = sum(c for _, c in batch)
        return self.prefill_fixed + self.prefill_per_token * new + self.prefill_per_cached_token * cached

    def prefill_op_times(self, batch: PrefillBatch) -> list[float]:
        n = self.num_layers * len(LAYER_OPERATORS)
        return [self.prefill_time(batch) / n] * n

    def _attention_tokens(self, context_lens: Sequence[int]) -> int:
        if not context_lens:
            return 0
        if self.attention == "padded":
            return len(context_lens) * max(context_lens)
        return sum(context_lens)

    def decode_step_time(self, context_lens: Sequence[int]) -> float:
        if not context_lens:
            return 0.0
        return (self.decode_fixed + self.decode_per_request * len(context_lens)
                + self.decode_per_context_token * self._attention_tokens(context_lens))

    def mixed_step_time(self, prefill: PrefillBatch, context_lens: Sequence[int]) -> float:
        return self.prefill_time(prefill) + self.decode_step_time(context_lens)

    def kv_transfer_time(self, tokens: int, link: str = "nvlink") -> float:
        return self.transfer_fixed + tokens * self.kv_bytes_per_token / self.link_bandwidth

    def kv_capacity_tokens(self, utilization: float = 0.9) -> int:
        return self.kv_capacity
