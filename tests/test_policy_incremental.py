"""The incremental policies decide exactly as their straightforward references (issue 12, item 1).

Each optimised policy runs in lockstep beside its reference on the same random workload (separate
request objects, same cost model): every ``schedule`` plan, every ``should_preempt`` answer and
every outcome must match, through operator-boundary preemptions, aborts of waiting and parked
requests, KV memory too small for everyone, and the online TTFT predictor's refits (no cost model
bound) as well as a bound one.
"""

from __future__ import annotations

import random
from itertools import accumulate

import pytest

from laneserve.core import sorted_keys
from laneserve.core.kv import KVCacheManager, blocks_for
from laneserve.core.sorted_keys import SortedKeys
from laneserve.core.plan import StepResult
from laneserve.core.request import Request
from laneserve.core.slo import SLO
from laneserve.costmodel import make_cost_model
from laneserve.core.request import Phase
from laneserve.policies.decode.mechanisms.quadtree import KVLengthQuadTree
from laneserve.policies.routing_laps import LapsPoolRouter, _Stats
from laneserve.policies import registry
from laneserve.policies.prefill.adaptive import AdaptivePrefill
from laneserve.policies.prefill.sedf import SEDFPrefill
from laneserve.policies.prefill.kairos import GuardedKairosPrefill, KairosPrefill
from laneserve.policies.prefill.laps import LapsPrefill
from laneserve.policies.prefill.fcfs import FCFSPrefill
from policy_references import (AdaptivePrefillReference, FCFSPrefillReference, SEDFPrefillReference, KairosPrefillReference,
                                                LapsPrefillReference)
from laneserve.sim.executor import SimExecutor

COST = make_cost_model(model="llama-3-8b", hardware="h100")


def random_requests(rng: random.Random, n: int) -> list[tuple]:
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rng.choice((5.0, 40.0, 400.0)))
        prompt = rng.randint(2000, 9000) if rng.random() < 0.2 else rng.randint(8, 300)
        ttft = rng.choice((0.1, 0.4, 1.0, 4.0, None))
        out.append((i, t, prompt, rng.randint(1, 4), ttft))
    return out


def make_request(spec: tuple) -> Request:
    rid, t, prompt, output, ttft = spec
    return Request(rid, t, prompt, output, SLO(ttft=ttft, tpot=None))


def plan_sig(plan) -> tuple | None:
    if plan is None:
        return None
    return (plan.label, plan.preemptible, plan.ops_done,
            tuple((c.request.request_id, c.start, c.num_new_tokens) for c in plan.prefills))


def lockstep(make, seed: int, *, n: int = 160, kv_tokens: int = 60_000, bind: bool = True) -> int:
    """Run ``make(reference)`` twice side by side; returns the number of steps compared."""
    rng = random.Random(seed)
    specs = random_requests(rng, n)
    pair = [make(False), make(True)]
    for s in pair:
        s.kv = KVCacheManager(blocks_for(kv_tokens, 16), 16)
        if bind and hasattr(s, "bind_cost_model"):
            s.bind_cost_model(COST)
    reqs = [{sp[0]: make_request(sp) for sp in specs} for _ in pair]
    executor = SimExecutor(COST)
    now, nxt, steps = 0.0, 0, 0

    def arrive(i: int, t: float) -> None:
        for s, rs in zip(pair, reqs):
            s.add_request(rs[specs[i][0]], t)

    while nxt < n or any(s.has_work for s in pair):
        plans = [s.schedule(now) for s in pair]
        assert plan_sig(plans[0]) == plan_sig(plans[1]), (seed, steps, now)
        steps += 1
        if plans[0] is None:
            if nxt >= n:
                break
            now = max(now, specs[nxt][1])
            arrive(nxt, now)
            nxt += 1
            continue
        results = [executor.execute(p) for p in plans]
        end, stop_at = now + results[0].duration, None
        running = {c.request.request_id for c in plans[0].prefills}
        while nxt < n and specs[nxt][1] <= end:
            t = specs[nxt][1]
            arrive(nxt, t)
            nxt += 1
            if plans[0].preemptible and stop_at is None:
                answers = [s.should_preempt(p, t) for s, p in zip(pair, plans)]
                assert answers[0] == answers[1], (seed, steps, t)
                if answers[0] and rng.random() < 0.8:
                    cum = list(accumulate(plans[0].op_times[plans[0].ops_done:]))
                    for k in SimExecutor.boundaries(plans[0]):
                        if now + cum[k - plans[0].ops_done - 1] >= t:
                            stop_at, end = k, now + cum[k - plans[0].ops_done - 1]
                            break
            if rng.random() < 0.05:                 # abort a request that is not running
                idle = sorted(set(pair[0].requests) - running)
                if idle:
                    victim = rng.choice(idle)
                    for s in pair:
                        s.abort(victim, t)
        now = end
        outcomes = []
        for s, p, r in zip(pair, plans, results):
            if stop_at is not None:
                r = StepResult(duration=r.duration, completed=False)
                p.ops_done = stop_at
            outcomes.append(s.update(p, r, now))
        assert [r.request_id for r in outcomes[0].prefilled] == [r.request_id for r in outcomes[1].prefilled]
        for s, o in zip(pair, outcomes):
            for r in o.prefilled:
                s.release(r.request_id)
        assert pair[0].queued_tokens == pair[1].queued_tokens == pending_tokens(pair[0])
    return steps


FLOWPREFILL_VARIANTS = [{}, {"ordering": "dedf"}, {"ordering": "edf"}, {"ordering": "fcfs"},
                        {"preemption": "chunk", "chunk": 1024}, {"preemption": "layer"},
                        {"batching": False}, {"token_budget": 2048, "max_batch_size": 4},
                        {"max_suspension": 0.2}]


@pytest.mark.parametrize("opts", FLOWPREFILL_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "sedf")
@pytest.mark.parametrize("bind", [True, False], ids=["bound-predictor", "online-predictor"])
def test_flowprefill_matches_reference(opts, bind):
    def make(reference: bool):
        cls = SEDFPrefillReference if reference else SEDFPrefill
        return cls(KVCacheManager(1, 16), **opts)
    for seed in range(6):
        assert lockstep(make, seed, bind=bind) > 20


def test_flowprefill_matches_reference_with_tiny_blocks(monkeypatch):
    """Blocks of at most 8 keys: the queue's sorted sets split and merge blocks all the time."""
    monkeypatch.setattr(sorted_keys, "LOAD", 4)

    def make(reference: bool):
        return (SEDFPrefillReference if reference else SEDFPrefill)(KVCacheManager(1, 16))
    for seed in range(3):
        assert lockstep(make, seed, n=300, bind=seed != 1) > 20


@pytest.mark.parametrize("load", [2, 4, 512])
def test_sorted_keys_matches_a_sorted_list(monkeypatch, load):
    """Random inserts, deletes (some during walks), membership and walks from a key agree with
    a plain sorted list."""
    monkeypatch.setattr(sorted_keys, "LOAD", load)
    rng = random.Random(load)
    ref = sorted({(rng.randint(0, 2), rng.random()) for _ in range(50)})
    keys = SortedKeys(ref)
    for step in range(3000):
        op = rng.random()
        if op < 0.45:
            k = (rng.randint(0, 2), rng.random())
            keys.add(k)
            ref.append(k)
            ref.sort()
        elif op < 0.85 and ref:
            k = ref.pop(rng.randrange(len(ref)))
            keys.remove(k)
            assert k not in keys
        elif ref:
            after = rng.choice([None, (1, 0.5), ref[rng.randrange(len(ref))]])
            expect = [k for k in ref if after is None or k > after]
            seen = []
            for k in keys.walk(after):          # delete some keys ahead of and at the walk
                seen.append(k)
                if rng.random() < 0.3:
                    victim = rng.choice(ref)
                    ref.remove(victim)
                    keys.remove(victim)
                    if victim in expect[len(seen):]:
                        expect.remove(victim)
            assert seen == expect
        assert len(keys) == len(ref) and keys.first() == (ref[0] if ref else None)
        if ref:
            assert ref[rng.randrange(len(ref))] in keys
    assert list(keys.walk()) == ref
    with pytest.raises(KeyError):
        keys.remove((5, 0.0))


def test_flowprefill_refits_are_exercised():
    """The online predictor refits mid-run (so the queue's incremental re-keying runs) and the lockstep
    still agrees."""
    made = []

    def make(reference: bool):
        s = (SEDFPrefillReference if reference else SEDFPrefill)(KVCacheManager(1, 16))
        made.append(s)
        return s
    lockstep(make, 11, n=300, bind=False)
    assert made[0].predict.version >= 3 and made[0].predict.version == made[1].predict.version


@pytest.mark.parametrize("opts", [{}, {"preemption": "chunk", "chunk": 1024}, {"lanes": False}],
                         ids=["adaptive", "chunk", "no-lanes"])
def test_adaptive_matches_reference(opts):
    """Adaptive prefill (S-EDF with LAPS' lanes while the lengths are bimodal) against the scanning
    reference, with KV memory too small for everyone: its Algorithm 1 leaves out the other lane
    and the prompts that cannot find memory without changing a decision."""
    def make(reference: bool):
        return (AdaptivePrefillReference if reference else AdaptivePrefill)(KVCacheManager(1, 16), **opts)
    made = []

    def tracked(reference: bool):
        made.append(make(reference))
        return made[-1]
    for seed in range(4):
        assert lockstep(tracked, seed, kv_tokens=20_000) > 20
    assert opts.get("lanes") is False or any(s.bimodal for s in made)


@pytest.mark.parametrize("opts", [{}, {"order": "ascending"}, {"estimate": "cost"}, {"chunk": 2048},
                                  {"mu_ema": 0.3, "max_batch_size": 3}],
                         ids=["desc", "asc", "costest", "c2k", "ema"])
def test_kairos_matches_reference(opts):
    def make(reference: bool):
        cls = KairosPrefillReference if reference else KairosPrefill
        return cls(KVCacheManager(1, 16), **opts)
    for seed in range(6):
        assert lockstep(make, seed) > 20


@pytest.mark.parametrize("opts", [{}, {"shape_buckets": False}, {"awd": False}, {"preempt": "operator"},
                                  {"deadline_free": True, "long_chunk": 8192}, {"order": "edf", "short_budget": 512},
                                  {"prefix_caching": True}, {"light_load": False, "order": "fcfs"}],
                         ids=["laps", "nobuckets", "noawd", "preempt", "offline", "edf", "prefix", "literal"])
def test_laps_matches_reference(opts):
    def make(reference: bool):
        return (LapsPrefillReference if reference else LapsPrefill)(KVCacheManager(1, 16), **opts)
    for seed in range(6):
        assert lockstep(make, seed, n=240) > 20


@pytest.mark.parametrize("opts", [{}, {"token_budget": 2048, "max_batch_size": 3}], ids=["fcfs", "small"])
def test_fcfs_matches_reference(opts):
    def make(reference: bool):
        return (FCFSPrefillReference if reference else FCFSPrefill)(KVCacheManager(1, 16), **opts)
    for seed in range(6):
        assert lockstep(make, seed) > 20


def test_kairos_out_of_order_arrival_and_large_queue():
    """Arrivals out of arrival order re-file the columns; a queue longer than the first partial
    sort's 128 makes the ranking widen."""
    def make(reference: bool):
        return (KairosPrefillReference if reference else KairosPrefill)(KVCacheManager(blocks_for(10**6, 16), 16),
                                                                       cost_model=COST, max_batch_size=400)
    pair = [make(False), make(True)]
    rng = random.Random(5)
    specs = random_requests(rng, 600)
    rng.shuffle(specs)
    for s in pair:
        for sp in specs:
            s.add_request(make_request(sp), 0.0)
    now = max(sp[1] for sp in specs)
    for _ in range(30):
        plans = [s.schedule(now) for s in pair]
        assert plan_sig(plans[0]) == plan_sig(plans[1])
        if plans[0] is None:
            break
        for s, p in zip(pair, plans):
            s.update(p, StepResult(duration=0.05), now + 0.05)
        now += 0.05


def pending_tokens(s) -> int:
    return sum(s.requests[i].remaining_prefill for i in s.pending)


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix", "prefix-caching"])
@pytest.mark.parametrize("spec", registry.available("prefill"))
def test_queued_tokens_is_the_pending_sum(spec, prefix):
    """The running ``queued_tokens`` equals the sum over the pending requests after every event:
    arrivals, (partial, preempted) steps, prefix hits at admission, aborts, releases."""
    rng = random.Random(3)
    s = registry.make("prefill", spec, KVCacheManager(blocks_for(40_000, 16), 16), prefix_caching=prefix)
    if hasattr(s, "bind_cost_model"):
        s.bind_cost_model(COST)
    executor = SimExecutor(COST)
    specs = random_requests(rng, 120)
    now, nxt, checked, last_wake = 0.0, 0, 0, None
    while nxt < len(specs) or s.has_work:
        assert s.queued_tokens == pending_tokens(s)
        checked += 1
        plan = s.schedule(now)
        if plan is None:
            wake = s.next_wakeup()
            if wake == last_wake:               # asked already: the simulator waits for an event
                wake = None
            last_wake = wake
            if nxt >= len(specs) and wake is None:
                break
            if wake is not None and (nxt >= len(specs) or wake < specs[nxt][1]):
                now = max(now, wake)
                continue
            now = max(now, specs[nxt][1])
            req = make_request(specs[nxt])
            req.prefix_len = rng.randint(0, req.prompt_len // 2)
            s.add_request(req, now)
            nxt += 1
            continue
        result = executor.execute(plan)
        if plan.preemptible and rng.random() < 0.2:
            result = StepResult(duration=result.duration / 2, completed=False)
        now += result.duration
        while nxt < len(specs) and specs[nxt][1] <= now:
            req = make_request(specs[nxt])
            req.prefix_len = rng.randint(0, req.prompt_len // 2)
            s.add_request(req, specs[nxt][1])
            nxt += 1
        if rng.random() < 0.1:
            running = {c.request.request_id for c in plan.prefills}
            idle = sorted(set(s.pending) - running)
            if idle:
                s.abort(rng.choice(idle), now)
                assert s.queued_tokens == pending_tokens(s)
        for r in s.update(plan, result, now).prefilled:
            s.release(r.request_id)
    assert checked > 50 and s.queued_tokens == pending_tokens(s)


class ScanQuadTree(KVLengthQuadTree):
    """The quad-tree's queries as they were before its leaves kept sorted sets: every call sorts
    or scans the leaves it touches."""

    def _recount_oldest(self, leaf) -> None:
        node = leaf
        while node is not None:
            node.oldest = (min((e.since for e in node.entries.values()), default=float("inf"))
                           if node.entries is not None else min(c.oldest for c in node.children))
            node = node.parent

    def remove(self, request_id):
        entry = super().remove(request_id)
        self._recount_oldest(self._leaf_for(entry.length))
        return entry

    def iter_entries(self, node=None, *, descending=False):
        node = node or self.root
        if node.num_requests == 0:
            return
        if node.entries is not None:
            yield from sorted(node.entries.values(), key=lambda e: (e.length, e.since), reverse=descending)
            return
        for child in (reversed(node.children) if descending else node.children):
            yield from self.iter_entries(child, descending=descending)

    def in_range(self, lo, hi, limit):
        found, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.num_requests == 0 or node.hi < lo or node.lo > hi:
                continue
            if node.entries is not None:
                found.extend(e for e in node.entries.values() if lo <= e.length <= hi)
            else:
                stack.extend(node.children or [])
        found.sort(key=lambda e: e.since)
        return found[:limit]

    def oldest(self, node):
        return min(self.iter_entries(node), key=lambda e: e.since)

    def _oldest_first(self, node):
        return iter(sorted(self.iter_entries(node), key=lambda e: e.since))


@pytest.mark.parametrize("seed", range(4))
def test_quadtree_matches_scanning_reference(seed, monkeypatch):
    """Random inserts, removals and growth with many ties (few lengths, few entry times): every
    query AlignedServe makes answers the same as the sorting/scanning reference."""
    monkeypatch.setattr(sorted_keys, "LOAD", 4)
    rng = random.Random(seed)
    trees = [KVLengthQuadTree(leaf_width=16, max_len=4096), ScanQuadTree(leaf_width=16, max_len=4096)]
    live: set[int] = set()

    def ids(entries):
        return [e.request_id for e in entries]

    def sel(s):
        return None if s is None else (s.request_ids, s.lo, s.hi, s.blocks, s.full)
    for step in range(1500):
        op = rng.random()
        if op < 0.45 or not live:
            rid = step
            length, since = rng.choice((rng.randint(1, 5000), rng.randint(30, 40))), float(rng.randint(0, 30))
            for t in trees:
                t.insert(rid, length, 1 + length // 256, since)
            live.add(rid)
        elif op < 0.75:
            rid = rng.choice(sorted(live))
            live.discard(rid)
            assert [ids([t.remove(rid)]) for t in trees][0] == [rid]
        else:
            rid = rng.choice(sorted(live))
            length = trees[0].entry(rid).length + rng.randint(0, 40)
            for t in trees:
                t.update(rid, length, 1 + length // 256)
        a, b = trees
        assert (a.root.oldest, a.root.num_requests) == (b.root.oldest, b.root.num_requests)
        lo = rng.randint(1, 4096)
        hi, limit = lo + rng.randint(0, 600), rng.randint(1, 30)
        assert ids(a.in_range(lo, hi, limit)) == ids(b.in_range(lo, hi, limit))
        budget, n_min, cap = rng.randint(1, 200), rng.randint(1, 40), rng.randint(1, 60)
        assert sel(a.density_first(budget, n_min, cap)) == sel(b.density_first(budget, n_min, cap))
        bound = rng.uniform(0, 40)
        leaf_a, leaf_b = a.starving_leaf(40.0, bound), b.starving_leaf(40.0, bound)
        assert (leaf_a and leaf_a.lo) == (leaf_b and leaf_b.lo)
        if leaf_a is not None:
            assert a.oldest(leaf_a).request_id == b.oldest(leaf_b).request_id
            assert sel(a.grow(leaf_a, budget, n_min, cap, force_one=True)) == \
                sel(b.grow(leaf_b, budget, n_min, cap, force_one=True))
            for desc in (False, True):
                assert ids(a.iter_entries(leaf_a.parent, descending=desc)) == \
                    ids(b.iter_entries(leaf_b.parent, descending=desc))
    trees[0].check()


def reference_signals(router: LapsPoolRouter, inst, stats: _Stats, now: float, period: float,
                      pool_rate: float | None) -> tuple[float, float, float]:
    """The LAPS controller's per-instance signals as first written (several passes, builtins)."""
    slo = router.slo_ttft
    busy = float(getattr(inst, "busy_time", 0.0))
    busy_delta, stats.busy_seen = max(busy - stats.busy_seen, 0.0), busy
    served, deviations, keep = 0, [], []
    for r in stats.outstanding:
        first = r.times.first_token
        if first is None and r.is_finished:
            continue
        if first is None and now - r.arrival_time <= slo:
            keep.append(r)
            continue
        end = first if first is not None else now
        start = r.times.prefill_start if r.times.prefill_start is not None else end
        deviations.append(max(min(end - r.arrival_time - slo, start - r.arrival_time), 0.0) / slo)
        if first is not None:
            served += r.prompt_len - r.num_cached_tokens
        else:
            keep.append(r)
    stats.outstanding = keep
    if busy_delta > 0 and served > 0:
        obs = served / busy_delta
        stats.rate = obs if stats.rate is None else 0.7 * stats.rate + 0.3 * obs
    if router.backlog == "wait":
        waiting = [now - r.arrival_time for r in keep if r.times.prefill_start is None]
        q = min(max(waiting, default=0.0) / slo, router.q_cap)
    else:
        rate = stats.rate or pool_rate
        q = min(inst.queued_tokens / rate / slo, router.q_cap) if rate else 0.0
    e = sum(deviations) / len(deviations) if deviations else 0.0
    u = min(busy_delta / period, 1.0) if period > 0 else 0.0
    return q, e, u


@pytest.mark.parametrize("backlog", ["wait", "tokens"])
def test_laps_controller_signals_match_reference(backlog):
    """The one-pass controller signals equal the first version's on random request states (not
    started, started, served, aborted, finished; young and late; arrivals after ``now`` too),
    down to the float, and keep the same requests outstanding."""
    class Inst:
        queued_tokens, busy_time = 5000, 0.0
    rng = random.Random(4)
    router = LapsPoolRouter(backlog=backlog)
    for trial in range(300):
        now = rng.uniform(0.0, 20.0)
        reqs = []
        for i in range(rng.randint(0, 40)):
            r = make_request((i, now - rng.uniform(-0.5, 3.0), rng.randint(1, 5000), 4, 0.4))
            kind = rng.random()
            if kind < 0.6:
                r.times.prefill_start = rng.choice((None, now - rng.uniform(0.0, 2.0)))
            if kind > 0.4:
                r.times.first_token = now - rng.uniform(0.0, 1.0)
            if rng.random() < 0.1:
                r.phase = rng.choice((Phase.ABORTED, Phase.FINISHED))
            reqs.append(r)
        inst = Inst()
        inst.busy_time = rng.uniform(0.0, 5.0)
        rate = rng.choice((None, 1e4))
        stats = [_Stats(outstanding=list(reqs), rate=rate) for _ in range(2)]
        pool_rate = rng.choice((None, 2e4))
        got = router.signals(inst, stats[0], now, 2.0, pool_rate)
        want = reference_signals(router, inst, stats[1], now, 2.0, pool_rate)
        assert got == want and stats[0].outstanding == stats[1].outstanding
        assert (stats[0].rate, stats[0].busy_seen) == (stats[1].rate, stats[1].busy_seen)


class _CountingKairos(GuardedKairosPrefill):
    """The registered Kairos prefill, counting the requests its ranking hands to the fill."""

    yielded = 0

    def _fill(self, ranked, now, token_budget):
        def counted(it):
            for req in it:
                self.yielded += 1
                yield req
        return super()._fill(counted(ranked), now, token_budget)


class _KairosWithoutSkip(_CountingKairos):
    """The same with the ranking's length skip off: every refused request is yielded and passed
    over by the fill's own check (the form before the skip)."""

    def _refused_bound(self) -> float:
        return float("inf")


@pytest.mark.parametrize("opts", [{}, {"rank": "urgency"}, {"chunk": 8192}], ids=["auto", "urgency", "c8k"])
def test_kairos_skips_refused_lengths_without_changing_a_decision(opts):
    """With KV memory short, Kairos' ranking leaves out the not-started requests at or above a
    refusal's length in one pass: the same plans as passing over each one, fewer requests walked."""
    made = []

    def make(reference: bool):
        made.append((_KairosWithoutSkip if reference else _CountingKairos)(KVCacheManager(1, 16), warmup=0, **opts))
        return made[-1]
    for seed in range(4):
        assert lockstep(make, seed, n=300, kv_tokens=12_000) > 20
    fast = sum(s.yielded for s in made[0::2])
    slow = sum(s.yielded for s in made[1::2])
    assert fast < slow


@pytest.mark.parametrize("opts", [{}, {"chunk": 2048}], ids=["desc", "c2k"])
def test_kairos_matches_reference_with_kv_short(opts):
    def make(reference: bool):
        cls = KairosPrefillReference if reference else KairosPrefill
        return cls(KVCacheManager(1, 16), **opts)
    for seed in range(4):
        assert lockstep(make, seed, n=300, kv_tokens=12_000) > 20
