"""Kairos slack-guided decode (§3.2, Algorithm 3) and the token pacing buffer: slack, selection
order and the throughput rule, the everyone-decodes fallback, the online LUT, no starvation and
token conservation in the simulator, pacing bounds, and greedy tokens on the engine."""

import random
from dataclasses import dataclass

import pytest

from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import StepResult
from laneserve.core.request import Phase, Request, RequestSpec
from laneserve.core.slo import SLO
from laneserve.costmodel import StepTimeLUT, make_cost_model
from laneserve.policies import registry
from laneserve.policies.decode.kairos import Held, KairosDecode, geometric_edges
from laneserve.policies.decode.mechanisms.pacing import TokenPacer
from laneserve.sim import ClusterConfig, Simulator


@dataclass
class LinearLUT:
    """step(b, L) = base + per_token * b * L (a padded kernel), with a record of observations."""

    base: float = 0.010
    per_token: float = 1e-7

    def __post_init__(self):
        self.observed = []

    def lookup(self, batch, length):
        return self.base + self.per_token * batch * length

    def observe(self, batch, length, seconds):
        self.observed.append((batch, length, seconds))


def decoding(rid, prompt, *, first=0.0, out=1, tpot=0.05):
    req = Request(rid, 0.0, prompt, 1000, SLO(ttft=10.0, tpot=tpot))
    req.times.first_token = req.times.last_token = first
    req.num_output_tokens = out
    req.num_computed_tokens = prompt + out - 1
    req.phase = Phase.DECODING
    return req


def kairos(lut=None, **opts):
    """Algorithm 3's mechanics, without the do-no-harm guard (tested on its own below)."""
    opts.setdefault("guard", False)
    return KairosDecode(KVCacheManager(4096, 16), lut=lut or LinearLUT(), **opts)


def test_slack_is_the_tpot_budget_left_minus_the_solo_step():
    sched = kairos()
    req = decoding(0, 1000, first=1.0, out=3)          # next token (index 3) due at 1.0 + 3 * 0.05
    solo = 0.010 + 1e-7 * (1000 + 3)
    assert sched.slack(req, now=1.1) == pytest.approx(1.15 - 1.1 - solo)
    assert sched.slack(req, now=1.1, batch_size=4) == pytest.approx(1.15 - 1.1 - 0.010 - 4e-7 * 1003)
    assert kairos().slack(Request(1, 0.0, 10, 5, SLO()), now=3.0) == float("inf")
    assert kairos(tpot_slo=0.1).slack(decoding(2, 10, tpot=None), now=0.0) == pytest.approx(0.1 - 0.010 - 1.1e-6)


def test_scan_by_ascending_length_keeps_shorts_and_delays_the_straggler():
    sched = kairos(LinearLUT(0.010, 1e-7))
    long = decoding(0, 100_000, first=0.0, out=1)
    shorts = [decoding(i, n, first=0.0, out=1) for i, n in ((1, 3000), (2, 1000), (3, 2000))]
    # every slack is about 50 ms - 10 ms - len/1e7: the straggler's 40 ms is s_min
    chosen = sched.select([long, *shorts], now=0.0)
    assert [r.request_id for r in chosen] == [2, 3, 1]          # ascending length
    assert long.policy_state.of(Held).steps == 1 and sched.stats.partial_steps == 1
    # the throughput rule alone: (|B|+1)/t_step must beat |B|/t_cur
    t3 = 0.010 + 1e-7 * 3 * 3001
    t4 = 0.010 + 1e-7 * 4 * 100_001
    assert 4 / t4 < 3 / t3
    no_rule = kairos(LinearLUT(0.010, 1e-9), throughput_rule=False)
    assert len(no_rule.select([long, *shorts], now=0.0)) == 4


def test_slack_test_caps_the_batch():
    sched = kairos(LinearLUT(0.010, 1e-6))
    tight = decoding(0, 1000, first=0.0, out=1)            # slack 0.05 - 0.012 - now
    others = [decoding(i, 3000, first=-10.0, out=1000) for i in range(1, 4)]   # far ahead of schedule
    chosen = sched.select([tight, *others], now=0.02)      # s_min = 18.999 ms (the tight one)
    # contexts 1001 and 4000: LUT[1, 1001] = 11 ms and LUT[2, 4000] = 18 ms fit, LUT[3, 4000] does not
    assert [r.request_id for r in chosen] == [0, 1]


def test_nothing_fits_then_everyone_decodes():
    sched = kairos(LinearLUT(0.010, 1e-7))
    reqs = [decoding(i, 1000 * (i + 1), first=0.0, out=1) for i in range(3)]
    chosen = sched.select(reqs, now=0.035)                  # s_min < 5 ms < every step time
    assert chosen == reqs and sched.stats.fallback_steps == 1
    assert all(r.policy_state.of(Held).steps == 0 for r in reqs)


def test_late_requests_bind_only_when_asked():
    late = decoding(0, 50_000, first=-5.0, out=2)           # seconds behind schedule
    on_time = [decoding(i, 1000, first=0.0, out=1) for i in (1, 2)]
    literal = kairos(late_binds=True)
    assert len(literal.select([late, *on_time], now=0.0)) == 3 and literal.stats.fallback_steps == 1
    refined = kairos(late_binds=False)
    assert [r.request_id for r in refined.select([late, *on_time], now=0.0)] == [1, 2]


def test_starvation_bound_forces_everyone():
    sched = kairos(LinearLUT(0.010, 1e-7), max_delay_steps=3)     # no TPOT targets: infinite slack
    long = Request(0, 0.0, 200_000, 50, SLO())
    shorts = [Request(i, 0.0, 100, 50, SLO()) for i in (1, 2, 3)]
    for r in (long, *shorts):
        r.times.first_token, r.num_output_tokens = 0.0, 1
    sizes = [len(sched.select([long, *shorts], now=0.0)) for _ in range(6)]
    assert sizes == [3, 3, 4, 3, 3, 4] and sched.stats.forced_steps == 2


def test_the_guard_decodes_everyone_when_everyone_fits_the_smallest_slack():
    """Ample slack: Algorithm 3's throughput rule leaves the long request out of the step (adding
    it lowers tokens per second), so it waits; the guard decodes everyone, since the
    everyone-decodes step fits every request's TPOT budget. Tight slack: both select the same."""
    def requests(first):
        out = [decoding(0, 60_000, first=first, out=2)] + [decoding(i, 200, first=first, out=2) for i in (1, 2, 3)]
        return out
    lut = LinearLUT(0.010, 1e-7)
    literal, guarded = kairos(lut), kairos(lut, guard=True)
    assert [r.request_id for r in literal.select(requests(0.0), now=0.0)] == [1, 2, 3]
    assert [r.request_id for r in guarded.select(requests(0.0), now=0.0)] == [0, 1, 2, 3]
    assert guarded.stats.guard_steps == 1 and literal.stats.guard_steps == 0
    # one token due very soon: the everyone-decodes step does not fit, Algorithm 3 decides
    tight = requests(-0.0995)
    assert not guarded.everyone_fits(tight, now=0.0)
    assert ([r.request_id for r in guarded.select(tight, now=0.0)]
            == [r.request_id for r in kairos(lut).select(requests(-0.0995), now=0.0)])
    assert registry.make("decode", "kairos-literal", KVCacheManager(4096, 16)).guard is False


def test_lut_running_mean_update_after_pure_decode_steps():
    lut = StepTimeLUT(batch_edges=(1, 2, 4), length_edges=(1024, 2048, 4096))
    lut.set(2, 2048, 0.020)                                 # profiled prior, count 1
    sched = KairosDecode(KVCacheManager(4096, 16), lut=lut, length_key="max")
    for i, prompt in enumerate((1500, 1900)):
        req = Request(i, 0.0, prompt, 100, SLO(tpot=0.05))
        sched.reserve(req)
        sched.add_request(req, 0.0)
        req.num_computed_tokens = prompt
        req.record_token(0.0)
    for seconds in (0.030, 0.040):
        plan = sched.schedule(0.0)
        assert len(plan.decodes) == 2
        sched.update(plan, StepResult(duration=seconds), 0.1)
    assert lut.counts[1, 1] == 3 and lut.means[1, 1] == pytest.approx((0.020 + 0.030 + 0.040) / 3)
    assert sched.stats.lut_updates == 2
    assert [r.context_len for r in plan.decodes] == [1503, 1903]
    assert sched.batch_length(plan.decodes) == 1903
    sched.length_key = "mean"
    assert sched.batch_length(plan.decodes) == 1703


def test_length_key_follows_the_attention_kernel():
    k = registry.make("decode", "kairos", KVCacheManager(64, 16))
    assert (k.length_key, k.late_binds) == ("max", False)
    k = registry.make("decode", "kairos:attention=ragged", KVCacheManager(64, 16))
    assert (k.length_key, k.late_binds) == ("mean", True)
    assert geometric_edges(16, 64) == (16, 23, 32, 45, 64)


def _random_specs(seed, n=60):
    rng = random.Random(seed)
    specs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(4.0)
        prompt = rng.choice([rng.randint(50, 2000)] * 9 + [rng.randint(20_000, 60_000)])
        specs.append(RequestSpec(i, t, prompt, rng.randint(1, 200), SLO(ttft=8.0, tpot=0.05)))
    return specs


@pytest.mark.parametrize("attention,spec,seed", [("padded", "kairos", 0), ("padded", "kairos-literal", 1),
                                                 ("ragged", "kairos:guard=false", 2), ("padded", "kairos-paced", 3)])
def test_every_request_finishes_and_tokens_are_conserved(attention, spec, seed):
    cost = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100", attention=attention)
    specs = _random_specs(seed)
    # a small decode memory forces preemption (swap and recompute) alongside delays
    cfg = ClusterConfig(num_prefill=2, num_decode=1, decode_policy=spec, decode_kv_tokens=120_000,
                        host_kv_tokens=60_000, decode_opts={"cost_model": cost})
    sim = Simulator(cfg, cost)
    res = sim.run(specs)
    assert res.unfinished == 0
    by_id = {r.request_id: r for r in res.requests}
    for s in specs:
        r = by_id[s.request_id]
        assert r.phase is Phase.FINISHED and r.num_output_tokens == s.output_len
    sched = sim.back[0].scheduler
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.requests
    assert sched.stats.steps > 0


@pytest.mark.parametrize("spec", ["kairos", "adaptive"])
def test_on_a_ragged_kernel_guarded_selection_is_continuous_batching(spec):
    """Do no harm: with a ragged kernel Kairos' selection cannot pay, so the registered kairos
    and adaptive decode decide exactly as continuous batching (and say their batch is stable);
    with the guard off, selection runs and the outcome differs on the same workload."""
    cost = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100", attention="ragged")
    specs = _random_specs(5, n=80)

    def run(decode):
        cfg = ClusterConfig(num_prefill=2, num_decode=1, decode_policy=decode, decode_kv_tokens=200_000,
                            host_kv_tokens=100_000)
        sim = Simulator(cfg, cost)
        res = sim.run(specs)
        return {r.request_id: (r.times.first_token, r.times.finished) for r in res.requests}, sim.back[0].scheduler

    base, _ = run("continuous")
    guarded, sched = run(spec)
    assert sched.stable_decode_batch
    assert guarded == base
    literal, sched = run("kairos-literal")
    assert not sched.stable_decode_batch and sched.stats.partial_steps > 0
    assert literal != base


def test_pacing_never_early_never_later_than_schedule_or_production():
    cost = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100", attention="padded")
    specs = _random_specs(7, n=40)

    def run(pace):
        cfg = ClusterConfig(num_prefill=2, num_decode=1, decode_policy=f"kairos:pace={pace}",
                            decode_opts={"cost_model": cost}, record_token_times=True)
        sim = Simulator(cfg, cost)
        return {r.request_id: r for r in sim.run(specs).requests}, sim.back[0].scheduler

    produced, _ = run(False)
    paced, sched = run(True)
    held = 0
    for rid, p in produced.items():
        q = paced[rid]
        assert q.times.first_token == p.times.first_token
        first, tpot = p.times.first_token, p.slo.tpot
        for k, (made, out) in enumerate(zip(p.times.token_times, q.times.token_times)):
            assert out >= made                                       # never before it exists
            assert out == pytest.approx(max(made, first + k * tpot))  # never past production/schedule
            held += out > made
        gaps = [b - a for a, b in zip(q.times.token_times, q.times.token_times[1:])]
        assert all(g >= 0 for g in gaps)
        n = p.num_output_tokens
        if n > 1:   # delivered mean TPOT = max(produced TPOT, target): attainment unchanged
            def mean(r, n=n):
                return (r.times.last_token - r.times.first_token) / (n - 1)
            assert mean(q) == pytest.approx(max(mean(p), tpot))
    assert held == sched.pacer.held_tokens > 0


def test_pacer_unit():
    pacer = TokenPacer(enabled=True, tpot=0.1)
    req = Request(0, 0.0, 10, 5, SLO())
    req.record_token(1.0)
    assert pacer.release_time(req, 1.02) == pytest.approx(1.1)
    assert pacer.release_time(req, 1.3) == 1.3
    assert TokenPacer().release_time(req, 1.02) == 1.02
    with pytest.raises(ValueError):
        TokenPacer(tpot=0.0)


def test_engine_kairos_decode_matches_continuous_batching_greedy_tokens():
    from engine_support import hf_greedy, prompts, tiny_checkpoint
    from laneserve.cluster import LocalCluster
    from laneserve.core import SamplingParams
    from laneserve.engine import EngineConfig

    path = tiny_checkpoint("llama")
    ps = prompts([12, 90, 5, 60], seed=4)
    greedy = dict(temperature=0, ignore_eos=True)
    reqs = [Request(i, 0.005 * i, len(p), 6, SLO(tpot=0.02), prompt_token_ids=list(p),
                    sampling=SamplingParams(max_tokens=6, **greedy)) for i, p in enumerate(ps)]
    cluster = LocalCluster(path, num_prefill=1, num_decode=1, decode_policy="kairos",
                           config=EngineConfig(num_threads=1), kv_tokens=4096)
    done = cluster.run(reqs, timeout=60)
    assert sorted(r.request_id for r in done) == list(range(len(ps)))
    for r in done:
        assert r.output_token_ids == hf_greedy("llama", ps[r.request_id], 6)
    dec = cluster.decode[0].scheduler
    assert isinstance(dec, KairosDecode) and dec.stats.steps > 0
    assert dec.kv.num_free_blocks == dec.kv.num_blocks


# ---- the lookup-sparing s_min decides as Algorithm 3 written plainly -------------------------
def reference_select(pol: KairosDecode, active, now):
    """Algorithm 3 as written: every request's slack looked up, then the scan (no delay bookkeeping)."""
    reserve_batch = len(active) if pol.slack_reserve == "batch" else 1
    slacks = [pol.slack(r, now, reserve_batch) for r in active]
    s_min = min(slacks)
    if s_min < 0 and not pol.late_binds:
        s_min = min((s for s in slacks if s >= 0), default=s_min)
    batch, t_cur, kv_sum = [], 0.0, 0
    for req in sorted(active, key=lambda r: (r.context_len, r.request_id)):
        n = len(batch) + 1
        t_step = pol.lut.lookup(n, (kv_sum + req.context_len) / n if pol.length_key == "mean" else req.context_len)
        if t_step <= s_min and (not batch or not pol.throughput_rule or n / t_step > len(batch) / t_cur):
            batch.append(req)
            t_cur = t_step
            kv_sum += req.context_len
    return batch or list(active)


@pytest.mark.parametrize("seed", range(6))
def test_select_matches_plain_algorithm_3_on_random_states(seed):
    rng = random.Random(seed)
    lut = make_cost_model("analytic", model="llama-3-8b", hardware="h100", attention="padded")
    kinds = set()
    for trial in range(60):
        pol = KairosDecode(KVCacheManager(0), cost_model=lut, tpot_slo=rng.choice((None, 0.08)),
                           late_binds=rng.choice((True, False)), slack_reserve=rng.choice(("single", "batch")),
                           length_key=rng.choice(("max", "mean")), max_delay_steps=10_000, guard=False)
        now = 100.0
        active = []
        for rid in range(rng.randint(1, 40)):
            out = rng.randint(1, 200)
            # first token long ago (late), just now (on time), or in between
            first = now - out * rng.choice((0.02, 0.05, 0.08)) + rng.uniform(-0.5, 0.5)
            req = decoding(rid, rng.randint(10, 20_000), first=first, out=out,
                           tpot=rng.choice((0.02, 0.05, 0.2, None)))
            active.append(req)
        want = [r.request_id for r in reference_select(pol, active, now)]
        assert [r.request_id for r in pol.select(active, now)] == want, trial
        kinds.add(len(want) < len(active))
    assert kinds == {True, False}          # partial steps and everyone-decodes steps both drawn
