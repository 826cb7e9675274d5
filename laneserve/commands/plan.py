"""``laneserve plan``: the cheapest deployment that serves a workload within its SLOs.

Give a workload (``--trace``, or a bundled ``--workload`` with ``--workload-opt``; ``--arrival``
replaces its arrival process), its SLOs (the workload's own, ``--ttft-slo-ms``/``--tpot-slo-ms`` for
every request, or ``--slo-class NAME:ttft_ms=X,tpot_ms=Y[,target=F]`` per class; ``--target``: the
fraction of each class's requests that must meet both), a model and GPU types, and either a
target rate (``--request-rate``: the fewest GPUs) or a GPU budget (``--budget``: the most goodput).

The search covers colocated and disaggregated layouts, prefill:decode instance counts, the TP
degree of each role, decode batch caps, prefill chunk sizes and policy presets (adaptive and the
baselines). A fast analytic bound prunes layouts that cannot reach the rate before any is
simulated; the survivors are simulated on the workload, cheapest first, over ``--jobs`` processes
(or Ray tasks with ``--ray-address``). Step times come from the ``--engine`` cost model (default
vllm: fitted on aiconfigurator's measured operators; ``--engine laneserve --profile FILE...``: the
engine's own profiles for the TP degrees they cover, the analytic model for the others).

Writes ``<name>.json``/``.md`` (ranked layouts, winner, its attainment curve, the ``laneserve
serve`` command deploying it) and ``<name>.png`` (Pareto front of goodput per GPU vs attainment,
and the winner's attainment against the request rate) into ``--output``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from laneserve.commands.argtypes import (MAX_COUNT, MAX_GPUS, MAX_TOKENS, at_least, existing_file, fraction,
                                         number_list, output_folder, positive)
from laneserve.commands.flag_names import add_slo_target_flags, renamed


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="find the cheapest deployment meeting a workload's SLOs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload and SLOs")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="Azure-format CSV or Mooncake-format JSONL (.gz ok); SLOs "
                     "by laneserve sim's rule for traces unless --ttft-slo-ms/--tpot-slo-ms/--slo-class")
    src.add_argument("--workload", default="azure_conv", help="bundled workload (laneserve sim --list)")
    w.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option of the bundled workload (repeatable)")
    w.add_argument("--num-requests", type=at_least(0, int, MAX_COUNT), default=500, help="first N requests (default 500; 0 = all)")
    w.add_argument("--arrival", default=None, metavar="poisson|gamma",
                   help="replace the arrival process (default: the workload's own arrivals, rescaled)")
    w.add_argument("--cv", type=positive(float, 100), default=1.0, help="coefficient of variation of gamma arrivals (> 1: bursty)")
    w.add_argument("--seed", type=int, default=0, help="seed of --arrival")
    add_slo_target_flags(w, "every request")
    w.add_argument("--slo-class", action="append", default=[], metavar="NAME:ttft_ms=X,tpot_ms=Y[,target=F]",
                   help="SLO (and attainment target) of one request class (repeatable)")
    w.add_argument("--target", type=fraction, default=0.9,
                   help="fraction of each class's requests that must meet TTFT and TPOT (default 0.9)")
    g = p.add_argument_group("objective")
    obj = g.add_mutually_exclusive_group()
    obj.add_argument("--request-rate", dest="rate", type=positive(float, 1e6), metavar="RATE",
                     help="target request rate (req/s): minimise GPUs (default: the workload's own mean rate)")
    renamed(obj, "--rate", canonical="--request-rate", dest="rate", type=positive(float, 1e6))
    obj.add_argument("--budget", type=at_least(1, int, MAX_GPUS),
                     help=f"GPU budget: maximise goodput within it (at most {MAX_GPUS})")
    s = p.add_argument_group("search space")
    s.add_argument("--model", default="llama-3.1-8b", help="model spec (laneserve sim --list)")
    s.add_argument("--gpus", default="h100", help="comma-separated GPU types to consider (h100,h200,a100)")
    s.add_argument("--engine", default="vllm", help="cost model: vllm (default) | sglang | trtllm | legacy | laneserve")
    s.add_argument("--profile", type=existing_file, action="append", default=[], metavar="FILE",
                   help="with --engine laneserve: a laneserve profile (repeatable, one per TP degree); the "
                        "degrees they cover are charged on them, the others on the analytic model")
    s.add_argument("--tp", type=number_list(int, low=1, high=64), default="1,2,4,8", help="tensor-parallel degrees per role (default 1,2,4,8)")
    s.add_argument("--layouts", default="colocated,disaggregated", help="colocated and/or disaggregated")
    s.add_argument("--presets", default="adaptive,fcfs,cp-edf,colocated",
                   help="policy presets: adaptive, fcfs, cp-edf (disaggregated), colocated")
    s.add_argument("--max-batch", type=number_list(int, low=1, high=65536), default="64,256", help="decode batch caps to try (default 64,256)")
    s.add_argument("--chunks", type=number_list(int, low=1, high=MAX_TOKENS), default="2048", help="prefill chunk sizes / token budgets to try (default 2048)")
    s.add_argument("--max-gpus", type=at_least(1, int, MAX_GPUS), default=64, help="largest layout considered with --request-rate")
    s.add_argument("--max-sims", type=at_least(1, int, 100_000), default=150, help="at most this many layouts simulated")
    s.add_argument("--router-policy", dest="router", default="round-robin", help="prefill router of every layout")
    renamed(s, "--router", canonical="--router-policy", dest="router")
    s.add_argument("--prune-slack", type=positive(float, 1000), default=1.0,
                   help="prune a layout when its bound x this is below the rate needed (> 1: prune less)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=at_least(1, int), default=15, help="rows of the ranked table printed")
    o.add_argument("--output", type=output_folder, default="out/plan", help="folder for JSON/markdown/PNG")
    o.add_argument("--name", default="plan", help="file name stem of the report")
    o.add_argument("--model-path", default="<CHECKPOINT>", help="checkpoint folder in the printed serve command")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--no-curve", action="store_true", help="skip the winner's attainment curve")
    o.add_argument("--jobs", "-j", type=at_least(1, int, 1024), default=None, help="worker processes (default: all cores)")
    o.add_argument("--ray-address", default=None, metavar="ADDRESS|auto",
                   help="simulate layouts as Ray tasks on this cluster instead of --jobs processes")
    p.set_defaults(func=run)


def parse_slo_class(text: str) -> tuple[str, float | None, float | None, float | None]:
    """``NAME:ttft_ms=X,tpot_ms=Y[,target=F]`` -> (name, ttft s, tpot s, target)."""
    name, _, body = text.partition(":")
    if not name or not body:
        raise ValueError(f"--slo-class {text!r}: expected NAME:ttft_ms=X,tpot_ms=Y[,target=F]")
    vals: dict[str, float] = {}
    for part in body.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("ttft_ms", "tpot_ms", "target") or not value:
            raise ValueError(f"--slo-class {text!r}: unknown or empty key {key!r}")
        try:
            vals[key] = (fraction if key == "target" else positive(float))(value)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--slo-class {text!r}: {key}: {exc}") from None
    ttft = vals["ttft_ms"] / 1e3 if "ttft_ms" in vals else None
    tpot = vals["tpot_ms"] / 1e3 if "tpot_ms" in vals else None
    return name.strip(), ttft, tpot, vals.get("target")


def build_spec(args: argparse.Namespace):
    """(PlanSpec, a description of the workload) from the parsed flags; ValueError on bad input."""
    from laneserve.commands.common import load_workload
    from laneserve.core import SLO
    from laneserve.plan import PlanSpec
    from laneserve.plan.planner import cost_model, fits
    from laneserve.workloads import IdleLatencySLO

    args.slo_scale = 1.0
    wl = load_workload(args, apply_slo_scale=False)
    gpus = [g.strip().lower() for g in args.gpus.split(",") if g.strip()]
    if not gpus:
        raise ValueError("--gpus names no GPU")
    tps = args.tp
    engine = _engine(args)
    if args.trace is not None and not args.slo_class:
        tp0 = next((tp for tp in sorted(tps) if fits(args.model, gpus[0], tp, engine)), None)
        if tp0 is None:
            raise ValueError(f"{args.model} fits on no TP degree of {args.tp} on {gpus[0]}")
        wl = IdleLatencySLO().apply(wl, cost_model(args.model, gpus[0], tp0, engine),
                                    ttft=args.ttft_slo, tpot=args.tpot_slo)
    targets = {}
    if args.slo_class:
        table = {}
        for text in args.slo_class:
            name, ttft, tpot, target = parse_slo_class(text)
            table[name] = SLO(ttft, tpot)
            if target is not None:
                targets[name] = target
        known = {s.slo_class for s in wl.specs}
        missing = sorted(set(table) - known)
        if missing:
            raise ValueError(f"--slo-class names class(es) {missing} the workload lacks (it has {sorted(known)})")
        wl = wl.with_slo(table)
    rate = args.rate
    if args.arrival:
        wl = wl.with_arrivals(args.arrival, rate=rate or wl.mean_rate, cv=args.cv, seed=args.seed)
    if args.budget is None and rate is None:
        rate = round(wl.mean_rate, 3)
    spec = PlanSpec(workload=wl, model=args.model, gpus=gpus, engine=engine, rate=rate,
                    budget=args.budget, target=args.target, class_targets=targets, tps=tps,
                    presets=[x.strip() for x in args.presets.split(",") if x.strip()],
                    max_batches=args.max_batch, chunks=args.chunks,
                    modes=[x.strip() for x in args.layouts.split(",") if x.strip()],
                    max_gpus=args.max_gpus, max_sims=args.max_sims, router=args.router,
                    prune_slack=args.prune_slack)
    return spec


def _engine(args: argparse.Namespace):
    """The engine the plan charges: ``--engine``'s name, or with ``--profile``, the laneserve engine
    on those profiles (:class:`~laneserve.plan.planner.ProfiledEngine`)."""
    if not args.profile:
        return args.engine
    if args.engine.strip().lower() != "laneserve":
        raise ValueError(f"--profile times laneserve's engine: pass --engine laneserve (not {args.engine!r})")
    from laneserve.plan.planner import ProfiledEngine
    return ProfiledEngine.of([str(p) for p in args.profile])


COLUMNS = ("rank", "layout", "gpus", "bound_rate", "rate", "goodput", "meets", "attainment_both",
           "worst_class", "goodput_per_gpu", "p90_ttft_ms", "p90_tpot_ms")


def table_rows(result, top: int | None = None) -> list[dict]:
    rows = []
    for i, r in enumerate(result.ranked[:top] if top else result.ranked, 1):
        worst = min(r["per_class"].items(), key=lambda kv: kv[1]) if r["per_class"] else ("", None)
        rows.append({"rank": i, **{k: r.get(k) for k in COLUMNS if k in r},
                     "worst_class": f"{worst[0]} {worst[1]:.3f}" if worst[1] is not None else ""})
    return rows


def plot_plan(path: Path, result, curve: list[dict] | None, title: str) -> Path:
    """Left: goodput per GPU against attainment of every simulated layout, the Pareto front
    joined, the winner starred. Right: the winner's simulated attainment against the rate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    fig = Figure(figsize=(10.5, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(1, 2)
    rows = result.ranked
    target = result.spec.target
    for mode, marker in (("colocated", "s"), ("disaggregated", "o")):
        pts = [(r["attainment_both"] or 0.0, r["goodput_per_gpu"]) for r in rows if r["mode"] == mode]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=18, alpha=0.6, label=mode)
    pts = sorted(((r["attainment_both"] or 0.0, r["goodput_per_gpu"]) for r in rows), key=lambda p: (-p[0], -p[1]))
    front, best = [], -1.0
    for a, g in pts:
        if g > best:
            front.append((a, g))
            best = g
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="k", lw=1, label="Pareto front")
    if result.winner is not None:
        w = result.winner
        ax.scatter([w["attainment_both"]], [w["goodput_per_gpu"]], marker="*", s=180, color="red",
                   label=f"winner ({w['gpus']} GPUs)", zorder=5)
    ax.axvline(target, color="grey", ls="--", lw=1)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("attainment (both SLOs)")
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    if curve:
        xs = [c["rate"] for c in curve]
        ax2.plot(xs, [c["attainment_both"] for c in curve], marker="o", label="all requests")
        for name in sorted(curve[0]["per_class"]) if len(curve[0]["per_class"]) > 1 else []:
            ax2.plot(xs, [c["per_class"].get(name, 0.0) for c in curve], marker=".", lw=1, label=name)
        ax2.axhline(target, color="grey", ls="--", lw=1)
        if result.spec.rate is not None:
            ax2.axvline(result.spec.rate, color="red", ls=":", lw=1, label="target rate")
        ax2.set_ylim(0, 1.02)
        ax2.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax2.set_xlabel("request rate (req/s)")
        ax2.set_ylabel("attainment (both SLOs)")
        ax2.set_title("winner, simulated", fontsize="small")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize="small")
    import textwrap
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize="medium")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def run(args: argparse.Namespace) -> int:
    from laneserve.measure.parallel import workers
    from laneserve.plan.planner import WorkloadShape

    try:
        spec = build_spec(args)
        jobs = workers(args.jobs, args.ray_address)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wl = spec.workload
    slos = WorkloadShape.of(wl).class_slos()
    goal = f"rate {spec.rate:g} req/s, fewest GPUs" if spec.rate is not None else f"budget {spec.budget} GPUs, most goodput"
    print(f"workload: {wl.name}, {len(wl)} requests, native rate {wl.mean_rate:.2f} req/s; classes: "
          + ", ".join(f"{k} ({s.ttft} s TTFT, {s.tpot} s TPOT)" for k, s in slos.items())
          + f"; target {spec.target:g}; {goal}; model {spec.model} on {','.join(spec.gpus)}, engine {spec.engine}",
          file=sys.stderr)
    t0 = time.perf_counter()
    result, curve = _search(args, spec, jobs)
    search_s = time.perf_counter() - t0
    rows = table_rows(result)
    deploy = _print_result(args, spec, result, rows, search_s)
    args.output.mkdir(parents=True, exist_ok=True)
    png = plot_plan(args.output / f"{args.name}.png", result, curve,
                    f"laneserve plan: {wl.name} ({len(wl)} requests), {spec.model}, {goal}, engine {spec.engine}")
    path = _write_plan(args, spec, result, rows, curve, deploy, slos, png, search_s)
    print(f"wrote {path}, {args.output / (args.name + '.md')}, {png} in {search_s:.1f} s", file=sys.stderr)
    return 0 if result.winner is not None else 1


def _search(args: argparse.Namespace, spec, jobs):
    """(the plan's result, the winner's attainment curve or None), with a progress bar."""
    from laneserve.measure.progress import progress_bar
    from laneserve.plan import attainment_curve, layout_of, plan

    bar = progress_bar(total=min(spec.max_sims, 1), desc="planning", enabled=False if args.no_progress else None)
    last = [0]

    def on_progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - last[0])
        last[0] = done

    result = plan(spec, jobs=jobs, progress=on_progress)
    bar.close()
    curve = None
    if result.winner is not None and not args.no_curve:
        base = spec.rate if spec.rate is not None else result.winner["goodput"]
        rates = [round(base * f, 3) for f in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)]
        curve = attainment_curve(spec, layout_of(result.winner), rates, jobs=jobs)
    return result, curve


def _print_result(args: argparse.Namespace, spec, result, rows: list[dict], search_s: float) -> dict | None:
    """Print the ranked table, the search's statistics and the winner's serve command (returned
    as ``serve_command``'s dict; None without a winner)."""
    from laneserve.bench.report import format_console_table
    from laneserve.plan import layout_of, serve_command

    print(format_console_table(rows[:args.top], [c for c in COLUMNS]))
    print(f"{result.considered} layouts in the search space, {result.simulated} simulated "
          f"({result.simulations} runs), {result.pruned} ruled out by the analytic bound and the "
          f"cheapest-first order, in {result.seconds:.1f} s ({search_s:.1f} s with the curve)", file=sys.stderr)
    deploy = None
    if result.winner is not None:
        deploy = serve_command(layout_of(result.winner), spec, model_path=args.model_path)
        print(f"winner: {result.winner['layout']} -> {result.winner['gpus']} GPUs")
        print(deploy["command"])
    else:
        print("no layout met the targets within the search limits (raise --max-gpus / --max-sims, "
              "or relax the SLOs)")
    return deploy


def _write_plan(args: argparse.Namespace, spec, result, rows: list[dict], curve, deploy, slos: dict, png: Path,
                search_s: float) -> Path:
    """The result JSON and markdown (ranked layouts, deploy command, winner's curve) into ``--output``."""
    import json
    import shlex

    from laneserve.bench.results import markdown_table, write_result

    wl = spec.workload
    headline = {"search_seconds": round(search_s, 2), "layouts_considered": result.considered,
                "layouts_ruled_out_unsimulated": result.pruned, "layouts_simulated": result.simulated,
                "simulator_runs": result.simulations}
    if result.winner is not None:
        w = result.winner
        headline.update({"winner": w["layout"], "winner_gpus": w["gpus"],
                         "winner_attainment_both": w["attainment_both"], "winner_rate": w["rate"],
                         "winner_goodput_per_gpu": w["goodput_per_gpu"]})
    md = (f"## Ranked layouts\n\n{markdown_table(rows[:50], list(COLUMNS))}\n"
          + (f"## Deploy\n\n```\n{deploy['command']}\n```\n\nRay: `{deploy['ray'][0]}`, then "
             f"the command with `--ray-address auto`.\n\nPlacement: {deploy['placement']}\n" if deploy else "")
          + (f"\n## Winner's attainment curve\n\n{markdown_table([{'rate': c['rate'], 'attainment_both': c['attainment_both'], 'p90_ttft_ms': c['p90_ttft_ms'], 'p90_tpot_ms': c['p90_tpot_ms']} for c in curve])}\n" if curve else "")
          + f"\n![plan]({png.name})\n")
    extra = {**result.to_json(), "deploy": deploy, "winner_curve": curve,
             "spec": {"model": spec.model, "gpus": list(spec.gpus), "engine": str(spec.engine), "rate": spec.rate,
                      "budget": spec.budget, "target": spec.target, "class_targets": spec.class_targets,
                      "workload": wl.name, "requests": len(wl),
                      "slos": {k: {"ttft": s.ttft, "tpot": s.tpot} for k, s in slos.items()}}}
    command = "laneserve " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["plan"] else None
    return write_result(args.name, headline, markdown=md, extra=json.loads(json.dumps(extra, default=str)),
                        results_dir=args.output, command=command)
