"""One cost model per role: a disaggregated cluster whose prefill and decode instances differ
(another tensor-parallel degree, another GPU) charged through the simulator's single cost model.

Prefill steps (and colocated mixed steps) are charged by ``prefill``, decode steps by ``decode``;
a KV transfer moves each of the smaller TP side's shards over its own link. KV capacity is the
decode side's (give each role its own with ``ClusterConfig.prefill_kv_tokens`` /
``decode_kv_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import CostModel, PrefillBatch, decode_summary_time, graphed_prefill_time


class RoleCostModel:
    """:class:`~laneserve.costmodel.base.CostModel` that sends prefill work to ``prefill`` and
    decode work to ``decode``."""

    def __init__(self, prefill: CostModel, decode: CostModel) -> None:
        # KV bytes per token may differ: a profile of a TP instance counts its replicated KV heads
        if prefill.num_layers != decode.num_layers:
            raise ValueError("the prefill and decode cost models must be of the same model")
        self.prefill, self.decode = prefill, decode
        self.name = f"prefill[{prefill.name}]+decode[{decode.name}]"
        self.attention = decode.attention
        self.num_layers = decode.num_layers
        self.kv_bytes_per_token = decode.kv_bytes_per_token
        self.model = getattr(decode, "model", None)
        self.tp = getattr(decode, "tp", 1)
        has_runs = hasattr(decode, "decode_step_times")
        if not has_runs:            # the simulator asks for runs only when the model has them
            self.decode_step_times = None  # type: ignore[assignment]
        if not hasattr(decode, "kv_capacity_tokens"):     # the simulator's default size, as for decode
            self.kv_capacity_tokens = None  # type: ignore[assignment]

    def prefill_time(self, batch: PrefillBatch) -> float:
        return self.prefill.prefill_time(batch)

    def graphed_prefill_time(self, batch: PrefillBatch) -> float:
        return graphed_prefill_time(self.prefill, batch)

    def prefill_op_times(self, batch: PrefillBatch) -> list[float]:
        return self.prefill.prefill_op_times(batch)

    def decode_step_time(self, context_lens: Sequence[int]) -> float:
        return self.decode.decode_step_time(context_lens)

    def decode_summary_time(self, batch: int, total: int, longest: int) -> float:
        return decode_summary_time(self.decode, batch, total, longest)

    def decode_step_times(self, batch: int, total: int, longest: int, steps: int) -> list[float]:
        return self.decode.decode_step_times(batch, total, longest, steps)

    def mixed_step_time(self, prefill: PrefillBatch, context_lens: Sequence[int]) -> float:
        return self.prefill.mixed_step_time(prefill, context_lens)

    def kv_transfer_time(self, tokens: int, link: str = "nvlink") -> float:
        side = self.prefill if getattr(self.prefill, "tp", 1) <= getattr(self.decode, "tp", 1) else self.decode
        return side.kv_transfer_time(tokens, link)

    def kv_capacity_tokens(self, utilization: float = 0.9) -> int:
        return self.decode.kv_capacity_tokens(utilization)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"RoleCostModel(prefill={self.prefill!r}, decode={self.decode!r})"
