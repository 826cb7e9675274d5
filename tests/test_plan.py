"""``laneserve plan``: the planner's winner, its ranking, the analytic bound, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from laneserve.cli import main
from laneserve.plan import Layout, PlanSpec, plan, serve_command
from laneserve.plan.planner import WorkloadShape, bound, rank_key, simulated_row
from laneserve.workloads import make_workload


@pytest.fixture(scope="module")
def spec() -> PlanSpec:
    wl = make_workload("azure_conv").head(120)
    return PlanSpec(workload=wl, model="llama-3.1-8b", gpus=("h100",), engine="vllm", rate=25.0,
                    tps=(1, 2), presets=("fcfs", "colocated"), max_batches=(256,), max_sims=24)


@pytest.fixture(scope="module")
def result(spec):
    return plan(spec, jobs=1)


def test_winner_simulates_to_the_attainment_it_reports(spec, result):
    w = result.winner
    assert w is not None and w["meets"]
    again = simulated_row(spec, Layout(**w["_layout"]))
    assert again["attainment_both"] == w["attainment_both"]
    assert again["per_class"] == w["per_class"]
    assert again["attainment_both"] >= spec.target
    # nothing simulated that meets the target is cheaper
    assert all(r["gpus"] >= w["gpus"] for r in result.ranked if r["meets"])


def test_a_deliberately_worse_layout_ranks_below_the_winner(spec, result):
    win = Layout(**result.winner["_layout"])
    worse = replace(win, max_batch=2)            # a decode batch cap that cannot keep up
    row = simulated_row(spec, worse)
    assert row["attainment_both"] < result.winner["attainment_both"]
    assert rank_key(row, spec) > rank_key(result.winner, spec)
    # more GPUs than needed (one instance more) ranks below too, though it meets the target
    bigger = replace(win, prefill=win.prefill + 1)
    big = simulated_row(spec, bigger)
    assert big["meets"] and rank_key(big, spec) > rank_key(result.winner, spec)


def test_bound_prunes_and_grows_with_instances(spec, result):
    shape = WorkloadShape.of(spec.workload)
    one = Layout("h100", "disaggregated", "fcfs", 1, 1, 1, 1)
    two = replace(one, prefill=2, decode=2)
    b1 = bound(one, shape, spec)
    assert b1.feasible and b1.rate(two) > b1.rate(one) > 0
    tiny = replace(spec, workload=spec.workload.with_slo(
        {"default": type(spec.workload.specs[0].slo)(1e-4, 0.05)}))
    assert not bound(one, WorkloadShape.of(tiny.workload), tiny).feasible
    assert result.pruned > 0 and result.simulated <= spec.max_sims
    assert result.considered == result.pruned + result.simulated


def test_budget_mode_stays_within_budget():
    wl = make_workload("azure_conv").head(100)
    spec = PlanSpec(workload=wl, model="llama-3.1-8b", gpus=("h100",), budget=2, tps=(1,),
                    presets=("fcfs", "colocated"), max_batches=(256,), max_sims=6)
    res = plan(spec, jobs=1)
    assert res.winner is not None and res.winner["gpus"] <= 2 and res.winner["goodput"] > 0
    assert res.ranked == sorted(res.ranked, key=lambda r: rank_key(r, spec))


def test_serve_command_deploys_the_layout(spec):
    lay = Layout("h100", "disaggregated", "fcfs", 2, 1, 3, 2, max_batch=64, chunk=2048)
    cmd = serve_command(lay, spec)
    argv = cmd["argv"]
    assert argv[:2] == ["laneserve", "serve"]
    assert argv[argv.index("--prefill") + 1] == "2" and argv[argv.index("--decode") + 1] == "3"
    assert "continuous:max_batch_size=64" in argv
    assert [p["gpus"] for p in cmd["placement"]] == [[0], [1], [2, 3], [4, 5], [6, 7]]
    assert "laneserve_decode" in cmd["ray"][0]
    col = serve_command(Layout("h100", "colocated", "colocated", 3, 1), spec)
    assert "--colocated" in col["argv"] and not [a for a in col["argv"] if "tensor-parallel" in a]


def _served_degrees(argv: list[str]) -> tuple[int, int, list[str]]:
    """(prefill degree, decode degree, devices) ``laneserve serve`` resolves from ``argv``."""
    from laneserve.cli import build_parser
    from laneserve.commands.vllm_flags import _tensor_parallel_sizes
    assert argv[:2] == ["laneserve", "serve"]
    args = build_parser().parse_args(argv[1:])
    _tensor_parallel_sizes(args)
    return args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size, args.devices.split(",")


@pytest.mark.parametrize("layout, degrees, devices", [
    (Layout("h100", "disaggregated", "fcfs", 2, 1, 3, 2), (1, 2), ["cuda:0", "cuda:1", "cuda:2", "cuda:4", "cuda:6"]),
    (Layout("h100", "disaggregated", "fcfs", 1, 4, 1, 4), (4, 4), ["cuda:0", "cuda:4"]),
    (Layout("h100", "disaggregated", "fcfs", 1, 2, 2, 1), (2, 1), ["cuda:0", "cuda:2", "cuda:3"]),
    (Layout("h100", "colocated", "colocated", 2, 2), (2, 2), ["cuda:0", "cuda:2"]),
])
def test_the_printed_command_parses_to_the_planned_degrees(spec, layout, degrees, devices):
    cmd = serve_command(layout, spec)
    assert "tp_note" not in cmd
    assert _served_degrees(cmd["argv"]) == (*degrees, devices)
    # each instance's ranks take its --devices entry and the GPUs after it: the planned placement
    from types import SimpleNamespace

    from laneserve.engine.tp.group import rank_device
    ranks = [[rank_device(SimpleNamespace(device=d), r).index for r in range(len(p["gpus"]))]
             for d, p in zip(devices, cmd["placement"])]
    assert ranks == [p["gpus"] for p in cmd["placement"]]


def test_role_cost_model_charges_each_role_with_its_own_model():
    from laneserve.costmodel import make_cost_model
    from laneserve.costmodel.roles import RoleCostModel
    p = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100", tp=1, engine="vllm")
    d = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100", tp=2, engine="vllm")
    both = RoleCostModel(p, d)
    assert both.prefill_time([(1000, 0)]) == p.prefill_time([(1000, 0)])
    assert both.decode_step_time([500] * 8) == d.decode_step_time([500] * 8)
    assert both.decode_step_times(8, 4000, 500, 5) == d.decode_step_times(8, 4000, 500, 5)


def test_plan_cli_writes_json_markdown_and_png(tmp_path, capsys):
    rc = main(["plan", "--num-requests", "60", "--request-rate", "10", "--gpus", "h100", "--tp", "1",
               "--presets", "colocated", "--max-batch", "256", "--max-sims", "4", "--jobs", "1",
               "--no-progress", "--no-curve", "--output", str(tmp_path), "--name", "p"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "laneserve serve" in out and "winner:" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["winner"]["meets"] and data["deploy"]["argv"][:2] == ["laneserve", "serve"]
    assert (tmp_path / "p.md").exists() and (tmp_path / "p.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["plan", "--request-rate", "1", "--budget", "2"])        # one objective at a time
    assert main(["plan", "--slo-class", "nope:ttft_ms=1", "--no-progress"]) == 2
