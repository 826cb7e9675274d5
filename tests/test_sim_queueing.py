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


def _lindley_starts(specs) -> list[float]:
    """Each request's service start in a FCFS single-server queue (Lindley's recursion)."""
    starts, free = [], 0.0
    for spec in sorted(specs, key=lambda s: s.arrival_time):
        start = max(spec.arrival_time, free)
        starts.append(start)
        free = start + spec.prompt_len * PER_TOKEN
    return starts


@pytest.mark.parametrize(("lens", "weights", "rho"), [([2000], [1.0], 0.8), ([500, 4000], [0.8, 0.2], 0.6)])
def test_every_wait_follows_lindleys_recursion(lens, weights, rho):
    """Request by request, the simulator's unbatched FCFS instance is the G/G/1 queue: each service
    starts at max(its arrival, the previous finish), for deterministic and two-point service times."""
    services = [n * PER_TOKEN for n in lens]
    rate = rho / sum(s * w for s, w in zip(services, weights))
    specs = _poisson_specs(rate, lens, weights, 5_000, seed=5)
    cost = LinearCostModel(prefill_per_token=PER_TOKEN)
    result = Simulator(ClusterConfig(prefill_opts={"max_batch_size": 1}), cost).run(specs)
    assert result.unfinished == 0
    by_arrival = sorted(result.requests, key=lambda r: r.arrival_time)
    waited = sum(1 for r in by_arrival if r.times.prefill_start > r.arrival_time + 1e-12)
    assert waited > len(specs) // 4                   # a queue formed: the recursion is exercised
    assert [r.times.prefill_start for r in by_arrival] == pytest.approx(_lindley_starts(specs), abs=1e-9)


def test_md1_mean_wait_matches_pollaczek_khinchine():
    """The mean over a long run against the closed form (M/D/1 at rho 0.5: W = rho S / (2 (1 - rho)));
    at 40,000 requests the sample mean's spread over seeds is within about 4%."""
    service = 2000 * PER_TOKEN                     # deterministic 20 ms
    rate = 0.5 / service
    specs = _poisson_specs(rate, [2000], [1.0], 40_000, seed=7)
    assert _mean_wait(specs) == pytest.approx(_pk_wait(rate, [service], [1.0]), rel=0.05)


def test_batching_beats_one_at_a_time_under_load():
    """With a fixed per-step overhead, FCFS batching under a token budget must cut waits."""
    specs = _poisson_specs(60.0, [200], [1.0], 5000, seed=3)
    cost = LinearCostModel(prefill_fixed=0.01, prefill_per_token=PER_TOKEN)
    single = Simulator(ClusterConfig(prefill_opts={"max_batch_size": 1}), cost).run(specs)
    batched = Simulator(ClusterConfig(prefill_opts={"token_budget": 4096}), cost).run(specs)
    def wait(res):
        return sum(r.times.prefill_start - r.arrival_time for r in res.requests) / len(specs)
    assert wait(batched) < 0.5 * wait(single)
