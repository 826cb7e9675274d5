"""``laneserve sim``: compare scheduling policies on a workload in the simulator.

With no arguments: the first 3,000 requests of the bundled Azure 2023 conversation trace, Llama-3-8B
on the H100 cost model, 1 prefill + 1 decode instance, the default ``adaptive+adaptive`` policies
against the baselines (FCFS and chunked-prefill EDF at 2K and 8K, with continuous-batching
decode), at four request rates; prints a table and writes JSON, markdown
and a PNG plot into ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from laneserve.commands.argtypes import (MAX_COUNT, MAX_GPUS, MAX_TOKENS, at_least, existing_file, fraction,
                                       number_list, output_folder, positive)
from laneserve.commands.flag_names import add_slo_target_flags, renamed
from laneserve.runtime.cluster import DEFAULT_DECODE_ROUTER, DEFAULT_ROUTER


DEFAULT_POLICIES = "adaptive+adaptive,fcfs+continuous,cp-edf-2k+continuous,cp-edf-8k+continuous"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate a cluster and compare scheduling policies",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_workload_flags(p)
    _add_cluster_flags(p)
    _add_cost_model_flags(p)
    _add_output_flags(p)
    p.set_defaults(func=run)


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--trace", type=existing_file, help="Azure-format CSV or Mooncake-format JSONL (.gz ok); its SLOs: "
                     "TTFT = max(0.4 s, 4 x the request's idle prefill time), TPOT = max(50 ms, 4 x its "
                     "idle decode step), on the run's cost model (--ttft-slo-ms/--tpot-slo-ms replace a rule)")
    src.add_argument("--workload", default="azure_conv",
                     help="named workload (default azure_conv); see --list")
    w.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option of a named workload, e.g. long_share=0.2 (repeatable)")
    w.add_argument("--num-requests", type=at_least(0, high=MAX_COUNT), default=3000,
                   help="use the first N requests (default 3000; 0 = all)")
    w.add_argument("--request-rate", dest="rates", default=None, metavar="RATE[,RATE...]",
                   type=number_list(float, low=0, low_open=True),
                   help="comma-separated request rates (req/s) to sweep; default: 4 rates around "
                        "the workload's own")
    renamed(w, "--rates", canonical="--request-rate", dest="rates", type=number_list(float, low=0, low_open=True))
    renamed(w, "--rate", canonical="--request-rate", dest="rate", type=positive())
    add_slo_target_flags(w, "every request (overrides the workload's)")
    w.add_argument("--slo-scale", type=positive(), default=1.0, help="multiply every SLO by this factor")


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster")
    c.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma-separated policy sets to compare: PREFILL+DECODE, or colocated[:opts] "
                        f"(default {DEFAULT_POLICIES})")
    c.add_argument("--prefill", type=at_least(1, high=MAX_GPUS), default=1, help="prefill instances (or colocated instances)")
    c.add_argument("--decode", type=at_least(0, high=MAX_GPUS), default=1, help="decode instances")
    c.add_argument("--router-policy", dest="router", default=DEFAULT_ROUTER, help="prefill router")
    renamed(c, "--router", canonical="--router-policy", dest="router")
    c.add_argument("--decode-router-policy", dest="decode_router", default=DEFAULT_DECODE_ROUTER,
                   help="decode router (auto: the decode policy's own, adaptive -> tpot-aware; else least-loaded)")
    renamed(c, "--decode-router", canonical="--decode-router-policy", dest="decode_router")
    c.add_argument("--host-kv-tokens", type=at_least(0), default=0,
                   help="host KV pool per decode instance, in tokens (default 0: none, except AlignedServe, "
                        "which gets 250 GB of host memory per GPU: 2 TB / 8 GPUs of a DGX H100)")
    c.add_argument("--predictor", choices=("online", "oracle", "profile"), default="online",
                   help="where SLO-aware policies get their latency predictions: online (default: "
                        "learned from each instance's own step times), oracle (the cost model that "
                        "charges the time) or profile (an offline fit with ~10%% noise)")
    c.add_argument("--max-model-len", type=at_least(0, high=MAX_TOKENS), default=None, metavar="N",
                   help="reject requests whose prompt + output exceed N tokens (default: the model's "
                        "context; 0 = no limit); rejected requests count as misses")
    c.add_argument("--prefix-cache-tokens", type=at_least(0), default=None, metavar="N",
                   help="give each prefill instance its own LRU prefix cache of N tokens (0 = its KV "
                        "capacity) for policies run with prefix_caching=true; default: idealised "
                        "(a request's prefix counts as cached wherever it lands)")
    c.add_argument("--kv-link", default="nvlink", help="prefill->decode KV link (nvlink, infiniband, pcie)")


def _add_cost_model_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("cost model")
    m.add_argument("--cost-model", default="analytic", help="analytic | fitted | linear")
    m.add_argument("--model", default="llama-3-8b", help="model spec (see --list)")
    m.add_argument("--hardware", default="h100", help="h100 | h200 | a100")
    m.add_argument("--tensor-parallel-size", "-tp", dest="tp", type=at_least(1, high=64), default=1,
                   help="tensor-parallel degree per instance (the default of both roles below)")
    renamed(m, "--tp", canonical="--tensor-parallel-size", dest="tp", type=at_least(1, high=64))
    m.add_argument("--prefill-tensor-parallel-size", dest="prefill_tp", type=at_least(1, high=64), default=None,
                   metavar="N", help="tensor-parallel degree of each prefill instance (default: -tp); its "
                                     "steps are charged on that degree's cost model")
    m.add_argument("--decode-tensor-parallel-size", dest="decode_tp", type=at_least(1, high=64), default=None,
                   metavar="N", help="tensor-parallel degree of each decode instance (default: -tp)")
    m.add_argument("--attention", default="ragged", help="decode attention kernel: ragged | padded")
    m.add_argument("--profile", type=existing_file, action="append", default=[], metavar="FILE",
                   help="engine profile JSON (laneserve profile) for --cost-model fitted or --engine laneserve; "
                        "a profile of a -tp N instance needs --tensor-parallel-size N. Repeatable: one "
                        "profile per degree, each role charged on the one of its own degree")
    m.add_argument("--engine", default="legacy",
                   help="whose kernels the analytic model charges: legacy (default: the original "
                        "constants) | vllm | sglang | trtllm (fitted on aiconfigurator's measured "
                        "operators: split-KV decode, FlashAttention-3, custom all-reduce) | laneserve")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--goodput-search", dest="goodput", action="store_true",
                   help="also search each policy's goodput (highest rate with >= 90%% attainment)")
    renamed(o, "--goodput", canonical="--goodput-search", dest="goodput", flag=True)
    o.add_argument("--slo-scale-search", action="store_true",
                   help="also search each policy's tightest SLO scale reaching the target at the "
                        "first rate")
    o.add_argument("--target", type=fraction, default=0.9,
                   help="attainment target for the searches (default 0.9)")
    o.add_argument("--output", type=output_folder, default=Path("out/sim"), help="folder for JSON/markdown/PNG")
    o.add_argument("--name", default="sim", help="file name stem of the report")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--jobs", "-j", type=at_least(1, high=1024), default=None,
                   help="worker processes for the (policy x rate) grid and the searches (default: all "
                        "cores; 1 = this process). Results are identical whatever the number")
    o.add_argument("--ray-address", default=None, metavar="ADDRESS|auto",
                   help="run the grid and the searches as Ray tasks on this cluster instead of --jobs "
                        "processes (same results)")
    o.add_argument("--list", action="store_true", help="list workloads, policies, models and exit")
    o.add_argument("--list-policies", action="store_true",
                   help="list every policy with its options and their defaults, and its presets, and exit")


def _list() -> None:
    from laneserve.costmodel import available_hardware, available_models
    from laneserve.policies import available
    from laneserve.workloads import available_workloads, workload_options
    print("workloads:")
    for name in available_workloads():
        print(f"  {name:18s} options: {', '.join(workload_options(name))}")
    for kind in ("prefill", "decode", "colocated", "router"):
        print(f"{kind} policies: {', '.join(available(kind))}")
    print("(--list-policies: their options)")
    print(f"models: {', '.join(available_models())}")
    print(f"hardware: {', '.join(available_hardware())}")


def _list_policies() -> None:
    from laneserve.policies.registry import describe
    print("spec: NAME[:key=value,...]; each policy with its options (defaults) and presets")
    for kind in ("prefill", "decode", "colocated", "router"):
        print(f"{kind}:")
        for line in describe(kind):
            print(f"  {line}")


def run(args: argparse.Namespace) -> int:
    if args.list:
        _list()
        return 0
    if args.list_policies:
        _list_policies()
        return 0
    from laneserve.bench.experiment import sweep
    from laneserve.measure.parallel import workers
    from laneserve.measure.progress import progress_bar
    from laneserve.bench.report import format_console_table

    try:
        wl, cost, base, policies, slo_rule = _setup(args)
        rates = _rates(args, wl)
        jobs = workers(args.jobs, args.ray_address)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    _print_setup(args, wl, cost, base, policies)
    t0 = time.perf_counter()
    bar = progress_bar(total=len(policies) * len(rates), desc=f"simulating ({jobs if args.ray_address else f'{jobs} jobs'})",
                       enabled=False if args.no_progress else None)
    rows = sweep(wl, policies, rates, cost, slo_scale=args.slo_scale, on_point=lambda *_: bar.update(1), jobs=jobs)
    bar.close()
    goodputs, scales = _searches(args, wl, policies, cost, rates, jobs)
    cols = ["policy", "rate", "attainment_ttft", "attainment_tpot", "attainment_both", "p90_ttft_ms",
            "p99_ttft_ms", "p90_tpot_ms", "output_throughput", "rejected"]
    print(format_console_table(rows, cols))
    if slo_rule is not None:
        print(f"SLO rule (--trace): {slo_rule}")
    paths = _write_report(args, rows, wl, cost, slo_rule, goodputs, scales, rates)
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0


def _setup(args: argparse.Namespace):
    """(workload, cost model, base cluster config, {spec: config} of the policy sets, the trace's
    SLO rule or None) from the flags; ValueError on bad input."""
    from laneserve.bench.experiment import policy_config, split_policy_sets, validate
    from laneserve.commands.common import load_workload
    from laneserve.sim import ClusterConfig
    from laneserve.workloads import IdleLatencySLO

    wl = load_workload(args, apply_slo_scale=False)
    cost, prefill_kv_tokens = _cost_model(args)
    base = ClusterConfig(num_prefill=args.prefill, num_decode=args.decode, num_colocated=args.prefill,
                         router=args.router, decode_router=args.decode_router,
                         host_kv_tokens=args.host_kv_tokens, kv_link=args.kv_link,
                         prefix_cache_tokens=args.prefix_cache_tokens, predictor=args.predictor,
                         max_model_len=args.max_model_len, prefill_kv_tokens=prefill_kv_tokens)
    slo_rule = None
    if args.trace is not None:       # one rule for any trace file, on the run's cost model
        wl = IdleLatencySLO().apply(wl, cost, ttft=args.ttft_slo, tpot=args.tpot_slo)
        slo_rule = wl.meta["slo_rule"]
    policies = {spec: policy_config(spec, base) for spec in split_policy_sets(args.policies)}
    if not policies:
        raise ValueError("--policies names no policy set")
    if _role_degrees(args) is not None and any(c.mode == "colocated" for c in policies.values()):
        raise ValueError("colocated instances take --tensor-parallel-size, not the per-role flags: "
                         "simulate the colocated policy sets in a run of their own")
    for config in policies.values():
        validate(config, cost)
    return wl, cost, base, policies, slo_rule


def _role_degrees(args: argparse.Namespace) -> tuple[int, int] | None:
    """(prefill degree, decode degree) when the per-role flags make them differ; None when every
    instance runs at ``-tp``."""
    pre = args.prefill_tp or args.tp
    dec = args.decode_tp or args.tp
    return None if pre == dec else (pre, dec)


def _cost_model(args: argparse.Namespace):
    """(the run's cost model, the prefill instances' KV tokens or None). Every instance at one
    degree: that degree's model. Per-role degrees: a :class:`RoleCostModel` charging each role's
    steps on its own degree's model, and the prefill instances' KV sized from theirs (the decode
    side's from the decode model). A degree's model reads the ``--profile`` of that degree (one
    profile: it, whatever its degree says)."""
    from laneserve.costmodel import make_cost_model
    from laneserve.costmodel.profile import profile_for_degree
    from laneserve.costmodel.roles import RoleCostModel
    from laneserve.sim import ClusterConfig
    from laneserve.sim.config import kv_capacity_tokens

    def at(tp: int):
        return make_cost_model(args.cost_model, model=args.model, hardware=args.hardware, tp=tp,
                               attention=args.attention,
                               profile=profile_for_degree(args.profile, tp) if args.profile else None,
                               engine=args.engine)

    degrees = _role_degrees(args)
    if degrees is None:
        return at(args.prefill_tp or args.tp), None
    pre = at(degrees[0])
    return RoleCostModel(pre, at(degrees[1])), kv_capacity_tokens(pre, ClusterConfig().gpu_memory_utilization)


def _rates(args: argparse.Namespace, wl) -> list[float]:
    """The request rates to sweep: the flags', else 1, 2, 4 and 6 x the workload's own rate (x prefill instances)."""
    if args.rate is not None:
        rates = [args.rate]
    elif args.rates:
        rates = list(args.rates)
    else:
        r0 = wl.mean_rate * max(1, args.prefill)
        rates = [round(r0 * f, 2) for f in (1, 2, 4, 6)]
    if not rates or min(rates) <= 0:
        raise ValueError("request rates must be > 0")
    return rates


def _print_setup(args: argparse.Namespace, wl, cost, base, policies: dict) -> None:
    from laneserve.sim.config import decode_router_name
    print(f"workload: {wl.name}, {len(wl)} requests, native rate {wl.mean_rate:.2f} req/s; "
          f"cost model: {cost!r}; predictor: {args.predictor}", file=sys.stderr)
    if args.decode_router == "auto" and base.mode == "disaggregated":
        routers = {spec: decode_router_name(config) for spec, config in policies.items()
                   if config.mode == "disaggregated"}
        print("decode router (auto): " + ", ".join(f"{spec} -> {name}" for spec, name in routers.items()),
              file=sys.stderr)


def _searches(args: argparse.Namespace, wl, policies: dict, cost, rates: list[float], jobs) -> tuple[dict, dict]:
    """({policy: goodput}, {policy: tightest SLO scale}) for the searches the flags ask for ({} otherwise)."""
    from laneserve.bench.experiment import policy_goodput, policy_slo_scale
    from laneserve.measure.parallel import map_jobs
    goodputs = {}
    if args.goodput:
        found = map_jobs(policy_goodput, [(wl, config, cost, min(rates) / 4, max(rates) * 4, args.target,
                                           args.slo_scale) for config in policies.values()], jobs)
        for name, res in zip(policies, found):
            goodputs[name] = res.value
            print(f"goodput[{name}] = {res.value if res.value is not None else 'not met'} req/s "
                  f"({res.evals} runs)", file=sys.stderr)
    scales = {}
    if args.slo_scale_search:
        found = map_jobs(policy_slo_scale, [(wl, config, cost, rates[0], args.target)
                                            for config in policies.values()], jobs)
        for name, res in zip(policies, found):
            scales[name] = res.value
            print(f"tightest SLO scale[{name}] at {rates[0]} req/s = "
                  f"{res.value if res.value is not None else 'not met'} ({res.evals} runs)", file=sys.stderr)
    return goodputs, scales


def _write_report(args: argparse.Namespace, rows, wl, cost, slo_rule, goodputs: dict, scales: dict,
                  rates: list[float]) -> dict:
    """JSON, markdown and PNG into ``--output``; the JSON's metrics carry the predictor, the SLO
    rule and the searches' results."""
    from laneserve.bench.report import write_report
    paths = write_report(args.output, args.name, rows, y_keys=("attainment_ttft", "attainment_both"),
                         title=f"{wl.name} on {cost!r}")
    data = json.loads(paths["json"].read_text())
    data["metrics"]["predictor"] = args.predictor
    if slo_rule is not None:
        data["metrics"]["slo_rule"] = slo_rule
    if goodputs:
        data["metrics"]["goodput"] = goodputs
    if scales:
        data["metrics"]["tightest_slo_scale"] = {"rate": rates[0], **scales}
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    return paths
