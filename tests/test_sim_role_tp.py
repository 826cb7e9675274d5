"""``laneserve sim --prefill-tensor-parallel-size`` / ``--decode-tensor-parallel-size``: each role's
instances are charged on their own degree's cost model and sized from it."""

from __future__ import annotations

import json

import pytest

from laneserve.cli import build_parser, main
from laneserve.commands.sim import _setup
from laneserve.core.kv import blocks_for
from laneserve.core.request import SLO, RequestSpec
from laneserve.costmodel import FittedCostModel, load_profile, make_cost_model, save_profile, synthesize_profile
from laneserve.sim import Simulator

PROMPT, OUTPUT = 3000, 40


def _args(*flags: str):
    return build_parser().parse_args(["sim", "--num-requests", "10", "--policies", "fcfs+continuous",
                                      "--no-progress", *flags])


def _one_request_busy_times(*flags: str) -> tuple[float, float]:
    """(prefill instance busy time, decode instance busy time) of one request."""
    _, cost, _, policies, _ = _setup(_args(*flags))
    config = policies["fcfs+continuous"]
    res = Simulator(config, cost).run([RequestSpec(0, 0.0, PROMPT, OUTPUT, SLO(10.0, 1.0))])
    assert len(res.finished) == 1
    pre, dec = res.instances
    assert (pre["role"], dec["role"]) == ("prefill", "decode")
    return pre["busy_time"], dec["busy_time"]


def _expected(tp: int) -> tuple[float, float]:
    """(prefill time of the prompt, the sum of its decode steps) on the TP ``tp`` model."""
    cm = make_cost_model("analytic", model="llama-3-8b", hardware="h100", tp=tp)
    decode = sum(cm.decode_step_time([PROMPT + k]) for k in range(1, OUTPUT))
    return cm.prefill_time([(PROMPT, 0)]), decode


def test_each_role_is_charged_on_its_own_degree():
    tp1, tp2 = _expected(1), _expected(2)
    assert tp2[0] < 0.8 * tp1[0] and tp2[1] < 0.95 * tp1[1]     # the degrees are told apart
    pre, dec = _one_request_busy_times("--prefill-tensor-parallel-size", "2")
    assert pre == pytest.approx(tp2[0], rel=1e-9) and dec == pytest.approx(tp1[1], rel=1e-9)
    pre, dec = _one_request_busy_times("-tp", "2", "--decode-tensor-parallel-size", "1")
    assert pre == pytest.approx(tp2[0], rel=1e-9) and dec == pytest.approx(tp1[1], rel=1e-9)
    pre, dec = _one_request_busy_times("--decode-tensor-parallel-size", "2")
    assert pre == pytest.approx(tp1[0], rel=1e-9) and dec == pytest.approx(tp2[1], rel=1e-9)
    # the prefill instances' KV: two GPUs' memory, the decode ones' one GPU's
    _, cost, _, policies, _ = _setup(_args("--prefill-tensor-parallel-size", "2"))
    front, back = Simulator(policies["fcfs+continuous"], cost)._make_instances()
    assert front[0].scheduler.kv.num_blocks == blocks_for(make_cost_model(tp=2).kv_capacity_tokens(0.9), 16)
    assert back[0].scheduler.kv.num_blocks == blocks_for(make_cost_model(tp=1).kv_capacity_tokens(0.9), 16)


def test_one_degree_is_the_plain_model_of_that_degree():
    _, cost, _, policies, _ = _setup(_args("-tp", "2", "--prefill-tensor-parallel-size", "2"))
    assert cost.tp == 2 and type(cost).__name__ == "AnalyticCostModel"
    assert policies["fcfs+continuous"].prefill_kv_tokens is None


def test_colocated_policy_sets_refuse_the_per_role_flags(capsys):
    rc = main(["sim", "--num-requests", "10", "--policies", "colocated", "--prefill-tensor-parallel-size", "2",
               "--no-progress"])
    assert rc == 2 and "colocated instances take --tensor-parallel-size" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--prefill-tensor-parallel-size", "--decode-tensor-parallel-size"])
def test_the_per_role_degrees_are_checked(flag, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sim", flag, "0"])
    assert flag in capsys.readouterr().err


# ---- one profile per degree ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """Two tiny profiles, TP1 and TP2, synthesized from the analytic models of those degrees."""
    folder = tmp_path_factory.mktemp("profiles")
    paths = {}
    for tp in (1, 2):
        prof = synthesize_profile(make_cost_model(tp=tp), [[(2**k, 0)] for k in range(6, 13)],
                                  [[n] * b for b in (1, 4, 16) for n in (512, 2048, 8192)], device=f"tp{tp}")
        prof.tensor_parallel_size = tp
        paths[tp] = save_profile(prof, folder / f"tp{tp}.json")
    return paths


def _fitted(path) -> tuple[float, float]:
    cm = FittedCostModel(load_profile(path))
    return cm.prefill_time([(PROMPT, 0)]), sum(cm.decode_step_time([PROMPT + k]) for k in range(1, OUTPUT))


@pytest.mark.parametrize("kind", [["--cost-model", "fitted"], ["--engine", "laneserve"]])
def test_each_role_reads_the_profile_of_its_degree(profiles, kind):
    tp1, tp2 = _fitted(profiles[1]), _fitted(profiles[2])
    assert tp2[0] < 0.8 * tp1[0]                                   # the profiles are told apart
    flags = [*kind, "--profile", str(profiles[2]), "--profile", str(profiles[1])]
    pre, dec = _one_request_busy_times(*flags, "--prefill-tensor-parallel-size", "2")
    assert pre == pytest.approx(tp2[0], rel=1e-9) and dec == pytest.approx(tp1[1], rel=1e-9)
    pre, dec = _one_request_busy_times(*flags, "-tp", "2")        # one degree: its own profile
    assert pre == pytest.approx(tp2[0], rel=1e-9) and dec == pytest.approx(tp2[1], rel=1e-9)


def test_a_degree_without_a_profile_or_with_two_is_refused(profiles, capsys):
    base = ["sim", "--num-requests", "10", "--no-progress", "--cost-model", "fitted"]
    assert main([*base, "--profile", str(profiles[1]), "--profile", str(profiles[2]), "-tp", "4"]) == 2
    assert "no profile measured a tensor parallel size 4 instance (they cover 1, 2)" in capsys.readouterr().err
    assert main([*base, "--profile", str(profiles[1]), "--profile", str(profiles[1])]) == 2
    assert "both measured a tensor parallel size 1 instance" in capsys.readouterr().err
    # a single profile keeps its degree check
    assert main([*base, "--profile", str(profiles[2]), "--decode-tensor-parallel-size", "2"]) == 2
    assert "measured a tensor parallel size 2 instance, the simulation asks for 1" in capsys.readouterr().err


# ---- laneserve plan --engine laneserve --profile ------------------------------------------------

def test_plan_charges_the_profiled_degrees_on_their_profiles(profiles):
    import pickle

    from laneserve.plan.planner import ProfiledEngine, cost_model
    engine = ProfiledEngine.of([str(profiles[2])])
    profiled, analytic = cost_model("llama-3-8b", "h100", 2, engine), cost_model("llama-3-8b", "h100", 2, "laneserve")
    fitted = FittedCostModel(load_profile(profiles[2]))
    assert profiled.prefill_time([(PROMPT, 0)]) == fitted.prefill_time([(PROMPT, 0)])
    assert profiled.prefill_time([(PROMPT, 0)]) != analytic.prefill_time([(PROMPT, 0)])
    assert profiled.kv_capacity_tokens(0.9) == analytic.kv_capacity_tokens(0.9)     # the GPU's memory
    uncovered = cost_model("llama-3-8b", "h100", 1, engine)                         # no TP1 profile
    assert uncovered.prefill_time([(PROMPT, 0)]) == cost_model("llama-3-8b", "h100", 1, "laneserve").prefill_time(
        [(PROMPT, 0)])
    clone = pickle.loads(pickle.dumps((engine, profiled)))                            # worker processes
    assert clone[0] == engine and clone[1].kv_capacity_tokens(0.9) == analytic.kv_capacity_tokens(0.9)
    assert "TP2" in str(engine) and "analytic for the other degrees" in str(engine)


def test_plan_cli_takes_profiles_for_the_laneserve_engine_only(profiles, tmp_path, capsys):
    base = ["plan", "--model", "llama-3-8b", "--num-requests", "20", "--request-rate", "2", "--tp", "1,2",
            "--presets", "colocated", "--max-batch", "64", "--max-sims", "1", "--jobs", "1", "--no-progress",
            "--no-curve", "--output", str(tmp_path), "--profile", str(profiles[1])]
    assert main([*base, "--engine", "vllm"]) == 2
    assert "pass --engine laneserve" in capsys.readouterr().err
    assert main([*base, "--engine", "laneserve"]) in (0, 1)
    said = f"laneserve (profiles: TP1 {profiles[1]}; analytic for the other degrees)"
    assert f"engine {said}" in capsys.readouterr().err
    assert json.loads((tmp_path / "plan.json").read_text())["spec"]["engine"] == said
