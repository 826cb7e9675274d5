"""Prometheus metrics through ``prometheus_client``: laneserve's own names, vLLM's, or both.

``--metrics-prefix`` picks the set:

- ``laneserve`` (default): the series under ``laneserve:``, named like vLLM's.
- ``vllm``: vLLM's metric names and label names under ``vllm:`` (every series carries
  ``model_name`` and ``engine``; ``vllm:request_success_total`` adds ``finished_reason``), so a
  dashboard or alert written for vLLM reads laneserve unchanged. Series vLLM has no counterpart for
  (refused and aborted requests, SLO attainment, in-flight requests, instance liveness, free and
  total KV blocks) stay under ``laneserve:``.
- ``both``: both sets side by side (for moving dashboards over).

No series carries a label called ``instance``: Prometheus sets its own ``instance`` on every scraped
target and would rename ours to ``exported_instance``. The instance a per-instance series describes
is its ``engine`` label (the instance id), as vLLM labels its engine cores.

Request latencies are measured in the API process, where the client sees them: TTFT (arrival to
first token sent), inter-token latency (gaps between token deliveries), TPOT per finished request,
end-to-end latency, and queue time (arrival to prefill start, reported by the prefill instance on
the shared clock). A request's path crosses engines (prefill then decode), so its series carry
``engine="api"`` under ``vllm:``. Counters: finished requests by finish reason, prompt and
generated tokens (with vLLM's per-request token histograms under ``vllm:``; prompt tokens are
counted per API request, all its prompts together), requests refused (by reason), aborted, and SLO
attainment by class and target.

Per-instance series come from each instance's latest ``stats`` message: running and waiting
requests, KV-cache usage and free blocks, preemptions, prefix-cache queries and hits (tokens, as
vLLM counts them), liveness; a dead instance reports only ``laneserve:instance_up 0``. They are
collected when ``/metrics`` is scraped, from the snapshot :meth:`ServerMetrics.render` is given.
Each :class:`ServerMetrics` has its own registry, so several servers (or tests) in one process do
not share series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIXES = ("laneserve", "vllm", "both")
#: the ``engine`` label of request-level ``vllm:`` series (measured in the API process)
REQUEST_ENGINE = "api"

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5))     # 1, 2, 5, 10 … 5M
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name without prefix, help, key in an instance snapshot); laneserve: and vllm: alike
_SHARED_GAUGES = (("num_requests_running", "Requests in the running batch.", "running"),
                  ("num_requests_waiting", "Requests waiting on the instance.", "waiting"),
                  ("kv_cache_usage_perc", "KV-cache usage (1 = full).", "kv_usage"))
_SHARED_COUNTERS = (("num_preemptions", "Preemptions (prefill steps stopped at a boundary, decode "
                     "swaps/recomputes).", "preemptions"),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (admitted requests).",
                     "prefix_queries"),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_hits"))
# vLLM's older names for the same values, which existing dashboards still query
_VLLM_ALIASES = (("gpu_cache_usage_perc", "KV-cache usage (1 = full); the older name of "
                  "vllm:kv_cache_usage_perc.", "kv_usage", "gauge"),
                 ("gpu_prefix_cache_queries", "Prompt tokens looked up in the prefix cache; the older name "
                  "of vllm:prefix_cache_queries.", "prefix_queries", "counter"),
                 ("gpu_prefix_cache_hits", "Prompt tokens found in the prefix cache; the older name of "
                  "vllm:prefix_cache_hits.", "prefix_hits", "counter"))
# laneserve-only, in every mode
_OWN_GAUGES = (("laneserve:kv_cache_free_blocks", "Free KV-cache blocks.", "kv_free"),
               ("laneserve:kv_cache_total_blocks", "KV-cache blocks.", "kv_total"),
               ("laneserve:tensor_parallel_size", "Ranks of the instance (one process each).",
                "tensor_parallel_size"))
_OWN_LABELS = ["model_name", "engine", "role"]
_VLLM_LABELS = ["model_name", "engine"]


class _Fan:
    """One observation or increment, recorded in several series."""

    __slots__ = ("observers", "incs")

    def __init__(self, observers=(), incs=()) -> None:
        self.observers = tuple(observers)
        self.incs = tuple(incs)

    def observe(self, value: float) -> None:
        for o in self.observers:
            o.observe(value)

    def inc(self, amount: float = 1.0) -> None:
        for c in self.incs:
            c.inc(amount)
        for o in self.observers:        # a counter's per-request histogram
            o.observe(amount)


class _SuccessFan:
    """``labels(model_name, finished_reason).inc()`` on each enabled success counter."""

    def __init__(self, own: Counter | None, vllm: Counter | None) -> None:
        self.own, self.vllm = own, vllm

    def labels(self, model_name: str, finished_reason: str) -> _Fan:
        incs = []
        if self.own is not None:
            incs.append(self.own.labels(model_name, finished_reason))
        if self.vllm is not None:
            incs.append(self.vllm.labels(model_name, REQUEST_ENGINE, finished_reason))
        return _Fan(incs=incs)


class _InstanceCollector(Collector):
    """The per-instance series and the in-flight gauge of the latest snapshot."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        model = m.model
        instances, in_flight = m.snapshot

        def family(kind: str, name: str, help_text: str, labels: list[str], key: str, own: bool):
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_text, labels=labels)
            for inst in instances:
                if inst.get(key) is not None:
                    values = [model, str(inst["id"])] + ([inst["role"]] if own else [])
                    fam.add_metric(values, float(inst[key]))
            return fam

        for prefix, own in ((("laneserve", True),) if m.own else ()) + ((("vllm", False),) if m.vllm else ()):
            labels = _OWN_LABELS if own else _VLLM_LABELS
            for name, help_text, key in _SHARED_GAUGES:
                yield family("gauge", f"{prefix}:{name}", help_text, labels, key, own)
            for name, help_text, key in _SHARED_COUNTERS:
                yield family("counter", f"{prefix}:{name}", help_text, labels, key, own)
        if m.vllm:
            for name, help_text, key, kind in _VLLM_ALIASES:
                yield family(kind, f"vllm:{name}", help_text, _VLLM_LABELS, key, False)
        for name, help_text, key in _OWN_GAUGES:
            yield family("gauge", name, help_text, _OWN_LABELS, key, True)
        yield family("gauge", "laneserve:instance_up", "1 while the instance process is alive.", _OWN_LABELS,
                     "alive", True)
        g = GaugeMetricFamily("laneserve:num_requests_in_flight", "Requests admitted and not finished (router).",
                              labels=["model_name"])
        g.add_metric([model], float(in_flight))
        yield g


class ServerMetrics:
    """The API server's metric families, under the names ``prefix`` picks (see the module
    docstring). The request path records through prefix-independent handles: ``ttft``, ``itl``,
    ``tpot``, ``e2e`` and ``queue`` take ``observe(seconds)``; ``prompt_tokens``,
    ``generation_tokens`` and ``aborted`` take ``inc(n)``; ``success.labels(model_name,
    finished_reason).inc()``; ``slo_met`` / ``slo_total`` take their labels; :meth:`reject`."""

    def __init__(self, model_name: str, prefix: str = "laneserve") -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"unknown metrics prefix {prefix!r}; choose one of {', '.join(PREFIXES)}")
        self.model = model_name
        self.prefix = prefix
        self.own = prefix in ("laneserve", "both")
        self.vllm = prefix in ("vllm", "both")
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.snapshot: tuple[list[dict], int] = ([], 0)

        def own_hist(name: str, help_text: str, buckets: tuple[float, ...]) -> list:
            if not self.own:
                return []
            return [Histogram(f"laneserve:{name}", help_text, ["model_name"], buckets=buckets,
                              registry=reg).labels(model_name)]

        def vllm_hist(name: str, help_text: str, buckets: tuple[float, ...]) -> list:
            if not self.vllm:
                return []
            return [Histogram(f"vllm:{name}", help_text, _VLLM_LABELS, buckets=buckets,
                              registry=reg).labels(model_name, REQUEST_ENGINE)]

        def own_counter(name: str, help_text: str) -> list:
            return [Counter(f"laneserve:{name}", help_text, ["model_name"], registry=reg).labels(model_name)] \
                if self.own else []

        def vllm_counter(name: str, help_text: str) -> list:
            return [Counter(f"vllm:{name}", help_text, _VLLM_LABELS, registry=reg).labels(model_name,
                                                                                        REQUEST_ENGINE)] \
                if self.vllm else []

        ttft_help, itl_help = "Time to first token (s).", "Inter-token latency (s)."
        self.ttft = _Fan(own_hist("time_to_first_token_seconds", ttft_help, LATENCY_BUCKETS)
                         + vllm_hist("time_to_first_token_seconds", ttft_help, LATENCY_BUCKETS))
        self.itl = _Fan(own_hist("inter_token_latency_seconds", itl_help, ITL_BUCKETS)
                        + vllm_hist("inter_token_latency_seconds", itl_help, ITL_BUCKETS)
                        + vllm_hist("time_per_output_token_seconds", "Inter-token latency (s); the older name "
                                    "of vllm:inter_token_latency_seconds.", ITL_BUCKETS))
        tpot_help = "Time per output token of each finished request (s)."
        self.tpot = _Fan(own_hist("request_time_per_output_token_seconds", tpot_help, ITL_BUCKETS)
                         + vllm_hist("request_time_per_output_token_seconds", tpot_help, ITL_BUCKETS))
        e2e_help = "End-to-end request latency (s)."
        self.e2e = _Fan(own_hist("e2e_request_latency_seconds", e2e_help, LATENCY_BUCKETS)
                        + vllm_hist("e2e_request_latency_seconds", e2e_help, LATENCY_BUCKETS))
        queue_help = "Time from arrival to the start of prefill (s)."
        self.queue = _Fan(own_hist("request_queue_time_seconds", queue_help, LATENCY_BUCKETS)
                          + vllm_hist("request_queue_time_seconds", queue_help, LATENCY_BUCKETS))
        # the phases of a finished request, as vLLM splits them: prefill (its start to the first
        # token), decode (first token to the last) and inference (prefill start to the last token)
        phase_help = {"prefill": "Time from the start of a finished request's prefill to its first token (s).",
                      "decode": "Time from a finished request's first token to its last (s).",
                      "inference": "Time from the start of a finished request's prefill to its last token (s)."}
        self.phase = {phase: _Fan(own_hist(f"request_{phase}_time_seconds", text, LATENCY_BUCKETS)
                                  + vllm_hist(f"request_{phase}_time_seconds", text, LATENCY_BUCKETS))
                      for phase, text in phase_help.items()}
        self.prompt_tokens = _Fan(
            incs=own_counter("prompt_tokens", "Prompt tokens of admitted requests.")
            + vllm_counter("prompt_tokens", "Prompt tokens of admitted requests."),
            observers=vllm_hist("request_prompt_tokens", "Prompt tokens per admitted API request.", TOKEN_BUCKETS))
        self.generation_tokens = _Fan(
            incs=own_counter("generation_tokens", "Generated tokens.")
            + vllm_counter("generation_tokens", "Generated tokens."),
            observers=vllm_hist("request_generation_tokens", "Generated tokens per finished request.",
                                TOKEN_BUCKETS))
        success_help = "Finished requests by finish reason."
        self.success = _SuccessFan(
            Counter("laneserve:request_success", success_help, ["model_name", "finished_reason"], registry=reg)
            if self.own else None,
            Counter("vllm:request_success", success_help, [*_VLLM_LABELS, "finished_reason"], registry=reg)
            if self.vllm else None)
        # laneserve's own series (no vLLM counterpart), in every mode
        self.rejected = Counter("laneserve:request_rejected", "Requests refused, by reason.",
                                ["model_name", "reason"], registry=reg)
        self.aborted = Counter("laneserve:request_aborted", "Admitted requests that ended before they finished: "
                               "the client disconnected or the server stopped.", ["model_name"],
                               registry=reg).labels(model_name)
        self.slo_met = Counter("laneserve:request_slo_met", "Finished requests meeting their SLO targets, by target "
                               "and class.", ["model_name", "slo_class", "target"], registry=reg)
        self.slo_total = Counter("laneserve:request_slo", "Finished requests with an SLO, by class.",
                                 ["model_name", "slo_class"], registry=reg)
        reg.register(_InstanceCollector(self))

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()

    def render(self, instances: list[dict], in_flight: int) -> bytes:
        """The exposition text, with the per-instance series of ``instances`` (dicts of ``id``,
        ``role`` and the snapshot keys; ``None`` values are left out) and ``in_flight``."""
        self.snapshot = (instances, in_flight)
        return generate_latest(self.registry)
