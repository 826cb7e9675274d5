"""Predictor refits re-key the prefill queues incrementally: the order after any sequence of
refits, time steps and membership changes equals a full re-prediction, and no single decision
re-predicts or re-files a number of requests that grows with the queue (counted, not timed)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from laneserve.core import sorted_keys
from laneserve.core.kv import KVCacheManager, blocks_for
from laneserve.core.request import Request
from laneserve.core.slo import SLO
from laneserve.costmodel import make_cost_model
from laneserve.policies import registry
from laneserve.policies.predictors import LearnedCostModel
from laneserve.policies.prefill.mechanisms.kairos_slots import linear_prefill_times
from laneserve.policies.prefill.mechanisms.priority import ORDERINGS, sedf_key
from laneserve.policies.prefill.mechanisms import sedf_queue
from laneserve.policies.prefill.mechanisms.sedf_queue import (MIGRATE_BATCH, SignedDeadlineQueue, class_range,
                                                              refit_bounds, size_class)
from laneserve.sim.executor import SimExecutor

COST = make_cost_model(model="llama-3-8b", hardware="h100")


class Quadratic:
    """A TTFT predictor that refits when told: ``c0 + n (c1 + n c2)`` with a version."""

    def __init__(self, c: tuple[float, float, float]) -> None:
        self.c, self.version = c, 0

    def refit(self, c: tuple[float, float, float]) -> None:
        self.c, self.version = c, self.version + 1

    def coefficients(self) -> tuple[float, float, float]:
        return self.c

    def __call__(self, n: float) -> float:
        c0, c1, c2 = self.c
        return c0 + n * (c1 + n * c2)


def random_coefficients(rng: random.Random) -> tuple[float, float, float]:
    scale = rng.choice((0.2, 1.0, 5.0))
    return (scale * rng.uniform(0.0, 0.02), scale * rng.uniform(0.0, 2e-4), scale * rng.choice((0.0, rng.uniform(0, 2e-9))))


def reference_order(queue: SignedDeadlineQueue, predictor: Quadratic, tokens: dict[int, int], now: float) -> list:
    return sorted(sedf_key(r, now, predictor(tokens[r.request_id])) for r in queue._reqs.values())


def check_walks(queue: SignedDeadlineQueue, reference: list, rng: random.Random) -> None:
    """``top`` is the reference's first key; a walk after any key (started or not) is the
    reference's rest, less only members of size classes wholly at or above the walk's bound."""
    top = queue.top()
    assert (top[0] if top else None) == (reference[0] if reference else None)
    if not reference:
        return
    after = rng.choice(reference) if rng.random() < 0.8 else (rng.choice((0, 1, 2)), rng.uniform(-5, 50), 0.0, -1)
    bound = rng.choice((10**9, 5000, 300, 64, 9))
    got = [r.request_id for r in queue.ordered_below(after, lambda: bound)]
    rest = [k[3] for k in reference if k > after]
    kept = set(got)
    assert [rid for rid in rest if rid in kept] == got                 # the reference's order
    lengths = {rid: queue._reqs[rid].remaining_prefill for rid in rest}
    assert all(rid in kept for rid in rest if class_range(size_class(lengths[rid]))[0] < bound)


def check_groups(queue: SignedDeadlineQueue) -> None:
    """Every member is in exactly one group or static class, and each group's class is its members'."""
    seen = 0
    for (c, tokens), group in queue._groups.items():
        assert group.cls == c and len(group.members) > 0
        for member in group.members:
            req = queue._reqs[member[2]]
            assert size_class(req.remaining_prefill) == (c if c >= 0 else -1 - c)
        seen += len(group.members)
    seen += sum(len(members) for members in queue._static_classes.values())
    assert seen == len(queue)


@pytest.mark.parametrize("migrate", [MIGRATE_BATCH, 0, 1])
@pytest.mark.parametrize("seed", range(6))
def test_refits_keep_the_order_of_a_full_reprediction(seed, migrate, monkeypatch):
    """Arrivals, departures, refits, steps forward and back; deadlines shared by several requests
    (arrivals on a 0.1 s grid) and step tokens shared by many (capped as in chunked prefill).
    With ``migrate`` 0 the older generations drain only through their due groups."""
    monkeypatch.setattr(sedf_queue, "MIGRATE_BATCH", migrate)
    check_random_run(seed)


@pytest.mark.parametrize("seed", range(3))
def test_the_order_holds_with_tiny_sorted_blocks_and_every_search_in_bulk(seed, monkeypatch):
    """The same run with blocks of at most 4 keys (the groups', heads' and checks' sorted sets
    split and merge all the time) and every decision's searches filed in bulk."""
    monkeypatch.setattr(sorted_keys, "LOAD", 2)
    monkeypatch.setattr(sedf_queue, "BULK_SEARCH", 0)
    check_random_run(seed)


def check_random_run(seed: int) -> None:
    rng = random.Random(seed)
    predictor = Quadratic(random_coefficients(rng))
    tokens: dict[int, int] = {}
    queue = SignedDeadlineQueue("sedf", predictor, lambda r: tokens[r.request_id])
    now, next_id, live = 0.0, 0, []
    for _ in range(300):
        for _ in range(rng.randint(0, 12)):                     # arrivals
            arrival = now + rng.uniform(-0.5, 0.0)
            if rng.random() < 0.2:
                arrival = round(arrival, 1)
            prompt = rng.randint(2000, 12000) if rng.random() < 0.2 else rng.randint(8, 300)
            ttft = rng.choice((0.1, 0.3, 1.0, 4.0, None))
            req = Request(next_id, arrival, prompt, 1, SLO(ttft=ttft, tpot=None))
            tokens[next_id] = prompt if rng.random() < 0.5 else min(prompt, 64)
            queue.add(req)
            live.append(next_id)
            next_id += 1
        for _ in range(rng.randint(0, 6)):                      # departures
            if live:
                queue.discard(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.25:
            predictor.refit(random_coefficients(rng))
        now += rng.choice((0.0, 0.01, 0.05, 0.3, 1.0)) if rng.random() > 0.05 else -0.2   # a step back too
        queue.advance(now)
        reference = reference_order(queue, predictor, tokens, now)
        assert [k for k, _ in queue.ordered()] == reference
        check_walks(queue, reference, rng)
        check_groups(queue)


def test_removals_during_a_walk_leave_the_rest_in_order():
    """Members removed while a walk is under way (those yielded and those ahead of it) are not
    yielded; every other member is, in the reference order."""
    rng = random.Random(7)
    predictor = Quadratic((0.01, 1e-4, 1e-9))
    queue = SignedDeadlineQueue("sedf", predictor, lambda r: min(r.prompt_len, 128))
    for i in range(3_000):
        queue.add(Request(i, round(rng.uniform(0.0, 2.0), 1), rng.randint(1, 4000), 1,
                          SLO(ttft=rng.choice((0.3, 1.0, 4.0, None)), tpot=None)))
    now = 1.5
    queue.advance(now)
    reference = [k for k, _ in queue.ordered()]
    assert reference == reference_order(queue, predictor, {r.request_id: min(r.prompt_len, 128)
                                                           for r in queue._reqs.values()}, now)
    assert {k[0] for k in reference} == {0, 1, 2}
    removed, got = set(), []
    for key, req in queue.ordered():
        got.append(key)
        if rng.random() < 0.3:
            queue.discard(req.request_id)                       # the one yielded
        if rng.random() < 0.3:
            ahead = rng.choice(reference)
            if ahead > key and ahead[3] in queue:
                queue.discard(ahead[3])                         # one not reached yet
                removed.add(ahead)
    assert got == [k for k in reference if k not in removed]


def test_size_classes_partition_the_token_counts_in_order():
    previous = -1
    for n in range(0, 20_000):
        c = size_class(n)
        lo, hi = class_range(c)
        assert lo <= n < hi and c >= previous
        previous = c


def test_refit_bounds_cover_the_change():
    rng = random.Random(1)
    for _ in range(200):
        old, new = random_coefficients(rng), random_coefficients(rng)
        band = rng.randint(0, 15)
        up, down = refit_bounds(old, new, band)
        lo, hi = (0, 0) if band == 0 else (1 << (band - 1), (1 << band) - 1)
        for n in np.linspace(lo, hi, 17).round():
            change = (new[0] + n * (new[1] + n * new[2])) - (old[0] + n * (old[1] + n * old[2]))
            assert -down <= change <= up


def spread_queue(n: int, predictor: Quadratic) -> SignedDeadlineQueue:
    """``n`` requests whose deadlines are spread over 1,000 s (few flip near any moment)."""
    rng = random.Random(n)
    queue = SignedDeadlineQueue("sedf", predictor, lambda r: r.prompt_len)
    for i in range(n):
        prompt = rng.randint(2000, 12000) if rng.random() < 0.2 else rng.randint(8, 300)
        queue.add(Request(i, 0.0, prompt, 1, SLO(ttft=rng.uniform(0.0, 1000.0), tpot=None)))
    return queue


@pytest.mark.parametrize("n", [5_000, 20_000])
def test_a_refit_does_not_repredict_the_queue_in_one_decision(n):
    """After a refit, each decision re-predicts the requests whose sign may have changed plus
    at most ``MIGRATE_BATCH``: the most any decision does must not grow with the queue (a full
    rebuild re-predicts all ``n`` at once)."""
    predictor = Quadratic((0.01, 1e-4, 0.0))
    queue = spread_queue(n, predictor)
    queue.advance(0.0)
    worst, now = 0, 0.0
    for step in range(400):
        if step % 50 == 0:
            c0, c1, _ = predictor.c
            predictor.refit((c0 * 1.3, c1 * (0.7 if step % 100 else 1.4), 0.0))
        before = queue.rekeys
        now += 0.05
        queue.advance(now)
        worst = max(worst, queue.rekeys - before)
    assert worst <= MIGRATE_BATCH + 64, worst
    assert queue.rekeys >= 5_000          # the older generations drained in the background
    assert [k for k, _ in queue.ordered()][:200] == sorted(
        sedf_key(r, now, predictor(r.prompt_len)) for r in queue._reqs.values())[:200]


def burst(spec: str, n: int, seed: int) -> tuple:
    """``spec`` with an online predictor, ``n`` requests queued at once (20% long prompts, three
    TTFT classes)."""
    sched = registry.make("prefill", spec, KVCacheManager(blocks_for(10**8, 16), 16))
    learner = LearnedCostModel()
    sched.bind_cost_model(learner)
    rng = np.random.default_rng(seed)
    for i in range(n):
        prompt = int(rng.integers(2048, 12289)) if rng.random() < 0.2 else int(rng.integers(32, 257))
        sched.add_request(Request(i, float(i) / n, prompt, 1, SLO(ttft=float(rng.choice([0.3, 1.0, 4.0])),
                                                                       tpot=None)), float(i) / n)
    return sched, learner


def run_step(sched, learner, executor, plan, now: float) -> float:
    """Charge ``plan``, feed the learner, finish what it prefilled; the time after it."""
    result = executor.execute(plan)
    now += result.duration
    learner.observe(plan, result.duration)
    for req in sched.update(plan, result, now).prefilled:
        sched.release(req.request_id)
    return now


def test_flowprefill_refit_decisions_stay_bounded():
    """S-EDF on a burst with its online predictor refitting: a decision re-predicts the requests
    whose sign the refit may have moved (in a dense burst, a share of those near their flip) and
    a bounded slice more, far from the whole queue a rebuild re-predicts."""
    worst = {}
    for n in (2_000, 8_000):
        sched, learner = burst("sedf", n, seed=0)
        now, executor, most = 1.0, SimExecutor(COST), 0
        sched.schedule(now)                     # the first decision settles the burst
        for _ in range(300):
            before = sched._queue.rekeys
            plan = sched.schedule(now)
            most = max(most, sched._queue.rekeys - before)
            now = run_step(sched, learner, executor, plan, now)
        assert learner.prefill_version >= 8
        worst[n] = most
    assert worst[2_000] < 2_000 // 8 and worst[8_000] < 8_000 // 8, worst


def flip_burst(spec: str, n: int, seed: int) -> tuple:
    """``spec`` with an online predictor (padded attention), ``n`` requests arriving within 10 ms:
    20% prompts of 2K-12K tokens, the rest 1-400, TTFT 0.3 / 1 / 4 s at random (whole classes
    reach their flip points together)."""
    sched = registry.make("prefill", spec, KVCacheManager(blocks_for(10**8, 16), 16))
    learner = LearnedCostModel("padded")
    sched.bind_cost_model(learner)
    rng = np.random.default_rng(seed)
    for i in range(n):
        prompt = int(rng.integers(2048, 12289)) if rng.random() < 0.2 else int(rng.integers(1, 401))
        t = 0.01 * i / n
        sched.add_request(Request(i, t, prompt, 1, SLO(ttft=float(rng.choice([0.3, 1.0, 4.0])), tpot=0.1)), t)
    return sched, learner


def negatives(queue: SignedDeadlineQueue) -> set[int]:
    return {k[3] for k, _ in queue.ordered() if k[0] == 2}


@pytest.mark.parametrize("spec", ["sedf", "sedf-chunk"])
def test_flip_bursts_search_groups_not_members(spec):
    """A burst whose TTFT classes turn negative together, with the predictor refitting early:
    single decisions turn thousands of requests negative, but the queue searches one split per
    group (a size class and step-token count) whose boundary may have moved and re-predicts one
    group at a time: the work of a decision is bounded by the groups, not by the members that
    flip."""
    padded = make_cost_model(model="llama-3-8b", hardware="h100", attention="padded")
    n = 4_000
    sched, learner = flip_burst(spec, n, seed=2)
    queue = sched.ordering.queue
    now, executor = 0.01, SimExecutor(padded)
    sched.schedule(now)
    most_flipped, work_then, most_work = 0, 0, 0
    before = negatives(queue)
    for _ in range(80):
        searches, rekeys, groups = queue.searches, queue.rekeys, len(queue._groups)
        plan = sched.schedule(now)
        after = negatives(queue)
        flipped = len(after - before)
        work = (queue.searches - searches, queue.rekeys - rekeys)
        assert work[0] <= groups + 1 and work[1] <= groups + 1, (work, groups)     # each group at most once
        most_work = max(most_work, work[0])
        if flipped > most_flipped:
            most_flipped, work_then = flipped, work[0]
        if plan is None:
            break
        now = run_step(sched, learner, executor, plan, now)
        before = negatives(queue)
    assert learner.prefill_version >= 5
    assert most_flipped > n // 5, most_flipped                 # a whole TTFT class in one decision
    if spec == "sedf-chunk":                                     # step tokens capped: few groups
        assert work_then < most_flipped // 2 and most_work < n // 8, (work_then, most_flipped, most_work)


class CountedPredictor:
    """A predictor whose calls are counted (its version and fit passed through)."""

    def __init__(self, predict) -> None:
        self.predict, self.calls = predict, 0

    @property
    def version(self):
        return self.predict.version

    def coefficients(self):
        return self.predict.coefficients()

    def __call__(self, n: float) -> float:
        self.calls += 1
        return self.predict(n)


def test_flip_burst_refits_ask_the_predictor_once_per_group():
    """sedf-chunk in the flip burst: after the early refits single decisions re-predict whole
    TTFT classes near their flip point, asking the predictor at most once per group (size class
    and step-token count) they hold — once per step-token count when many go at once — not once
    per request."""
    padded = make_cost_model(model="llama-3-8b", hardware="h100", attention="padded")
    n = 8_000
    sched, learner = flip_burst("sedf-chunk", n, seed=2)
    queue = sched.ordering.queue
    queue.predict = counted = CountedPredictor(queue.predict)
    now, executor, decisions = 0.01, SimExecutor(padded), []
    sched.schedule(now)
    for _ in range(60):
        calls, rekeys, groups = counted.calls, queue.rekeys, len(queue._groups)
        plan = sched.schedule(now)
        decisions.append((queue.rekeys - rekeys, counted.calls - calls, groups))
        now = run_step(sched, learner, executor, plan, now)
    assert learner.prefill_version >= 5
    rekeys, calls, groups = max(decisions)
    assert rekeys > groups // 4 and groups < n // 8, (rekeys, groups)      # whole classes re-predicted
    assert calls < rekeys, (calls, rekeys)       # in bulk: once per step-token count (the classes share 2048)
    for rekeys, calls, groups in decisions:
        assert calls <= rekeys <= groups, (rekeys, calls, groups)


@pytest.mark.parametrize("attention", ["ragged", "padded"])
def test_linear_prefill_times_equal_the_models_own(attention):
    model = LearnedCostModel(attention)
    rng = np.random.default_rng(3)
    for _ in range(5):
        model._prefill.coef = rng.random(4) * np.array([1e-4, 1e-9, 1e-3, 1e-2]) * (rng.random(4) > 0.2)
        plen = rng.integers(1, 130_000, 3000).astype(float)
        new = np.minimum(plen, rng.integers(0, 130_000, 3000)).astype(float)
        new[::5] = 0.0
        got = linear_prefill_times(model, new, plen)
        assert got is not None
        want = [model.prefill_time([(int(a), int(b) - int(a))]) for a, b in zip(new, plen)]
        assert got.tolist() == want


def test_linear_prefill_times_refuses_other_models():
    assert linear_prefill_times(COST, np.array([10.0]), np.array([10.0])) is None


@pytest.mark.parametrize("spec", ["kairos", "kairos-costest"])
def test_kairos_refit_recomputes_no_duration_one_by_one(spec):
    """A refit of the learned model re-times every queued request at once (vectorised), exactly as
    one by one: after each decision the column equals the model's per-request times, and the
    requests re-read one at a time are only those the decision's events touched."""
    sched, learner = burst(spec, 3000, seed=1)
    now, executor = 1.0, SimExecutor(COST)
    sched.schedule(now)
    for _ in range(150):
        touched = len(sched._dirty)
        before = sched.recomputed
        plan = sched.schedule(now)
        assert sched.recomputed - before <= max(touched, 0) + 64
        slots = sched._slots
        live = np.flatnonzero(slots.alive[:slots.n])
        sample = live[:: max(1, len(live) // 50)]
        assert [slots.dur[i] for i in sample] == [
            learner.prefill_time([(int(slots.rem[i]), int(slots.plen[i]) - int(slots.rem[i]))]) for i in sample]
        now = run_step(sched, learner, executor, plan, now)
    assert learner.prefill_version >= 7


def test_dedf_class_flips_search_each_group_once_in_the_reference_order():
    """D-EDF with 20K queued in three TTFT classes: when a class's deadlines pass together (one
    decision flipping thousands), the decision searches at most one split per group (size class)
    and the order is the reference's."""
    queue = SignedDeadlineQueue("dedf", lambda n: 0.0, lambda r: r.prompt_len)
    rng = random.Random(4)
    for i in range(20_000):
        queue.add(Request(i, 0.01 * rng.random(), rng.randint(1, 400), 1,
                          SLO(ttft=rng.choice((0.3, 1.0, 4.0)), tpot=None)))
    queue.advance(0.1)
    assert len(queue._groups) < 50
    for now in (0.305, 0.32, 1.02, 4.1):
        searches, negative = queue.searches, sum(k[0] == 2 for k, _ in queue.ordered())
        queue.advance(now)
        flipped = sum(k[0] == 2 for k, _ in queue.ordered()) - negative
        assert flipped > 1_000 and queue.searches - searches <= len(queue._groups), (now, flipped)
        assert [k for k, _ in queue.ordered()] == sorted(
            ORDERINGS["dedf"](r, now, 0.0) for r in queue._reqs.values())


@pytest.mark.parametrize("spec", ["sedf-chunk", "sedf", "adaptive"])
def test_kv_full_decisions_ask_a_bounded_number_of_admissions(spec):
    """With KV memory full, a decision does not ask every waiting request whether it fits: after
    a prompt is refused, the not-started ones at least as long are skipped by size class (the
    equivalence with asking each is tests/test_policy_incremental.py's)."""
    kv = KVCacheManager(blocks_for(60_000, 16), 16)
    sched = registry.make("prefill", spec, kv)
    sched.bind_cost_model(LearnedCostModel("padded"))
    rng = np.random.default_rng(5)
    for i in range(4_000):
        prompt = int(rng.integers(2048, 12289)) if rng.random() < 0.2 else int(rng.integers(1, 401))
        t = 0.01 * i / 4_000
        sched.add_request(Request(i, t, prompt, 1, SLO(ttft=float(rng.choice([0.3, 1.0, 4.0])), tpot=0.1)), t)
    kv.allocate(-1, 60_000)                   # another holder fills the memory
    asked = [0]
    admit = sched.admit

    def counted(req, now):
        asked[0] += 1
        return admit(req, now)

    sched.admit = counted
    for now in (0.01, 0.2, 0.35, 1.1, 5.0):
        asked[0] = 0
        assert sched.schedule(now) is None    # nothing fits
        assert 0 < asked[0] <= 100, (now, asked[0])     # asking each would be 4,000
