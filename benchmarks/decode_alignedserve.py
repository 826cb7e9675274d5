"""AlignedServe (§4.2–4.4) in the simulator: decode throughput, P99 TPOT and the share of
iterations that mix two batches, AlignedServe vs FCFS continuous batching (vLLM / DistServe decode).

Setup: Llama-2-7B on the H100 analytic cost model with PADDED decode attention (a batch pays
``batch * longest context``, the kernel the paper's bubble argument is about); 4 prefill
instances + 1 decode instance (so that decode is the bottleneck), a 4M-token host KV pool per
decode instance for both policies (continuous batching swaps into it on preemption). Workloads:
``alignedserve_mix`` with 70–95 % short requests (< 1000 prompt tokens; long ones 1000–8000,
outputs 128–1024) and the first 1000 requests of the Azure 2023 conversation trace, all arriving
at 30 req/s (an offered load well above either policy's decode capacity: a throughput test).

Transfer costs: continuous batching's swaps go over PCIe; AlignedServe runs the paper's
GPU-prefetch-for-GPU design — the pool -> peer-GPU leg is a background PCIe timeline
(``prefetch_tokens_per_s`` from the cost model's PCIe link; a request needed before its copy is
done waits) and the peer -> decode leg is charged on the critical path over NVLink
(``swap_link="nvlink"``). Ablations at 95 % short: without GPU prefetch (direct PCIe copies on the
critical path, "w/o P") and the paper-literal switch (``switch_evict="memory"``: the old batch is
evicted only when memory runs short).

Decode throughput = output tokens generated on the decode instance / (last finish − first decode
start). TPOT follows vLLM ((E2E − TTFT)/(n − 1)), so it includes time parked in the pool;
the per-iteration latency the paper plots as "P99 TPOT" is reported as P99 ITL.

    python benchmarks/decode_alignedserve.py            # ~1 min

Predictors and context: this reproduction pins ``predictor="oracle"`` (the policies
read the cost model that charges the time, as before the honest-predictor default) and
``max_model_len=0`` (no context check: the paper setups run prompts longer than the spec's
context), so its figures stay comparable with the paper's and with earlier runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from laneserve.measure.metrics import summarize
from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import make_workload

MODEL, HARDWARE = "llama-2-7b", "h100"
SHORT_RATIOS = (0.70, 0.75, 0.80, 0.85, 0.90, 0.95)
RATE = 30.0
HOST_TOKENS = 4_000_000


def run(specs, cost, policy: str, *, swap_link: str, opts: dict | None = None) -> dict:
    # the paper's algorithm: the do-no-harm guard is off, as in ``alignedserve-literal``
    policy = "alignedserve-literal" if policy == "alignedserve" else policy
    cfg = ClusterConfig(predictor="oracle", max_model_len=0, num_prefill=4, num_decode=1, decode_policy=policy,
                        host_kv_tokens=HOST_TOKENS,
                        swap_link=swap_link, decode_opts=opts or {}, record_token_times=True)
    sim = Simulator(cfg, cost)
    res = sim.run(specs)
    reqs = res.requests
    tokens = sum(max(r.num_output_tokens - 1, 0) for r in reqs)
    start = min(r.times.decode_start for r in reqs if r.times.decode_start is not None)
    end = max(r.times.finished for r in reqs)
    s = summarize(reqs, duration=res.duration)
    row = {"policy": f"{policy.removesuffix('-literal')} {_short(opts or {})}".strip(), "unfinished": res.unfinished,
           "decode_tput": tokens / (end - start), "p99_tpot_ms": s["p99_tpot_ms"],
           "mean_tpot_ms": s["mean_tpot_ms"], "p99_itl_ms": s["p99_itl_ms"],
           "decode_steps": res.instances[-1]["steps"], "wall_s": res.wall_seconds}
    st = getattr(sim.back[0].scheduler, "stats", None)
    if st is not None:
        row.update(switch_share=st.switch_iteration_share, batches=st.batches_formed,
                   full_batches=st.full_batches, starvation_batches=st.starvation_batches,
                   median_batch=float(np.median(st.batch_sizes)), evictions=st.evictions,
                   max_pool_wait_s=max(st.pool_waits, default=0.0), prefetch_waits=sim.back[0].scheduler.aligner.stager.wait_events)
    return row


def _short(opts: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in opts.items() if k != "prefetch_tokens_per_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="requests per workload")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cost = make_cost_model("analytic", model=MODEL, hardware=HARDWARE, attention="padded")
    pcie_tokens_per_s = 1e6 / cost.kv_transfer_time(10**6, "pcie")
    aligned = {"prefetch_tokens_per_s": pcie_tokens_per_s}

    workloads = {f"mix-{int(r * 100)}short": make_workload("alignedserve_mix", n=args.n, short_ratio=r,
                                                            rate=RATE, seed=1) for r in SHORT_RATIOS}
    workloads["azure-conv"] = make_workload("azure_conv", limit=args.n, rate=RATE)
    rows = []
    for name, w in workloads.items():
        base = run(w.specs, cost, "continuous", swap_link="pcie")
        ours = run(w.specs, cost, "alignedserve", swap_link="nvlink", opts=aligned)
        for row in (base, ours):
            row["workload"] = name
            rows.append(row)
        ours["gain"] = ours["decode_tput"] / base["decode_tput"]
        ours["p99_tpot_ratio"] = ours["p99_tpot_ms"] / base["p99_tpot_ms"]
        ours["p99_itl_ratio"] = ours["p99_itl_ms"] / base["p99_itl_ms"]
        print(f"{name}: continuous {base['decode_tput']:.0f} tok/s, alignedserve {ours['decode_tput']:.0f} "
              f"tok/s ({ours['gain']:.2f}x), switch share {ours['switch_share']:.3f}", flush=True)
    w95 = workloads["mix-95short"]
    ablations = []
    for label, link, opts in (("w/o GPU prefetch (PCIe)", "pcie", {"prefetch": False}),
                              ("paper-literal switch (evict on memory only)", "nvlink",
                               {**aligned, "switch_evict": "memory"}),
                              ("no starvation bound", "nvlink", {**aligned, "starvation_bound": 0})):
        row = run(w95.specs, cost, "alignedserve", swap_link=link, opts=opts)
        row["variant"] = label
        ablations.append(row)
        print(f"95short {label}: {row['decode_tput']:.0f} tok/s, switch share {row['switch_share']:.3f}", flush=True)

    by = {(r["workload"], r["policy"].split()[0]): r for r in rows}

    def gain(w: str) -> float:
        return by[(w, "alignedserve")]["decode_tput"] / by[(w, "continuous")]["decode_tput"]

    metrics = {
        "decode_throughput_gain_95short": gain("mix-95short"),
        "switch_iteration_share": by[("mix-95short", "alignedserve")]["switch_share"],
        "decode_throughput_gain_70short": gain("mix-70short"),
        "decode_throughput_gain_azure": gain("azure-conv"),
        "max_switch_iteration_share": max(r["switch_share"] for r in rows if "switch_share" in r),
        "p99_tpot_ratio_95short": by[("mix-95short", "alignedserve")]["p99_tpot_ratio"],
        "p99_itl_ratio_95short": by[("mix-95short", "alignedserve")]["p99_itl_ratio"],
        "gain_without_gpu_prefetch_95short":
            ablations[0]["decode_tput"] / by[("mix-95short", "continuous")]["decode_tput"],
        "paper_literal_switch_share_95short": ablations[1]["switch_share"],
        "runtime_s": time.perf_counter() - t0,
    }
    cols = ["workload", "policy", "decode_tput", "gain", "p99_tpot_ms", "p99_tpot_ratio", "p99_itl_ms",
            "switch_share", "batches", "full_batches", "starvation_batches", "median_batch", "evictions",
            "max_pool_wait_s", "unfinished"]
    abl_cols = ["variant", "decode_tput", "p99_tpot_ms", "p99_itl_ms", "switch_share", "batches",
                "starvation_batches", "evictions", "max_pool_wait_s"]
    md = (f"Llama-2-7B, H100 analytic cost model, padded attention; 4P+1D; {args.n} requests per workload "
          f"at {RATE} req/s. Paper: up to 1.98x decode throughput, <= 8.6-12.4 % switch iterations.\n\n"
          + markdown_table(rows, cols) + "\n## Ablations (95 % short)\n\n" + markdown_table(ablations, abl_cols)
          + "\n![throughput](decode_alignedserve.png)\n")
    write_result("decode_alignedserve", metrics, markdown=md,
                 extra={"rows": rows, "ablations": ablations,
                        "setup": {"model": MODEL, "hardware": HARDWARE, "attention": "padded", "rate": RATE,
                                  "n": args.n, "host_kv_tokens": HOST_TOKENS, "num_prefill": 4,
                                  "prefetch_tokens_per_s": pcie_tokens_per_s}})
    plot(rows, RESULTS_DIR / "decode_alignedserve.png")
    print({k: round(v, 3) for k, v in metrics.items()})


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [f"mix-{int(r * 100)}short" for r in SHORT_RATIOS]
    x = [int(r * 100) for r in SHORT_RATIOS]
    for policy, style in (("continuous", "o-"), ("alignedserve", "s-")):
        pts = {r["workload"]: r for r in rows if r["policy"].split()[0] == policy}
        ax1.plot(x, [pts[n]["decode_tput"] for n in names], style, label=policy)
        ax2.plot(x, [pts[n]["p99_itl_ms"] for n in names], style, label=policy)
    ax1.set(xlabel="short requests (%)", ylabel="decode throughput (tok/s)", title="Decode throughput")
    ax2.set(xlabel="short requests (%)", ylabel="P99 inter-token latency (ms)", title="P99 iteration latency")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("AlignedServe vs continuous batching (Llama-2-7B, H100, padded attention, simulator)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
