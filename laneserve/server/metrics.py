"""Prometheus metrics in the text exposition format, named like vLLM's under ``laneserve:``.

Request latencies are measured in the API process, where the client sees them: TTFT (arrival to
first token sent), inter-token latency (gaps between token deliveries), TPOT, end-to-end latency,
and queue time (arrival to prefill start, reported by the prefill instance on the shared clock).
Per-instance gauges come from each instance's latest ``stats`` message and carry
``instance``/``role`` labels: running and waiting requests, KV-cache usage and free blocks,
preemptions, liveness. No client library: a handful of metric families, written by hand.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in labels.items())
    return "{" + body + "}"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.series: dict[tuple, list] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [[0] * len(self.buckets), 0.0, 0]
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[0][i] += 1
        s[1] += value
        s[2] += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, (counts, total, n) in self.series.items():
            labels = dict(key)
            cum = 0
            for b, c in zip(self.buckets, counts):
                cum += c
                out.append(f"{self.name}_bucket{_labels({**labels, 'le': repr(float(b))})} {cum}")
            out.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {n}")
            out.append(f"{self.name}_sum{_labels(labels)} {total}")
            out.append(f"{self.name}_count{_labels(labels)} {n}")
        return out


class Counter:
    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.values: dict[tuple, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        out += [f"{self.name}{_labels(dict(k))} {v}" for k, v in self.values.items()]
        return out


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.ttft = Histogram("laneserve:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = Histogram("laneserve:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.tpot = Histogram("laneserve:request_time_per_output_token_seconds",
                              "Time per output token of each finished request.", ITL_BUCKETS)
        self.e2e = Histogram("laneserve:e2e_request_latency_seconds", "End-to-end request latency.",
                             LATENCY_BUCKETS)
        self.queue = Histogram("laneserve:request_queue_time_seconds",
                               "Time from arrival to the start of prefill.", LATENCY_BUCKETS)
        self.success = Counter("laneserve:request_success_total", "Finished requests by finish reason.")
        self.prompt_tokens = Counter("laneserve:prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("laneserve:generation_tokens_total", "Generated tokens.")
        self.rejected = Counter("laneserve:request_rejected_total", "Requests refused, by reason.")
        self.slo_met = Counter("laneserve:request_slo_met_total",
                               "Finished requests meeting their SLO targets, by target and class.")
        self.slo_total = Counter("laneserve:request_slo_total", "Finished requests with an SLO, by class.")
        self.families = [self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.success,
                         self.prompt_tokens, self.generation_tokens, self.rejected, self.slo_met, self.slo_total]

    def render(self, instances: list[dict], in_flight: int) -> str:
        lines: list[str] = []
        for fam in self.families:
            lines += fam.render()
        gauges = (("laneserve:num_requests_running", "Requests in the running batch.", "running"),
                  ("laneserve:num_requests_waiting", "Requests waiting on the instance.", "waiting"),
                  ("laneserve:kv_cache_usage_perc", "KV-cache usage (1 = full).", "kv_usage"),
                  ("laneserve:kv_cache_free_blocks", "Free KV-cache blocks.", "kv_free"),
                  ("laneserve:kv_cache_total_blocks", "KV-cache blocks.", "kv_total"),
                  ("laneserve:instance_up", "1 while the instance process is alive.", "alive"))
        for name, help_text, key in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            for inst in instances:
                v = inst.get(key)
                if v is not None:
                    labels = {"model_name": self.model, "instance": inst["id"], "role": inst["role"]}
                    lines.append(f"{name}{_labels(labels)} {float(v)}")
        lines += ["# HELP laneserve:num_preemptions_total Preemptions (prefill steps stopped at a boundary, "
                  "decode swaps/recomputes).", "# TYPE laneserve:num_preemptions_total counter"]
        for inst in instances:
            if inst.get("preemptions") is not None:
                labels = {"model_name": self.model, "instance": inst["id"], "role": inst["role"]}
                lines.append(f"laneserve:num_preemptions_total{_labels(labels)} {float(inst['preemptions'])}")
        lines += ["# HELP laneserve:num_requests_in_flight Requests admitted and not finished (router).",
                  "# TYPE laneserve:num_requests_in_flight gauge",
                  f"laneserve:num_requests_in_flight{_labels({'model_name': self.model})} {in_flight}"]
        return "\n".join(lines) + "\n"
