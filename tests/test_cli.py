import json

import pytest

from laneserve.cli import main


def test_sim_cli_writes_report(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["sim", "--num-requests", "300", "--request-rate", "5,40", "--no-progress", "--jobs", "1",
               "--policies", "fcfs+continuous,cp-edf-2k+continuous", "--output", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "fcfs+continuous" in table and "cp-edf-2k+continuous" in table
    data = json.loads((out / "sim.json").read_text())
    assert {"command", "machine", "metrics"} <= set(data)
    rows = data["rows"]
    assert len(rows) == 4
    by = {(r["policy"], r["rate"]): r for r in rows}
    # overload hurts: attainment at 40 req/s is below that at 5 req/s
    assert by[("fcfs+continuous", 40.0)]["attainment_ttft"] < by[("fcfs+continuous", 5.0)]["attainment_ttft"]
    assert (out / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| policy" in (out / "sim.md").read_text()


def test_sim_cli_says_which_decode_router_auto_chose(tmp_path, capsys):
    rc = main(["sim", "--num-requests", "100", "--request-rate", "5", "--no-progress", "--jobs", "1", "--decode", "2",
               "--policies", "adaptive+adaptive,fcfs+continuous", "--output", str(tmp_path / "o")])
    assert rc == 0
    err = capsys.readouterr().err
    assert "decode router (auto): adaptive+adaptive -> tpot-aware, fcfs+continuous -> least-loaded" in err
    rc = main(["sim", "--num-requests", "100", "--request-rate", "5", "--no-progress", "--jobs", "1", "--decode", "2",
               "--policies", "adaptive+adaptive", "--decode-router-policy", "least-loaded", "--output", str(tmp_path / "p")])
    assert rc == 0 and "decode router (auto)" not in capsys.readouterr().err


def test_sim_cli_trace_and_colocated(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:15:{i:02d}.0000000,{100 + 50 * i},{5 + i}\n" for i in range(40)))
    rc = main(["sim", "--trace", str(trace), "--request-rate", "2", "--no-progress", "--jobs", "1", "--policies",
               "colocated:prefill=fcfs,token_budget=1024", "--output", str(tmp_path / "o")])
    assert rc == 0
    rows = json.loads((tmp_path / "o" / "sim.json").read_text())["rows"]
    assert rows[0]["completed"] == 40


def test_sim_cli_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["sim", "--policies", "nope+continuous", "--output", str(tmp_path)]) == 2
    assert "unknown prefill policy 'nope'" in capsys.readouterr().err
    assert main(["sim", "--workload", "nope", "--output", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as refused:             # checked when parsed (tests/test_cli_errors.py)
        main(["sim", "--request-rate", "0", "--output", str(tmp_path)])
    assert refused.value.code == 2


def test_sim_cli_list(capsys):
    assert main(["sim", "--list"]) == 0
    out = capsys.readouterr().out
    assert "azure_conv" in out and "cp-edf-2k" in out and "llama-3-8b" in out


def test_sim_cli_goodput_and_slo_scale_search(tmp_path):
    out = tmp_path / "o"
    rc = main(["sim", "--num-requests", "200", "--request-rate", "10", "--no-progress", "--jobs", "1", "--goodput-search",
               "--slo-scale-search", "--policies", "fcfs+continuous", "--output", str(out)])
    assert rc == 0
    metrics = json.loads((out / "sim.json").read_text())["metrics"]
    goodput = metrics["goodput"]["fcfs+continuous"]
    scale = metrics["tightest_slo_scale"]["fcfs+continuous"]
    assert goodput is not None and goodput > 0
    assert scale is not None and 0 < scale <= 20


def test_sim_cli_jobs_give_identical_results(tmp_path):
    """The (policy x rate) grid and the goodput searches over two worker processes write exactly
    what one process writes."""
    args = ["sim", "--num-requests", "200", "--request-rate", "5,20", "--no-progress", "--goodput-search",
            "--policies", "fcfs+continuous,cp-edf-2k+continuous"]
    got = {}
    for jobs in ("1", "2"):
        assert main([*args, "--jobs", jobs, "--output", str(tmp_path / jobs)]) == 0
        data = json.loads((tmp_path / jobs / "sim.json").read_text())
        got[jobs] = (data["rows"], data["metrics"])
    assert got["1"] == got["2"]
    assert len(got["1"][0]) == 4 and set(got["1"][1]["goodput"]) == {"fcfs+continuous", "cp-edf-2k+continuous"}
    with pytest.raises(SystemExit) as refused:
        main([*args, "--jobs", "0", "--output", str(tmp_path / "0")])
    assert refused.value.code == 2


def test_sim_serve_and_bench_share_the_names_of_rates_and_routers():
    from laneserve.cli import build_parser
    parse = build_parser().parse_args
    sim = parse(["sim", "--request-rate", "1,2", "--router-policy", "least-loaded", "--decode-router-policy",
                 "tpot-aware"])
    assert (sim.rates, sim.router, sim.decode_router) == ([1.0, 2.0], "least-loaded", "tpot-aware")
    assert parse(["sim", "--rates", "3", "--router", "round-robin"]).rates == [3.0]
    serve = parse(["serve", "--router", "least-loaded", "--decode-router", "least-loaded"])
    assert (serve.router, serve.decode_router) == ("least-loaded", "least-loaded")
    assert parse(["bench", "--request-rate", "1,2"]).request_rate == [1.0, 2.0]
