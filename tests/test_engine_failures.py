"""Failures stay with the request that caused them, on a real engine instance: a logits
row that cannot be sampled fails that request alone (the others in the same batch go on, token
for token as without it), and its KV is freed."""

from __future__ import annotations

from engine_support import make_executor, make_request, prompts

from laneserve.core.clock import VirtualClock
from laneserve.engine.instance import EngineInstance
from laneserve.engine.sampler import PLACEHOLDER_TOKEN, UnsampleableRows
from laneserve.policies import registry


def _run(poison: int | None) -> tuple[dict, EngineInstance]:
    ex = make_executor("llama")
    inst = EngineInstance(registry.make("colocated", "colocated", ex.kv, token_budget=512), ex, clock=VirtualClock())
    reqs = [make_request(rid, p, max_tokens=6) for rid, p in enumerate(prompts([12, 20, 7], seed=3))]
    real = ex.sampler
    poisoned_params = reqs[poison].sampling if poison is not None else None

    class Poisoned:                          # the real sampler, with one request's row failing
        def sample(self, logits, params, output_index, histories=None, states=None):
            tokens, lps = real.sample(logits, params, output_index, histories, states)
            rows = {row: "injected NaN row" for row, p in enumerate(params) if p is poisoned_params}
            if rows:
                for row in rows:
                    tokens[row], lps[row] = PLACEHOLDER_TOKEN, None
                raise UnsampleableRows(rows, tokens, lps)
            return tokens, lps
    ex.sampler = Poisoned()
    for r in reqs:
        inst.submit(r)
    failed = {}
    while not inst.idle:
        if inst.step() is not None:
            failed.update(inst.failed)
    return {"reqs": reqs, "failed": failed}, inst


def test_unsampleable_row_fails_only_its_request():
    clean, _ = _run(None)
    got, inst = _run(poison=1)
    assert list(got["failed"]) == [1] and "injected" in got["failed"][1]
    poisoned = got["reqs"][1]
    assert poisoned.is_finished and poisoned.finish_reason == "error"
    for i in (0, 2):                       # the rest of the batch is untouched
        assert got["reqs"][i].output_token_ids == clean["reqs"][i].output_token_ids
        assert len(got["reqs"][i].output_token_ids) == 6
    kv = inst.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
