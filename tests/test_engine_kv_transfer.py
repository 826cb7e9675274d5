"""KV movement: export -> host pool -> import for prefill -> decode transfer (PD
disaggregation), swap out / swap in through the host pool (AlignedServe §3), different block sizes
on the two sides."""

from __future__ import annotations

import pytest

from engine_support import Driver, hf_greedy, make_executor, make_request, prompts
from laneserve.core.plan import StepPlan
from laneserve.engine import KVPayload

FAMILY = "llama"
NEW = 8


@pytest.mark.parametrize("attention", ["ragged", "padded"])
def test_prefill_export_host_import_decode(attention):
    ps = prompts([19, 7], seed=21)
    prefill = make_executor(FAMILY, attention, block_size=8)
    decode = make_executor(FAMILY, attention, block_size=16, host_blocks=16)
    reqs = [make_request(i, p, NEW) for i, p in enumerate(ps)]
    Driver(prefill).step([(r, r.prompt_len) for r in reqs], [])
    payloads = {r.request_id: prefill.export_kv(r.request_id, r.prompt_len) for r in reqs}
    for r in reqs:
        prefill.kv.free(r.request_id)
        assert payloads[r.request_id].num_tokens == r.prompt_len and payloads[r.request_id].kv.device.type == "cpu"
        # decode side: park in the host pool, then swap into device blocks
        decode.host_pool.allocate(r.request_id, r.prompt_len)
        decode.import_kv(r.request_id, payloads[r.request_id], into_host=True)
    plan = StepPlan(swap_in=[decode.host_pool.swap_in(decode.kv, r.request_id, r.prompt_len) for r in reqs])
    assert decode.execute(plan).sampled == {}
    out = Driver(decode).run(reqs)
    assert out == [hf_greedy(FAMILY, p, NEW) for p in ps]


def test_swap_out_and_in_mid_decode():
    ps = prompts([10, 30], seed=4)
    ex = make_executor(FAMILY, block_size=8, host_blocks=32)
    driver = Driver(ex)
    reqs = [make_request(i, p, NEW) for i, p in enumerate(ps)]
    driver.step([(r, r.prompt_len) for r in reqs], [])
    driver.step([], reqs)
    victim = reqs[1]
    out_copy = ex.host_pool.swap_out(ex.kv, victim.request_id, victim.context_len - 1)
    # the freed blocks get reused (and overwritten) by another request while the victim is parked
    other = make_request(5, prompts([40], seed=8)[0], 1)
    ex.kv.allocate(other.request_id, other.prompt_len)
    from laneserve.core.plan import PrefillChunk
    plan = StepPlan(prefills=[PrefillChunk(other, 0, other.prompt_len)], swap_out=[out_copy])
    ex.execute(plan)
    ex.kv.free(other.request_id)
    driver.step([], [reqs[0]])
    in_copy = ex.host_pool.swap_in(ex.kv, victim.request_id, victim.context_len - 1)
    ex.execute(StepPlan(swap_in=[in_copy]))
    out = driver.run(reqs)
    assert out == [hf_greedy(FAMILY, p, NEW) for p in ps]


def test_import_checks_shapes_and_blocks():
    a = make_executor(FAMILY)
    req = make_request(0, prompts([9])[0], 1)
    Driver(a).step([(req, 9)], [])
    payload = a.export_kv(0, 9)
    b = make_executor(FAMILY)
    b.kv.allocate(0, 9)
    with pytest.raises(ValueError):      # other model geometry
        b.import_kv(0, KVPayload(9, payload.kv[..., :8].contiguous()))
    c = make_executor(FAMILY)
    c.kv.allocate(0, 4)
    with pytest.raises(ValueError):
        c.import_kv(0, payload)          # too few blocks
    with pytest.raises(ValueError):
        c.export_kv(0, 9, from_host=True)  # no host pool
