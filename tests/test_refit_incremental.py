"""Predictor refits re-key the prefill queues incrementally: the order after any sequence of
refits, time steps and membership changes equals a full re-prediction, and no single decision
re-predicts a number of requests that grows with the queue (counted, not timed)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from laneserve.core.kv import KVCacheManager, blocks_for
from laneserve.core.request import Request
from laneserve.core.slo import SLO
from laneserve.costmodel import make_cost_model
from laneserve.policies import registry
from laneserve.policies.predictors import LearnedCostModel
from laneserve.policies.prefill.mechanisms.kairos_slots import linear_prefill_times
from laneserve.policies.prefill.mechanisms.priority import ORDERINGS, sedf_key
from laneserve.policies.prefill.mechanisms import sedf_queue
from laneserve.policies.prefill.mechanisms.sedf_queue import (BULK_FLIP, MIGRATE_BATCH, SignedDeadlineQueue,
                                                              class_range, refit_bounds, size_class)
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


@pytest.mark.parametrize("bulk_flip,vector", [(BULK_FLIP, sedf_queue._VECTOR), (0, sedf_queue._VECTOR), (0, 0)])
@pytest.mark.parametrize("seed", range(6))
def test_refits_keep_the_order_of_a_full_reprediction(seed, bulk_flip, vector, monkeypatch):
    """With ``bulk_flip`` 0 nearly every flip and due migration goes through the bulk passes, with
    ``vector`` 0 every flip scan too runs on arrays."""
    monkeypatch.setattr(sedf_queue, "BULK_FLIP", bulk_flip)
    monkeypatch.setattr(sedf_queue, "_VECTOR", vector)
    rng = random.Random(seed)
    predictor = Quadratic(random_coefficients(rng))
    tokens: dict[int, int] = {}
    queue = SignedDeadlineQueue("sedf", predictor, lambda r: tokens[r.request_id])
    now, next_id, live = 0.0, 0, []
    for _ in range(300):
        for _ in range(rng.randint(0, 12)):                     # arrivals
            arrival = now + rng.uniform(-0.5, 0.0)
            prompt = rng.randint(2000, 12000) if rng.random() < 0.2 else rng.randint(8, 300)
            ttft = rng.choice((0.1, 0.3, 1.0, 4.0, None))
            req = Request(next_id, arrival, prompt, 1, SLO(ttft=ttft, tpot=None))
            tokens[next_id] = prompt
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
        assert [k for k, _ in queue.ordered()] == reference_order(queue, predictor, tokens, now)
        for c, members in queue._classes.items():               # the size classes agree with the order
            assert all(size_class(queue._reqs[k[3]].remaining_prefill) == (c if c >= 0 else -1 - c) for k in members)
        assert sum(len(m) for m in queue._classes.values()) == len(queue)


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


@pytest.mark.parametrize("spec", ["sedf", "adaptive"])
def test_flip_bursts_move_a_bounded_number_of_keys_one_by_one(spec):
    """A burst whose TTFT classes turn negative together, with the predictor refitting early:
    decisions re-predict thousands of requests at once, but the keys moved one at a time per
    decision stay within the one-by-one thresholds (the rest go through the bulk passes)."""
    padded = make_cost_model(model="llama-3-8b", hardware="h100", attention="padded")
    for n in (2_000, 8_000):
        sched, learner = flip_burst(spec, n, seed=2)
        queue = sched.ordering.queue
        now, executor, most_moves, most_rekeys = 0.01, SimExecutor(padded), 0, 0
        sched.schedule(now)
        for _ in range(120):
            moves, rekeys = queue.moves, queue.rekeys
            plan = sched.schedule(now)
            most_moves = max(most_moves, queue.moves - moves)
            most_rekeys = max(most_rekeys, queue.rekeys - rekeys)
            if plan is None:
                break
            now = run_step(sched, learner, executor, plan, now)
        assert most_rekeys > n // 8, (n, most_rekeys)              # the burst re-keys in bulk
        assert most_moves <= 2 * (BULK_FLIP + n // 64) + MIGRATE_BATCH, (n, most_moves)


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


def test_flip_burst_refits_ask_the_predictor_once_per_step_token_count():
    """sedf-chunk in the flip burst: after the early refits single decisions re-predict thousands
    of queued requests (a whole TTFT class near its flip point), but ask the predictor at most once
    per distinct step-token count of the queue, beyond the members handled one at a time."""
    padded = make_cost_model(model="llama-3-8b", hardware="h100", attention="padded")
    n = 8_000
    sched, learner = flip_burst("sedf-chunk", n, seed=2)
    queue = sched.ordering.queue
    queue.predict = counted = CountedPredictor(queue.predict)
    now, executor, decisions = 0.01, SimExecutor(padded), []
    sched.schedule(now)
    for _ in range(60):
        calls, rekeys, distinct, size = counted.calls, queue.rekeys, len(set(queue._tokens.values())), len(queue)
        plan = sched.schedule(now)
        decisions.append((queue.rekeys - rekeys, counted.calls - calls, distinct, size))
        now = run_step(sched, learner, executor, plan, now)
    assert learner.prefill_version >= 5
    rekeys, calls, distinct, _ = max(decisions)
    assert rekeys > n // 4 and distinct < n // 16, (rekeys, distinct)          # whole classes re-predicted
    for rekeys, calls, distinct, size in decisions:
        assert calls <= distinct + BULK_FLIP + size // 64 + MIGRATE_BATCH, (rekeys, calls, distinct)


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


def test_dedf_class_flips_go_in_bulk_in_the_reference_order():
    """D-EDF with 20K queued in three TTFT classes: when a class's deadlines pass together (one
    decision flipping thousands), no key moves one at a time and the order is the reference's."""
    queue = SignedDeadlineQueue("dedf", lambda n: 0.0, lambda r: r.prompt_len)
    rng = random.Random(4)
    for i in range(20_000):
        queue.add(Request(i, 0.01 * rng.random(), rng.randint(1, 400), 1,
                          SLO(ttft=rng.choice((0.3, 1.0, 4.0)), tpot=None)))
    queue.advance(0.1)
    for now in (0.305, 0.32, 1.02, 4.1):
        moves, negative = queue.moves, sum(k[0] == 2 for k, _ in queue.ordered())
        queue.advance(now)
        flipped = sum(k[0] == 2 for k, _ in queue.ordered()) - negative
        assert flipped > 1_000 and queue.moves == moves, (now, flipped)
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
