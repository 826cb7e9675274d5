"""SLO tables as data: FlowPrefill's per-model, per-class TTFT targets and laneserve's defaults.

FlowPrefill (FlowPrefill §6.1, Table 2, "Settings of different TTFT SLO requirements")::

    Model        Text   Image  Search  File
    Llama3-8B    0.25s  0.5s   4.0s    6.0s
    Qwen2.5-14B  0.4s   0.8s   6.5s    9.0s
    Llama3-70B   1.0s   2.0s   15.0s   18.0s

The paper sets TTFT targets only (its metric is TTFT attainment); a TPOT target, when wanted, is an
option of the generator. The paper also runs Qwen3-30B-A3B but gives no SLO row for it, so none is
invented here.

Defaults for the other workloads (not from one paper; override with ``slo=`` or
:meth:`Workload.with_slo` and sweep with :meth:`Workload.scale_slo`):

- chat traces and multi-turn chat (Azure conversation, ShareGPT, LMSys-like): TTFT 0.4 s as in
  LAPS §4 (LMSys-Chat-1M experiment), TPOT 50 ms as in Kairos §4.1;
- long-context traces (Mooncake conversation, mean input ~12K tokens): TTFT 8 s and TPOT 50 ms,
  Kairos §4.1's production setting for a long-tail trace.
"""

from __future__ import annotations

import re

from laneserve.core.slo import SLO

#: FlowPrefill task classes, in Table 1/2 order (names as in Table 2).
FLOWPREFILL_CLASSES: tuple[str, ...] = ("Text", "Image", "Search", "File")

#: FlowPrefill Table 2: model -> class -> TTFT SLO in seconds.
FLOWPREFILL_TTFT_SLO: dict[str, dict[str, float]] = {
    "Llama3-8B": {"Text": 0.25, "Image": 0.5, "Search": 4.0, "File": 6.0},
    "Qwen2.5-14B": {"Text": 0.4, "Image": 0.8, "Search": 6.5, "File": 9.0},
    "Llama3-70B": {"Text": 1.0, "Image": 2.0, "Search": 15.0, "File": 18.0},
}

#: (family, billions of parameters) -> Table 2 row, for matching free-form model names.
_FLOWPREFILL_KEYS: dict[tuple[str, float], str] = {
    ("llama", 8.0): "Llama3-8B", ("qwen", 14.0): "Qwen2.5-14B", ("llama", 70.0): "Llama3-70B",
}

CHAT_SLO = SLO(ttft=0.4, tpot=0.05)
LONG_CONTEXT_SLO = SLO(ttft=8.0, tpot=0.05)


def flowprefill_model_key(model: str) -> str:
    """Resolve a model name to a FlowPrefill Table 2 row.

    Matching is by family (``llama`` / ``qwen``) and parameter count, case-insensitive, ignoring
    an organisation prefix and suffixes: ``"Llama3-8B"``, ``"meta-llama/Meta-Llama-3.1-8B-Instruct"``
    and ``"llama-3-8b"`` all give ``"Llama3-8B"``; ``"Qwen/Qwen2.5-14B-Instruct"`` gives
    ``"Qwen2.5-14B"``. Anything else raises ``ValueError`` listing the rows.
    """
    if model in FLOWPREFILL_TTFT_SLO:
        return model
    name = model.lower().rsplit("/", 1)[-1]
    family = "llama" if "llama" in name else "qwen" if "qwen" in name else None
    size = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)b(?![a-z])", name)
    key = (family, float(size.group(1))) if family and size else None
    if key not in _FLOWPREFILL_KEYS:
        raise ValueError(f"no FlowPrefill Table 2 SLO row for model {model!r}; "
                         f"choose one of {', '.join(FLOWPREFILL_TTFT_SLO)}")
    return _FLOWPREFILL_KEYS[key]


def flowprefill_slos(model: str = "Llama3-8B", *, tpot: float | None = None) -> dict[str, SLO]:
    """Per-class SLOs of FlowPrefill Table 2 for ``model`` (TTFT only unless ``tpot`` is given)."""
    row = FLOWPREFILL_TTFT_SLO[flowprefill_model_key(model)]
    return {cls: SLO(ttft=row[cls], tpot=tpot) for cls in FLOWPREFILL_CLASSES}
