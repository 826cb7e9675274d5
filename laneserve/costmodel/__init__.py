"""Cost models: one latency interface (:class:`CostModel`) with analytic (roofline, calibrated on
measured H100/A100 profiles by ``laneserve calibrate``) and fitted (engine profile, FlowPrefill / Kairos / LAPS predictors)
implementations (docs/design.md, "Cost models"). Pure Python + numpy; never imports torch.

    >>> cm = make_cost_model("analytic", model="llama-3-8b", hardware="h100")
    >>> cm.prefill_time([(1024, 0)]) > cm.decode_step_time([1024])
    True
"""

from __future__ import annotations

from collections.abc import Callable

from .analytic import AnalyticCostModel
from .base import LAYER_OPERATORS, CostModel, PrefillBatch
from .engines import ENGINES, EngineCostModel, make_engine_cost_model
from .fitted import FittedCostModel, PolynomialTTFT, StepTimeLUT
from .laps_fit import LapsPrefillModel
from .linear import LinearCostModel
from .profile import Profile, check_profile_degree, load_profile, save_profile, synthesize_profile
from .specs import HARDWARE, MODELS, HardwareSpec, HostOverhead, LinkSpec, ModelSpec

__all__ = [
    "CostModel", "PrefillBatch", "LAYER_OPERATORS", "AnalyticCostModel", "FittedCostModel",
    "PolynomialTTFT", "StepTimeLUT", "LapsPrefillModel", "ModelSpec", "HardwareSpec", "LinkSpec",
    "HostOverhead",
    "MODELS", "HARDWARE", "Profile", "load_profile", "save_profile", "synthesize_profile",
    "make_cost_model", "available_models", "available_hardware", "available_kinds",
    "get_model_spec", "get_hardware_spec", "ENGINES", "EngineCostModel", "available_engines",
]


def available_models() -> list[str]:
    return sorted(MODELS)


def available_hardware() -> list[str]:
    return sorted(HARDWARE)


def _lookup(table: dict, name: str, what: str):
    key = name.strip().lower()
    if key not in table:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(sorted(table))}")
    return table[key]


def get_model_spec(name: str) -> ModelSpec:
    return _lookup(MODELS, name, "model")


def get_hardware_spec(name: str) -> HardwareSpec:
    return _lookup(HARDWARE, name, "hardware")


def available_engines() -> list[str]:
    return list(ENGINES)


def _make_analytic(*, model: str, hardware: str, tp: int, attention: str,
                   profile: str | None, host_overhead: bool, engine: str = "legacy") -> CostModel:
    if engine.lower() != "legacy":
        return make_engine_cost_model(get_model_spec(model), get_hardware_spec(hardware), tp=tp,
                                      engine=engine, attention=attention.lower(),
                                      host_overhead=host_overhead, profile=profile)
    return AnalyticCostModel(get_model_spec(model), get_hardware_spec(hardware), tp=tp,
                             attention=attention.lower(), host_overhead=host_overhead)


def _make_fitted(*, model: str, hardware: str, tp: int, attention: str,
                 profile: str | None, host_overhead: bool, engine: str = "legacy") -> CostModel:
    if profile is None:
        raise ValueError("kind='fitted' needs profile=<path to an engine profile JSON>")
    prof = check_profile_degree(load_profile(profile), tp, str(profile))
    return FittedCostModel(prof, links=dict(get_hardware_spec(hardware).links))


def _make_linear(*, model: str, hardware: str, tp: int, attention: str,
                 profile: str | None, host_overhead: bool, engine: str = "legacy") -> CostModel:
    return LinearCostModel(attention=attention.lower())


_KINDS: dict[str, Callable[..., CostModel]] = {"analytic": _make_analytic, "fitted": _make_fitted,
                                               "linear": _make_linear}


def available_kinds() -> list[str]:
    return sorted(_KINDS)


def make_cost_model(kind: str = "analytic", *, model: str = "llama-3-8b", hardware: str = "h100",
                    tp: int = 1, attention: str = "ragged", profile: str | None = None,
                    host_overhead: bool = False, engine: str = "legacy") -> CostModel:
    """Build a cost model by name. ``analytic``: roofline of ``model`` on ``hardware`` with tensor
    parallelism ``tp`` (``host_overhead=True`` adds the per-iteration CPU cost; default: GPU time
    only); ``engine`` picks whose kernels it models (``legacy``, the default: the original
    constants, unchanged; ``vllm`` / ``sglang`` / ``trtllm``: :class:`EngineCostModel`, fitted on
    aiconfigurator's measurements; ``laneserve``: this project's engine, from ``profile`` when
    given); ``fitted``: fitted from the engine profile at ``profile`` (its own attention kind and
    measured overheads; ``hardware`` supplies the links the profile did not measure)."""
    if engine.lower() not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    return _lookup(_KINDS, kind, "cost model kind")(model=model, hardware=hardware, tp=tp,
                                                     attention=attention, profile=profile,
                                                     host_overhead=host_overhead, engine=engine)
