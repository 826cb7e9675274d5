"""``--metrics-prefix``: the ``/metrics`` exposition checked against the metric names, types and
label names vLLM documents, so dashboards and alerts written for vLLM read laneserve unchanged."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from laneserve.server.metrics import ServerMetrics
from server_support import serving, wait_for

#: vLLM's metrics as its documentation lists them ("Production Metrics", docs/usage/metrics.md, and
#: the metrics design page docs/design/metrics.md) and vllm/v1/metrics/loggers.py declares them:
#: name -> (type, label names beyond model_name and engine). Counters are exposed with ``_total``.
VLLM_DOCUMENTED = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:gpu_cache_usage_perc": ("gauge", ()),                 # the pre-0.9 name, still on dashboards
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:gpu_prefix_cache_queries": ("counter", ()),
    "vllm:gpu_prefix_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:time_per_output_token_seconds": ("histogram", ()),   # the pre-0.11 name of inter_token_latency
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
}
#: documented vLLM series laneserve does not expose (yet): engine-step histograms, request-parameter histograms, config/LoRA info
VLLM_NOT_EXPOSED = {
    "vllm:time_per_prefill_token_request_seconds",
    "vllm:iteration_tokens_total", "vllm:request_max_num_generation_tokens", "vllm:request_params_n",
    "vllm:request_params_max_tokens", "vllm:cache_config_info", "vllm:lora_requests_info",
}
#: the series a vLLM Grafana dashboard queries (examples/observability/prometheus_grafana) that
#: laneserve fills
DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
)

INSTANCES = [{"id": 0, "role": "prefill", "running": 2, "waiting": 1, "kv_usage": 0.5, "kv_free": 8, "kv_total": 16,
              "preemptions": 3, "prefix_queries": 640, "prefix_hits": 128, "alive": 1},
             {"id": 1, "role": "decode", "running": 4, "waiting": 0, "kv_usage": 0.25, "kv_free": 12,
              "kv_total": 16, "preemptions": 0, "prefix_queries": None, "prefix_hits": None, "alive": 1},
             {"id": 2, "role": "decode", "running": None, "alive": 0}]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _exercised(prefix: str) -> ServerMetrics:
    m = ServerMetrics("m", prefix)
    m.ttft.observe(0.03)
    m.itl.observe(0.01)
    m.itl.observe(0.02)
    m.tpot.observe(0.015)
    m.e2e.observe(0.5)
    m.queue.observe(0.002)
    for phase, seconds in (("prefill", 0.03), ("decode", 0.45), ("inference", 0.48)):
        m.phase[phase].observe(seconds)
    m.prompt_tokens.inc(100)
    m.generation_tokens.inc(3)
    m.success.labels("m", "length").inc()
    m.success.labels("m", "stop").inc()
    m.aborted.inc()
    m.reject("too_large")
    return m


def test_vllm_exposition_matches_documented_names_types_and_labels():
    assert not VLLM_NOT_EXPOSED & set(VLLM_DOCUMENTED)
    fams = _families(_exercised("vllm").render(INSTANCES, in_flight=6).decode())
    for name, (kind, extra) in VLLM_DOCUMENTED.items():
        assert name in fams, name
        fam = fams[name]
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == {"model_name", "engine", *extra}, (s.name, s.labels)
            assert s.labels["model_name"] == "m"
    # no laneserve: duplicate of a vLLM series; laneserve's own extras remain
    assert "laneserve:time_to_first_token_seconds" not in fams and "laneserve:num_requests_running" not in fams
    for own in ("laneserve:request_aborted", "laneserve:request_rejected", "laneserve:instance_up",
                "laneserve:num_requests_in_flight", "laneserve:kv_cache_free_blocks"):
        assert own in fams, own


def test_vllm_values_per_engine_and_per_request():
    text = _exercised("vllm").render(INSTANCES, in_flight=6).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}

    def eng(e: str) -> tuple:
        return (("engine", e), ("model_name", "m"))
    assert got[("vllm:num_requests_running", eng("0"))] == 2
    assert got[("vllm:num_requests_running", eng("1"))] == 4
    assert got[("vllm:kv_cache_usage_perc", eng("0"))] == got[("vllm:gpu_cache_usage_perc", eng("0"))] == 0.5
    assert got[("vllm:prefix_cache_queries_total", eng("0"))] == 640
    assert got[("vllm:prefix_cache_hits_total", eng("0"))] == 128
    assert got[("vllm:gpu_prefix_cache_hits_total", eng("0"))] == 128
    assert got[("vllm:num_preemptions_total", eng("0"))] == 3
    assert ("vllm:prefix_cache_queries_total", eng("1")) not in got          # not reported: left out
    assert not any(labels and dict(labels).get("engine") == "2" and name.startswith("vllm:")
                   for name, labels in got)                                     # dead: no vLLM series
    api = eng("api")
    assert got[("vllm:prompt_tokens_total", api)] == 100
    assert got[("vllm:generation_tokens_total", api)] == 3
    assert got[("vllm:request_generation_tokens_count", api)] == 1
    assert got[("vllm:request_generation_tokens_sum", api)] == 3
    assert got[("vllm:inter_token_latency_seconds_count", api)] == 2
    assert got[("vllm:time_per_output_token_seconds_count", api)] == 2
    assert got[("vllm:time_to_first_token_seconds_bucket", (("engine", "api"), ("le", "0.04"),
                                                            ("model_name", "m")))] == 1
    assert got[("vllm:request_success_total", (("engine", "api"), ("finished_reason", "length"),
                                               ("model_name", "m")))] == 1
    names = {name for name, _ in got}
    for series in DASHBOARD_SERIES:
        assert series in names, series


@pytest.mark.parametrize("prefix", ["laneserve", "vllm", "both"])
def test_no_series_carries_an_instance_label(prefix):
    text = _exercised(prefix).render(INSTANCES, in_flight=1).decode()
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            assert "instance" not in s.labels, (s.name, s.labels)


def test_prefixes_select_the_sets():
    own = _families(_exercised("laneserve").render(INSTANCES, 0).decode())
    both = _families(_exercised("both").render(INSTANCES, 0).decode())
    assert not any(n.startswith("vllm:") for n in own)
    for name in VLLM_DOCUMENTED:
        assert name in both
        own_name = name.replace("vllm:", "laneserve:")
        if not name.startswith("vllm:gpu_") and name not in ("vllm:time_per_output_token_seconds",
                                                              "vllm:request_prompt_tokens",
                                                              "vllm:request_generation_tokens"):
            assert own_name in both and own_name in own, own_name
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in both.values() for x in f.samples}
    assert s[("laneserve:num_requests_running", (("engine", "0"), ("model_name", "m"), ("role", "prefill")))] == 2
    assert s[("vllm:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 2
    with pytest.raises(ValueError, match="metrics prefix"):
        ServerMetrics("m", "prometheus")


def test_live_server_with_vllm_prefix():
    """``laneserve serve --metrics-prefix vllm`` (stub instances): a streamed request shows up in
    vLLM's request series and each instance in the per-engine gauges."""
    with serving("--stub", "--prefill", "1", "--decode", "1", "--metrics-prefix", "vllm",
                 "--max-restarts", "0") as server:
        body = {"model": "laneserve-stub", "prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert any(line == "data: [DONE]" for line in r.iter_lines())

        def scraped():
            text = httpx.get(server.url + "/metrics", timeout=5).text
            got = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
            api = (("engine", "api"), ("model_name", "laneserve-stub"))
            return got if got.get(("vllm:e2e_request_latency_seconds_count", api)) == 1 else None

        got = wait_for(scraped, 10, "the finished request in vllm:e2e_request_latency_seconds")
        engines = {dict(labels)["engine"] for name, labels in got if name == "vllm:num_requests_running"}
        assert engines == {"0", "1"}
        assert got[("vllm:generation_tokens_total", (("engine", "api"), ("model_name", "laneserve-stub")))] == 4
        assert not any(name.startswith("laneserve:time_to_first") for name, _ in got)
        assert not any("instance" in dict(labels) for _, labels in got)
        api = (("engine", "api"), ("model_name", "laneserve-stub"))
        phase = {p: got[(f"vllm:request_{p}_time_seconds_sum", api)] for p in ("prefill", "decode", "inference")}
        assert all(got[(f"vllm:request_{p}_time_seconds_count", api)] == 1 for p in phase)
        assert phase["decode"] > 0 and phase["inference"] >= phase["decode"]
        assert phase["prefill"] + phase["decode"] == pytest.approx(phase["inference"], abs=1e-6)
