"""Adaptive decode's slack gate for TPOT-infeasible requests (a context whose step alone is over its
TPOT target): held while the feasible requests beside it have no slack to spare, served on their
slack and within the bound, never starved; every request decodes while a hand-off waits for memory.
"""

import pytest

from laneserve.core.request import Phase, Request, RequestSpec
from laneserve.core.slo import SLO
from laneserve.costmodel import make_cost_model
from laneserve.policies.decode.mechanisms.infeasible_gate import InfeasibleGate
from laneserve.sim import ClusterConfig, Simulator

COST = make_cost_model(model="llama-3.1-8b", hardware="h100")   # 60K context alone: a 60 ms step
SLO_ = SLO(ttft=30.0, tpot=0.05)
LONG, SHORT = 60_000, 1_000


def scenario(n_short: int = 8, short_out: int = 60, long_out: int = 200) -> list[RequestSpec]:
    """One infeasible request (decoding from ~7.3 s), then short ones arriving while it decodes."""
    specs = [RequestSpec(0, 0.0, LONG, long_out, SLO_)]
    specs += [RequestSpec(1 + i, 8.0 + 0.05 * i, SHORT, short_out, SLO_) for i in range(n_short)]
    return specs


def run(decode: str, specs: list[RequestSpec]):
    sim = Simulator(ClusterConfig(prefill_policy="fcfs", decode_policy=decode, record_token_times=True), COST)
    res = sim.run(specs)
    assert res.unfinished == 0 and len(res.finished) == len(specs)
    by_id = {r.request_id: r for r in res.finished}
    return by_id, sim.back[0].scheduler


def tpot(req: Request) -> float:
    t = req.times
    return (t.last_token - t.first_token) / (req.num_output_tokens - 1)


def gaps(req: Request) -> list[float]:
    times = req.times.token_times
    return [b - a for a, b in zip(times, times[1:])]


@pytest.fixture(scope="module")
def gated():
    return run("adaptive", scenario())


def test_the_scenario_has_one_infeasible_request_and_without_the_gate_it_breaks_the_others():
    assert COST.decode_step_time([LONG]) > SLO_.tpot > COST.decode_step_time([SHORT] * 9)
    by_id, _ = run("adaptive:defer_infeasible=false", scenario())
    assert sum(tpot(by_id[i]) > SLO_.tpot for i in range(1, 9)) >= 4


def test_infeasible_request_is_held_then_served_within_the_bound(gated):
    by_id, sched = gated
    assert sched.gate.stats.deferred > 0                    # it was held back
    assert all(tpot(by_id[i]) <= SLO_.tpot for i in range(1, 9))
    long = by_id[0]
    assert long.num_output_tokens == 200 and long.finish_reason != "error"
    step = COST.decode_step_time([LONG + 200] + [SHORT + 60] * 8)
    # the bound, the step running when it passes and its own
    assert max(gaps(long)) <= sched.options.infeasible_bound + 2 * step + 1e-9
    # it kept decoding beside them on their slack, not only after they left
    last_short = max(by_id[i].times.last_token for i in range(1, 9))
    assert sum(t < last_short for t in long.times.token_times) > 5


def test_infeasible_request_is_not_starved_when_the_others_never_have_slack():
    # a reserve no request ever has: only the bound lets the infeasible request in
    specs = scenario(n_short=8, short_out=400, long_out=30)
    by_id, sched = run("adaptive:infeasible_reserve=1000000,infeasible_bound=0.5", specs)
    long = by_id[0]
    assert sched.gate.stats.forced > 0
    step = COST.decode_step_time([LONG + 30] + [SHORT + 400] * 8)
    assert max(gaps(long)) <= 0.5 + 2 * step + 1e-9
    last_short = max(by_id[i].times.last_token for i in range(1, 9))
    assert sum(t < last_short for t in long.times.token_times) >= 5     # served while they decode
    assert all(tpot(by_id[i]) <= SLO_.tpot for i in range(1, 9))


def decoding(rid: int, prompt: int, *, first: float, out: int) -> Request:
    req = Request(rid, 0.0, prompt, 1000, SLO_)
    req.times.first_token = first
    req.num_output_tokens = out
    req.phase = Phase.DECODING
    return req


def step_time(n: int, total: int, longest: int) -> float:
    return 0.01 if longest < 10_000 else 0.06


def test_selection_rules():
    gate = InfeasibleGate(reserve=1.0, bound=2.0)
    rich = decoding(1, SHORT, first=0.0, out=10)            # due 0.45 with its reserve
    long = decoding(2, LONG, first=0.0, out=2)
    assert gate.select([rich, long], 0.3, step_time) == [rich, long]      # 0.06 s step fits its slack
    poor = decoding(3, SHORT, first=0.3, out=2)              # due 0.35 with its reserve
    assert gate.select([rich, long, poor], 0.3, step_time) == [rich, poor]
    assert gate.select([rich, long, poor], 0.3, step_time, memory_bound=True) == [rich, long, poor]
    assert gate.select([long], 1.0, step_time) == [long]                  # alone: it decodes
    assert gate.select([rich, long, poor], 3.0, step_time) == [rich, long, poor]   # the bound
    assert gate.stats.forced == 1 and gate.stats.memory_bound == 1
    with pytest.raises(ValueError, match="bound"):
        InfeasibleGate(bound=0)
    with pytest.raises(ValueError, match="reserve"):
        InfeasibleGate(reserve=-1)
