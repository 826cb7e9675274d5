"""Scheduling cost: wall time of every registered policy's decisions with 1K, 10K and 100K queued,
prefill policies with the online predictor refitting.

Prefill set-up (the worst case a refitting predictor meets: a burst on one instance, Llama-3-8B/H100
analytic cost model): ``N`` requests arrive within ``BURST_SECONDS`` — 80% short prompts of 32-256
tokens, 20% long prompts of 2K-12K tokens, each with a TTFT target drawn from three classes
(0.3 / 1 / 4 s; TPOT 50 ms, 128 output tokens) — and are queued on one instance without a step
running. The policy reads an online predictor of its own (:class:`LearnedCostModel`, as
``ClusterConfig(predictor="online")``, the default, gives every instance), fed every completed
step as the instance runtime feeds it; it refits after observation 1, 2, 4, …, 256 and then
every 256, so ``--prefill-steps`` (default 1,300) reaches fourteen refits with the queue still
near ``N``. The instance then runs the steps (the simulator's executor charges each one) while
more requests of the same mix keep arriving at ``LIVE_RATE``. Each policy event is timed:

- *schedule*: one ``schedule()`` call (the decision);
- *completion*: ``update()`` of the step that ended plus the next ``schedule()``;
- *arrival*: ``add_request()`` plus, while a preemptible step runs, ``should_preempt()`` (a True
  stops the step at the next operator boundary, as the simulator does).

Per policy and event: count, mean, p99 and max (wall and CPU time); the prefill rows also give the
refits seen, the slowest decision right after one (``max_after_refit_ms``) and the most a single
decision re-predicted one at a time (``max_rekeys``: S-EDF's queue counts groups of requests that
share a size class and step-token count, Kairos durations read one by one; 0 where the policy
keeps none).

A decode policy gets ``N`` prefilled requests of the ``short_long_mix`` workload (80% 32-256
tokens, 20% 4-8K; KV transferred, first token out) arriving over ``FILL_SECONDS`` and runs
``STEPS`` decode steps; its device KV holds all of them (the scheduler really holds ``N``;
256-token blocks keep the block lists small), AlignedServe's host pool likewise. A router routes
``STEPS`` arrivals over 4 prefill instances (FCFS; LAPS in spatial mode for ``laps-pools``) that
hold ``N`` queued requests between them, and ``STEPS`` finished prefills over 4
continuous-batching decode instances that hold ``N`` requests between them (event
``route_decode``). Decode policies and routers read the oracle cost model (no refits).

Policies: every registry name, aliases with the same options counted once (``--list`` prints them).
Metrics: ``worst_{mean,p99,max}_decision_ms_{1k,10k,100k}``, the largest mean / p99 / max over every
policy and every event kind (targets at 10K: mean <= 1 ms, p99 <= 2 ms, max <= 20 ms; at 100K max
<= 100 ms), except a prefill policy's first decision after the burst (event ``first``, reported
apart): it settles what the untimed burst deferred (S-EDF: the slack sign flips of everything that
went late during the burst; Kairos: the columns of every queued request), work a running instance
spreads over its arrivals. Wall times on a shared 2-core machine; CPU time of the process is
recorded beside them (a wall figure far above its CPU twin was another process's doing;
``worst_cpu_*`` are the CPU-time twins of the headline figures, and ``load_average`` records the
machine's 1-minute load average at the start and end of the run). The fill is not timed; the
garbage collector is frozen after it (``gc.freeze``) so that collections scan only what the
measured steps allocate.

``--case flip-burst`` replaces the prefill set-up by a burst within 10 ms (short prompts 1-400
tokens, TPOT 0.1 s, padded attention): each TTFT class's slack turns negative together while the
predictor's early refits re-key the queue. ``--case kv-full`` is the flip burst on an instance with
``KV_FULL_TOKENS`` of KV memory (a few long prompts started in chunks fill it), so that most
decisions walk the queue with KV memory full; its prefill rows give the most admissions a single
decision refused (``max_refusals``). ``cpu_max_call`` is the 1-based index of the slowest
call (CPU time) among its event's calls (a ``schedule`` index ``k`` is decision ``k + 1``).

    python benchmarks/sched_cost.py [--case refits|flip-burst] [--sizes 1000,10000,100000] [--steps 200] [--prefill-steps 1300]
        [--only sedf,kairos] [--name sched_cost]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time
from collections.abc import Callable
from itertools import accumulate

import numpy as np

from laneserve.bench.results import markdown_table, write_result
from laneserve.core.kv import HostKVPool, KVCacheManager, blocks_for
from laneserve.core.plan import StepResult
from laneserve.core.request import Phase, Request
from laneserve.core.slo import SLO
from laneserve.costmodel import make_cost_model
from laneserve.policies import registry
from laneserve.policies.predictors import LearnedCostModel
from laneserve.sim.config import kv_capacity_tokens
from laneserve.sim.executor import SimExecutor
from laneserve.sim.simulator import SimInstance
from laneserve.workloads import make_workload

FILL_SECONDS = 10.0
BURST_SECONDS = 1.0         # the prefill burst arrives within this
LIVE_RATE = 20.0            # requests/s arriving while the steps run
LONG_SHARE = 0.2
SHORT_TOKENS, LONG_TOKENS = (32, 256), (2048, 12288)
TTFT_CLASSES = (0.3, 1.0, 4.0)
TPOT = 0.05
ATTENTION = "ragged"
#: ``--case flip-burst``: the prefill burst arrives within 10 ms, short prompts 1-400 tokens, TPOT
#: 0.1 s, padded attention: whole TTFT classes reach their flip points together
FLIP_BURST = {"BURST_SECONDS": 0.01, "SHORT_TOKENS": (1, 400), "TPOT": 0.1, "ATTENTION": "padded"}
KV_TOKENS: int | None = None    # the prefill instance's KV memory (None: the model's on the GPU)
KV_FULL_TOKENS = 40_000
#: ``--case kv-full``: the flip burst with KV memory for three or four long prompts
KV_FULL = {**FLIP_BURST, "KV_TOKENS": KV_FULL_TOKENS}
DECODE_BLOCK = 256
NUM_ROUTED_INSTANCES = 4


class Clock:
    """Wall and CPU seconds of timed calls, per event kind."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.extra: dict[str, float | int] = {}

    def time(self, kind: str, fn: Callable, *args):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn(*args)
        w1, c1 = time.perf_counter(), time.process_time()
        self.wall.setdefault(kind, []).append(w1 - w0)
        self.cpu.setdefault(kind, []).append(c1 - c0)
        return out

    def add(self, kind: str, wall: float, cpu: float) -> None:
        self.wall.setdefault(kind, []).append(wall)
        self.cpu.setdefault(kind, []).append(cpu)


def requests(n: int, *, seed: int, rate: float, start: float = 0.0, first_id: int = 0) -> list[Request]:
    wl = make_workload("short_long_mix", n=n, long_share=LONG_SHARE, rate=rate, seed=seed)
    return [Request.from_spec(dataclasses.replace(s, request_id=first_id + s.request_id,
                                                  arrival_time=start + s.arrival_time)) for s in wl.specs]


def burst_requests(n: int, *, seed: int, rate: float, start: float = 0.0, first_id: int = 0) -> list[Request]:
    """``n`` requests of the prefill mix (``LONG_SHARE`` long prompts, three TTFT classes) arriving
    at ``rate`` per second from ``start`` (uniform arrival times, sorted)."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < LONG_SHARE
    prompt = np.where(long, rng.integers(LONG_TOKENS[0], LONG_TOKENS[1] + 1, n),
                      rng.integers(SHORT_TOKENS[0], SHORT_TOKENS[1] + 1, n))
    ttft = rng.choice(TTFT_CLASSES, n)
    arrival = start + np.sort(rng.random(n)) * (n / rate)
    return [Request(first_id + i, float(arrival[i]), int(prompt[i]), 128, SLO(ttft=float(ttft[i]), tpot=TPOT))
            for i in range(n)]


def distinct_specs(kind: str) -> list[str]:
    """Registry names whose (factory, options) differ: the policy's own name where it has one,
    else the first alias in sorted order."""
    seen: dict[tuple, str] = {}
    for name in registry.available(kind):
        factory, opts = registry.resolve(kind, name)
        key = (factory, tuple(sorted(opts.items())))
        if key not in seen or (not opts and getattr(factory, "name", None) == name):
            seen[key] = name
    return list(seen.values())


# ---- prefill ---------------------------------------------------------------------------------
def _rekeys(sched) -> int:
    """What the policy re-predicted one at a time so far (S-EDF: groups; Kairos: requests; 0 where
    it keeps no such count)."""
    queue = getattr(getattr(sched, "ordering", None), "queue", None)   # S-EDF's ordering (sedf, adaptive)
    return getattr(queue, "rekeys", 0) + getattr(sched, "recomputed", 0)


def run_prefill(spec: str, n: int, steps: int, cost) -> Clock:
    kv = KVCacheManager(blocks_for(KV_TOKENS or kv_capacity_tokens(cost, 0.9), 16), 16)
    sched = registry.make("prefill", spec, kv)
    refusals = [0]
    if KV_TOKENS is not None and hasattr(sched, "admit"):
        admit = sched.admit

        def counted(req: Request, now: float) -> bool:
            ok = admit(req, now)
            refusals[0] += not ok
            return ok

        sched.admit = counted
    learner = LearnedCostModel(attention=getattr(cost, "attention", "ragged"))
    if hasattr(sched, "bind_cost_model"):
        sched.bind_cost_model(learner)
    executor = SimExecutor(cost)
    for req in burst_requests(n, seed=0, rate=n / BURST_SECONDS):
        sched.add_request(req, req.arrival_time)
    live = iter(burst_requests(20 * steps + 100, seed=1, rate=LIVE_RATE, start=BURST_SECONDS, first_id=n))
    nxt = next(live)
    clock = Clock()
    clock.extra = {"refits": 0, "max_after_refit_ms": 0.0, "max_rekeys": 0}
    if KV_TOKENS is not None:
        clock.extra["max_refusals"] = 0
    gc.collect()
    gc.freeze()
    now, first = BURST_SECONDS, True
    update_wall = update_cpu = 0.0
    refitted = False
    for _ in range(steps):
        rekeys, refused = _rekeys(sched), refusals[0]
        c0, w0 = time.process_time(), time.perf_counter()
        plan = sched.schedule(now)
        w1, c1 = time.perf_counter(), time.process_time()
        if "max_refusals" in clock.extra:
            clock.extra["max_refusals"] = max(clock.extra["max_refusals"], refusals[0] - refused)
        clock.add("first" if first else "schedule", w1 - w0, c1 - c0)
        if not first:
            clock.add("completion", update_wall + w1 - w0, update_cpu + c1 - c0)
            clock.extra["max_rekeys"] = max(clock.extra["max_rekeys"], _rekeys(sched) - rekeys)
            if refitted:
                clock.extra["max_after_refit_ms"] = max(clock.extra["max_after_refit_ms"], 1e3 * (w1 - w0))
        first = refitted = False
        update_wall = update_cpu = 0.0
        if plan is None:                      # idle until the next arrival
            now = nxt.arrival_time
            clock.time("arrival", sched.add_request, nxt, now)
            nxt = next(live)
            continue
        result = executor.execute(plan)
        end, stop_at = now + result.duration, None
        while nxt.arrival_time <= end:
            t = nxt.arrival_time
            c0, w0 = time.process_time(), time.perf_counter()
            sched.add_request(nxt, t)
            preempt = plan.preemptible and stop_at is None and sched.should_preempt(plan, t)
            w1, c1 = time.perf_counter(), time.process_time()
            clock.add("arrival", w1 - w0, c1 - c0)
            nxt = next(live)
            if preempt:                       # stop at the next operator boundary, as the simulator
                cum = list(accumulate(plan.op_times[plan.ops_done:]))
                for k in SimExecutor.boundaries(plan):
                    if now + cum[k - plan.ops_done - 1] >= t:
                        stop_at, end = k, now + cum[k - plan.ops_done - 1]
                        break
        if stop_at is not None:
            result = StepResult(duration=end - now, completed=False)
            plan.ops_done = stop_at
        elif learner.observe(plan, result.duration):       # the runtime feeds completed steps
            clock.extra["refits"] += 1
            refitted = True
        now = end
        c0, w0 = time.process_time(), time.perf_counter()
        outcome = sched.update(plan, result, now)
        for req in outcome.prefilled:         # the KV leaves at once
            sched.release(req.request_id)
        update_wall, update_cpu = time.perf_counter() - w0, time.process_time() - c0
    gc.unfreeze()
    return clock


# ---- decode ----------------------------------------------------------------------------------
def prefilled(reqs: list[Request]) -> list[Request]:
    for r in reqs:
        r.num_computed_tokens = r.prompt_len
        r.times.prefill_start = r.arrival_time
        r.times.prefill_end = r.arrival_time
        r.record_token(r.arrival_time)
        r.phase = Phase.TRANSFERRING
    return reqs


def run_decode(spec: str, n: int, steps: int, cost) -> Clock:
    fill = prefilled(requests(n, seed=0, rate=n / FILL_SECONDS))
    live = prefilled(requests(20 * steps + 100, seed=1, rate=LIVE_RATE, start=FILL_SECONDS, first_id=n))
    tokens = sum(r.prompt_len + r.max_output_tokens for r in (*fill, *live))
    blocks = blocks_for(tokens, DECODE_BLOCK) + len(fill) + len(live)
    kv = KVCacheManager(blocks, DECODE_BLOCK)
    sched = registry.make("decode", spec, kv, host_pool=HostKVPool(blocks, DECODE_BLOCK))
    executor = SimExecutor(cost)

    def arrive(req: Request, t: float) -> None:
        sched.reserve(req)
        sched.add_request(req, t)

    for req in fill:
        arrive(req, req.arrival_time)
    clock = Clock()
    gc.collect()
    gc.freeze()
    now, i = FILL_SECONDS, 0
    update_wall = update_cpu = 0.0
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        plan = sched.schedule(now)
        w1, c1 = time.perf_counter(), time.process_time()
        clock.add("schedule", w1 - w0, c1 - c0)
        clock.add("completion", update_wall + w1 - w0, update_cpu + c1 - c0)
        end = now + (executor.execute(plan).duration if plan is not None else 0.0)
        while i < len(live) and (live[i].arrival_time <= end or plan is None):
            end = max(end, live[i].arrival_time)
            clock.time("arrival", arrive, live[i], end)
            i += 1
            if plan is None:
                break
        now = end
        if plan is not None:
            c0, w0 = time.process_time(), time.perf_counter()
            sched.update(plan, StepResult(duration=0.0), now)
            update_wall, update_cpu = time.perf_counter() - w0, time.process_time() - c0
        else:
            update_wall = update_cpu = 0.0
    gc.unfreeze()
    return clock


# ---- routers ---------------------------------------------------------------------------------
def run_router(spec: str, n: int, steps: int, cost) -> Clock:
    policy = "laps:mode=spatial" if spec.startswith("laps") else "fcfs"
    tokens = kv_capacity_tokens(cost, 0.9)
    instances = [SimInstance(i, "prefill", registry.make("prefill", policy, KVCacheManager(blocks_for(tokens, 16), 16)))
                 for i in range(NUM_ROUTED_INSTANCES)]
    clock = Clock()
    timed_routes(registry.make("router", spec), instances, n, steps, (0, 1), "route", clock)
    route_decode(spec, n, steps, cost, clock)
    return clock


def route_decode(spec: str, n: int, steps: int, cost, clock: Clock) -> None:
    """The decode side: finished prefills placed on 4 continuous-batching decode instances that
    hold ``n`` requests between them (event ``route_decode``; held without KV: the routers read
    requests, not blocks); a router that predicts step times (``tpot-aware``) reads the run's
    cost model."""
    instances = [SimInstance(NUM_ROUTED_INSTANCES + i, "decode",
                             registry.make("decode", "continuous", KVCacheManager(1, DECODE_BLOCK)))
                 for i in range(NUM_ROUTED_INSTANCES)]
    router = registry.make("router", spec)
    if router.reads_step_times:
        router.bind_cost_model(cost)
    timed_routes(router, instances, n, steps, (2, 3), "route_decode", clock)


def timed_routes(router, instances: list, n: int, steps: int, seeds: tuple[int, int], event: str,
                 clock: Clock) -> None:
    """``n`` requests routed untimed (by the router under test) to fill ``instances``, then
    ``steps`` more timed as ``event``; each lands in the chosen instance's scheduler."""
    fill = requests(n, seed=seeds[0], rate=n / FILL_SECONDS)
    live = requests(steps, seed=seeds[1], rate=LIVE_RATE, start=FILL_SECONDS, first_id=n)
    for req in fill:
        instances[router.route(req, instances, req.arrival_time)].scheduler.add_request(req, req.arrival_time)
    gc.collect()
    gc.freeze()
    for req in live:
        i = clock.time(event, router.route, req, instances, req.arrival_time)
        instances[i].scheduler.add_request(req, req.arrival_time)
    gc.unfreeze()


RUNNERS = {"prefill": run_prefill, "decode": run_decode, "router": run_router}


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else 0.0


def summarise(kind: str, spec: str, n: int, clock: Clock) -> list[dict]:
    rows = []
    for event, walls in clock.wall.items():
        cpus = clock.cpu[event]
        rows.append({"kind": kind, "policy": spec, "queued": n, "event": event, "count": len(walls),
                     "mean_ms": 1e3 * sum(walls) / len(walls), "p99_ms": 1e3 * _p99(walls),
                     "max_ms": 1e3 * max(walls), "cpu_mean_ms": 1e3 * sum(cpus) / len(cpus),
                     "cpu_p99_ms": 1e3 * _p99(cpus), "cpu_max_ms": 1e3 * max(cpus),
                     "cpu_max_call": max(range(len(cpus)), key=cpus.__getitem__) + (event != "first"),
                     **(clock.extra if event == "schedule" else {})})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--steps", type=int, default=200, help="decode steps (routes) measured per policy and size")
    ap.add_argument("--prefill-steps", type=int, default=1300,
                    help="prefill steps measured per policy and size (1,300 reach fourteen refits)")
    ap.add_argument("--only", default="", help="comma-separated policy names to run (default: all)")
    ap.add_argument("--name", default="sched_cost", help="result file name")
    ap.add_argument("--list", action="store_true", help="print the policies measured and exit")
    ap.add_argument("--case", choices=("refits", "flip-burst", "kv-full"), default="refits",
                    help="prefill set-up: the 1 s burst (default), the 10 ms flip burst, or the flip burst "
                         "with KV memory full")
    args = ap.parse_args()
    if args.case != "refits":
        globals().update(FLIP_BURST if args.case == "flip-burst" else KV_FULL)
    cost = make_cost_model(model="llama-3-8b", hardware="h100", attention=ATTENTION)
    only = {s for s in args.only.split(",") if s}
    cases = [(kind, spec) for kind in ("prefill", "decode", "router") for spec in distinct_specs(kind)
             if not only or spec in only]
    if args.list:
        for kind, spec in cases:
            print(kind, spec)
        return
    rows: list[dict] = []
    load_start = os.getloadavg()[0]
    for n in (int(s) for s in args.sizes.split(",")):
        for kind, spec in cases:
            w0 = time.perf_counter()
            steps = args.prefill_steps if kind == "prefill" else args.steps
            got = summarise(kind, spec, n, RUNNERS[kind](spec, n, steps, cost))
            rows.extend(got)
            timed = [r for r in got if r["event"] != "first"]
            worst = max(timed, key=lambda r: r["mean_ms"])
            print(f"{n:>7} {kind:8s} {spec:18s} worst mean {worst['mean_ms']:8.3f} ms ({worst['event']}), "
                  f"p99 {max(r['p99_ms'] for r in timed):7.2f} ms, max {max(r['max_ms'] for r in timed):8.2f} ms"
                  f"  [{time.perf_counter() - w0:.1f} s]", flush=True)
    metrics: dict[str, float | int] = {}
    for n in sorted({r["queued"] for r in rows}):
        at = [r for r in rows if r["queued"] == n and r["event"] != "first"]
        tag = f"{n // 1000}k"
        for stat in ("mean", "p99", "max"):
            metrics[f"worst_{stat}_decision_ms_{tag}"] = max(r[f"{stat}_ms"] for r in at)
            metrics[f"worst_cpu_{stat}_decision_ms_{tag}"] = max(r[f"cpu_{stat}_ms"] for r in at)
        refit_rows = [r for r in at if "max_after_refit_ms" in r]
        if refit_rows:
            metrics[f"worst_after_refit_ms_{tag}"] = max(r["max_after_refit_ms"] for r in refit_rows)
            metrics[f"worst_rekeys_per_decision_{tag}"] = max(r["max_rekeys"] for r in refit_rows)
            metrics[f"fewest_refits_{tag}"] = min(r["refits"] for r in refit_rows)
    load = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    metrics.update(target_worst_mean_decision_ms_10k=1.0, target_worst_p99_decision_ms_10k=2.0,
                   target_worst_max_decision_ms_10k=20.0, target_worst_max_decision_ms_100k=100.0,
                   steps_per_case=args.steps, prefill_steps_per_case=args.prefill_steps, case=args.case)
    note = (f"1-minute load average {load[0]} at the start, {load[1]} at the end, on "
            f"{os.cpu_count()} cores: wall times above their CPU twins are waits for the CPU")
    write_result(args.name, metrics, extra={"load_average": load, "note": note, "rows": rows},
                 markdown=f"{note}.\n\n" + markdown_table(rows, ["kind", "policy", "queued", "event", "count", "mean_ms",
                                                "p99_ms", "max_ms", "cpu_mean_ms", "cpu_p99_ms", "cpu_max_ms", "cpu_max_call",
                                                "refits", "max_after_refit_ms", "max_rekeys", "max_refusals"]))


if __name__ == "__main__":
    main()
