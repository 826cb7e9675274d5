"""Where adaptive prefill lost TTFT to Kairos' prefill on long-context traffic: forced resumes of
hopeless long prefills.

``long_context_mix`` (400 requests, Poisson, TTFT 8 s / TPOT 50 ms) on 1P+1D, Llama-3.1-8B on
H100 (analytic cost model), host KV pool 4M tokens, online predictors, seed 0. Adaptive decode on
every row but the Kairos pair, so the rows differ only in the prefill policy:

- ``adaptive`` (``bound_late=False``): the suspension bound skips a parked task already late at
  its bound (it waits in priority order);
- ``adaptive:bound_late=true``: adaptive before, FlowPrefill's bound on every parked task (a task
  parked 10 s is resumed ahead of everything and not preempted again);
- ``kairos``: Kairos' prefill (the registered guarded form: deadline order, hopeless requests last,
  length-normalised urgency when prompts block), and ``kairos:rank=edf`` (the same without the
  urgency order);
- ``kairos+kairos``: the Kairos pair of the league.

Per rate: both-SLO, TTFT and TPOT attainment, forced resumes and the most tasks parked at once;
at 1 req/s TTFT attainment by prompt length. What it showed: Kairos' gain was not its urgency
order (``rank=edf`` keeps it) but that its late requests go last, where adaptive's suspension
bound forced late long prefills back in, non-preemptible, ahead of requests that could still make
8 s, prompts under 2K tokens included.

    python benchmarks/longctx_hol.py
"""

from __future__ import annotations

import numpy as np

from laneserve.bench.results import markdown_table, write_result
from laneserve.costmodel import make_cost_model
from laneserve.policies.prefill.mechanisms.sedf_tasks import PreemptiveTasks
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import make_workload

N = 400
RATES = (0.4, 0.6, 0.8, 1.0, 1.2, 1.5)
HOST_KV = 4_000_000
POLICIES = ("adaptive+adaptive", "adaptive:bound_late=true+adaptive", "kairos+adaptive",
            "kairos:rank=edf+adaptive", "kairos+kairos")
BINS = (0, 2_000, 5_000, 10_000, 20_000, 40_000, 10**9)
BIN_RATE = 1.0
ON_STEP = PreemptiveTasks.on_step


def run(policy: str, specs, cost) -> tuple[dict, list]:
    prefill, decode = policy.split("+")
    sim = Simulator(ClusterConfig(prefill_policy=prefill, decode_policy=decode, host_kv_tokens=HOST_KV), cost)
    most_parked = [0]                   # the most tasks parked at once (each holds its activations)

    def counted(self, plan, result, now):
        ON_STEP(self, plan, result, now)
        most_parked[0] = max(most_parked[0], len(self.parked))

    PreemptiveTasks.on_step = counted
    try:
        res = sim.run(specs)
    finally:
        PreemptiveTasks.on_step = ON_STEP
    tasks = getattr(sim.front[0].scheduler, "tasks", None)
    reqs = res.finished
    n = np.array([r.num_output_tokens for r in reqs])
    ttft = np.array([r.times.first_token - r.times.arrival for r in reqs])
    tpot = np.array([(r.times.last_token - r.times.first_token) / max(k - 1, 1) if k > 1 else 0.0
                     for r, k in zip(reqs, n)])
    ok_ttft = ttft <= np.array([r.slo.ttft for r in reqs]) + 1e-9
    ok_tpot = tpot <= np.array([r.slo.tpot for r in reqs]) + 1e-9
    row = {"both": float(np.mean(ok_ttft & ok_tpot)), "ttft": float(ok_ttft.mean()),
           "tpot": float(ok_tpot.mean()), "unfinished": res.unfinished,
           "forced_resumes": tasks.num_forced_resumes if tasks else None,
           "preemptions": tasks.num_preemptions if tasks else None,
           "most_parked": most_parked[0] if tasks else None,
           "longest_suspension_s": round(max(tasks.suspensions), 2) if tasks and tasks.suspensions else None}
    prompt = np.array([r.prompt_len for r in reqs])
    bins = []
    for lo, hi in zip(BINS, BINS[1:]):
        m = (prompt >= lo) & (prompt < hi)
        bins.append({"prompt": f"{lo // 1000}K-" + (f"{hi // 1000}K" if hi < 10**9 else ""),
                     "requests": int(m.sum()), "ttft": float(ok_ttft[m].mean()) if m.any() else None})
    return row, bins


def main() -> None:
    cost = make_cost_model(model="llama-3.1-8b", hardware="h100")
    rows, by_length = [], []
    for rate in RATES:
        specs = make_workload("long_context_mix", n=N, rate=rate).specs
        for policy in POLICIES:
            row, bins = run(policy, specs, cost)
            rows.append({"policy": policy, "rate": rate, **row})
            if rate == BIN_RATE:
                by_length.append({"policy": policy, **{b["prompt"]: b["ttft"] for b in bins}})
                counts = {b["prompt"]: b["requests"] for b in bins}
            print(f"{policy} @ {rate}: both {row['both']:.4f} ttft {row['ttft']:.4f}", flush=True)
    by = {(r["policy"], r["rate"]): r for r in rows}
    metrics = {}
    for rate in RATES:
        new, old = by[("adaptive+adaptive", rate)], by[("adaptive:bound_late=true+adaptive", rate)]
        kp = by[("kairos+adaptive", rate)]
        metrics[f"adaptive_both_at_{rate:g}"] = new["both"]
        metrics[f"adaptive_before_both_at_{rate:g}"] = old["both"]
        metrics[f"kairos_prefill_both_at_{rate:g}"] = kp["both"]
    md = ("Both-SLO, TTFT and TPOT attainment of all 400 requests; `forced_resumes`: suspension bounds that "
          "resumed a parked task ahead of every priority; `most_parked`: the most tasks parked at once; "
          "`longest_suspension_s`: the longest a parked task waited (a late task under `bound_late=False` "
          "may wait past the 10 s bound).\n\n"
          + markdown_table(rows)
          + f"\n## TTFT attainment by prompt length at {BIN_RATE:g} req/s\n\nrequests per bin: {counts}\n\n"
          + markdown_table(by_length))
    write_result("longctx_hol", metrics, extra={"rows": rows, "ttft_by_length": by_length}, markdown=md)


if __name__ == "__main__":
    main()
