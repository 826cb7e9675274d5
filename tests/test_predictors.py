"""Honest predictors: the online learner converges to the time the simulator
charges, every SLO-aware policy reads the predictor the run chose, and online runs are
deterministic."""

from dataclasses import replace

import numpy as np
import pytest

from laneserve.bench.experiment import policy_config
from laneserve.costmodel import FittedCostModel, make_cost_model
from laneserve.policies.base import InstanceScheduler
from laneserve.policies.predictors import (PRIOR_PREFILL, LearnedCostModel, LearnedTTFT, PredictorSource,
                                           profile_cost_model)
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import make_workload

COST = make_cost_model("analytic", model="llama-3-8b", hardware="h100")
PADDED = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100", attention="padded")


def _batches(seed: int, n: int) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    prefill = [[(int(rng.integers(16, 6000)), int(rng.choice([0, 0, 2048, 8192])))
                for _ in range(int(rng.integers(1, 4)))] for _ in range(n)]
    decode = [[int(rng.integers(64, 8000)) for _ in range(int(rng.integers(1, 200)))] for _ in range(n)]
    return prefill, decode


def _mean_rel_error(model, cost, prefill, decode) -> tuple[float, float]:
    p = np.mean([abs(model.prefill_time(b) / cost.prefill_time(b) - 1) for b in prefill])
    d = np.mean([abs(model.decode_step_time(b) / cost.decode_step_time(b) - 1) for b in decode])
    return float(p), float(d)


@pytest.mark.parametrize("cost", [COST, PADDED], ids=["ragged", "padded"])
def test_online_model_converges_to_the_charged_time(cost):
    learner = LearnedCostModel(cost.attention)
    held_p, held_d = _batches(1, 100)
    seen_p, seen_d = _batches(2, 256)
    errors = [_mean_rel_error(learner, cost, held_p, held_d)]
    done = 0
    for n in (4, 32, 256):
        for b, d in zip(seen_p[done:n], seen_d[done:n]):
            learner.observe_prefill(b, cost.prefill_time(b))
            learner.observe_decode(d, cost.decode_step_time(d))
        done = n
        errors.append(_mean_rel_error(learner, cost, held_p, held_d))
    prefill_err = [e[0] for e in errors]
    decode_err = [e[1] for e in errors]
    assert prefill_err[0] > 0.5 and decode_err[0] > 0.2         # the generic prior is far off
    assert prefill_err[-1] < 0.05 and decode_err[-1] < 0.06     # what a linear model can reach
    assert prefill_err[-1] < prefill_err[1] < prefill_err[0]
    assert decode_err[-1] < decode_err[0]


def test_refits_come_in_doubling_epochs():
    learner = LearnedCostModel()
    versions = []
    for i in range(1, 1100):
        learner.observe_prefill([(100 + i, 0)], 0.01 + 1e-4 * (100 + i))
        versions.append(learner.prefill_version)
    refits = [i + 1 for i in range(len(versions)) if versions[i] != (versions[i - 1] if i else 0)]
    assert refits[:10] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert refits[10:] == [768, 1024]          # then every MAX_EPOCH observations


def test_learned_ttft_reads_the_model_and_is_monotone():
    learner = LearnedCostModel()
    ttft = LearnedTTFT(learner)
    assert ttft(1000) == pytest.approx(PRIOR_PREFILL[3] + 1000 * PRIOR_PREFILL[0])
    for n in (64, 256, 1024, 4096, 8192, 300, 2000, 6000):
        learner.observe_prefill([(n, 0)], COST.prefill_time([(n, 0)]))
    for n in (128, 3000, 7000):
        assert ttft(n) == pytest.approx(COST.prefill_time([(n, 0)]), rel=0.1)
    values = [ttft(n) for n in range(0, 20000, 500)]
    assert values == sorted(values)


def test_learner_skips_steps_it_cannot_attribute():
    from laneserve.core.plan import StepPlan
    from laneserve.core.request import Request, RequestSpec
    req = Request.from_spec(RequestSpec(0, 0.0, 100, 4))
    learner = LearnedCostModel()
    stopped = StepPlan(prefills=[], decodes=[req], ops_done=3)
    assert not learner.observe(stopped, 0.02) and learner.observations == 0
    assert learner.observe(StepPlan(decodes=[req]), 0.02) and learner.observations == 1


def test_profile_predictor_is_close_but_not_the_oracle():
    profile = profile_cost_model(COST)
    assert isinstance(profile, FittedCostModel)
    assert profile_cost_model(COST) is profile          # fitted once per cost model
    held_p, held_d = _batches(3, 100)
    p_err, d_err = _mean_rel_error(profile, COST, held_p, held_d)
    assert 0.0 < p_err < 0.15 and 0.0 < d_err < 0.15


def test_predictor_source_modes():
    assert PredictorSource("oracle", COST).for_instance() == (COST, None)
    model, learner = PredictorSource("online", PADDED).for_instance()
    assert model is learner and learner.attention == "padded"
    assert PredictorSource("online", COST).for_instance()[1] is not learner     # one per instance
    with pytest.raises(ValueError, match="predictor"):
        PredictorSource("perfect", COST)
    with pytest.raises(ValueError, match="predictor"):
        ClusterConfig(predictor="perfect")


def _instances(spec: str, mode: str, cost=COST, **kw):
    sim = Simulator(replace(policy_config(spec, ClusterConfig(**kw)), predictor=mode), cost)
    return sim._make_instances()


def test_every_role_is_bound_to_the_runs_predictor():
    front, back = _instances("sedf+kairos", "oracle")
    assert front[0].scheduler.predict(2048) == pytest.approx(COST.prefill_time([(2048, 0)]), rel=0.1)
    lut = back[0].scheduler.lut
    assert lut.lookup(1, 4096) == pytest.approx(COST.decode_step_time([4096]), rel=0.02)
    assert back[0].scheduler.length_key == "mean"          # follows the run's (ragged) kernel
    front, back = _instances("sedf+kairos", "online")
    assert front[0].learner is not None and back[0].learner is not None
    assert isinstance(front[0].scheduler.predict, LearnedTTFT)
    assert front[0].scheduler.predict.model is front[0].learner
    (colo,), _ = _instances("colocated:prefill=sedf,decode=kairos", "oracle")
    assert colo.scheduler.prefill.predict(2048) == pytest.approx(COST.prefill_time([(2048, 0)]), rel=0.1)
    assert colo.scheduler.decode.lut.lookup(1, 4096) == pytest.approx(COST.decode_step_time([4096]), rel=0.02)


def test_kairos_decode_table_follows_the_runs_model():
    other = make_cost_model("analytic", model="llama-3.1-70b", hardware="h100", tp=4)
    _, back = _instances("fcfs+kairos", "oracle", cost=other)
    assert back[0].scheduler.lut.lookup(8, 2048) == pytest.approx(other.decode_step_time([2048] * 8), rel=0.02)


@pytest.mark.parametrize("spec", ["sedf+kairos", "kairos:estimate=cost+continuous", "laps:order=sedf+continuous"])
def test_online_run_learns_and_is_deterministic(spec):
    specs = make_workload("azure_conv", limit=300).with_rate(8.0).specs
    cfg = replace(policy_config(spec, ClusterConfig()), predictor="online")
    runs = []
    for _ in range(2):
        sim = Simulator(cfg, COST)
        result = sim.run(specs)
        runs.append([(r.times.first_token, r.times.finished) for r in result.requests])
        assert all(r.finish_reason == "length" for r in result.requests)
        for inst in (*sim.front, *sim.back):   # a learner where the policy reads predictors, fed
            reads = type(inst.scheduler).bind_cost_model is not InstanceScheduler.bind_cost_model
            assert (inst.learner is not None) == reads
            assert inst.learner is None or inst.learner.observations > 0
    assert runs[0] == runs[1]
