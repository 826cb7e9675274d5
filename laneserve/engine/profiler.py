"""``laneserve profile``: measure this engine on its device and write a profile that
:class:`~laneserve.costmodel.fitted.FittedCostModel` loads, so the simulator can be the engine's
twin. Prefill over lengths and cached prefixes (single and batched), decode over batch sizes and
context lengths (uniform and skewed), KV export/import copies, and per-operator time fractions.
Timings are medians of repeated runs; the KV contents are irrelevant to timing and left as they are.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable

from laneserve.core.plan import PrefillChunk, StepPlan
from laneserve.core.request import Request
from laneserve.core.slo import SLO
from laneserve.costmodel.base import LAYER_OPERATORS
from laneserve.costmodel.profile import DecodeSample, KVCopySample, PrefillSample, Profile
from laneserve.engine.executor import EngineExecutor

QUICK = {"prefill_lens": (16, 64, 256, 1024), "cached": (0, 512), "prefill_batches": ((8, 64), (4, 256)),
         "decode_batches": (1, 4, 16), "decode_ctx": (64, 512, 2048), "repeats": 3}
FULL = {"prefill_lens": (16, 32, 64, 128, 256, 512, 1024, 2048, 4096), "cached": (0, 256, 1024, 2048),
        "prefill_batches": ((4, 32), (16, 32), (8, 128), (4, 512), (16, 128)),
        "decode_batches": (1, 2, 4, 8, 16, 32, 64), "decode_ctx": (32, 128, 512, 1024, 2048, 4096),
        "repeats": 5}


class EngineProfiler:
    def __init__(self, executor: EngineExecutor, *, repeats: int = 3,
                 on_sample: Callable[[str], None] | None = None) -> None:
        self.ex = executor
        self.repeats = repeats
        self.on_sample = on_sample
        self._ids = 10**9                     # far from any live request id

    def _request(self, prompt_len: int, computed: int = 0, outputs: int = 0) -> Request:
        self._ids += 1
        req = Request(self._ids, 0.0, prompt_len, max(outputs, 1) + 1, SLO(),
                      prompt_token_ids=[(7 * i + 3) % 97 + 1 for i in range(prompt_len)])
        req.num_computed_tokens = computed
        if outputs:
            req.output_token_ids = [5] * outputs
            req.num_output_tokens = outputs
        return req

    def _time(self, make_plan: Callable[[], tuple[StepPlan, list[Request]]]) -> float:
        kv = self.ex.kv
        times = []
        for _ in range(self.repeats + 1):         # first run warms up workspaces
            plan, reqs = make_plan()
            try:
                times.append(self.ex.execute(plan).duration)
            finally:
                for r in reqs:
                    kv.free(r.request_id)
        return statistics.median(times[1:])

    def prefill(self, batch: list[tuple[int, int]]) -> PrefillSample:
        def make() -> tuple[StepPlan, list[Request]]:
            reqs = [self._request(new + cached, cached) for new, cached in batch]
            for r in reqs:
                self.ex.kv.allocate(r.request_id, r.prompt_len)
            return StepPlan(prefills=[PrefillChunk(r, r.num_computed_tokens, r.remaining_prefill) for r in reqs]), reqs
        sample = PrefillSample([n for n, _ in batch], [c for _, c in batch], self._time(make))
        self._report(f"prefill {batch[:2]}{'...' if len(batch) > 2 else ''} x{len(batch)}: {sample.seconds * 1e3:.2f} ms")
        return sample

    def decode(self, context_lens: list[int]) -> DecodeSample:
        def make() -> tuple[StepPlan, list[Request]]:
            reqs = [self._request(c - 1, c - 1, outputs=1) for c in context_lens]
            for r in reqs:
                self.ex.kv.allocate(r.request_id, r.context_len)
            return StepPlan(decodes=reqs), reqs
        sample = DecodeSample(list(context_lens), self._time(make))
        self._report(f"decode {len(context_lens)} x ctx<= {max(context_lens)}: {sample.seconds * 1e3:.2f} ms")
        return sample

    def kv_copy(self, tokens: int) -> KVCopySample:
        import time
        req = self._request(tokens, tokens)
        kv = self.ex.kv
        times = []
        for _ in range(self.repeats):
            kv.allocate(req.request_id, tokens)
            t0 = time.perf_counter()
            payload = self.ex.export_kv(req.request_id, tokens)
            self.ex.import_kv(req.request_id, payload)
            times.append(time.perf_counter() - t0)
            kv.free(req.request_id)
        return KVCopySample(tokens, statistics.median(times))

    def op_fractions(self, tokens: int = 256) -> list[float]:
        req = self._request(tokens)
        self.ex.kv.allocate(req.request_id, tokens)
        plan = StepPlan(prefills=[PrefillChunk(req, 0, tokens)], preemptible=True)
        try:
            self.ex.execute(plan)
        finally:
            self.ex.kv.free(req.request_id)
        per_kind = [0.0] * len(LAYER_OPERATORS)       # aggregate over layers, by operator kind
        for i, t in enumerate(plan.op_times or []):
            per_kind[i % len(LAYER_OPERATORS)] += t
        total = sum(per_kind)
        return [t / total for t in per_kind] if total else [1 / len(per_kind)] * len(per_kind)

    def _report(self, text: str) -> None:
        if self.on_sample is not None:
            self.on_sample(text)

    def run(self, grid: dict, *, model_name: str, device: str) -> Profile:
        ex = self.ex
        cfg = ex.model.config
        kv_tokens = ex.kv.num_blocks * ex.kv.block_size // 2     # headroom for block rounding
        max_ctx = min(cfg.max_position_embeddings, kv_tokens)      # one request's longest context
        prof = Profile(model=model_name, device=device, attention=ex.config.attention,
                       num_layers=cfg.num_layers, kv_bytes_per_token=cfg.kv_bytes_per_token(ex.model.embed.element_size()))
        quiet, self.on_sample = self.on_sample, None       # warm-up: thread pools, workspaces
        for _ in range(3):
            self.prefill([(min(256, max_ctx), 0)])
            self.decode([min(256, max_ctx)] * 4)
        self.on_sample = quiet
        for n in grid["prefill_lens"]:
            for c in grid["cached"]:
                if n + c <= max_ctx:
                    prof.prefill.append(self.prefill([(n, c)]))
        for count, n in grid["prefill_batches"]:
            if n <= max_ctx and count * n <= kv_tokens:
                prof.prefill.append(self.prefill([(n, 0)] * count))
        for b in grid["decode_batches"]:
            for c in grid["decode_ctx"]:
                if c <= max_ctx and b * c <= kv_tokens:
                    prof.decode.append(self.decode([c] * b))
                    if b > 1 and c > 64:          # skewed: one long, the rest short
                        prof.decode.append(self.decode([c] + [max(c // 16, 16)] * (b - 1)))
        for tokens in _pow2_upto(min(4096, max_ctx)):
            prof.kv_copy.append(self.kv_copy(tokens))
        prof.op_fractions = self.op_fractions(min(256, max_ctx))
        return prof


def _pow2_upto(limit: int) -> Iterable[int]:
    n = 64
    while n <= limit:
        yield n
        n *= 4
