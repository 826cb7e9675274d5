"""Derive the engine cost models' calibration data from aiconfigurator-core's measured tables.

Run with a Python that has ``aiconfigurator-core`` (0.12.0, Apache-2.0; it needs pandas, pyarrow
and scipy, which laneserve does not: a separate virtual environment is fine)::

    python -m venv /tmp/aic && /tmp/aic/bin/pip install aiconfigurator-core==0.12.0
    /tmp/aic/bin/python benchmarks/engine_tables.py

For each backend (vllm 0.24.0, sglang 0.5.14, trtllm 1.3.0rc20) and system (h100_sxm, h200_sxm) it
writes ``laneserve/costmodel/data/aiconfigurator_steps.csv``: aiconfigurator's per-operator
breakdown (summed into operator groups) of a decode step (batch x context) and a prefill step (batch x prompt length) of
Llama-3.1-8B (TP1, TP2) and Llama-3.1-70B (TP2, TP4, TP8), composed by its SDK from its measured
per-operator database (GEMM, attention, element-wise, all-reduce tables); and
``aiconfigurator_allreduce.csv``: its measured all-reduce tables (vLLM custom all-reduce, graph
and eager; SGLang's and TRT-LLM's custom all-reduce; NCCL), bf16, 2/4/8 GPUs (the tables'
``message_size`` counts 16-bit elements, as aiconfigurator's SDK queries them with tokens x hidden;
the CSV's ``bytes`` is twice it). laneserve reads only
these two small CSVs (``laneserve.costmodel.engines``), never the parquet tables.
"""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "laneserve" / "costmodel" / "data"
SYSTEMS = ("h100_sxm", "h200_sxm")
BACKENDS = ("vllm", "sglang", "trtllm")
MODELS = {"llama-3.1-8b": ("meta-llama/Meta-Llama-3.1-8B", (1, 2)),
          "llama-3.1-70b": ("meta-llama/Meta-Llama-3.1-70B", (2, 4, 8))}
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PREFILL = [(1, n) for n in (64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)] + \
          [(b, n) for b in (2, 4, 8) for n in (128, 512, 1024, 2048)]
#: aiconfigurator's operators, summed into the groups laneserve models (ms per step, all layers)
GROUPS = {"gemm": ("qkv_gemm", "proj_gemm", "gate_ffn1_gemm", "ffn2_gemm"),
          "logits": ("logits_gemm",), "attention": ("attention",),
          "norm": ("add_norm_1", "add_norm_2"), "act": ("act_gate",), "embedding": ("embedding",),
          "allreduce": ("ar_1", "ar_2", "embedding_ar")}
COMM = {"vllm": [("comm/vllm/0.24.0/custom_allreduce_perf.parquet", None)],
        "sglang": [("comm/sglang/0.5.14/custom_allreduce_perf.parquet", None)],
        "trtllm": [("comm/trtllm/1.3.0rc20/custom_allreduce_perf.parquet", None)],
        "nccl": [("comm/nccl/2.29.2/nccl_perf.parquet", "all_reduce")]}


def main() -> int:
    logging.disable(logging.WARNING)
    import pandas as pd
    from aiconfigurator_core.sdk import config
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.perf_database import get_database, get_latest_database_version
    import aiconfigurator_core

    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for system in SYSTEMS:
        for backend in BACKENDS:
            version = get_latest_database_version(system, backend)
            db = get_database(system, backend, version)
            be = get_backend(backend)
            for name, (path, tps) in MODELS.items():
                for tp in tps:
                    model = get_model(path, config.ModelConfig(tp_size=tp), backend)
                    points = [("decode", b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
                    points += [("prefill", b, n) for b, n in PREFILL]
                    for phase, batch, length in points:
                        if phase == "decode":
                            rc = config.RuntimeConfig(batch_size=batch, isl=length, osl=2)
                            res = be.run_static(model, db, rc, "static_gen")
                            ops, prefix = res.get_generation_latency_dict(), "generation_"
                        else:
                            rc = config.RuntimeConfig(batch_size=batch, isl=length, osl=1)
                            res = be.run_static(model, db, rc, "static_ctx")
                            ops, prefix = res.get_context_latency_dict(), "context_"
                        rows.append({"system": system, "backend": backend, "version": version,
                                     "model": name, "tp": tp, "phase": phase, "batch": batch,
                                     "length": length,
                                     **{g: float(f"{sum(float(ops.get(prefix + op, 0.0)) for op in members):.5g}")
                                        for g, members in GROUPS.items()}})
            print(f"{system} {backend} {version}: {len(rows)} rows so far", file=sys.stderr)
    with open(OUT / "aiconfigurator_steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    data = Path(aiconfigurator_core.__file__).parent / "systems" / "data"
    ar_rows = []
    for system in SYSTEMS:
        for kind, files in COMM.items():
            for rel, op in files:
                df = pd.read_parquet(data / system / rel)
                if op is not None:
                    df = df[(df["op_name"] == op) & (df["nccl_dtype"] == "half")]
                    df = df.assign(kernel_source="nccl")
                for r in df.itertuples():
                    ar_rows.append({"system": system, "kind": kind, "kernel": r.kernel_source.lower(),
                                    "num_gpus": int(r.num_gpus), "bytes": 2 * int(r.message_size),
                                    "latency_ms": round(float(r.latency), 6)})
    with open(OUT / "aiconfigurator_allreduce.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(ar_rows[0]))
        w.writeheader()
        w.writerows(ar_rows)
    print(f"wrote {len(rows)} step rows, {len(ar_rows)} all-reduce rows to {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
