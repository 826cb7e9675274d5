"""Workloads: real traces, ShareGPT multi-turn, synthetic paper mixes, arrival processes, SLOs.

``make_workload(name, **opts)`` builds any registered workload; ``available_workloads()`` lists the
names. Every factory accepts its own keyword options (see the function each name maps to); the
trace workloads also take ``rate`` (rescale to that mean rate with :meth:`Workload.with_rate`).
Unknown names or options raise ``ValueError`` naming the valid ones. No torch anywhere here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from laneserve.core.slo import SLO
from laneserve.workloads.arrivals import arrival_times, gamma_arrivals, poisson_arrivals
from laneserve.workloads.sharegpt import sharegpt_workload
from laneserve.workloads.slo_tables import (CHAT_SLO, FLOWPREFILL_CLASSES, FLOWPREFILL_TTFT_SLO,
                                            LONG_CONTEXT_SLO, flowprefill_model_key, flowprefill_slos)
from laneserve.workloads.synthetic import (FLOWPREFILL_PROMPT_STATS, alignedserve_mix, flowprefill_mix,
                                           lmsys_multiturn, long_context_mix, short_long_mix)
from laneserve.workloads.traces import (AZURE_CONV_PATH, MOONCAKE_CONV_PATH, IdleLatencySLO, detect_format,
                                        load_azure_csv, load_mooncake_jsonl, load_trace)
from laneserve.workloads.workload import Workload


def azure_conv(*, limit: int | None = None, rate: float | None = None,
               slo: SLO = CHAT_SLO) -> Workload:
    """The bundled Azure 2023 conversation trace (optionally the first ``limit`` rows, rescaled
    to mean ``rate`` req/s)."""
    w = load_azure_csv(AZURE_CONV_PATH, limit=limit, slo=slo)
    return w.with_rate(rate) if rate is not None else w


def mooncake_conv(*, limit: int | None = None, rate: float | None = None,
                  slo: SLO = LONG_CONTEXT_SLO) -> Workload:
    """The bundled Mooncake conversation trace (optionally truncated and rescaled)."""
    w = load_mooncake_jsonl(MOONCAKE_CONV_PATH, limit=limit, slo=slo)
    return w.with_rate(rate) if rate is not None else w


_REGISTRY: dict[str, Callable[..., Workload]] = {
    "azure_conv": azure_conv,
    "mooncake_conv": mooncake_conv,
    "sharegpt": sharegpt_workload,
    "flowprefill_mix": flowprefill_mix,
    "alignedserve_mix": alignedserve_mix,
    "lmsys_multiturn": lmsys_multiturn,
    "short_long_mix": short_long_mix,
    "long_context_mix": long_context_mix,
}


def available_workloads() -> list[str]:
    return sorted(_REGISTRY)


def workload_options(name: str) -> list[str]:
    """The keyword options ``make_workload(name, ...)`` accepts."""
    return list(inspect.signature(_factory(name)).parameters)


def _factory(name: str) -> Callable[..., Workload]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(available_workloads())}") from None


def make_workload(name: str, **opts) -> Workload:
    """Build the workload registered as ``name`` with keyword ``opts``."""
    factory = _factory(name)
    valid = workload_options(name)
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        raise ValueError(f"workload {name!r} has no option(s) {', '.join(unknown)}; "
                         f"valid options: {', '.join(valid)}")
    try:
        return factory(**opts)
    except TypeError as e:   # e.g. a positional-only mistake or a wrong value type
        raise ValueError(f"workload {name!r}: bad options {opts}: {e}") from None


__all__ = [
    "AZURE_CONV_PATH", "CHAT_SLO", "FLOWPREFILL_CLASSES", "FLOWPREFILL_PROMPT_STATS",
    "FLOWPREFILL_TTFT_SLO", "IdleLatencySLO", "LONG_CONTEXT_SLO", "MOONCAKE_CONV_PATH", "Workload", "alignedserve_mix",
    "arrival_times", "azure_conv", "mooncake_conv", "available_workloads", "detect_format", "flowprefill_mix", "flowprefill_model_key",
    "flowprefill_slos", "gamma_arrivals", "lmsys_multiturn", "load_azure_csv", "load_mooncake_jsonl",
    "load_trace", "make_workload", "poisson_arrivals", "sharegpt_workload", "short_long_mix",
    "workload_options",
]
