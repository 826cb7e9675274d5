"""The one cost-model interface that the simulator, the policies' predictors and the engine's
profiles all share (docs/design.md, "Cost models").

Times are in seconds. A prefill batch is a sequence of ``(new_tokens, cached_tokens)`` pairs: the
tokens computed in this step and the tokens of the same request whose KV is already present
(chunked prefill, prefix reuse, multi-turn history). A decode batch is the sequence of context
lengths (KV length *including* the token being decoded) of the requests in the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

PrefillBatch = Sequence[tuple[int, int]]

# Operator boundaries at which a prefill can be preempted, in execution order within a layer
# (FlowPrefill §4: operator-level preemption). The engine's resumable prefill yields at the same ones.
LAYER_OPERATORS: tuple[str, ...] = ("qkv_proj", "attention", "o_proj", "gate_up", "down")


@runtime_checkable
class CostModel(Protocol):
    """Latency model of one instance (one model replica, possibly tensor-parallel)."""

    name: str
    #: "padded" (a decode batch pays batch_size * longest context in attention, like a padded SDPA
    #: batch) or "ragged" (pays the sum of context lengths, like paged/flash attention).
    attention: str
    num_layers: int
    kv_bytes_per_token: int

    def prefill_time(self, batch: PrefillBatch) -> float:
        """Duration of one prefill step over ``batch``."""
        ...

    def prefill_op_times(self, batch: PrefillBatch) -> list[float]:
        """Per-operator durations of the same step in execution order: layer by layer, the
        operators of :data:`LAYER_OPERATORS`; the embedding is folded into the first operator and
        the final norm + LM head into the last. ``sum(prefill_op_times(b)) == prefill_time(b)``
        (up to float rounding) and ``len(...) == num_layers * len(LAYER_OPERATORS)``."""
        ...

    def decode_step_time(self, context_lens: Sequence[int]) -> float:
        """Duration of one decode iteration producing one token for each request."""
        ...

    def mixed_step_time(self, prefill: PrefillBatch, context_lens: Sequence[int]) -> float:
        """Duration of one colocated step that runs prefill chunks and decodes together."""
        ...

    def kv_transfer_time(self, tokens: int, link: str = "nvlink") -> float:
        """Time to move the KV cache of ``tokens`` tokens over ``link``
        ("nvlink", "infiniband"/"rdma", "pcie", "host")."""
        ...


def graphed_prefill_time(cost: CostModel, batch: PrefillBatch) -> float:
    """Duration of a prefill step replayed from a captured CUDA graph (LAPS §3: short prefills
    padded to a pre-captured (L, B) shape). A cost model that knows what graph replay saves
    implements ``graphed_prefill_time``; for the others (CPU profiles, simple models) it is the
    ordinary prefill time."""
    fn = getattr(cost, "graphed_prefill_time", None)
    return fn(batch) if fn is not None else cost.prefill_time(batch)



def contexts(n: int, total: int, longest: int) -> list[int]:
    """``n`` context lengths that sum to ``total``, the longest ``longest``: a batch that every
    cost model charges like any batch with these three figures (the models read a decode batch
    through its size, total and longest context only)."""
    if n == 1:
        return [total]
    q, r = divmod(total - longest, n - 1)
    return [longest] + [q + 1] * r + [q] * (n - 1 - r)


def decode_summary_time(cost: CostModel, n: int, total: int, longest: int) -> float:
    """Duration of a decode step of ``n`` requests whose contexts sum to ``total``, the longest
    ``longest``. A cost model that can say so from the three figures implements
    ``decode_summary_time``; for the others it is ``decode_step_time`` of :func:`contexts`."""
    if n <= 0:
        return 0.0
    fn = getattr(cost, "decode_summary_time", None)
    return fn(n, total, longest) if fn is not None else cost.decode_step_time(contexts(n, total, longest))
