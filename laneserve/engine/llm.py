"""Offline batch API: ``LLM(model).generate(prompts, params)`` on one colocated engine instance.

The same scheduler contract as every other instance: a colocated scheduler (decode-first, then
prefill chunks under the token budget) drives an :class:`EngineExecutor`. With no model path the
embedded smoke checkpoint is used — random weights, its text is noise — and a warning says so.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

from laneserve.core.request import Request
from laneserve.core.sampling import SamplingParams
from laneserve.core.slo import SLO
from laneserve.engine.config import EngineConfig
from laneserve.engine.resources import DEFAULT_CPU_KV_TOKENS, EngineResources
from laneserve.runtime.build import build_instance
from laneserve.runtime.cluster import Deployment
from laneserve.runtime.spec import InstanceSpec, PolicySpec

__all__ = ["DEFAULT_CPU_KV_TOKENS", "LLM", "CompletionOutput"]


@dataclass(slots=True)
class CompletionOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 policy: str | PolicySpec | None = None, quiet: bool = False, tensor_parallel_size: int = 1) -> None:
        """``policy``: the colocated policy spec; None: every entry point's default pair
        (:class:`~laneserve.runtime.cluster.Deployment`: adaptive prefill and decode, colocated).
        ``tensor_parallel_size``: ranks the model is sharded over (one process each; call
        :meth:`close` or use the object as a context manager to stop them)."""
        from laneserve.engine.smoke import is_smoke_model, smoke_model_path

        config = config or EngineConfig()
        path = Path(model) if model is not None else smoke_model_path()
        if not path.exists():
            raise FileNotFoundError(f"model folder not found: {path}")
        self.is_smoke = is_smoke_model(path)
        if self.is_smoke and not quiet:
            print(f"laneserve: using the embedded SMOKE model at {path} (random weights: its text is "
                  "noise); pass a checkpoint folder for real output", file=sys.stderr)
        self.model_path = path
        self.config = config
        self.tensor_parallel_size = tensor_parallel_size
        self.spec = InstanceSpec.of(
            "colocated", policy or Deployment(mode="colocated").front_policy,
            host_kv_tokens=config.num_host_blocks * config.block_size, token_budget=config.max_num_batched_tokens,
            device=config.device, tensor_parallel_size=tensor_parallel_size)
        self.resources = EngineResources(path, config, stop_checker=True)
        self.instance = build_instance(0, self.spec, self.resources)
        self.executor = self.instance.executor
        self.model = self.executor.model
        self.tokenizer = self.model.tokenizer
        self._ids = count()

    def close(self) -> None:
        """Stop the rank processes of a tensor-parallel instance (nothing to do on one rank)."""
        self.resources.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def max_model_len(self) -> int:
        return self.model.config.max_position_embeddings

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"the model's context length {self.max_model_len}")
        if not self.executor.kv.fits_ever(len(prompt_ids) + params.max_tokens):
            raise ValueError(f"prompt + max_tokens ({len(prompt_ids) + params.max_tokens} tokens) does not fit "
                             f"the KV cache ({self.executor.kv.num_blocks * self.executor.kv.block_size} tokens)")
        now = self.instance.clock.now()
        req = Request(request_id=next(self._ids), arrival_time=now, prompt_len=len(prompt_ids),
                      max_output_tokens=params.max_tokens, slo=SLO(), prompt_token_ids=prompt_ids,
                      sampling=params)
        return req

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = False) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = (list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        reqs = [self._make_request(self.encode(p), sp) for p, sp in zip(prompts, params_list)]
        for req in reqs:                      # validate everything before submitting anything
            self.instance.submit(req, at=req.arrival_time)
        bar = None
        if progress:
            from laneserve.measure.progress import progress_bar
            bar = progress_bar(total=len(reqs), desc="generating")
        self.instance.run_until_idle(on_finish=(lambda r: bar.update(1)) if bar else None)
        if bar:
            bar.close()
        return [self._output(p, r) for p, r in zip(prompts, reqs)]

    def _output(self, prompt, req: Request) -> CompletionOutput:
        ids = list(req.output_token_ids or [])
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if req.finish_reason == "stop" and req.sampling and req.sampling.stop:
                cut = [i for s in req.sampling.stop if (i := text.find(s)) >= 0]
                if cut:
                    text = text[:min(cut)]
        t = req.times
        metrics = {}
        if t.first_token is not None:
            metrics["ttft"] = t.first_token - req.arrival_time
            if t.finished is not None:
                metrics["e2e"] = t.finished - req.arrival_time
        return CompletionOutput(req.request_id, prompt if isinstance(prompt, str) else None,
                                list(req.prompt_token_ids or []), text, ids, req.finish_reason, metrics)

