"""The simulator against queueing theory: one FCFS prefill instance without batching is an
M/G/1 queue, whose mean wait is given by Pollaczek-Khinchine: W = lambda E[S^2] / (2 (1 - rho))."""

import random

import pytest

from laneserve.core import RequestSpec
from laneserve.costmodel.linear import LinearCostModel
from laneserve.sim import ClusterConfig, Simulator

PER_TOKEN = 1e-5


def _poisson_specs(rate: float, prompt_lens: list[int], weights: list[float], n: int, seed: int):
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        specs.append(RequestSpec(i, t, rng.choices(prompt_lens, weights)[0], 1))
    return specs


def _mean_wait(specs) -> float:
    cost = LinearCostModel(prefill_per_token=PER_TOKEN)
    result = Simulator(ClusterConfig(prefill_opts={"max_batch_size": 1}), cost).run(specs)
    assert result.unfinished == 0
    waits = [r.times.prefill_start - r.arrival_time for r in result.requests]
    return sum(waits) / len(waits)


def _pk_wait(rate: float, services: list[float], weights: list[float]) -> float:
    es = sum(s * w for s, w in zip(services, weights))
    es2 = sum(s * s * w for s, w in zip(services, weights))
    rho = rate * es
    assert rho < 1
    return rate * es2 / (2 * (1 - rho))


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_mean_wait_matches_pollaczek_khinchine(rho):
    service = 2000 * PER_TOKEN                     # deterministic 20 ms
    rate = rho / service
    specs = _poisson_specs(rate, [2000], [1.0], 100_000, seed=7)
    expected = _pk_wait(rate, [service], [1.0])   # = rho * S / (2 (1 - rho))
    assert _mean_wait(specs) == pytest.approx(expected, rel=0.03)


def test_mg1_two_service_times_matches_pollaczek_khinchine():
    lens, weights = [500, 4000], [0.8, 0.2]
    services = [n * PER_TOKEN for n in lens]
    rate = 0.6 / sum(s * w for s, w in zip(services, weights))
    specs = _poisson_specs(rate, lens, weights, 150_000, seed=11)
    assert _mean_wait(specs) == pytest.approx(_pk_wait(rate, services, weights), rel=0.03)


def test_batching_beats_one_at_a_time_under_load():
    """With a fixed per-step overhead, FCFS batching under a token budget must cut waits."""
    specs = _poisson_specs(60.0, [200], [1.0], 5000, seed=3)
    cost = LinearCostModel(prefill_fixed=0.01, prefill_per_token=PER_TOKEN)
    single = Simulator(ClusterConfig(prefill_opts={"max_batch_size": 1}), cost).run(specs)
    batched = Simulator(ClusterConfig(prefill_opts={"token_budget": 4096}), cost).run(specs)
    def wait(res):
        return sum(r.times.prefill_start - r.arrival_time for r in res.requests) / len(specs)
    assert wait(batched) < 0.5 * wait(single)
