"""Prometheus metrics through ``prometheus_client``, named like vLLM's under ``laneserve:``.

Request latencies are measured in the API process, where the client sees them: TTFT (arrival to
first token sent), inter-token latency (gaps between token deliveries), TPOT, end-to-end latency,
and queue time (arrival to prefill start, reported by the prefill instance on the shared clock).
Counters: finished requests by finish reason, prompt and generated tokens, requests refused (by
reason), aborted (the client went away or the server stopped before the request finished), and
SLO attainment by class and target.

Per-instance gauges come from each instance's latest ``stats`` message and carry
``instance``/``role`` labels: running and waiting requests, KV-cache usage and free blocks,
preemptions, prefix-cache queries and hits (tokens, as vLLM counts them), liveness; a dead instance reports only ``instance_up 0``. They are collected when
``/metrics`` is scraped, from the snapshot :meth:`ServerMetrics.render` is given. Each
:class:`ServerMetrics` has its own registry, so several servers (or tests) in one process do not
share series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, help, key in an instance snapshot)
_INSTANCE_GAUGES = (("laneserve:num_requests_running", "Requests in the running batch.", "running"),
                    ("laneserve:num_requests_waiting", "Requests waiting on the instance.", "waiting"),
                    ("laneserve:kv_cache_usage_perc", "KV-cache usage (1 = full).", "kv_usage"),
                    ("laneserve:kv_cache_free_blocks", "Free KV-cache blocks.", "kv_free"),
                    ("laneserve:kv_cache_total_blocks", "KV-cache blocks.", "kv_total"),
                    ("laneserve:instance_up", "1 while the instance process is alive.", "alive"))
_INSTANCE_LABELS = ["model_name", "instance", "role"]


class _InstanceCollector(Collector):
    """The per-instance gauges, the preemption counters and the in-flight gauge of the latest
    snapshot."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        model = self.metrics.model
        instances, in_flight = self.metrics.snapshot
        for name, help_text, key in _INSTANCE_GAUGES:
            g = GaugeMetricFamily(name, help_text, labels=_INSTANCE_LABELS)
            for inst in instances:
                if inst.get(key) is not None:
                    g.add_metric([model, str(inst["id"]), inst["role"]], float(inst[key]))
            yield g
        c = CounterMetricFamily("laneserve:num_preemptions", "Preemptions (prefill steps stopped at a boundary, "
                                "decode swaps/recomputes).", labels=_INSTANCE_LABELS)
        for inst in instances:
            if inst.get("preemptions") is not None:
                c.add_metric([model, str(inst["id"]), inst["role"]], float(inst["preemptions"]))
        yield c
        for key, name, help_text in (("prefix_queries", "laneserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (admitted requests)."),
                                     ("prefix_hits", "laneserve:prefix_cache_hits",
                                      "Prompt tokens found in the prefix cache.")):
            c = CounterMetricFamily(name, help_text, labels=_INSTANCE_LABELS)
            for inst in instances:
                if inst.get(key) is not None:
                    c.add_metric([model, str(inst["id"]), inst["role"]], float(inst[key]))
            yield c
        g = GaugeMetricFamily("laneserve:num_requests_in_flight", "Requests admitted and not finished (router).",
                              labels=["model_name"])
        g.add_metric([model], float(in_flight))
        yield g


class ServerMetrics:
    """The API server's metric families. Series labelled by the model only are pre-bound
    (``metrics.ttft.observe(s)``); the others take their labels (``metrics.success.labels(
    model_name=..., finished_reason=...).inc()``)."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.snapshot: tuple[list[dict], int] = ([], 0)

        def hist(name: str, help_text: str, buckets: tuple[float, ...]):
            return Histogram(name, help_text, ["model_name"], buckets=buckets, registry=reg).labels(model_name)

        def per_model(name: str, help_text: str):
            return Counter(name, help_text, ["model_name"], registry=reg).labels(model_name)

        self.ttft = hist("laneserve:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = hist("laneserve:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.tpot = hist("laneserve:request_time_per_output_token_seconds",
                         "Time per output token of each finished request.", ITL_BUCKETS)
        self.e2e = hist("laneserve:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue = hist("laneserve:request_queue_time_seconds", "Time from arrival to the start of prefill.",
                          LATENCY_BUCKETS)
        self.success = Counter("laneserve:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=reg)
        self.prompt_tokens = per_model("laneserve:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = per_model("laneserve:generation_tokens", "Generated tokens.")
        self.rejected = Counter("laneserve:request_rejected", "Requests refused, by reason.",
                                ["model_name", "reason"], registry=reg)
        self.aborted = per_model("laneserve:request_aborted", "Admitted requests that ended before they finished: "
                                 "the client disconnected or the server stopped.")
        self.slo_met = Counter("laneserve:request_slo_met", "Finished requests meeting their SLO targets, by target "
                               "and class.", ["model_name", "slo_class", "target"], registry=reg)
        self.slo_total = Counter("laneserve:request_slo", "Finished requests with an SLO, by class.",
                                 ["model_name", "slo_class"], registry=reg)
        reg.register(_InstanceCollector(self))

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()

    def render(self, instances: list[dict], in_flight: int) -> bytes:
        """The exposition text, with the per-instance series of ``instances`` (dicts of ``id``,
        ``role`` and the gauge keys; ``None`` values are left out) and ``in_flight``."""
        self.snapshot = (instances, in_flight)
        return generate_latest(self.registry)
