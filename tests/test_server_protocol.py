"""Unit tests of the serving system's pure parts (no server): request validation and SLO
precedence, incremental detokenisation with stop strings, the Prometheus text, the KV transports
and the load generator's conversion to metrics."""

from __future__ import annotations

import re

import pytest

from laneserve.core.request import RequestSpec
from laneserve.core.slo import SLO, SLOClass
from laneserve.server.detok import IncrementalDetokenizer
from laneserve.server.metrics import ServerMetrics
from laneserve.server.protocol import BadRequest, ServerDefaults, parse_completion

DEFAULTS = ServerDefaults(default_slo=SLO(1.0, 0.1),
                          classes={"interactive": SLOClass("interactive", SLO(0.2, 0.04), priority=-1)})


def parse(body, headers=None):
    return parse_completion({"model": "m", **body}, tokenizer=None, max_model_len=100, vocab_size=50,
                            kv_tokens=80, headers=headers or {}, defaults=DEFAULTS)


def test_slo_precedence_field_over_header_over_class_over_default():
    assert parse({"prompt": [1, 2]}).slo == SLO(1.0, 0.1)
    g = parse({"prompt": [1, 2], "slo_class": "interactive"})
    assert (g.slo, g.slo_class, g.priority) == (SLO(0.2, 0.04), "interactive", -1)
    g = parse({"prompt": [1], "slo_class": "interactive"}, {"x-slo-ttft-ms": "300"})
    assert g.slo == SLO(0.3, 0.04)
    g = parse({"prompt": [1], "slo_class": "interactive", "slo": {"tpot_ms": 25}, "priority": 3},
              {"x-slo-ttft-ms": "300"})
    assert (g.slo, g.priority) == (SLO(0.3, 0.025), 3)
    # an unknown class is a label when the request sets both targets itself
    assert parse({"prompt": [1], "slo_class": "batch", "slo": {"ttft_ms": 5000, "tpot_ms": 200}}).slo_class == "batch"
    with pytest.raises(BadRequest, match="unknown slo_class"):
        parse({"prompt": [1], "slo_class": "batch", "slo": {"ttft_ms": 5000}})


def test_sampling_and_limits():
    g = parse({"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "top_k": 0, "stop_token_ids": [7],
               "ignore_eos": True, "seed": 4})
    sp = g.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.stop_token_ids, sp.ignore_eos, sp.seed) == (5, 0.0, -1, (7,), True, 4)
    assert parse({"prompt": [1]}).sampling.max_tokens == 16
    with pytest.raises(BadRequest, match="KV cache"):
        parse({"prompt": [1] * 70, "max_tokens": 20})
    with pytest.raises(BadRequest, match="maximum context length"):
        parse({"prompt": [1] * 90, "max_tokens": 20})
    with pytest.raises(BadRequest, match="no tokenizer"):
        parse({"prompt": "text"})
    with pytest.raises(BadRequest, match="stop strings need a tokenizer"):
        parse({"prompt": [1], "stop": "x"})
    assert [p.ids for p in parse({"prompt": [[1], [2, 3]]}).prompts] == [[1], [2, 3]]     # a batch
    with pytest.raises(BadRequest, match="must be a boolean"):
        parse({"prompt": [1], "stream": "yes"})


class _WordTokenizer:
    """Decodes ids as space-joined words (like the smoke model's word-level tokenizer)."""

    words = ["a", "b", "STOP", "c", "d"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids)


def test_detokenizer_stop_string_is_never_partly_streamed():
    d = IncrementalDetokenizer(_WordTokenizer(), stop=(" STOP",))
    sent = []
    for tok in (0, 1, 2, 3):
        d.add([tok])
        sent.append(d.delta())
        if d.stopped:
            break
    assert d.stopped and d.text == "a b"
    assert "".join(sent) + d.delta(final=True) == "a b"
    assert all("S" not in s for s in sent)
    plain = IncrementalDetokenizer(_WordTokenizer())
    plain.add([0, 1])
    plain.add([3])
    assert plain.delta() == "a b c"


def _samples(text: str) -> dict[tuple, float]:
    """(name, sorted labels) -> value, by prometheus_client's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_render_prometheus_text():
    m = ServerMetrics("m")
    m.ttft.observe(0.03)
    m.ttft.observe(3.0)
    m.aborted.inc()
    m.reject("bad_request")
    text = m.render([{"id": 0, "role": "prefill", "running": 2, "waiting": 1, "kv_usage": 0.5, "kv_free": 8,
                      "kv_total": 16, "preemptions": 3, "alive": 1},
                     {"id": 1, "role": "decode", "running": None, "alive": 0}], in_flight=2).decode()
    got = _samples(text)
    model = (("model_name", "m"),)
    inst0 = (("engine", "0"), ("model_name", "m"), ("role", "prefill"))
    assert got[("laneserve:time_to_first_token_seconds_bucket", (("le", "0.04"), *model))] == 1
    assert got[("laneserve:time_to_first_token_seconds_bucket", (("le", "+Inf"), *model))] == 2
    assert got[("laneserve:time_to_first_token_seconds_count", model)] == 2
    assert got[("laneserve:num_requests_running", inst0)] == 2
    assert got[("laneserve:num_preemptions_total", inst0)] == 3
    assert got[("laneserve:request_aborted_total", model)] == 1
    assert got[("laneserve:request_rejected_total", (("model_name", "m"), ("reason", "bad_request")))] == 1
    assert got[("laneserve:num_requests_in_flight", model)] == 2
    dead = (("engine", "1"), ("model_name", "m"), ("role", "decode"))
    assert got[("laneserve:instance_up", dead)] == 0 and ("laneserve:num_requests_running", dead) not in got


@pytest.mark.parametrize("name", ["shm", "inline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_transport_roundtrip(tmp_path, name, dtype):
    torch = pytest.importorskip("torch")
    from laneserve.cluster.transport import make_transport
    from laneserve.engine.kv_cache import KVPayload
    kv = torch.randn(2, 2, 37, 2, 8).to(getattr(torch, dtype))
    t = make_transport(name, directory=tmp_path)
    desc = t.put(5, KVPayload(37, kv))
    from laneserve.cluster.messages import Handoff, decode, encode
    back = t.get(decode(encode(Handoff(5, [1], 37, desc, 0.0))).kv)     # the descriptor survives the wire
    assert back.num_tokens == 37 and back.kv.dtype == kv.dtype and torch.equal(back.kv, kv)
    assert list(tmp_path.iterdir()) == []       # shm files are unlinked on receipt


def test_router_discards_a_descriptor_through_its_transport(tmp_path):
    """The router drops KV it will not deliver by the descriptor alone: the transport the
    descriptor names releases it (an shm file is unlinked), an unknown transport is an error."""
    torch = pytest.importorskip("torch")
    from laneserve.cluster.transport import discard_descriptor, make_transport
    from laneserve.engine.kv_cache import KVPayload
    desc = make_transport("shm", directory=tmp_path).put(3, KVPayload(4, torch.ones(2, 2, 4, 2, 8)))
    assert len(list(tmp_path.iterdir())) == 1
    discard_descriptor(desc)
    assert list(tmp_path.iterdir()) == []
    discard_descriptor(desc)                     # already gone: nothing to do
    discard_descriptor(make_transport("inline").put(3, KVPayload(4, torch.ones(2, 2, 4, 2, 8))))
    with pytest.raises(ValueError, match="unknown KV transport 'carrier-pigeon'"):
        discard_descriptor({"t": "carrier-pigeon"})


def test_loadgen_outcomes_become_vllm_style_summary():
    from laneserve.bench.loadgen import LoadResult, RequestOutcome, bench_summary
    specs = [RequestSpec(i, 0.0, 10, 4, slo=SLO(0.5, 0.1)) for i in range(3)]
    ok = RequestOutcome(specs[0], True, 0.0, 0.2, [0.2, 0.25, 0.3, 0.35], 0.35, 4)
    slow = RequestOutcome(specs[1], True, 0.0, 0.9, [0.9, 1.0, 1.1, 1.2], 1.2, 4)
    failed = RequestOutcome(specs[2], False, 0.0, error="HTTP 429", status=429)
    s = bench_summary(LoadResult([ok, slow, failed], 2.0, "m"))
    assert (s["completed"], s["failed"], s["rejected_429"]) == (2, 1, 1)
    assert s["attainment_ttft"] == pytest.approx(1 / 3)
    assert s["mean_ttft_ms"] == pytest.approx(550.0)
    assert s["mean_itl_ms"] == pytest.approx(75.0)        # gaps of 50 ms and 100 ms
    assert s["ttfts"][:2] == pytest.approx([0.2, 0.9]) and s["output_lens"] == [4, 4, 0]
    assert s["request_goodput"] == pytest.approx(0.5)


def test_sampling_surface_fields_become_sampling_params():
    g = parse({"prompt": [1, 2], "max_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": -1,
               "repetition_penalty": 1.3, "logit_bias": {"7": 100, "3": -2.5}, "min_tokens": 4})
    sp = g.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_tokens) == (0.5, -1.0, 1.3, 4)
    assert dict(sp.logit_bias) == {7: 100.0, 3: -2.5}
    from laneserve.cluster.messages import Add, RequestDesc, decode, encode
    wire = encode(Add(RequestDesc(9, [1, 2], sp, 0.0)))
    assert decode(wire, vocab_size=50).request.sampling == sp
    with pytest.raises(ValueError, match="logit_bias"):
        decode(wire, vocab_size=5)                        # an instance never trusts the wire's ids
    for body, message in (({"logit_bias": {"x": 1}}, "keys must be token ids"),
                          ({"logit_bias": {"50": 1}}, "outside the vocabulary"),
                          ({"logit_bias": {"1": 100.5}}, "'logit_bias.1' must be <= 100"),
                          ({"logit_bias": {"1": 1, "01": 2}}, "names a token id twice"),
                          ({"logit_bias": {str(i): 1 for i in range(1025)}}, "at most 1024"),
                          ({"presence_penalty": 2.5}, "'presence_penalty' must be in [-2.0, 2.0]"),
                          ({"repetition_penalty": 0}, "'repetition_penalty' must be in [0.01, 2.0]"),
                          ({"min_tokens": 17}, "'min_tokens' (17) must be <= max_tokens (16)"),
                          ({"min_tokens": -1}, "'min_tokens' must be >= 0"),
                          ({"frequency_penalty": float("nan")}, "must be a finite number")):
        with pytest.raises(BadRequest, match=re.escape(message)):
            parse({"prompt": [1], **body})


def test_unknown_fields_are_ignored_and_logged_once_per_name(caplog, monkeypatch):
    import laneserve.server.protocol as protocol
    monkeypatch.setattr(protocol, "_logged_unknown", set())   # other tests' unknown names may have filled it
    with caplog.at_level("WARNING", logger="laneserve.server"):
        for _ in range(3):
            g = parse({"prompt": [1, 2], "guided_json_typo": {"a": 1}, "temperature": 0})
            assert g.sampling.temperature == 0.0
    assert sum("guided_json_typo" in r.getMessage() for r in caplog.records) == 1
    # neutral values of fields other parts implement are accepted; others refused by name
    parse({"prompt": [1], "n": 1, "echo": False, "best_of": 1, "suffix": None})
    with pytest.raises(BadRequest, match="'suffix' is not supported"):
        parse({"prompt": [1], "suffix": "x"})
    # n samples of each prompt; best_of > n samples best_of, each token's logprob kept for the ranking
    g = parse({"prompt": [1], "n": 2})
    assert (g.n, g.sampling.n, g.sampling.logprobs) == (2, 2, None)
    g = parse({"prompt": [1], "n": 2, "best_of": 3})
    assert (g.n, g.sampling.n, g.sampling.logprobs, g.logprobs) == (2, 3, 0, None)


def test_request_models_are_strict_and_name_the_field():
    cases = [({"prompt": [1], "max_tokens": True}, "'max_tokens' must be an integer, got bool"),
             ({"prompt": [1], "temperature": "0.5"}, "'temperature' must be a number, got str"),
             ({"prompt": [1], "seed": 2**64}, "'seed' must be <= 9223372036854775807"),
             ({"prompt": [1], "stop": ["a"] * 17}, "'stop' must be a non-empty string or a list"),
             ({"prompt": 5}, "'prompt' must be a string or a list of token ids"),
             ({"prompt": [1], "slo": {"ttft": 5}}, "unknown field 'slo.ttft'"),
             ({"prompt": [1], "stream_options": {"include_usage": True}}, "only allowed when 'stream' is true")]
    for body, message in cases:
        with pytest.raises(BadRequest, match=re.escape(message)) as info:
            parse(body)
        assert info.value.param == next(iter(k for k in body if k != "prompt"), "prompt")
