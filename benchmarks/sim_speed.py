"""Simulator speed: simulated requests per wall-clock second.

Replays the full bundled Azure 2023 conversation trace (19,366 requests) on 4 prefill + 4 decode
instances (Llama-3-8B, H100 analytic cost model) with the baseline policies, at the trace's own
rate and at 4x; then 10K and 100K requests (the trace tiled end to end) to show how it scales.
Also: ``sedf+kairos`` and ``adaptive+adaptive`` on the Azure trace; the full Mooncake conversation
trace (12,031 requests, ~12K-token prompts, Llama-3.1-8B); the step-by-step loop (``macro_steps=False``) on the headline
run, whose per-request results must equal the macro-stepped run's (checked); and the speedup of
a parallel sweep (``laneserve sim --jobs 2`` vs ``--jobs 1``: the default 3-policy x 4-rate grid
on the first 10,000 Azure requests, 3,000 before the simulator got faster and worker start-up
outweighed a point; identical results, checked).
Target: metrics.requests_per_second >= 10,000. Requests per second are per second of
the simulating process's CPU time (the simulator is one thread: on a quiet machine that is its
wall time); the wall-clock figures are in the rows too, with the machine's load average, since on
the shared 2-core machine other jobs take a varying share of the cores (the sweep speedup, a
parallel figure, is wall time). The policy modules are imported before the first timed run (a
one-time cost, not per request); the runs share one cost model, whose memoised terms carry over
from run to run. The headline (``requests_per_second``) is the median of three runs of its config
(fcfs+continuous, full trace, native rate), the first of them the first run of the process (memo
cold); all three are in ``requests_per_second_runs``, with their mean. On this VM identical runs
vary by up to +-20% even on a quiet machine, so one run cannot say which side of 10,000 it is.
Each row also gives ``machine_speed`` (:func:`machine_speed`, a fixed pure-Python loop timed just
before the run), so that runs taken at different times can be read against the VM's speed then.

    PYTHONPATH=. python benchmarks/sim_speed.py
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, replace

from laneserve.bench.results import markdown_table, write_result
from laneserve.core import RequestSpec
from laneserve.costmodel import make_cost_model
from laneserve.policies import registry
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import Workload, make_workload

BASE = ClusterConfig(num_prefill=4, num_decode=4)
POLICIES = {"fcfs+continuous": BASE,
            "cp-edf-2k+continuous": replace(BASE, prefill_policy="cp-edf-2k", router="least-loaded")}
HEADLINE_RUNS = 3
SEDF_KAIROS = replace(BASE, prefill_policy="sedf", decode_policy="kairos")
ADAPTIVE = replace(BASE, prefill_policy="adaptive", decode_policy="adaptive")


def tiled(base: Workload, n: int) -> Workload:
    """The trace repeated end to end until it has ``n`` requests."""
    specs, offset, i = [], 0.0, 0
    gap = base.duration / max(len(base) - 1, 1)
    while len(specs) < n:
        for s in base.specs:
            if len(specs) == n:
                break
            specs.append(RequestSpec(i, s.arrival_time + offset, s.prompt_len, s.output_len, slo=s.slo))
            i += 1
        offset += base.duration + gap
    return Workload.from_specs(f"{base.name}x{n}", specs)


def machine_speed(n: int = 400_000) -> float:
    """Iterations per CPU second of a fixed pure-Python loop (dict, list and float work, as in the
    simulator), timed just before a run: the VM's speed at that moment, to read runs taken at
    different times against (it does not capture everything: in one process the first run is
    slower than the next at the same figure)."""
    c0 = time.process_time()
    table: dict[int, int] = {}
    acc, seen = 0.0, []
    for i in range(n):
        table[i & 1023] = i
        acc += table.get(i & 511, 0) * 0.5
        if not i & 63:
            seen.append(acc)
    return n / (time.process_time() - c0)


def measure(workload: Workload, config: ClusterConfig, cost, *, macro_steps: bool = True) -> tuple[dict, list]:
    """The run's figures, and every request's outcome (to compare runs)."""
    speed = machine_speed()
    t0, c0 = time.perf_counter(), time.process_time()
    res = Simulator(config, cost, macro_steps=macro_steps).run(workload.specs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out_tokens = sum(r.num_output_tokens for r in res.requests)
    outcome = [(r.request_id, r.finish_reason, r.num_output_tokens, asdict(r.times)) for r in res.requests]
    return {"requests": len(workload), "cpu_s": cpu, "wall_s": wall,
            "requests_per_second": len(workload) / cpu, "requests_per_wall_second": len(workload) / wall,
            "simulated_s": res.duration, "events": res.events, "machine_speed": speed,
            "decode_steps": sum(i["steps"] for i in res.instances if i["role"] == "decode"),
            "output_tokens_per_second": out_tokens / cpu, "unfinished": res.unfinished}, outcome


def sweep_speedup(cost) -> dict:
    """Wall time of the (policy x rate) grid with 1 and 2 worker processes; rows must be equal."""
    from laneserve.bench.experiment import policy_config, sweep
    wl = make_workload("azure_conv").head(10_000)
    base = ClusterConfig()
    policies = {p: policy_config(p, base) for p in ("fcfs+continuous", "cp-edf-2k+continuous", "cp-edf-8k+continuous")}
    rates = [round(wl.mean_rate * f, 2) for f in (1, 2, 4, 6)]
    out = {}
    for jobs in (1, 2):
        t0 = time.perf_counter()
        out[jobs] = (sweep(wl, policies, rates, cost, jobs=jobs), time.perf_counter() - t0)
    assert out[1][0] == out[2][0], "parallel sweep rows differ"
    return {"sweep_wall_s_jobs1": out[1][1], "sweep_wall_s_jobs2": out[2][1],
            "sweep_speedup_jobs": out[1][1] / out[2][1]}


def main() -> None:
    load_before = os.getloadavg()
    registry.available("prefill")        # imports every policy module (outside the timed runs)
    cost = make_cost_model(model="llama-3-8b", hardware="h100")
    azure = make_workload("azure_conv")
    rows, outcomes = [], {}

    def run(name: str, label: str, wl: Workload, config: ClusterConfig, model=cost, **kw) -> dict:
        m, outcomes[(name, label)] = measure(wl, config, model, **kw)
        rows.append({"policy": name, "run": label, **m})
        print(f"{name:22s} {label:42s} {m['requests_per_second']:8.0f} req/s "
              f"({m['cpu_s']:.1f} s CPU, {m['wall_s']:.1f} s wall, {m['events']} events)", flush=True)
        return rows[-1]

    for name, config in POLICIES.items():
        for label, wl in (("azure full, native rate", azure),
                          ("azure full, 4x rate", azure.with_rate(4 * azure.mean_rate)),
                          ("10K tiled, 4x rate", tiled(azure, 10_000).with_rate(4 * azure.mean_rate)),
                          ("100K tiled, 4x rate", tiled(azure, 100_000).with_rate(4 * azure.mean_rate))):
            run(name, label, wl, config)
    baselines = list(rows)
    # the headline is the median of three runs of its config: single runs on this shared VM vary
    # by up to +-20% from run to run, and the first also fills the cost model's memo
    repeats = [rows[0]] + [run("fcfs+continuous", f"azure full, native rate (run {k} of {HEADLINE_RUNS})",
                               azure, BASE) for k in range(2, HEADLINE_RUNS + 1)]
    speeds = sorted(r["requests_per_second"] for r in repeats)
    headline_speed = speeds[len(speeds) // 2]
    step = run("fcfs+continuous", "azure full, native rate, step by step", azure, BASE, macro_steps=False)
    assert outcomes[("fcfs+continuous", "azure full, native rate")] == outcomes[
        ("fcfs+continuous", "azure full, native rate, step by step")], "macro steps changed a result"
    kairos = run("sedf+kairos", "azure full, native rate", azure, SEDF_KAIROS)
    adaptive = run("adaptive+adaptive", "azure full, native rate", azure, ADAPTIVE)
    mooncake = run("fcfs+continuous", "mooncake full, native rate (llama-3.1-8b)",
                   make_workload("mooncake_conv"), BASE, make_cost_model(model="llama-3.1-8b", hardware="h100"))
    metrics = {"requests_per_second": headline_speed,
               "requests_per_second_runs": [r["requests_per_second"] for r in repeats],
               "requests_per_second_mean": sum(speeds) / len(speeds),
               "machine_speed_runs": [r["machine_speed"] for r in repeats],
               "requests_per_second_min": min(r["requests_per_second"] for r in baselines),
               "requests_per_second_100k": min(r["requests_per_second"] for r in baselines if r["requests"] == 100_000),
               "requests_per_second_step_by_step": step["requests_per_second"],
               "macro_step_speedup": rows[0]["requests_per_second"] / step["requests_per_second"],
               "requests_per_second_sedf_kairos": kairos["requests_per_second"],
               "requests_per_second_adaptive": adaptive["requests_per_second"],
               "requests_per_second_mooncake": mooncake["requests_per_second"],
               "target_requests_per_second": 10_000, **sweep_speedup(cost)}
    load = f"{load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    note = (f"Requests per second per CPU second of the simulating process; load average (1 min) on the "
            f"machine: {load}. The headline run's per-request results "
            f"equal the step-by-step loop's (checked); the runs of a stable decode batch are one event "
            f"each (laneserve/sim/macro.py), so events fall from {step['events']} to {rows[0]['events']}.\n")
    write_result("sim_speed", metrics, extra={"rows": rows, "load_average": load},
                 markdown=markdown_table(rows, ["policy", "run", "requests", "cpu_s", "wall_s", "requests_per_second",
                                                "requests_per_wall_second", "events", "decode_steps",
                                                "machine_speed"])
                 + "\n" + note)


if __name__ == "__main__":
    main()
