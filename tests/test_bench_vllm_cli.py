"""``laneserve bench`` speaks ``vllm bench serve``: recorded vLLM command lines parse with vLLM's
meaning, one runs end to end against a live ``laneserve serve`` (smoke model) and writes vLLM's
result file; datasets, context clamping, goodput and failure reasons behave as vLLM users expect."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from laneserve.bench.loadgen import LoadResult, RequestOutcome, clamp_to_context, error_counts
from laneserve.cli import build_parser, main
from laneserve.commands import bench
from laneserve.core import RequestSpec
from laneserve.workloads import bench_datasets as bd

#: ``vllm bench serve`` command lines as vLLM's documentation gives them (docs/benchmarking/cli.md,
#: the ``vllm bench serve`` CLI reference and the benchmark-serving examples), placeholders kept
VLLM_BENCH_COMMAND_LINES = [
    "vllm bench serve --backend vllm --model NousResearch/Hermes-3-Llama-3.1-8B --endpoint /v1/completions "
    "--dataset-name sharegpt --dataset-path <your data path>/ShareGPT_V3_unfiltered_cleaned_split.json "
    "--num-prompts 10",
    "vllm bench serve --port 9001 --save-result --save-detailed --backend vllm "
    "--model meta-llama/Llama-3.1-8B-Instruct --endpoint /v1/completions --dataset-name custom "
    "--dataset-path <path-to-your-data-jsonl> --skip-chat-template --num-prompts 80 --max-concurrency 1 "
    "--temperature=0.3 --top-p=0.75 --result-dir \"./log/\"",
    "vllm bench serve --backend openai-chat --model Qwen/Qwen2.5-1.5B-Instruct --endpoint /v1/chat/completions "
    "--dataset-name random --num-prompts 10",
    "vllm bench serve --backend vllm --base-url http://127.0.0.1:8000 --model <model> --dataset-name random "
    "--random-input-len 1024 --random-output-len 128 --num-prompts 1000 --max-concurrency 200",
    "vllm bench serve --model meta-llama/Llama-3.1-8B-Instruct --dataset-name random --request-rate 10 "
    "--goodput ttft:500 tpot:50 e2el:4000 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 90,95,99",
    "vllm bench serve --backend openai-chat --model meta-llama/Llama-3.1-8B-Instruct --endpoint /v1/chat/completions "
    "--dataset-name sonnet --dataset-path benchmarks/sonnet.txt --sonnet-input-len 550 --sonnet-output-len 150 "
    "--sonnet-prefix-len 200 --num-prompts 100",
    "vllm bench serve --model meta-llama/Llama-3.1-8B-Instruct --dataset-name random --random-input-len 2048 "
    "--random-output-len 256 --random-range-ratio 0.25 --request-rate 8 --burstiness 0.5 --ignore-eos --seed 42 "
    "--disable-tqdm --save-result --result-filename results.json",
    "vllm bench serve --backend vllm --model meta-llama/Llama-3.1-8B-Instruct "
    "--tokenizer meta-llama/Llama-3.1-8B-Instruct --dataset-name random --random-input-len 512 "
    "--random-output-len 64 --random-prefix-len 256 --num-prompts 200 --request-rate inf --label mybench "
    "--metadata tp=1 version=0.1 --save-result --result-dir results",
    "vllm bench serve --backend openai --host 127.0.0.1 --port 8000 --model meta-llama/Llama-3.1-8B-Instruct "
    "--dataset-name sharegpt --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --sharegpt-output-len 256 "
    "--num-prompts 500 --request-rate 4 --max-concurrency 64 --temperature 0",
]


def _argv(line: str, **subs: str) -> list[str]:
    """The line's arguments after ``vllm bench serve``, its placeholders filled in (``subs`` first)."""
    for key, value in {**subs, "<your data path>": "/data", "<path-to-your-data-jsonl>": "data.jsonl",
                       "<model>": "smoke-llama"}.items():
        line = line.replace(key, value)
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "bench", "serve"]
    return ["bench", *argv[3:]]


def test_recorded_vllm_bench_serve_lines_parse_with_vllms_meaning():
    parser = build_parser()
    parsed = [parser.parse_args(_argv(line)) for line in VLLM_BENCH_COMMAND_LINES]
    assert all(a.func is bench.run for a in parsed)
    sharegpt, custom, chat, rnd, goodput, sonnet, bursty, tok, openai = parsed
    assert (sharegpt.backend, sharegpt.dataset_name, sharegpt.num_requests) == ("vllm", "sharegpt", 10)
    assert custom.port == 9001 and custom.save_result and custom.max_concurrency == 1
    assert (custom.temperature, custom.top_p, custom.result_dir) == (0.3, 0.75, Path("./log/"))
    assert chat.backend == "openai-chat" and chat.endpoint == "/v1/chat/completions"
    assert (rnd.random_input_len, rnd.random_output_len, rnd.num_requests) == (1024, 128, 1000)
    assert bench.parse_goodput(goodput.goodput) == {"ttft": 0.5, "tpot": 0.05, "e2el": 4.0}
    assert bench._percentiles(goodput)[1:] == (["ttft", "tpot", "itl", "e2el"], [90.0, 95.0, 99.0])
    assert (sonnet.sonnet_input_len, sonnet.sonnet_output_len, sonnet.sonnet_prefix_len) == (550, 150, 200)
    assert (bursty.burstiness, bursty.ignore_eos, bursty.seed, bursty.no_progress) == (0.5, True, 42, True)
    assert bursty.random_range_ratio == 0.25 and bursty.result_filename == "results.json"
    assert tok.tokenizer == "meta-llama/Llama-3.1-8B-Instruct" and tok.label == "mybench"
    assert bench._metadata(tok) == {"tp": "1", "version": "0.1"} and tok.random_prefix_len == 256
    assert openai.sharegpt_output_len == 256 and openai.temperature == 0.0


def test_laneserve_spellings_keep_their_meaning():
    parser = build_parser()
    a = parser.parse_args(["bench", "--profile", "out/profile.json", "--quicktok-encoding", "qwen3",
                           "--result-file", "r.json", "--num-requests", "7"])
    assert a.profile == "out/profile.json" and a.quicktok_encoding == "qwen3" and a.num_requests == 7
    assert str(a.output_json) == "r.json" and a.dataset_name is None and a.workload == "short_long_mix"
    b = parser.parse_args(["bench", "--profile", "--sim-profile", "p.json"])
    assert b.profile is bench._PROFILE_FLAG and str(b.sim_profile) == "p.json"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--dataset-name", "random", "--workload", "azure_conv"])


def test_random_dataset_lengths_prefix_and_seed():
    s = bd.random_samples(50, input_len=100, output_len=20, range_ratio=0.5, prefix_len=8, vocab_size=300, seed=3)
    assert all(58 <= x.prompt_len <= 158 and 10 <= x.output_len <= 30 for x in s)
    assert all(x.prompt[:8] == s[0].prompt[:8] and len(x.prompt) == x.prompt_len for x in s)
    assert all(0 <= t < 300 for x in s for t in x.prompt)
    assert s == bd.random_samples(50, input_len=100, output_len=20, range_ratio=0.5, prefix_len=8, vocab_size=300,
                                  seed=3)
    with pytest.raises(ValueError, match="range-ratio"):
        bd.random_samples(1, input_len=10, output_len=5, range_ratio=1.0, vocab_size=100)


def test_sonnet_dataset_fits_the_input_length_and_shares_its_head(tmp_path):
    count = lambda t: len(t.split())  # noqa: E731
    s = bd.sonnet_samples(5, input_len=200, output_len=30, prefix_len=60, count_tokens=count, seed=1)
    assert all(x.prompt.startswith(bd.SONNET_INSTRUCTION) and x.prompt_len <= 200 for x in s)
    heads = {x.prompt.split("\n")[1] for x in s}
    assert len(heads) == 1 and len({x.prompt for x in s}) == 5
    poem = tmp_path / "sonnet.txt"
    poem.write_text("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n")
    own = bd.sonnet_samples(2, input_len=60, output_len=8, prefix_len=10, count_tokens=count, path=poem)
    assert all("summer" in x.prompt or "lovely" in x.prompt for x in own)


def test_sharegpt_and_custom_datasets(tmp_path):
    count = lambda t: len(t.split())  # noqa: E731
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "tell me about the sea and the sky please"},
                                           {"from": "gpt", "value": "the sea is wide and the sky is blue"}]},
             {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
             {"id": "c", "conversations": [{"from": "gpt", "value": "orphan reply with no question at all"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    s = bd.sharegpt_samples(10, count_tokens=count, path=path)
    assert [(x.prompt_len, x.output_len) for x in s] == [(9, 9)]          # short and orphan ones left out
    assert bd.sharegpt_samples(10, count_tokens=count, path=path, output_len=5)[0].output_len == 5
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a b c"}\n\n{"prompt": "d e"}\n')
    assert [(x.prompt, x.output_len) for x in bd.custom_samples(5, path=data, count_tokens=count, output_len=7)] == [
        ("a b c", 7), ("d e", 7)]


def test_clamp_to_context_cuts_prompts_then_outputs():
    specs = [RequestSpec(0, 0.0, 100, 10), RequestSpec(1, 0.0, 5000, 100), RequestSpec(2, 0.0, 10, 9000),
             RequestSpec(3, 0.0, 3000, 10)]
    prompts = {1: tuple(range(5000)), 3: "x " * 3000}
    new, new_prompts, cut = clamp_to_context(specs, prompts, 4096, truncate_text=lambda t, n: "x " * n,
                                             text_margin=50)
    assert cut == 2 + 0 and new[0] == specs[0]
    assert (new[1].prompt_len, new[1].output_len, len(new_prompts[1])) == (3996, 100, 3996)
    assert (new[2].prompt_len, new[2].output_len) == (1, 4095)
    assert new[3] == specs[3] and new_prompts[3] == prompts[3]           # fits, margin included
    assert all(s.prompt_len + s.output_len <= 4096 for s in new)


def test_vllm_goodput_and_failure_reasons():
    outs = []
    for i, (first, end, n) in enumerate([(0.1, 1.1, 11), (0.9, 1.9, 11), (0.1, 5.1, 11), (0.2, 0.2, 1)]):
        o = RequestOutcome(RequestSpec(i, 0.0, 4, n), success=True, send=0.0, first=first, end=end, output_tokens=n)
        o.chunks = [first]
        outs.append(o)
    for msg in ("HTTP 400: {\"error\": {\"message\": \"context is 4096 tokens, you asked 5000\"}}",
                "HTTP 400: {\"error\": {\"message\": \"context is 4096 tokens, you asked 6100\"}}",
                "ReadTimeout: timed out"):
        outs.append(RequestOutcome(RequestSpec(len(outs), 0.0, 4, 4), error=msg, status=400 if "HTTP" in msg else None))
    result = LoadResult(outs, duration=2.0, model="m")
    # ttft <= 0.5 s and tpot <= 0.2 s: requests 0 and 3 (one token: TPOT 0); e2el <= 2 s adds nothing
    assert bench.vllm_goodput(result, {"ttft": 0.5, "tpot": 0.2}) == 1.0
    assert bench.vllm_goodput(result, {"e2el": 2.0}) == 1.5
    assert error_counts(outs) == {"HTTP 400: context is N tokens, you asked N": 2, "ReadTimeout: timed out": 1}
    with pytest.raises(ValueError, match="ttft, tpot, e2el"):
        bench.parse_goodput(["itl:5"])


@pytest.fixture(scope="module")
def server(shared_server):
    srv = shared_server("--colocated", "--kv-tokens", "16384")    # tests/conftest.py
    srv.wait_ready()
    return srv


def test_recorded_line_runs_end_to_end_and_writes_vllms_result_file(server, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is the capital of country number {i}?"}) + "\n"
                            for i in range(4)))
    monkeypatch.chdir(tmp_path)
    argv = _argv(VLLM_BENCH_COMMAND_LINES[1], **{"<path-to-your-data-jsonl>": str(data)})
    argv += ["--base-url", server.url, "--model", "smoke-llama", "--num-prompts", "4", "--custom-output-len", "6"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Failed requests by reason" not in printed
    files = list((tmp_path / "log").glob("vllm-inf*qps-concurrency1-smoke-llama-*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    for key in ("date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
                "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                "mean_e2el_ms", "p99_e2el_ms", "input_lens", "output_lens", "ttfts", "itls", "generated_texts",
                "errors", "latencies", "max_output_tokens_per_s", "max_concurrent_requests"):
        assert key in res, key
    assert (res["backend"], res["request_rate"], res["max_concurrency"]) == ("vllm", "inf", 1)
    assert res["completed"] == res["num_prompts"] == 4 and res["failed"] == 0 and res["errors"] == [""] * 4
    assert res["output_lens"] == [6] * 4 and all(t > 0 for t in res["input_lens"])


def test_random_dataset_at_a_rate_with_goodput(server, tmp_path, capsys):
    argv = _argv(VLLM_BENCH_COMMAND_LINES[6]) + [
        "--base-url", server.url, "--model", "smoke-llama", "--num-prompts", "6", "--random-input-len", "40",
        "--random-output-len", "8", "--request-rate", "50", "--goodput", "ttft:60000", "--result-dir", str(tmp_path),
        "--metric-percentiles", "50,99", "--percentile-metrics", "ttft,e2el"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "P50 TTFT (ms)" in printed and "Mean E2EL (ms)" in printed and "Mean TPOT" not in printed
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["completed"] == 6 and res["request_rate"] == 50.0 and res["burstiness"] == 0.5
    # --random-range-ratio 0.25 from the recorded line: lengths within 25% of 40 and 8
    assert all(30 <= n <= 50 for n in res["input_lens"]) and all(6 <= n <= 10 for n in res["output_lens"])
    assert res["request_goodput"] == pytest.approx(6 / res["duration"])
    assert "p50_ttft_ms" in res and "p99_tpot_ms" in res        # the file keeps every statistic


def test_prompts_longer_than_the_context_are_cut_with_a_warning(server, tmp_path, capsys):
    out = tmp_path / "long.json"
    assert main(["bench", "--base-url", server.url, "--dataset-name", "random", "--random-input-len", "6000",
                 "--random-output-len", "4", "--num-prompts", "2", "--disable-tqdm", "--output-json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "2 of 2 requests cut to fit the server's context of 4096 tokens" in err
    res = json.loads(out.read_text())
    assert res["completed"] == 2 and res["failed"] == 0 and res["input_lens"] == [4092, 4092]


def test_failures_are_reported_by_reason(server, tmp_path, capsys):
    out = tmp_path / "f.json"
    assert main(["bench", "--base-url", server.url, "--dataset-name", "random", "--random-input-len", "8",
                 "--random-output-len", "2", "--num-prompts", "3", "--served-model-name", "no-such-model",
                 "--disable-tqdm", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Failed requests by reason:" in printed
    res = json.loads(out.read_text())
    assert res["failed"] == 3 and len(res["error_counts"]) == 1
    (reason, n), = res["error_counts"].items()
    assert n == 3 and reason.startswith("HTTP 4") and "no-such-model" in reason


def test_chat_backend_sends_text_prompts(server, tmp_path):
    out = tmp_path / "chat.json"
    argv = _argv(VLLM_BENCH_COMMAND_LINES[2], **{"Qwen/Qwen2.5-1.5B-Instruct": "smoke-llama"})
    argv += ["--base-url", server.url, "--num-prompts", "2", "--random-input-len", "30", "--random-output-len", "4",
             "--disable-tqdm", "--output-json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["endpoint"] == "/v1/chat/completions" and res["backend"] == "openai-chat"
    assert res["completed"] == 2 and res["output_lens"] == [4, 4]
