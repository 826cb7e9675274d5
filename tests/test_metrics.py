"""Behaviour of the metrics, searches, reports and progress helpers in laneserve.bench."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from laneserve.measure.metrics import request_metrics, summarize
from laneserve.measure.progress import progress, progress_bar, progress_enabled
from laneserve.bench.report import format_console_table, format_serving_block, write_report
from laneserve.measure.search import goodput_search, slo_scale_search
from laneserve.core.request import Phase, Request, RequestSpec
from laneserve.core.slo import SLO


def make_request(rid: int, token_times: list[float], *, arrival: float = 0.0, prompt: int = 16,
                 slo: SLO = SLO(), slo_class: str = "default", prefill_start: float | None = None,
                 finished: float | None = None, record: bool = True,
                 reason: str | None = "length") -> Request:
    spec = RequestSpec(request_id=rid, arrival_time=arrival, prompt_len=prompt,
                       output_len=max(1, len(token_times)), slo=slo, slo_class=slo_class)
    req = Request.from_spec(spec, record_token_times=record)
    req.times.prefill_start = arrival if prefill_start is None else prefill_start
    for t in token_times:
        req.record_token(t)
    req.phase = Phase.DECODING
    if reason is not None:
        req.finish(token_times[-1] if finished is None else finished, reason)
    return req


# ---- per-request definitions ---------------------------------------------------------------

def test_request_metrics_follow_vllm_definitions():
    req = make_request(7, [2.0, 2.1, 2.3, 2.6], arrival=1.0, prefill_start=1.5)
    m = request_metrics(req)
    assert m.status == "completed" and m.output_tokens == 4
    assert m.ttft == pytest.approx(1.0)
    assert m.e2el == pytest.approx(1.6)
    assert m.tpot == pytest.approx((1.6 - 1.0) / 3)
    assert m.queue_time == pytest.approx(0.5)
    assert m.itls == pytest.approx([0.1, 0.2, 0.3])
    assert m.itl_mean == pytest.approx(0.2)
    assert m.itl_max == pytest.approx(0.3)
    assert m.decode_throughput == pytest.approx(3 / 0.6)


def test_itl_falls_back_to_tpot_and_max_itl_without_token_times():
    req = make_request(1, [1.0, 1.1, 1.5], record=False)
    assert req.times.token_times is None
    m = request_metrics(req)
    assert m.itls is None
    assert m.itl_mean == pytest.approx(m.tpot) == pytest.approx(0.25)
    assert m.itl_max == pytest.approx(0.4)


def test_e2e_uses_finish_time_and_tpot_follows_it():
    req = make_request(1, [1.0, 2.0, 3.0], finished=3.5)
    m = request_metrics(req)
    assert m.e2el == pytest.approx(3.5)
    assert m.tpot == pytest.approx((3.5 - 1.0) / 2)


def test_single_token_output_has_no_tpot_and_meets_any_tpot_slo():
    req = make_request(1, [0.5], slo=SLO(ttft=1.0, tpot=1e-6))
    m = request_metrics(req)
    assert m.tpot is None and m.itl_mean is None and m.decode_throughput is None
    assert m.meets_ttft and m.meets_tpot and m.meets_both
    other = make_request(2, [0.5, 0.6, 0.7])
    s = summarize([req, other])
    assert s["mean_tpot_ms"] == pytest.approx(100.0)     # only the 3-token request counts
    assert s["attainment_tpot"] == 1.0


# ---- attainment ----------------------------------------------------------------------------

def test_attainment_counts_failed_requests_as_misses():
    slo = SLO(ttft=1.0, tpot=0.1)
    reqs = [
        make_request(0, [0.5, 0.55, 0.6], slo=slo),            # meets both
        make_request(1, [2.0, 2.05], slo=slo),                 # misses TTFT
        make_request(2, [0.5, 1.0, 1.5], slo=slo),             # misses TPOT
        make_request(3, [1.0, 1.1], slo=slo),                  # exactly at both targets
        make_request(4, [9.0, 9.5]),                           # no targets: met
        make_request(5, [0.2], slo=slo, reason="abort"),       # aborted after one token
        make_request(6, [0.2, 0.25], slo=slo, reason=None),    # never finished
    ]
    assert reqs[5].phase is Phase.ABORTED and reqs[6].phase is Phase.DECODING
    s = summarize(reqs)
    assert (s["num_requests"], s["completed"], s["aborted"], s["unfinished"], s["failed"]) == (7, 5, 1, 1, 2)
    assert s["attainment_ttft"] == pytest.approx(4 / 7)
    assert s["attainment_tpot"] == pytest.approx(4 / 7)
    assert s["attainment_both"] == pytest.approx(3 / 7)
    assert not request_metrics(reqs[5]).meets_ttft
    assert s["request_goodput"] == pytest.approx(3 / s["duration"])


def test_per_class_breakdown():
    tight, loose = SLO(ttft=0.5), SLO(ttft=5.0)
    reqs = [make_request(i, [0.1 * (i + 1), 0.1 * (i + 1) + 0.01], slo=tight, slo_class="chat")
            for i in range(10)]
    reqs += [make_request(10 + i, [1.0 + i, 1.5 + i], slo=loose, slo_class="batch") for i in range(4)]
    reqs.append(make_request(99, [0.1], slo=loose, slo_class="batch", reason="abort"))
    pc = summarize(reqs)["per_class"]
    assert set(pc) == {"chat", "batch"}
    assert pc["chat"]["num_requests"] == 10 and pc["chat"]["attainment_ttft"] == pytest.approx(0.5)
    assert pc["chat"]["p90_ttft_ms"] == pytest.approx(np.percentile(np.arange(1, 11) * 100.0, 90))
    assert pc["batch"]["failed"] == 1 and pc["batch"]["completed"] == 4
    assert pc["batch"]["attainment_ttft"] == pytest.approx(4 / 5)
    assert pc["batch"]["attainment_both"] == pytest.approx(4 / 5)


# ---- aggregate statistics --------------------------------------------------------------------

def _random_requests(n: int, *, record: bool, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        arrival = float(rng.uniform(0, 10))
        first = arrival + float(rng.exponential(0.3)) + 1e-3
        gaps = rng.exponential(0.02, size=int(rng.integers(1, 30)))
        times = [first, *(first + np.cumsum(gaps)).tolist()]
        reqs.append(make_request(i, times, arrival=arrival, prompt=int(rng.integers(1, 500)),
                                 record=record, prefill_start=arrival + 1e-4))
    return reqs


def test_summary_statistics_match_numpy():
    reqs = _random_requests(300, record=True)
    ms = [request_metrics(r) for r in reqs]
    s = summarize(reqs, percentiles=(90, 99, 99.9))
    ttft = np.array([m.ttft for m in ms]) * 1000
    tpot = np.array([m.tpot for m in ms if m.tpot is not None]) * 1000
    e2el = np.array([m.e2el for m in ms]) * 1000
    itl = np.concatenate([m.itls for m in ms if m.itls]) * 1000
    for name, arr in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el), ("itl", itl)):
        assert s[f"mean_{name}_ms"] == pytest.approx(arr.mean())
        assert s[f"median_{name}_ms"] == pytest.approx(np.median(arr))
        assert s[f"std_{name}_ms"] == pytest.approx(arr.std())
        assert s[f"p90_{name}_ms"] == pytest.approx(np.percentile(arr, 90))
        assert s[f"p99_{name}_ms"] == pytest.approx(np.percentile(arr, 99))
        assert s[f"p99.9_{name}_ms"] == pytest.approx(np.percentile(arr, 99.9))
    assert s["max_itl_ms"] == pytest.approx(itl.max())
    assert s["mean_queue_ms"] == pytest.approx(0.1)


def test_itl_without_token_times_is_token_weighted():
    recorded = summarize(_random_requests(100, record=True, seed=3))
    bare = summarize(_random_requests(100, record=False, seed=3))
    assert bare["mean_itl_ms"] == pytest.approx(recorded["mean_itl_ms"])
    assert bare["max_itl_ms"] == pytest.approx(recorded["max_itl_ms"])
    assert bare["mean_ttft_ms"] == pytest.approx(recorded["mean_ttft_ms"])


def test_throughput_and_duration():
    reqs = [make_request(i, [i + 0.5, i + 1.0], arrival=float(i), prompt=10) for i in range(4)]
    s = summarize(reqs)
    assert s["duration"] == pytest.approx(4.0)                  # first arrival to last finish
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(12.0)
    assert s["mean_decode_throughput"] == pytest.approx(2.0)
    assert summarize(reqs, duration=8.0)["request_throughput"] == pytest.approx(0.5)


def test_empty_summary_does_not_fail():
    s = summarize([])
    assert s["num_requests"] == 0 and s["attainment_both"] is None
    assert s["mean_ttft_ms"] is None and s["per_class"] == {}
    assert "Successful requests:" in format_serving_block(s)


# ---- searches --------------------------------------------------------------------------------

def _step(threshold: float):
    return lambda x: 1.0 if x <= threshold else 0.5


@pytest.mark.parametrize("threshold", [0.7, 3.3, 17.0, 63.9])
def test_goodput_search_finds_monotone_threshold(threshold):
    r = goodput_search(_step(threshold), lo=0.5, hi=100.0, rel_tol=0.01)
    assert r.met and not r.saturated and r.monotone
    assert r.value <= threshold and r.bound > threshold
    assert (r.bound - r.value) <= 0.01 * r.value + 1e-12
    assert r.evals == len(r.points) <= 20


def test_goodput_search_edges():
    calls = []
    r = goodput_search(lambda x: 1.0, lo=1.0, hi=10.0, progress=lambda *a: calls.append(a))
    assert r.met and r.saturated and r.value == 10.0 and r.bound is None
    assert len(calls) == r.evals and calls[-1][2] == r.evals
    never = goodput_search(lambda x: 0.5, lo=1.0, hi=10.0)
    assert not never.met and never.value is None and never.evals == 1 and not never.saturated
    nan = goodput_search(lambda x: float("nan"), lo=1.0, hi=10.0)
    assert not nan.met
    capped = goodput_search(_step(50.0), lo=1.0, hi=100.0, max_evals=3)
    assert capped.evals == 3 and capped.value == 4.0 and capped.met


def test_goodput_search_is_robust_to_non_monotone_attainment():
    noisy = {1.0: 0.95, 2.0: 0.95, 4.0: 0.8, 3.0: 0.95, 3.5: 0.7}
    f = lambda x: noisy.get(x, 0.92 if x < 3.2 else 0.5)   # noqa: E731
    r = goodput_search(f, lo=1.0, hi=100.0, rel_tol=0.05)
    assert r.met
    passing = [x for x, a in r.points if a >= 0.9]
    assert r.value == max(passing)
    assert not r.monotone
    dip = goodput_search(lambda x: 0.5 if 1.5 < x < 2.5 else 0.95, lo=1.0, hi=100.0)
    assert dip.met and dip.value >= 1.0 and all(a < 0.9 for x, a in dip.points if x > dip.value)


def test_slo_scale_search_finds_tightest_scale():
    f = lambda s: min(1.0, s / 1.37)   # noqa: E731 — attainment reaches 0.9 at 1.233
    r = slo_scale_search(f, lo=0.1, hi=8.0, rel_tol=0.01)
    assert r.met and not r.saturated
    assert f(r.value) >= 0.9 and r.bound < 0.9 * 1.37 <= r.value
    assert r.value - r.bound <= 0.01 * r.value + 1e-12
    easy = slo_scale_search(lambda s: 1.0, lo=0.5, hi=4.0)
    assert easy.saturated and easy.value == 0.5
    hard = slo_scale_search(lambda s: 0.0, lo=0.5, hi=4.0)
    assert not hard.met and hard.value is None


# ---- reports ---------------------------------------------------------------------------------

def _runs():
    rows = []
    for policy, knee in (("fcfs", 4.0), ("laps", 8.0)):
        for rate in (2.0, 4.0, 6.0, 8.0, 10.0):
            att = 1.0 if rate <= knee else 0.6
            rows.append({"policy": policy, "rate": rate, "attainment_ttft": att,
                         "attainment_tpot": 1.0, "attainment_both": att, "p90_ttft_ms": 10 * rate,
                         "p99_ttft_ms": 20 * rate, "p90_tpot_ms": None, "output_throughput": 100 * rate,
                         "per_class": {"chat": {"attainment_both": att}}})
    return rows


def test_write_report_writes_json_markdown_png(tmp_path):
    runs = _runs()
    paths = write_report(tmp_path, "sweep", runs, y_keys=("attainment_both", "attainment_ttft"),
                         title="test sweep", command="pytest")
    data = json.loads(paths["json"].read_text())
    assert data["command"] == "pytest" and len(data["rows"]) == len(runs)
    assert data["metrics"]["laps: max rate with attainment_both >= 0.9"] == 8.0
    md = paths["md"].read_text()
    table_rows = [ln for ln in md.splitlines() if ln.startswith(("| fcfs |", "| laps |"))]
    assert len(table_rows) == len(runs)
    assert "attainment_both" in md and "p99_ttft_ms" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_formats():
    rows = [{"policy": "fcfs", "rate": 2.0, "goodput": None}, {"policy": "laps-temporal", "rate": 12.5}]
    text = format_console_table(rows, ["policy", "rate", "goodput"])
    lines = text.splitlines()
    assert lines[0].split() == ["policy", "rate", "goodput"] and set(lines[1]) <= {"-", " "}
    assert len({len(ln) for ln in lines}) == 1          # numeric columns right-aligned
    assert lines[3].startswith("laps-temporal") and "12.5" in lines[3]
    s = summarize(_random_requests(20, record=True))
    block = format_serving_block(s)
    for label in ("Successful requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):",
                  "P99 TTFT (ms):", "Mean TPOT (ms):", "P90 ITL (ms):", "TTFT and TPOT attainment (%):"):
        assert label in block
    assert block.splitlines()[0].startswith("=") and "Serving Benchmark Result" in block


# ---- progress and imports --------------------------------------------------------------------

def test_progress_is_silent_in_ci_and_when_forced_off(monkeypatch, capsys):
    items = [1, 2, 3]
    monkeypatch.setenv("CI", "true")
    assert progress(items, enabled=True) is items and not progress_enabled(True)
    bar = progress_bar(total=3, enabled=True)
    bar.update(2)
    bar.close()
    monkeypatch.delenv("CI")
    assert progress(items, enabled=False) is items
    assert list(progress(items, enabled=True, desc="x")) == items
    assert capsys.readouterr().out == ""


def test_bench_imports_stay_light():
    code = ("import sys, laneserve.measure.metrics, laneserve.measure.search, laneserve.bench.report, "
            "laneserve.measure.progress; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'tqdm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
