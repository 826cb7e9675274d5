"""Shared helpers for the engine tests: tiny random-weight checkpoints (built once per session),
a minimal scheduler-role driver, and Hugging Face reference generation."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import PrefillChunk, StepPlan
from laneserve.core.request import Request
from laneserve.core.sampling import SamplingParams
from laneserve.core.slo import SLO
from laneserve.engine import EngineConfig, EngineExecutor, load_model

VOCAB = 512
# tiny ops: one intra-op thread is faster and immune to OpenMP spin contention on a busy machine
torch.set_num_threads(1)
_TMP = tempfile.TemporaryDirectory(prefix="laneserve-engine-tests-")


@functools.cache
def tiny_checkpoint(family: str) -> Path:
    """A 2-layer random checkpoint of ``family`` ("llama" with llama3 rope scaling, "qwen2" with
    qkv bias and tied embeddings, "qwen3" with q/k norm)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=VOCAB - 1, bos_token_id=1)
    if family == "llama":
        cfg = LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                          rope_theta=500000.0)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16, rope_theta=1000000.0)
    else:
        raise ValueError(family)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg)
    # sharper logits than the default init so greedy choices are far from ties
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] != VOCAB:
                p.mul_(5.0 if family == "qwen2" else 2.5)
    path = Path(_TMP.name) / family
    model.save_pretrained(path)
    return path


@functools.cache
def hf_model_at(path: Path):
    """The ``transformers`` model of the checkpoint at ``path`` (fp32, eval), loaded once."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_model(family: str):
    return hf_model_at(tiny_checkpoint(family))


def hf_greedy(family: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    return hf_greedy_at(tiny_checkpoint(family), prompt, max_new_tokens)


def hf_greedy_at(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: ``transformers`` ``generate(do_sample=False)`` on one unpadded prompt, EOS ignored."""
    model = hf_model_at(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(family: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(family)(torch.tensor([tokens])).logits[0]


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


def make_request(rid: int, prompt: list[int], max_tokens: int = 8, **sampling) -> Request:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    req = Request(request_id=rid, arrival_time=0.0, prompt_len=len(prompt), max_output_tokens=max_tokens,
                  slo=SLO(), prompt_token_ids=list(prompt))
    req.sampling = SamplingParams(max_tokens=max_tokens, **sampling)
    return req


@functools.cache
def _model(family: str, dtype: str = "float32"):
    return load_model(tiny_checkpoint(family), dtype=dtype)


def make_executor(family: str, attention: str = "ragged", num_blocks: int = 256, block_size: int = 8,
                  host_blocks: int = 0) -> EngineExecutor:
    from laneserve.core.kv import HostKVPool

    cfg = EngineConfig(attention=attention, block_size=block_size, num_kv_blocks=num_blocks,
                       num_host_blocks=host_blocks, max_num_batched_tokens=256, num_threads=1)
    kv = KVCacheManager(num_blocks, block_size)
    host = HostKVPool(host_blocks, block_size) if host_blocks else None
    return EngineExecutor(_model(family), kv, cfg, host)


class Driver:
    """Plays the scheduler role: allocates blocks, builds plans, calls ``execute`` and advances the
    counters exactly as a scheduler's ``update`` would."""

    def __init__(self, executor: EngineExecutor) -> None:
        self.ex = executor
        self.now = 0.0
        self.logprobs: dict[int, list] = {}

    def step(self, chunks: list[tuple[Request, int]], decodes: list[Request], *,
             preemptible: bool = False, granularity: str = "operator",
             should_stop: Callable[[], bool] | None = None, plan: StepPlan | None = None):
        kv = self.ex.kv
        if plan is None:
            plan = StepPlan(preemptible=preemptible, preempt_granularity=granularity)
            for req, n in chunks:
                kv.allocate(req.request_id, req.num_computed_tokens + n)
                plan.prefills.append(PrefillChunk(req, req.num_computed_tokens, n))
            for req in decodes:
                kv.allocate(req.request_id, req.context_len)
                plan.decodes.append(req)
        reqs = [c.request for c in plan.prefills] + list(plan.decodes)
        before = [(r.num_computed_tokens, r.num_output_tokens, list(r.output_token_ids or [])) for r in reqs]
        result = self.ex.execute(plan, should_stop)
        after = [(r.num_computed_tokens, r.num_output_tokens, list(r.output_token_ids or [])) for r in reqs]
        assert before == after, "the executor must not change request counters"
        if result.completed:
            self.update(plan, result)
        return plan, result

    def update(self, plan: StepPlan, result) -> None:
        self.now += 1.0
        for c in plan.prefills:
            # a recompute after preemption (the request already has outputs) records no token,
            # like policies/base.py ``_advance_prefill``
            recompute = c.request.num_output_tokens > 0
            c.request.num_computed_tokens = c.end
            if c.completes_prompt and not recompute:
                c.request.record_token(self.now, result.sampled[c.request.request_id])
        for req in plan.decodes:
            req.num_computed_tokens += 1
            req.record_token(self.now, result.sampled[req.request_id])
        for rid, lp in (getattr(result, "logprobs", None) or {}).items():
            self.logprobs.setdefault(rid, []).append(lp)

    def run(self, reqs: list[Request], chunk_size: int = 1 << 30, decode_batch: bool = True) -> list[list[int]]:
        """Prefill every request in chunks of ``chunk_size`` (all prompts together in one step),
        then decode all of them together until each has ``max_output_tokens`` tokens."""
        while any(not r.prefill_done for r in reqs):
            chunks = [(r, min(chunk_size, r.remaining_prefill)) for r in reqs if not r.prefill_done]
            self.step(chunks, [])
        while True:
            live = [r for r in reqs if r.num_output_tokens < r.max_output_tokens]
            if not live:
                break
            if decode_batch:
                self.step([], live)
            else:
                for r in live:
                    self.step([], [r])
        return [list(r.output_token_ids or []) for r in reqs]


class OutputPenalty:
    """The direct formula of vLLM's presence/frequency penalties (HF has no processor for them), as
    a ``transformers`` logits processor: over the generated tokens only,
    ``logit -= frequency * count + presence * (count > 0)``."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones(out.shape, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)
