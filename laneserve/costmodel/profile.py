"""Profile file I/O (docs/design.md, "Cost models": a cost model fitted from the engine's own profile).

An engine profile is one JSON file::

    {"model": str, "device": str, "attention": "padded"|"ragged", "num_layers": int,
     "kv_bytes_per_token": int,
     "prefill": [{"new_tokens": [...], "cached_tokens": [...], "seconds": float}, ...],
     "decode":  [{"context_lens": [...], "seconds": float}, ...],
     "kv_copy": [{"tokens": int, "seconds": float}, ...],          # optional
     "kv_copy_link": "host",                                        # optional
     "op_fractions": [5 floats],                                    # optional
     "tensor_parallel_size": int}                                   # optional, default 1

A profile of a tensor-parallel instance (``laneserve profile -tp N``) times the whole group's
steps (rank 0's view: broadcast, every rank's shard, the all-reduces) and counts every rank's KV
bytes per token; it models an instance of that degree only (:func:`check_profile_degree`).

Also loaders for the shared H100 measurements used by calibration and the benchmarks: Vidur's
per-layer MLP/linear profile, Vidur's send/recv network profile and LLMServingSim's per-operator
layer profile.
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from .base import CostModel, PrefillBatch


@dataclass(slots=True)
class PrefillSample:
    new_tokens: list[int]
    cached_tokens: list[int]
    seconds: float


@dataclass(slots=True)
class DecodeSample:
    context_lens: list[int]
    seconds: float


@dataclass(slots=True)
class KVCopySample:
    tokens: int
    seconds: float


@dataclass(slots=True)
class Profile:
    model: str
    device: str
    attention: str
    num_layers: int
    kv_bytes_per_token: int
    prefill: list[PrefillSample] = field(default_factory=list)
    decode: list[DecodeSample] = field(default_factory=list)
    kv_copy: list[KVCopySample] = field(default_factory=list)
    kv_copy_link: str = "host"
    op_fractions: list[float] | None = None
    tensor_parallel_size: int = 1

    def to_dict(self) -> dict:
        data = asdict(self)
        if self.op_fractions is None:
            del data["op_fractions"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        if data.get("attention", "ragged") not in ("padded", "ragged"):
            raise ValueError(f"profile attention must be 'padded' or 'ragged', got {data['attention']!r}")
        prefill = [PrefillSample([int(x) for x in s["new_tokens"]],
                                 [int(x) for x in s.get("cached_tokens") or [0] * len(s["new_tokens"])],
                                 float(s["seconds"])) for s in data.get("prefill", [])]
        for s in prefill:
            if len(s.new_tokens) != len(s.cached_tokens):
                raise ValueError("prefill sample: new_tokens and cached_tokens differ in length")
        return cls(model=str(data["model"]), device=str(data["device"]),
                   attention=str(data.get("attention", "ragged")),
                   num_layers=int(data["num_layers"]),
                   kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                   prefill=prefill,
                   decode=[DecodeSample([int(x) for x in s["context_lens"]], float(s["seconds"]))
                           for s in data.get("decode", [])],
                   kv_copy=[KVCopySample(int(s["tokens"]), float(s["seconds"]))
                            for s in data.get("kv_copy", [])],
                   kv_copy_link=str(data.get("kv_copy_link", "host")),
                   op_fractions=data.get("op_fractions"),
                   tensor_parallel_size=_degree(data.get("tensor_parallel_size", 1)))


def _degree(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"profile tensor_parallel_size must be a positive integer, got {value!r}")
    return value


def load_profile(path: str | Path) -> Profile:
    return Profile.from_dict(json.loads(Path(path).read_text()))


def check_profile_degree(profile: Profile, tp: int, source: str = "the profile") -> Profile:
    """``profile`` if it measured an instance of tensor parallel size ``tp``; else a ValueError
    naming both degrees (a TP1 profile says nothing of a TP4 instance's all-reduces, nor the reverse)."""
    if profile.tensor_parallel_size != tp:
        raise ValueError(f"{source} measured a tensor parallel size {profile.tensor_parallel_size} instance, the "
                         f"simulation asks for {tp}: pass --tensor-parallel-size {profile.tensor_parallel_size}, "
                         f"or profile with laneserve profile -tp {tp}")
    return profile


def profiles_by_degree(paths: Sequence[str | Path]) -> dict[int, str]:
    """``{tensor parallel size: path}`` of engine profiles; two of one degree are a ValueError
    (which one would a run of that degree read?)."""
    by_degree: dict[int, str] = {}
    for path in paths:
        degree = load_profile(path).tensor_parallel_size
        if degree in by_degree:
            raise ValueError(f"{by_degree[degree]} and {path} both measured a tensor parallel size {degree} "
                             "instance: give one profile per degree")
        by_degree[degree] = str(path)
    return by_degree


def profile_for_degree(paths: Sequence[str | Path], tp: int) -> str:
    """The one of ``paths`` (engine profiles, each of its own tensor parallel size) that measured a
    TP ``tp`` instance. A single path is returned whatever its degree (loading it checks that,
    :func:`check_profile_degree`); of several, none of degree ``tp`` is a ValueError naming the
    degrees they cover."""
    if len(paths) == 1:
        return str(paths[0])
    by_degree = profiles_by_degree(paths)
    if tp not in by_degree:
        raise ValueError(f"no profile measured a tensor parallel size {tp} instance (they cover "
                         f"{', '.join(map(str, sorted(by_degree)))}): profile one with laneserve profile -tp {tp}")
    return by_degree[tp]


def save_profile(profile: Profile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return path


def synthesize_profile(model: CostModel, prefill_batches: Iterable[PrefillBatch],
                       decode_batches: Iterable[Sequence[int]], *, device: str = "synthetic",
                       kv_copy_tokens: Sequence[int] = (), kv_copy_link: str = "host") -> Profile:
    """A profile whose timings come from another cost model (tests, a simulator twin of a model)."""
    return Profile(
        model=model.name, device=device, attention=model.attention, num_layers=model.num_layers,
        kv_bytes_per_token=model.kv_bytes_per_token,
        prefill=[PrefillSample([int(n) for n, _ in b], [int(c) for _, c in b], model.prefill_time(b))
                 for b in map(list, prefill_batches)],
        decode=[DecodeSample([int(c) for c in ctx], model.decode_step_time(ctx))
                for ctx in decode_batches],
        kv_copy=[KVCopySample(int(t), model.kv_transfer_time(int(t), kv_copy_link))
                 for t in kv_copy_tokens],
        kv_copy_link=kv_copy_link)


# --- shared CSV measurements --------------------------------------------------------------------

#: Vidur's per-layer operator names (``time_stats.<op>.median``, milliseconds).
VIDUR_OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


@dataclass(slots=True)
class VidurMlpRow:
    num_tokens: int
    tp: int
    op_seconds: dict[str, float]      # median per operator, seconds


def open_profile_csv(path: str | Path) -> TextIO:
    """Open a measured profile CSV as text: ``path`` itself, else its gzip copy ``<path>.gz`` (the
    profiles packaged in ``laneserve/costmodel/data`` are gzipped; a ``--profiles`` folder may hold
    either form)."""
    path = Path(path)
    packed = path.with_name(path.name + ".gz")
    if not path.exists() and packed.exists():
        return gzip.open(packed, "rt", newline="")
    return open(path, newline="")


def load_vidur_mlp(path: str | Path) -> list[VidurMlpRow]:
    """Rows of Vidur's ``mlp.csv`` (one layer's non-attention operators vs tokens and TP)."""
    rows = []
    with open_profile_csv(path) as f:
        for r in csv.DictReader(f):
            ops = {op: float(r[f"time_stats.{op}.median"]) * 1e-3 for op in VIDUR_OPS
                   if r.get(f"time_stats.{op}.median")}
            rows.append(VidurMlpRow(int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]), ops))
    return rows


@dataclass(slots=True)
class SendRecvRow:
    nbytes: int
    seconds: float          # median
    devices_per_node: int


def load_vidur_send_recv(path: str | Path) -> list[SendRecvRow]:
    with open_profile_csv(path) as f:
        return [SendRecvRow(int(r["size"]), float(r["time_stats.send_recv.median"]) * 1e-3,
                            int(r["devices_per_node"])) for r in csv.DictReader(f)]


def load_llmservingsim_layers(path: str | Path) -> dict[tuple[int, int, int], dict[str, float]]:
    """LLMServingSim's ``layers.csv``: ``{(input_tokens, kv_cache, tp): {layer_name: seconds}}``."""
    table: dict[tuple[int, int, int], dict[str, float]] = {}
    with open_profile_csv(path) as f:
        for r in csv.DictReader(f):
            key = (int(r["input"]), int(r["kv_cache"]), int(r["tp_size"]))
            table.setdefault(key, {})[r["layer_name"]] = float(r["latency(ns)"]) * 1e-9
    return table


#: Grouping of LLMServingSim's operator names (per layer unless marked otherwise).
LLMSS_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLMSS_ELEMENTWISE = ("input_layernorm", "rope", "post_layernorm", "act_fn")
LLMSS_ONCE = ("embedding", "final_layernorm", "lm_head")


def llmss_prefill_seconds(ops: dict[str, float], num_layers: int, *,
                          lm_head_seconds: float | None = None) -> float:
    """Whole-model time from one row set: per-layer operators times ``num_layers`` plus the
    once-per-model ones. ``lm_head_seconds`` replaces the profiled LM head (which the profile runs
    over every input token) by the cost of a last-token-only LM head."""
    once = {k: ops[k] for k in LLMSS_ONCE if k in ops}
    if lm_head_seconds is not None:
        once["lm_head"] = lm_head_seconds
    per_layer = sum(v for k, v in ops.items() if k not in LLMSS_ONCE)
    return num_layers * per_layer + sum(once.values())
