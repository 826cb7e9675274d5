import subprocess
import sys

import pytest

from laneserve.core import (SLO, HostKVPool, KVCacheManager, KVOutOfMemory, Phase, Request,
                            RequestSpec, SamplingParams, StepPlan)
from laneserve.core.plan import PrefillChunk


def test_pure_layers_do_not_import_torch():
    code = ("import sys; import laneserve.core, laneserve.costmodel, laneserve.policies, "
            "laneserve.sim, laneserve.runtime, laneserve.workloads, laneserve.measure.metrics; "
            "from laneserve.policies import available; available('prefill'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_slo_validation_and_scaling():
    assert SLO(0.5, 0.05).scaled(2) == SLO(1.0, 0.1)
    assert SLO(None, 0.05).scaled(2) == SLO(None, 0.1)
    with pytest.raises(ValueError):
        SLO(ttft=0)
    with pytest.raises(ValueError):
        SLO(1, 1).scaled(-1)


def test_spec_validation():
    with pytest.raises(ValueError, match="prompt_len"):
        RequestSpec(0, 0.0, 0, 1)
    with pytest.raises(ValueError, match="output_len"):
        RequestSpec(0, 0.0, 5, 0)
    with pytest.raises(ValueError, match="prefix_len"):
        RequestSpec(0, 0.0, 5, 1, prefix_len=9)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_request_counters_and_token_times():
    req = Request.from_spec(RequestSpec(3, 1.0, 10, 3, slo=SLO(0.5, 0.1)), slo_scale=2,
                            record_token_times=True)
    assert req.slo == SLO(1.0, 0.2) and req.ttft_deadline == 2.0
    assert req.remaining_prefill == 10 and req.context_len == 10
    req.num_computed_tokens = 10
    req.record_token(1.5, 7)
    req.record_token(1.6, 8)
    req.record_token(1.9, 9)
    assert req.context_len == 13 and req.remaining_output == 0
    assert req.times.first_token == 1.5 and req.times.last_token == 1.9
    assert req.times.max_itl == pytest.approx(0.3)
    assert req.times.token_times == [1.5, 1.6, 1.9] and req.output_token_ids == [7, 8, 9]
    req.finish(2.0)
    assert req.phase is Phase.FINISHED and req.is_finished


def test_policy_records_are_one_per_type_and_request():
    from dataclasses import dataclass

    @dataclass
    class Mine:
        steps: int = 0

    @dataclass
    class Other:
        lane: str | None = None

    a, b = (Request.from_spec(RequestSpec(i, 0.0, 10, 4)) for i in range(2))
    assert a.policy_state.peek(Mine) is None and a.policy_state.records is None   # nothing made by a look
    a.policy_state.of(Mine).steps += 2
    assert a.policy_state.of(Mine) is a.policy_state.peek(Mine) and a.policy_state.of(Mine).steps == 2
    assert a.policy_state.of(Other).lane is None and b.policy_state.peek(Mine) is None


def test_kv_allocation_free_and_errors():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.allocate(1, 9) and kv.num_allocated(1) == 3
    assert kv.allocate(1, 12) == [] and kv.num_allocated(1) == 3
    assert len(kv.allocate(1, 13)) == 1
    assert kv.blocks_needed(2, 40) == 10 and not kv.can_grow(2, 40)
    with pytest.raises(KVOutOfMemory):
        kv.allocate(2, 40)
    assert kv.num_allocated(2) == 0 and kv.num_free_blocks == 6   # a failed allocation takes nothing
    assert kv.free(1) == 4 and kv.num_free_blocks == 10 and kv.free(1) == 0
    with pytest.raises(ValueError, match="freed twice"):
        kv.allocator.free([0])


def test_watermark_limits_admission_not_growth():
    kv = KVCacheManager(num_blocks=10, block_size=1, watermark=0.2)
    assert kv.can_admit(1, 8) and not kv.can_admit(1, 9)
    kv.allocate(1, 8)
    assert kv.can_grow(1, 10) and not kv.fits_ever(9)


def test_host_pool_swap_roundtrip_conserves_blocks():
    dev = KVCacheManager(8, 4)
    pool = HostKVPool(8, 4)
    dev.allocate(5, 10)
    out = pool.swap_out(dev, 5, 10)
    assert len(out.src_blocks) == len(out.dst_blocks) == 3
    assert dev.num_free_blocks == 8 and pool.num_free_blocks == 5
    back = pool.swap_in(dev, 5, 10)
    assert back.src_blocks == out.dst_blocks and len(back.dst_blocks) == 3
    assert pool.num_free_blocks == 8 and dev.num_allocated(5) == 3


def test_plan_prefill_batch_with_padding():
    reqs = [Request.from_spec(RequestSpec(i, 0.0, n, 1)) for i, n in enumerate([5, 9])]
    plan = StepPlan(prefills=[PrefillChunk(reqs[0], 0, 5), PrefillChunk(reqs[1], 2, 7)])
    assert plan.prefill_batch() == [(5, 0), (7, 2)] and plan.num_prefill_tokens == 12
    plan.padded_shape = (16, 4)
    assert plan.prefill_batch() == [(16, 0), (16, 2), (16, 0), (16, 0)]
