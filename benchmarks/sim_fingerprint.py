"""Per-request fingerprints of the simulator configurations the league and the reproductions use:
a refactor that must not change behaviour is checked with ``--check`` against the committed file.

Every league workload x entry x shape x predictor mode runs at two rates (0.6x and 1.5x the
workload's prefill capacity estimate) on its first 150 (1P+1D) or 300 (4P+4D) requests, plus the
colocated mode and the reproductions' literal presets. A run's fingerprint is the SHA-256 of every
request's (id, finish reason, phase, prefill, transfer, first-token and finish times, longest gap, output tokens, preemptions,
prefill and decode instance) and the instance counters. ``--check`` exits 1 naming every
configuration whose fingerprint changed.

    python benchmarks/sim_fingerprint.py            # write benchmarks/results/sim_fingerprint.json
    python benchmarks/sim_fingerprint.py --check    # compare against it
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import league  # noqa: E402  (benchmarks/league.py: the league's workloads and entries)

from laneserve.bench.league import SHAPES, capacity_estimate, entry_config  # noqa: E402
from laneserve.measure.parallel import default_jobs, map_jobs  # noqa: E402
from laneserve.costmodel import make_cost_model  # noqa: E402
from laneserve.sim import ClusterConfig, Simulator  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "sim_fingerprint.json"
SIZES = {"1P+1D": 150, "4P+4D": 300}
RATE_FACTORS = (0.6, 1.5)
#: the reproductions' own presets and the colocated mode (name -> config fields)
EXTRA = {
    "sedf-chunk+continuous": dict(prefill_policy="sedf-chunk", decode_policy="continuous"),
    "d-edf+continuous": dict(prefill_policy="d-edf", decode_policy="continuous"),
    "laps-literal+continuous": dict(prefill_policy="laps-literal", decode_policy="continuous"),
    "kairos-literal+kairos-literal": dict(prefill_policy="kairos-literal", decode_policy="kairos-literal"),
    "fcfs+alignedserve-literal": dict(prefill_policy="fcfs", decode_policy="alignedserve-literal"),
    "colocated": dict(mode="colocated", num_colocated=2, colocated_policy="colocated"),
    "colocated-cp-edf": dict(mode="colocated", num_colocated=2,
                             colocated_policy="colocated:prefill=cp-edf-2k,decode=continuous"),
    "colocated-adaptive": dict(mode="colocated", num_colocated=2,
                               colocated_policy="colocated:prefill=adaptive,decode=adaptive"),
}


def fingerprint(result) -> str:
    h = hashlib.sha256()
    for r in sorted(result.requests, key=lambda r: r.request_id):
        t = r.times
        h.update(repr((r.request_id, r.finish_reason, r.phase.name, t.prefill_start, t.prefill_end,
                       t.transfer_start, t.transfer_end, t.first_token, t.finished, t.max_itl, r.num_output_tokens, r.num_preemptions, r.prefill_instance,
                       r.decode_instance)).encode())
    h.update(repr([sorted((k, v) for k, v in s.items() if k != "role") for s in result.instances]).encode())
    return h.hexdigest()[:16]


def run_one(key: str, workload, config: ClusterConfig, cost, rate: float) -> tuple[str, str]:
    result = Simulator(config, cost).run(workload.with_rate(rate).specs)
    return key, fingerprint(result)


def tasks(cost) -> list[tuple]:
    out = []
    from laneserve.bench.league import missing_policy
    for w in league.WORKLOADS:
        for shape in w.shapes:
            wl = w.build(SIZES[shape], cost)
            cap = capacity_estimate(wl, cost, SHAPES[shape][0],
                                    cached=bool(w.prefill_opts.get("prefix_caching")))
            entries = [e for e in league.ENTRIES if shape in e.shapes and missing_policy(e) is None]
            for e in entries:
                for mode in ("online", "oracle"):
                    cfg = entry_config(e, shape, w, mode, host_kv_tokens=league.HOST_KV_TOKENS)
                    for f in RATE_FACTORS:
                        out.append((f"{w.name}|{shape}|{e.name}|{mode}|{f}", wl, cfg, cost, cap * f))
            if shape == "1P+1D":
                for name, fields in EXTRA.items():
                    cfg = replace(ClusterConfig(host_kv_tokens=league.HOST_KV_TOKENS, router="least-loaded",
                                                prefill_opts=dict(w.prefill_opts)), **fields)
                    for f in RATE_FACTORS:
                        out.append((f"{w.name}|{shape}|{name}|online|{f}", wl, cfg, cost, cap * f))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed fingerprints")
    ap.add_argument("--jobs", "-j", type=int, default=default_jobs())
    ap.add_argument("--only", help="run only configurations whose key contains this text")
    args = ap.parse_args()
    cost = make_cost_model("analytic", model=league.MODEL, hardware=league.HARDWARE)
    todo = [t for t in tasks(cost) if not args.only or args.only in t[0]]
    print(f"{len(todo)} configurations", file=sys.stderr)
    got = dict(map_jobs(run_one, todo, args.jobs))
    if not args.check:
        OUT.write_text(json.dumps(dict(sorted(got.items())), indent=1) + "\n")
        print(f"wrote {OUT} ({len(got)} fingerprints)")
        return 0
    want = json.loads(OUT.read_text())
    changed = [k for k in got if want.get(k) != got[k]]
    for k in changed:
        print(f"changed: {k}  {want.get(k)} -> {got[k]}")
    print(f"{len(got) - len(changed)}/{len(got)} fingerprints identical")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
