"""What every model family's forward shares, whatever its layers: the attributes the runner, the
bucket runner and the executor read (``dtype``, ``device``, ``num_operators``, ``vocab_size``),
and the tensor-parallel pieces (``comm``: the all-reduce after a row-parallel projection, the
vocab-parallel embedding lookup, and the logits gathered where sampling happens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.engine.models.config import ModelConfig

#: operators a layer yields after (qkv_proj, attention, o_proj, gate_up, down): preemption points
OPERATORS_PER_LAYER = 5


class DecoderModel:
    """Base of :class:`~laneserve.engine.models.llama.LlamaModel` and
    :class:`~laneserve.engine.models.opt.OPTModel`; ``embed`` is the (rank's) token table."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 tokenizer: object | None, path: str | None) -> None:
        self.config = config
        self.embed = embed
        self.lm_head = lm_head
        self.tokenizer = tokenizer
        self.path = path
        #: tensor-parallel communicator (``engine/tp/comm.py``); None on a single rank
        self.comm = None
        #: first vocabulary id of this rank's embedding / LM-head rows (vocab-parallel)
        self.vocab_start = 0
        #: the whole vocabulary (the rows of ``lm_head`` are a part of it on a sharded model)
        self.vocab_size = config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def num_operators(self) -> int:
        return self.config.num_layers * OPERATORS_PER_LAYER

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output summed over the ranks (identity on one rank)."""
        return partial if self.comm is None else self.comm.all_reduce(partial)

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ``input_ids`` (vocab-parallel: each rank looks up its part)."""
        if self.comm is None:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start        # vocab-parallel: ids outside this part give 0
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.comm.all_reduce(h.masked_fill(outside[:, None], 0.0))

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """The LM head over ``last`` (float32), gathered over the ranks' vocab parts."""
        logits = F.linear(last, self.lm_head)
        if self.comm is not None:
            logits = self.comm.gather_logits(logits, self.vocab_size)
        return logits.float()
