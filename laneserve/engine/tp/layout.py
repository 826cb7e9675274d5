"""Which part of each weight a rank owns (vLLM's rules, so the same degrees are accepted).

Attention heads are split evenly; KV heads are split when there are at least as many as ranks and
replicated (each rank holds the one KV head its query heads use) when there are fewer. The MLP's
intermediate dimension is split evenly. The vocabulary is split in equal padded parts: rank ``r``
owns ids ``[r * part, (r + 1) * part)``, the tail beyond the real vocabulary is zero padding that
the logits gather drops.
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.engine.models.config import ModelConfig


class TensorParallelError(ValueError):
    """A tensor-parallel degree the model cannot be split into."""


def check_degree(cfg: ModelConfig, tp: int) -> None:
    """Raise one clear error when ``tp`` cannot shard ``cfg``."""
    if tp < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {tp}")
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"{cfg.num_heads} attention heads are not divisible by it")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"{kv} KV heads neither divide it nor are divisible by it")
    if cfg.intermediate_size % tp:
        problems.append(f"the MLP intermediate size {cfg.intermediate_size} is not divisible by it")
    if problems:
        raise TensorParallelError(f"tensor_parallel_size={tp} cannot shard {cfg.architecture}: "
                                  + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Rank ``rank``'s slices of a model of config ``cfg`` at degree ``tp``."""

    cfg: ModelConfig
    rank: int
    tp: int

    def __post_init__(self) -> None:
        check_degree(self.cfg, self.tp)
        if not 0 <= self.rank < self.tp:
            raise TensorParallelError(f"rank {self.rank} outside a group of {self.tp}")

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads // self.tp

    @property
    def num_kv_heads(self) -> int:
        return max(self.cfg.num_kv_heads // self.tp, 1)

    @property
    def heads(self) -> range:
        return range(self.rank * self.num_heads, (self.rank + 1) * self.num_heads)

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank holds (one replicated head when there are fewer than ranks)."""
        kv = self.cfg.num_kv_heads
        if kv >= self.tp:
            return range(self.rank * self.num_kv_heads, (self.rank + 1) * self.num_kv_heads)
        first = self.rank // (self.tp // kv)
        return range(first, first + 1)

    @property
    def intermediate(self) -> range:
        part = self.cfg.intermediate_size // self.tp
        return range(self.rank * part, (self.rank + 1) * part)

    @property
    def vocab_part(self) -> int:
        return -(-self.cfg.vocab_size // self.tp)

    @property
    def vocab(self) -> range:
        """The ids this rank's embedding rows stand for (the last rank's may run past the vocab)."""
        return range(self.rank * self.vocab_part, (self.rank + 1) * self.vocab_part)

    def dims(self, what: range, size: int) -> tuple[int, int]:
        """``what`` (head or row indices) as an element range of a dimension of ``size`` per index."""
        return what.start * size, what.stop * size
