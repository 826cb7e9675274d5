"""FlowPrefill (flowprefill.txt §5): S-EDF ordering, SLO-aware batching (Algorithm 1), event-driven
preemption and resumption of the same plan (Algorithm 2), the suspension bound, and the
simulator / engine runs."""

from __future__ import annotations

import random

import pytest

from laneserve.core import SLO, RequestSpec
from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import StepResult
from laneserve.core.request import Phase, Request
from laneserve.costmodel import PolynomialTTFT, make_cost_model
from laneserve.policies import make
from laneserve.policies.prefill.sedf import SEDFPrefill
from laneserve.policies.predictors import PRIOR_PREFILL, LearnedTTFT
from laneserve.policies.prefill.mechanisms.priority import priority_key
from laneserve.sim import ClusterConfig, Simulator


def priority_value(ordering: str, req: Request, now: float, predicted: float = 0.0) -> float:
    """The paper's scalar ``sgn(x)/deadline``, the form it states (the policy ranks with
    :func:`priority_key`, which orders requests the same way)."""
    d = req.ttft_deadline
    x = {"sedf": d - now - predicted, "dedf": d - now, "edf": 1.0}.get(ordering)
    if x is None:
        raise ValueError(f"ordering {ordering!r} has no scalar priority")
    if d == float("inf"):
        return 0.0
    return (1.0 if x >= 0 else -1.0) / d


COST = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100")   # Llama-3-8B shape, 128K context
LINEAR = lambda n: 1e-3 * n      # noqa: E731  (1 ms per token: easy arithmetic)


def req(rid, arrival, prompt, ttft, out=4):
    return Request(rid, arrival, prompt, out, SLO(ttft=ttft))


def sched(**opts):
    opts.setdefault("predictor", LINEAR)
    return make("prefill", opts.pop("spec", "sedf"), KVCacheManager(4096, 16), **opts)


# ---- priorities ---------------------------------------------------------------------------------
def test_sedf_orders_feasible_by_deadline_then_late_behind():
    now = 10.0
    a = req(0, 9.0, 100, 2.0)      # deadline 11, slack 11-10-0.1 > 0
    b = req(1, 9.5, 100, 1.0)      # deadline 10.5, slack 0.4 > 0  -> first
    c = req(2, 8.0, 3000, 4.0)     # deadline 12, slack 12-10-3 < 0 -> late
    d = req(3, 9.9, 3000, 4.5)     # deadline 14.4, slack 1.4 > 0
    e = req(4, 5.0, 100, 4.9)      # deadline 9.9, slack < 0         -> late, earlier deadline
    keys = {r.request_id: priority_key("sedf", r, now, LINEAR(r.prompt_len)) for r in (a, b, c, d, e)}
    assert sorted(keys, key=keys.get) == [1, 0, 3, 2, 4]
    # the paper's scalar sgn(slack)/deadline sorts the same way (descending)
    vals = {r.request_id: priority_value("sedf", r, now, LINEAR(r.prompt_len)) for r in (a, b, c, d, e)}
    assert sorted(vals, key=vals.get, reverse=True) == [1, 0, 3, 2, 4]
    assert vals[2] < 0 < vals[3]


def test_dedf_and_edf_ignore_predicted_time():
    now = 10.0
    c = req(2, 8.0, 3000, 4.0)     # can no longer make it (S-EDF) but its deadline is ahead
    f = req(5, 9.0, 10, 3.5)       # deadline 12.5
    assert priority_key("sedf", c, now, 3.0) > priority_key("sedf", f, now, 0.01)
    assert priority_key("dedf", c, now, 3.0) < priority_key("dedf", f, now, 0.01)
    assert priority_key("edf", c, now, 3.0) < priority_key("edf", f, now, 0.01)
    late = req(6, 1.0, 10, 1.0)    # deadline passed: D-EDF drops it, naive EDF keeps it first
    assert priority_key("dedf", late, now) > priority_key("dedf", f, now)
    assert priority_key("edf", late, now) < priority_key("edf", f, now)


def test_ties_break_by_arrival():
    a, b = req(0, 1.0, 10, 2.0), req(1, 2.0, 10, 1.0)   # same deadline 3.0
    assert priority_key("sedf", a, 1.5, 0.0) < priority_key("sedf", b, 1.5, 0.0)


def test_predictor_from_cost_model_and_online():
    s = make("prefill", "sedf", KVCacheManager(64, 16))
    s.bind_cost_model(COST)
    assert s.predict(4096) == pytest.approx(COST.prefill_time([(4096, 0)]), rel=0.1)
    online = LearnedTTFT()
    assert online(1000) == pytest.approx(PRIOR_PREFILL[3] + 1000 * PRIOR_PREFILL[0])   # the prior
    for n in (100, 400, 1600, 3200):
        online.observe(n, 1e-4 * n + 1e-8 * n * n)
    assert online(800) == pytest.approx(1e-4 * 800 + 1e-8 * 800 ** 2, rel=0.05)
    fitted = PolynomialTTFT.from_cost_model(COST)
    s2 = make("prefill", "sedf", KVCacheManager(64, 16), predictor=fitted)
    s2.bind_cost_model(make_cost_model("analytic", model="llama-3-8b", hardware="a100"))   # ignored
    assert s2.predict(2048) == pytest.approx(fitted.predict(2048))


# ---- Algorithm 1 ----------------------------------------------------------------------------------
def test_batching_stops_at_head_deadline():
    s = sched(token_budget=100_000)
    s.add_request(req(0, 0.0, 50, 0.2), 0.0)           # head: 0.2 s left, 50 ms predicted
    for i in range(1, 8):
        s.add_request(req(i, 0.0, 40, 5.0), 0.0)
    plan = s.schedule(0.0)
    # add while 1ms*(50 + 40k) < 0.2 s  -> k <= 3 (170 tokens), the 4th would predict 0.21 s
    assert [c.request.request_id for c in plan.prefills] == [0, 1, 2, 3]
    assert plan.num_prefill_tokens == 170 and plan.preemptible and plan.preempt_granularity == "operator"


def test_batching_stops_at_token_budget_and_can_be_disabled():
    s = sched(token_budget=130)
    s.add_request(req(0, 0.0, 50, 10.0), 0.0)
    for i in range(1, 5):
        s.add_request(req(i, 0.0, 40, 20.0 + i), 0.0)
    plan = s.schedule(0.0)
    assert plan.num_prefill_tokens == 90                 # 130 would not be < G
    s2 = sched(batching=False)
    for i in range(3):
        s2.add_request(req(i, 0.0, 40, 10.0 + i), 0.0)
    assert len(s2.schedule(0.0).prefills) == 1


def test_batch_skips_a_candidate_that_does_not_fit_but_keeps_scanning():
    s = sched(token_budget=200)
    s.add_request(req(0, 0.0, 50, 10.0), 0.0)
    s.add_request(req(1, 0.0, 500, 11.0), 0.0)          # too big for G
    s.add_request(req(2, 0.0, 60, 12.0), 0.0)
    assert [c.request.request_id for c in s.schedule(0.0).prefills] == [0, 2]


# ---- Algorithm 2: preemption and resumption -------------------------------------------------------
def test_preempt_only_for_more_urgent_and_resume_same_plan():
    s = sched()
    long = req(0, 0.0, 2000, 30.0)
    s.add_request(long, 0.0)
    plan = s.schedule(0.0)
    assert plan.prefills[0].request is long
    s.add_request(req(1, 0.1, 500, 60.0), 0.1)           # later deadline: no preemption
    assert not s.should_preempt(plan, 0.1)
    urgent = req(2, 0.2, 100, 0.5)
    s.add_request(urgent, 0.2)
    assert s.should_preempt(plan, 0.2)
    plan.ops_done = 7                                    # the executor stopped at a boundary
    s.update(plan, StepResult(duration=0.21, completed=False), 0.21)
    assert long.phase is Phase.PREEMPTED and long.num_computed_tokens == 0
    assert s.num_preemptions == 1 and s.next_wakeup() == pytest.approx(0.21 + s.max_suspension)
    p2 = s.schedule(0.21)
    assert p2 is not plan and p2.prefills[0].request is urgent
    out = s.update(p2, StepResult(duration=0.1), 0.31)
    assert out.prefilled == [urgent]
    p3 = s.schedule(0.31)
    assert p3 is plan and plan.ops_done == 7             # resumed where it stopped
    assert not s.should_preempt(plan, 0.4)               # only the 60 s request waits
    out = s.update(p3, StepResult(duration=1.8), 2.1)
    assert out.prefilled == [long] and long.prefill_done and s.suspensions == [pytest.approx(0.1)]
    p4 = s.schedule(2.1)
    assert p4.prefills[0].request.request_id == 1
    s.update(p4, StepResult(duration=0.5), 2.6)
    assert s.schedule(2.6) is None and s.next_wakeup() is None


def test_suspension_bound_forces_resume():
    s = sched(max_suspension=1.0)
    s.add_request(req(0, 0.0, 2000, 30.0), 0.0)
    plan = s.schedule(0.0)
    s.add_request(req(1, 0.1, 2000, 3.0), 0.1)
    assert s.should_preempt(plan, 0.1)
    s.update(plan, StepResult(duration=0.1, completed=False), 0.1)
    p2 = s.schedule(0.1)
    assert p2 is not plan
    assert not s.should_preempt(p2, 0.9)                 # bound not reached yet
    assert s.should_preempt(p2, 1.1)                     # wake-up at 1.1: the parked task is due
    s.update(p2, StepResult(duration=1.0, completed=False), 1.1)
    assert s.schedule(1.1) is plan and s.num_forced_resumes == 1
    s.add_request(req(2, 1.2, 10, 0.05), 1.2)            # more urgent, but the forced task keeps running
    assert not s.should_preempt(plan, 1.2)


def test_a_task_late_at_its_bound_is_not_forced_without_bound_late():
    """``bound_late=False`` (adaptive's choice): the bound skips a task whose slack is negative at
    its bound, and the wake-up no longer names it; a task still on time at its bound is forced."""
    for bound_late in (True, False):
        s = sched(max_suspension=1.0, bound_late=bound_late)
        s.add_request(req(0, 0.0, 2000, 2.5), 0.0)        # 2 s of work, deadline 2.5: late from 0.6 parked
        plan = s.schedule(0.0)
        s.add_request(req(1, 0.1, 2000, 2.2), 0.1)        # deadline 2.3: ranks first
        assert s.should_preempt(plan, 0.1)
        s.update(plan, StepResult(duration=0.1, completed=False), 0.1)
        p2 = s.schedule(0.1)
        assert p2.prefills[0].request.request_id == 1
        # parked at 0.1 with 1.9 s left: at its bound (1.1) its slack is 2.5 - 1.1 - 1.9 < 0
        if bound_late:
            assert s.next_wakeup() == pytest.approx(1.1) and s.should_preempt(p2, 1.1)
        else:
            assert s.next_wakeup() is None and not s.should_preempt(p2, 1.1)
            s.update(p2, StepResult(duration=2.0), 2.1)    # the on-time task ends; then the late one
            assert s.schedule(2.1) is plan and s.num_forced_resumes == 0
    s = sched(max_suspension=1.0, bound_late=False)        # on time at its bound: forced as before
    s.add_request(req(0, 0.0, 2000, 30.0), 0.0)
    plan = s.schedule(0.0)
    s.add_request(req(1, 0.1, 2000, 3.0), 0.1)
    s.update(plan, StepResult(duration=0.1, completed=False), 0.1)
    p2 = s.schedule(0.1)
    assert s.next_wakeup() == pytest.approx(1.1) and s.should_preempt(p2, 1.1)
    s.update(p2, StepResult(duration=1.0, completed=False), 1.1)
    assert s.schedule(1.1) is plan and s.num_forced_resumes == 1


def test_past_the_cap_on_parked_tasks_late_ones_are_bounded_again():
    """``bound_late=False`` exempts late tasks from the bound only while at most
    ``late_parked_cap`` tasks are parked (each holds its KV and activations)."""
    for cap in (16, 1):
        s = sched(max_suspension=1.0, bound_late=False, late_parked_cap=cap)
        s.add_request(req(0, 0.0, 2000, 2.5), 0.0)
        p0 = s.schedule(0.0)
        s.add_request(req(1, 0.1, 2000, 2.2), 0.1)        # deadline 2.3: preempts request 0
        assert s.should_preempt(p0, 0.1)
        s.update(p0, StepResult(duration=0.1, completed=False), 0.1)
        p1 = s.schedule(0.1)
        s.add_request(req(2, 0.2, 2000, 2.05), 0.2)       # deadline 2.25: preempts request 1
        assert s.should_preempt(p1, 0.2)
        s.update(p1, StepResult(duration=0.1, completed=False), 0.2)
        p2 = s.schedule(0.2)
        assert p2.prefills[0].request.request_id == 2 and len(s.parked) == 2
        # both parked tasks are late at their bounds (1.1 and 1.2)
        if cap == 16:
            assert s.next_wakeup() is None and not s.should_preempt(p2, 1.1)
        else:                                              # 2 parked > 1: the oldest is bounded again
            assert s.next_wakeup() == pytest.approx(1.1) and s.should_preempt(p2, 1.1)
            s.update(p2, StepResult(duration=0.9, completed=False), 1.1)
            assert s.schedule(1.1) is p0 and s.num_forced_resumes == 1
            assert s.next_wakeup() == pytest.approx(1.2)   # still 2 parked (1 and 2): request 1's bound is next


def test_chunk_granularity_steps_and_requeues():
    s = sched(preemption="chunk", chunk=512)
    s.add_request(req(0, 0.0, 1200, 30.0), 0.0)
    sizes = []
    while (plan := s.schedule(1.0)) is not None:
        assert plan.preempt_granularity == "chunk" and not s.should_preempt(plan, 1.0)
        sizes.append(plan.num_prefill_tokens)
        s.update(plan, StepResult(duration=0.1), 1.0)
    assert sizes == [512, 512, 176]


def test_abort_member_of_parked_batch_requeues_the_rest():
    s = sched()
    for i in range(3):
        s.add_request(req(i, 0.0, 50, 10.0 + i), 0.0)
    plan = s.schedule(0.0)
    assert len(plan.prefills) == 3
    s.add_request(req(9, 0.1, 10, 0.3), 0.1)
    s.update(plan, StepResult(duration=0.1, completed=False), 0.1)
    s.abort(1, 0.1)
    assert s.dropped_plans == [plan] and not s.parked and set(s.waiting) == {0, 2, 9}


# ---- simulator properties ------------------------------------------------------------------------
def random_specs(seed, n=120):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rng.choice([4.0, 15.0]))
        long = rng.random() < 0.25
        prompt = rng.randint(2000, 16000) if long else rng.randint(10, 1500)
        out.append(RequestSpec(i, t, prompt, rng.randint(1, 30),
                               slo=SLO(ttft=rng.choice([0.1, 0.25, 2.0, 6.0]))))
    return out


@pytest.fixture
def chunk_log(monkeypatch):
    """Every completed prefill chunk (request id, start, end), to prove each prompt token is
    computed exactly once."""
    log: list[tuple[int, int, int]] = []
    original = SEDFPrefill.update

    def update(self, plan, result, now):
        if result.completed:
            log.extend((c.request.request_id, c.start, c.end) for c in plan.prefills)
        return original(self, plan, result, now)

    monkeypatch.setattr(SEDFPrefill, "update", update)
    return log


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spec", ["sedf", "sedf-layer", "sedf-chunk", "dedf", "edf:batching=false"])
def test_suspension_bound_and_conservation_on_random_workloads(seed, spec, chunk_log):
    max_susp = 0.2
    specs = random_specs(seed)
    sim = Simulator(ClusterConfig(prefill_policy=f"{spec}:max_suspension={max_susp}" if ":" not in spec
                                  else f"{spec},max_suspension={max_susp}"), COST)
    result = sim.run(specs)
    assert result.unfinished == 0
    assert all(r.phase is Phase.FINISHED and r.num_output_tokens == r.max_output_tokens for r in result.requests)
    tiles: dict[int, list[tuple[int, int]]] = {}
    for rid, start, end in chunk_log:
        tiles.setdefault(rid, []).append((start, end))
    for r in result.requests:          # each prompt computed exactly once, in order
        spans = sorted(tiles[r.request_id])
        assert spans[0][0] == 0 and spans[-1][1] == r.prompt_len
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    s = sim.front[0].scheduler
    biggest = max(max(x.prompt_len for x in specs), s.token_budget)
    one_layer = COST.prefill_time([(biggest, 0)]) / COST.model.num_layers
    unit = {"sedf-chunk": COST.prefill_time([(s.chunk_size, 0)])}.get(spec, one_layer)
    assert all(d <= max_susp + unit + 1e-9 for d in s.suspensions)
    if spec != "sedf-chunk":
        assert s.num_preemptions > 0 and len(s.suspensions) == s.num_preemptions
    assert not s.parked and s.running is None and s.kv.num_free_blocks == s.kv.num_blocks


@pytest.mark.parametrize("seed", range(3))
def test_late_parked_tasks_still_finish_and_only_they_outlast_the_bound(seed, monkeypatch):
    """Adaptive prefill (``bound_late=False``) on overloaded random workloads: every request
    finishes, each prompt token is computed once, and a suspension longer than the bound (plus
    one operator) is always one whose task was late at its bound."""
    from laneserve.policies.prefill.adaptive import AdaptivePrefill
    from laneserve.policies.prefill.mechanisms.priority import LATE
    from laneserve.policies.prefill.mechanisms.sedf_tasks import PreemptiveTasks
    log, late_at_bound = [], []
    update, resume = AdaptivePrefill.update, PreemptiveTasks._resume

    def logged_update(self, plan, result, now):
        if result.completed:
            log.extend((c.request.request_id, c.start, c.end) for c in plan.prefills)
        return update(self, plan, result, now)

    def logged_resume(self, task, now, *, forced):
        due = task.suspended_at + self.max_suspension
        late_at_bound.append(self.ordering.task_key(task, due, False)[0] == LATE)
        return resume(self, task, now, forced=forced)

    monkeypatch.setattr(AdaptivePrefill, "update", logged_update)
    monkeypatch.setattr(PreemptiveTasks, "_resume", logged_resume)
    max_susp = 0.2
    specs = random_specs(seed, n=200)
    sim = Simulator(ClusterConfig(prefill_policy=f"adaptive:max_suspension={max_susp}"), COST)
    result = sim.run(specs)
    assert result.unfinished == 0
    assert all(r.phase is Phase.FINISHED for r in result.requests)
    tiles: dict[int, list[tuple[int, int]]] = {}
    for rid, start, end in log:
        tiles.setdefault(rid, []).append((start, end))
    for r in result.requests:
        spans = sorted(tiles[r.request_id])
        assert spans[0][0] == 0 and spans[-1][1] == r.prompt_len
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    s = sim.front[0].scheduler
    one_layer = COST.prefill_time([(max(max(x.prompt_len for x in specs), s.token_budget), 0)]) / COST.model.num_layers
    assert len(late_at_bound) == len(s.suspensions) > 0
    over = [late for d, late in zip(s.suspensions, late_at_bound) if d > max_susp + one_layer + 1e-9]
    assert over and all(over)            # some late tasks waited past the bound, and only late ones
    assert not s.parked and s.running is None and s.kv.num_free_blocks == s.kv.num_blocks


def test_sedf_beats_fcfs_on_the_four_class_mix():
    from laneserve.measure.metrics import summarize
    from laneserve.workloads import make_workload

    wl = make_workload("flowprefill_mix", model="Llama3-8B", n=300, rate=10.0)
    att = {}
    for pol in ("fcfs", "sedf"):
        res = Simulator(ClusterConfig(prefill_policy=pol), COST).run(wl.specs)
        att[pol] = summarize(res.requests, duration=res.duration)["attainment_ttft"]
    assert att["sedf"] > att["fcfs"] + 0.1


# ---- engine: scheduling does not change greedy tokens --------------------------------------------
class TickClock:
    """Advances a fixed tick on every reading: arrivals become due at operator boundaries
    deterministically, whatever the machine's speed."""

    def __init__(self, tick: float = 1.0) -> None:
        self.t, self.tick = 0.0, tick

    def now(self) -> float:
        self.t += self.tick
        return self.t


class _HostCopyLink:
    """A KV link between two instances of one thread: a host copy, the prefill blocks freed at once."""

    def take(self, source, req, now):
        return source.hand_off(req, lambda r: source.executor.export_kv(r.request_id, r.num_computed_tokens))

    def deliver(self, req, dest, payload, now):
        dest.offer_kv(req, payload)

    def discard(self, req, payload):
        raise AssertionError("the decode instance always accepts")


def _engine_pd_run(prefill_spec: str) -> tuple[dict[int, list[int]], object]:
    from engine_support import make_executor, prompts
    from laneserve.core.sampling import SamplingParams
    from laneserve.engine.instance import EngineInstance
    from laneserve.runtime.cluster import ClusterRuntime, Deployment

    pex, dex = make_executor("qwen3", num_blocks=256), make_executor("qwen3", num_blocks=256)
    clock = TickClock()
    psched = make("prefill", prefill_spec, pex.kv)
    dsched = make("decode", "continuous", dex.kv)
    pinst = EngineInstance(psched, pex, clock=clock, instance_id=0)
    dinst = EngineInstance(dsched, dex, clock=clock, instance_id=1)
    # the hand-off is the cluster runtime's, as in every driver; the link is LocalCluster's, minus threads
    runtime = ClusterRuntime(Deployment(prefill_policy=prefill_spec, decode_policy="continuous"), _HostCopyLink(),
                             front=[pinst], back=[dinst])
    lengths = [180, 12, 30, 150, 9, 20]
    due = [0.0, 3.0, 5.0, 6.0, 30.0, 31.0]           # in clock ticks: the short ones land mid-prefill
    ttft = [500.0, 20.0, 40.0, 800.0, 15.0, 25.0]
    reqs = []
    for i, (p, at, slo) in enumerate(zip(prompts(lengths, seed=3), due, ttft)):
        r = Request(i, at, len(p), 5, SLO(ttft=slo), prompt_token_ids=list(p))
        r.sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        pinst.submit(r, at=at)
        reqs.append(r)
    for _ in range(10_000):
        if pinst.idle and dinst.idle:
            break
        out = pinst.step()
        for r in out.prefilled if out else []:
            assert runtime.on_prefilled(r, pinst, clock.now()) is dinst
        dinst.take_kv(lambda payload: payload)
        dinst.step()
    assert all(r.phase is Phase.FINISHED for r in reqs)
    return {r.request_id: r.output_token_ids for r in reqs}, psched


def test_engine_sedf_with_operator_preemption_keeps_greedy_tokens():
    fcfs, _ = _engine_pd_run("fcfs")
    sedf, sched_ = _engine_pd_run("sedf")
    assert sched_.num_preemptions > 0 and not sched_.parked
    assert sedf == fcfs and all(len(t) == 5 for t in sedf.values())


def test_engine_laps_lanes_with_operator_preemption_keep_greedy_tokens():
    """Composition on the engine: LAPS lanes whose long chunks FlowPrefill-style preemption stops
    when a short batch is due; parked chunks resume with the same tokens as FCFS."""
    fcfs, _ = _engine_pd_run("fcfs")
    laps, sched_ = _engine_pd_run("laps-preempt:boundary=64,long_chunk=256,w_min=0,w_max=0")
    assert sched_.preemptions > 0 and sched_._parked_long is None and not sched_.dropped_plans
    assert laps == fcfs
