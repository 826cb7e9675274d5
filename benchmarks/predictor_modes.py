"""How much the oracle predictor flattered the SLO-aware prefill policies.

Setup: FlowPrefill's four-class mix (``flowprefill_mix``, Llama3-8B lengths, 800 requests, seed 0)
on the Llama-3-8B / H100 analytic cost model, 1 prefill + 1 decode instance, continuous-batching
decode, no context check (``max_model_len=0``: the mix has prompts beyond 8K, as the paper's
setup). Metric: goodput = highest request rate with >= 90 % of requests meeting their class's TTFT
target (bisection, 3 % tolerance), for each prefill policy under each predictor:

- ``oracle``: the policies read the cost model that charges the time (the old behaviour);
- ``profile``: a fit to a noisy offline profile (laneserve.policies.predictors.profile_cost_model);
- ``online``: each instance learns its step times from a generic prior (the default).

FCFS reads no predictor: its three figures must be equal (a check on the harness).
Headline: ``online_over_oracle`` per policy (1.0 = the learned predictor loses nothing).

    PYTHONPATH=. python benchmarks/predictor_modes.py      # a few minutes
"""

from __future__ import annotations

import time

from laneserve.bench.experiment import goodput
from laneserve.measure.parallel import default_jobs, map_jobs
from laneserve.bench.results import markdown_table, write_result
from laneserve.costmodel import make_cost_model
from laneserve.policies.predictors import PREDICTORS
from laneserve.sim import ClusterConfig
from laneserve.workloads import make_workload

POLICIES = ("fcfs", "sedf", "kairos-costest", "laps:order=sedf")
N_REQUESTS, SEED = 800, 0


def search(policy: str, predictor: str) -> float:
    cost = make_cost_model("analytic", model="llama-3-8b", hardware="h100")
    wl = make_workload("flowprefill_mix", n=N_REQUESTS, model="Llama3-8B", rate=1.0, seed=SEED)
    cfg = ClusterConfig(prefill_policy=policy, predictor=predictor, max_model_len=0)
    res = goodput(wl, cfg, cost, lo=1.0, hi=64.0, metric="attainment_ttft", rel_tol=0.03)
    return res.value or 0.0


def main() -> None:
    t0 = time.perf_counter()
    tasks = [(p, m) for p in POLICIES for m in PREDICTORS]
    values = dict(zip(tasks, map_jobs(search, tasks, default_jobs())))
    rows = []
    for p in POLICIES:
        row = {"policy": p, **{m: values[p, m] for m in PREDICTORS}}
        row["online_over_oracle"] = row["online"] / row["oracle"] if row["oracle"] else None
        row["profile_over_oracle"] = row["profile"] / row["oracle"] if row["oracle"] else None
        rows.append(row)
        print(row, flush=True)
    slo_aware = [r for r in rows if r["policy"] != "fcfs"]
    metrics = {
        "min_online_over_oracle": min(r["online_over_oracle"] for r in slo_aware),
        "min_profile_over_oracle": min(r["profile_over_oracle"] for r in slo_aware),
        **{f"{r['policy']}_online_over_oracle": r["online_over_oracle"] for r in slo_aware},
        "fcfs_same_under_every_predictor": len({values["fcfs", m] for m in PREDICTORS}) == 1,
        "wall_seconds": time.perf_counter() - t0,
    }
    write_result("predictor_modes", metrics, markdown=markdown_table(rows),
                 extra={"rows": rows, "metric": "goodput at 90% TTFT attainment (req/s)",
                        "setup": f"Llama-3-8B / H100 analytic, 1P+1D, flowprefill_mix n={N_REQUESTS} seed {SEED}"})


if __name__ == "__main__":
    main()
