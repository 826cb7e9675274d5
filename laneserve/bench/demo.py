"""``make demo``: what the project is for, on the bundled trace, in well under a minute.

Runs ``laneserve sim`` with goodput searches on the first ``REQUESTS`` requests of the bundled
Azure 2023 conversation trace (Llama-3-8B on the H100 cost model, 1 prefill + 1 decode instance,
TTFT 0.4 s, TPOT 50 ms): FCFS + continuous batching, each paper's policy (FlowPrefill's S-EDF,
Kairos, LAPS, AlignedServe) and the ``adaptive+adaptive`` default when it is registered. It prints
the attainment-vs-rate table, writes ``<output>/sim.{json,md,png}``, and ends with one line saying
how much more goodput the default gets than FCFS + continuous batching (without ``adaptive``: the
best policy of the run, said so).

    python -m laneserve.bench.demo --output out/demo
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

BASELINE = "fcfs+continuous"
PAPER_POLICIES = ("sedf+continuous", "kairos+kairos", "laps+continuous", "fcfs+alignedserve")
DEFAULT = "adaptive+adaptive"
REQUESTS = 500
RATES = "8,16,24,32"          # req/s; the goodput search spans RATES' min / 4 .. max * 4
HOST_KV_TOKENS = 1_000_000    # AlignedServe parks requests in a host pool; every policy gets it


def registered(policy_set: str) -> bool:
    """Whether both halves of ``prefill+decode`` are registered policies."""
    from laneserve.policies import registry
    prefill, _, decode = policy_set.partition("+")
    try:
        registry.resolve("prefill", prefill)
        registry.resolve("decode", decode)
    except ValueError:
        return False
    return True


def demo_policies() -> list[str]:
    """FCFS + CB, the paper policies, and the default when it is registered."""
    return [BASELINE, *PAPER_POLICIES, *([DEFAULT] if registered(DEFAULT) else [])]


def summary_line(goodputs: Mapping[str, float | None], *, default: str = DEFAULT,
                 baseline: str = BASELINE) -> str:
    """One sentence: the default's goodput against the baseline's (a goodput never met is 0).
    Without the default in ``goodputs``, the best other policy is named instead, and said to be."""
    base = goodputs.get(baseline) or 0.0
    if default in goodputs:
        name, got, who = default, goodputs[default] or 0.0, f"The default, {default},"
    else:
        others = {k: v or 0.0 for k, v in goodputs.items() if k != baseline}
        if not others:
            return f"Only {baseline} ran: nothing to compare."
        name = max(others, key=others.get)
        got, who = others[name], f"{default} is not registered; the best policy here, {name},"
    if base <= 0:
        return f"{who} reaches {got:.2f} req/s of goodput; {baseline} never meets the 90% target."
    ratio = got / base
    return (f"{who} gets {ratio:.2f}x the goodput of {baseline} ({got:.2f} vs {base:.2f} req/s, "
            f"{100 * (ratio - 1):+.0f}%).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", type=Path, default=Path("out/demo"))
    ap.add_argument("--num-requests", type=int, default=REQUESTS)
    ap.add_argument("--jobs", "-j", type=int, default=None, help="worker processes (default: all cores)")
    args = ap.parse_args(argv)
    from laneserve.cli import main as cli
    sim_args = ["sim", "--policies", ",".join(demo_policies()), "--num-requests", str(args.num_requests),
                "--request-rate", RATES, "--host-kv-tokens", str(HOST_KV_TOKENS), "--goodput-search", "--no-progress",
                "--output", str(args.output)]
    if args.jobs is not None:
        sim_args += ["--jobs", str(args.jobs)]
    rc = cli(sim_args)
    if rc:
        return rc
    goodputs = json.loads((args.output / "sim.json").read_text())["metrics"]["goodput"]
    print(summary_line(goodputs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
