"""The engine on a GPU, in one command of at most ~5 minutes, results written as it goes:

  (a) greedy tokens against Hugging Face ``generate``, fp32, every attention path, graphs on and off;
      and graph capture beside another thread that keeps synchronising (capture isolation);
  (b) decode step time of a Llama-3.1-8B-shaped random model at batch 1/8/32/64 and ~1K context,
      graphs and eager, as a fraction of the measured device copy bandwidth;
  (c) prefill TFLOP/s at 2K and 8K tokens (against a measured bf16 matmul);
  (d) preemption latency of an 8K prefill per granularity (and per ``preempt_max_inflight``);
  (e) offline throughput with the default engine settings against HF ``generate`` on the same weights;
  (f) the prefill policies end to end on the engine (1 prefill + 1 decode instance in-process; a
      short/long mix: 24% long prompts of 6,144-8,192 tokens, the rest 64-512, one output token,
      TTFT SLO 0.15 s short / 3 s long, Poisson arrivals) beside the simulator fed this engine's own
      GPU profile (``EngineProfiler``, what ``laneserve profile`` runs; saved next to the results);
  (g) MoE layers shaped like Qwen3-30B-A3B's (128 experts of 2048 x 768, top-8, bf16, random): the
      two MoE operators' step time at batch 1/32/128 against the bytes of the expert weights the
      batch touches (a fraction of the copy bandwidth), the grouped Triton path against a loop over
      the experts, its output against that loop, and one CUDA-graph capture and replay of it.
  (h) tensor parallelism, where two or more GPUs are visible (one line says so where there is
      one): greedy tokens of TP2 (and TP4 with four GPUs) against TP1, fp32, and the wall time of
      the same generation, for a dense Llama model and a Qwen3-MoE one (experts split across ranks).

    PYTHONPATH=. python3 benchmarks/gpu_check.py            # on a CUDA machine
    PYTHONPATH=. python3 benchmarks/gpu_check.py --dry-run  # every section on CPU at tiny sizes

Each section runs under its own ``try``: a failure is recorded (with its traceback) and the next
section runs. ``benchmarks/results/gpu_check.json`` and ``.md`` are rewritten after every section
(a dry run writes ``gpu_check_dryrun.*`` instead, never the GPU file names). Without CUDA and
without ``--dry-run`` the script says so and exits 0.

Models are random-weight and built in memory with ``transformers`` ``from_config`` (no download, no
checkpoint written): the engine reads the Hugging Face model's own tensors, so both sides run the
same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384,
                rope_theta=500000.0, rms_norm_eps=1e-5)
CHECK_MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


class Report:
    """Section results, rewritten to JSON and markdown after every section."""

    def __init__(self, path_stem: Path, meta: dict) -> None:
        self.stem = path_stem
        self.data = {"meta": meta, "sections": {}}
        self.t0 = time.perf_counter()

    def run(self, key: str, title: str, fn, *args) -> object:
        print(f"== ({key}) {title}", flush=True)
        start = time.perf_counter()
        entry = {"title": title}
        out = None
        try:
            out = fn(*args)
            entry.update(status="ok", result=out)
        except Exception as exc:          # one section's failure must not lose the others
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            print(entry["traceback"], flush=True)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        self.data["sections"][key] = entry
        self.data["meta"]["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        self.write()
        cleanup()
        return out

    def write(self) -> None:
        self.stem.parent.mkdir(parents=True, exist_ok=True)
        self.stem.with_suffix(".json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        lines = [f"# {self.stem.name}", "", f"Command: `{' '.join(sys.argv)}`  ",
                 f"Machine: {self.data['meta'].get('machine')}  ", f"Elapsed: {self.data['meta'].get('elapsed_s')} s", ""]
        for key, entry in self.data["sections"].items():
            lines.append(f"## ({key}) {entry['title']}: {entry['status']} ({entry['seconds']} s)")
            lines.append("")
            if entry["status"] != "ok":
                lines += ["```", entry["error"], "```", ""]
                continue
            lines += _markdown(entry["result"]) + [""]
        self.stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _markdown(result) -> list[str]:
    """Tables for the lists of flat dicts in a section's result, ``key: value`` for the rest."""
    lines = []
    items = result.items() if isinstance(result, dict) else [("result", result)]
    for key, value in items:
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            cols = list(dict.fromkeys(k for row in value for k in row))
            lines += [f"**{key}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |" for row in value]
            lines.append("")
        else:
            lines.append(f"- {key}: {_fmt(value)}")
    return lines


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- in-memory models shared by HF and the engine ------------------------------------------
class MemoryModel:
    """A random-weight HF Llama built on the device, plus a folder holding only its config.json;
    while :meth:`engine_loading` is active the engine's loader reads this model's tensors for that
    folder instead of safetensors files."""

    def __init__(self, shape: dict, device: str, dtype: torch.dtype, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=shape["vocab_size"] - 1)
        torch.manual_seed(seed)
        with torch.device(device):
            try:
                self.hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
            except TypeError:
                self.hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
        self.hf.eval()
        self.folder = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
        cfg.save_pretrained(self.folder)
        raw = json.loads((self.folder / "config.json").read_text())
        raw["dtype"] = raw["torch_dtype"] = str(dtype).removeprefix("torch.")
        raw["architectures"] = ["LlamaForCausalLM"]
        (self.folder / "config.json").write_text(json.dumps(raw))
        self.shape = shape
        self.dtype = dtype

    def params(self) -> int:
        return sum(p.numel() for p in self.hf.parameters())

    @contextlib.contextmanager
    def engine_loading(self):
        from laneserve.engine.models import loader
        real = loader.read_state_dict
        folder = self.folder

        def read_state_dict(path):
            if Path(path).resolve() == folder.resolve():
                return dict(self.hf.state_dict())
            return real(path)

        loader.read_state_dict = read_state_dict
        try:
            yield str(folder)
        finally:
            loader.read_state_dict = real

    def close(self) -> None:
        del self.hf
        cleanup()


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def engine_llm(path: str, config):
    from laneserve.engine.llm import LLM
    return LLM(path, config=config, quiet=True)


def greedy_params(n: int):
    from laneserve.core.sampling import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---- sections ----------------------------------------------------------------------------------
def section_a(args) -> dict:
    from laneserve.engine import EngineConfig
    device = args.device
    shape = TINY if args.dry_run else CHECK_MODEL
    new_tokens = 6 if args.dry_run else 32
    lengths = (5, 17, 40) if args.dry_run else (17, 64, 200, 333)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, shape["vocab_size"] - 1) for _ in range(n)] for n in lengths]
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    mm = MemoryModel(shape, device, torch.float32)
    try:
        ref = hf_greedy(mm.hf, prompts, new_tokens, device)
        rows = []
        paths = ["ragged", "padded"] + (["paged"] if _triton_ok(device) else [])
        with mm.engine_loading() as path:
            for attention in paths:
                for graphs in (False, True):
                    row = {"attention": attention, "cuda_graphs": graphs}
                    try:
                        llm = engine_llm(path, EngineConfig(device=device, dtype="float32", attention=attention,
                                                            cuda_graphs=graphs, num_kv_blocks=256,
                                                            graph_max_context=1024))
                        outs = [o.token_ids for o in llm.generate(prompts, greedy_params(new_tokens))]
                        same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r))
                        total = sum(len(r) for r in ref)
                        row.update(identical=same / total, tokens=total,
                                   first_divergence=[next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None)
                                                     for o, r in zip(outs, ref)])
                        if graphs:
                            g = llm.executor.runner.graphs.stats
                            row.update(captures=g.captures, replays=g.replays, static_eager=g.static_eager)
                        del llm
                    except Exception as exc:
                        row.update(identical=None, error=f"{type(exc).__name__}: {exc}")
                    rows.append(row)
                    cleanup()
        isolation = capture_isolation(mm, prompts, device)
    finally:
        mm.close()
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    args.paged_ok = any(r["attention"] == "paged" and r.get("identical") == 1.0 for r in rows)
    return {"model": shape, "new_tokens": new_tokens, "prompt_lengths": list(lengths), "rows": rows,
            "capture_isolation": isolation,
            "all_identical": all(r.get("identical") == 1.0 for r in rows), "paged_usable": args.paged_ok}


def capture_isolation(mm: MemoryModel, prompts: list[list[int]], device: str) -> dict:
    """Another thread keeps synchronising (``.item()``) while an engine captures its CUDA graphs
    (a fresh engine: every bucket is captured on first use): errors on either side are counted."""
    import threading

    from laneserve.engine import EngineConfig
    stop = threading.Event()
    errors: list[str] = []
    syncs = [0]

    def other_instance() -> None:
        x = torch.ones(64, device=device)
        while not stop.is_set():
            try:
                (x * 2).sum().item()
                syncs[0] += 1
            except Exception as exc:     # what global capture mode raised here
                errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.001)

    thread = threading.Thread(target=other_instance, daemon=True)
    thread.start()
    capture_error = None
    captures = 0
    try:
        with mm.engine_loading() as path:
            llm = engine_llm(path, EngineConfig(device=device, dtype="float32", cuda_graphs=True,
                                                num_kv_blocks=256, graph_max_context=1024))
            llm.generate(prompts, greedy_params(8))
            captures = llm.executor.runner.graphs.stats.captures
            del llm
    except Exception as exc:
        capture_error = f"{type(exc).__name__}: {exc}"
    finally:
        stop.set()
        thread.join(timeout=10)
    return {"captures": captures, "other_thread_syncs": syncs[0], "other_thread_errors": len(errors),
            "first_error": errors[0] if errors else None, "capture_error": capture_error}


def _triton_ok(device: str) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.startswith("cuda"):
        return True
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


def big_model(args) -> MemoryModel:
    if getattr(args, "big", None) is None:
        shape = TINY if args.dry_run else LLAMA_8B
        dtype = torch.float32 if args.dry_run else torch.bfloat16
        args.big = MemoryModel(shape, args.device, dtype, seed=1)
    return args.big


def engine_attention(args, interpreted: bool = False) -> str:
    """The attention path for the throughput sections: the CUDA default when (a) showed it exact
    (in a dry run, ``interpreted`` sections take the paged path in Triton's interpreter)."""
    from laneserve.engine.config import default_attention
    choice = default_attention(args.device)
    if args.dry_run and interpreted and getattr(args, "paged_ok", False):
        return "paged"
    if choice == "paged" and not getattr(args, "paged_ok", False):
        return "ragged"
    return choice


def big_executor(args, cuda_graphs: bool, kv_tokens: int, interpreted: bool = True):
    from laneserve.core.kv import KVCacheManager
    from laneserve.engine import EngineConfig, EngineExecutor
    from laneserve.engine.models.loader import load_model
    mm = big_model(args)
    with mm.engine_loading() as path:
        model = load_model(path, args.device, "auto", load_tokenizer_too=False)
    cfg = EngineConfig(device=args.device, cuda_graphs=cuda_graphs, attention=engine_attention(args, interpreted),
                       num_kv_blocks=kv_tokens // 16, max_num_batched_tokens=8192,
                       graph_max_context=1024 if args.dry_run else 2048)
    return EngineExecutor(model, KVCacheManager(cfg.num_kv_blocks, cfg.block_size), cfg)


def copy_bandwidth(device: str, gib: float) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 2 / min(times)


def section_b(args) -> dict:
    from laneserve.engine.profiler import EngineProfiler
    batches = (1, 2) if args.dry_run else (1, 8, 32, 64)
    ctx = 48 if args.dry_run else 1024
    bw = copy_bandwidth(args.device, 0.05 if args.dry_run else 2.0)
    rows = []
    mm = big_model(args)
    weight_bytes = mm.params() * (2 if mm.dtype == torch.bfloat16 else 4)
    for graphs in (True, False):
        ex = big_executor(args, graphs, max(batches) * (ctx + 64) + 256)
        per_token = ex.model.config.kv_bytes_per_token(ex.model.embed.element_size())
        prof = EngineProfiler(ex, repeats=3 if args.dry_run else 10)
        for b in batches:
            seconds = prof.decode([ctx] * b).seconds
            moved = weight_bytes + b * ctx * per_token
            rows.append({"cuda_graphs": graphs, "attention": ex.runner.attention_name, "batch": b, "context": ctx,
                         "step_ms": seconds * 1e3,
                         "bytes_gb": moved / 1e9, "fraction_of_copy_bw": moved / seconds / bw})
        del ex, prof
        cleanup()
    return {"copy_bandwidth_tb_s": bw / 1e12, "attention": engine_attention(args, True), "rows": rows}


def matmul_tflops(device: str, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def section_c(args) -> dict:
    from laneserve.engine.profiler import EngineProfiler
    lengths = (64, 128) if args.dry_run else (2048, 8192)
    mm = big_model(args)
    ex = big_executor(args, False, max(lengths) + 256)
    cfg = ex.model.config
    non_embed = mm.params() - cfg.vocab_size * cfg.hidden_size           # input embedding is a lookup
    prof = EngineProfiler(ex, repeats=2 if args.dry_run else 5)
    rows = []
    for n in lengths:
        seconds = prof.prefill([(n, 0)]).seconds
        flops = 2 * non_embed * n + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n   # causal attention
        rows.append({"tokens": n, "step_ms": seconds * 1e3, "tflop_s": flops / seconds / 1e12})
    peak = matmul_tflops(args.device, 1024 if args.dry_run else 8192, mm.dtype)
    for r in rows:
        r["fraction_of_matmul"] = r["tflop_s"] / peak
    del ex
    return {"matmul_tflop_s": peak, "rows": rows}


def section_d(args) -> dict:
    import dataclasses

    import preemption_latency as pl
    prompt_len = 256 if args.dry_run else 8192
    chunk = 64 if args.dry_run else 512
    runs, signals = (1, 5) if args.dry_run else (3, 20)
    ex = big_executor(args, False, prompt_len + 256)
    rows, per_op = [], {}
    for inflight in (1, 2, 0):
        ex.config = dataclasses.replace(ex.config, preempt_max_inflight=inflight)
        stats, ops = pl.measure(ex, prompt_len, chunk, runs, signals, seed=0, log=lambda m: None)
        per_op[inflight] = ops
        for g, s in stats.items():
            if inflight != 1 and g == "chunk":
                continue            # chunked steps do not depend on the bound
            rows.append({"preempt_max_inflight": inflight, "granularity": g, **{k: s[k] for k in (
                "trials", "mean_ms", "p50_ms", "p99_ms", "max_ms", "largest_span_ms", "step_s")}})
    del ex
    return {"prompt_len": prompt_len, "chunk": chunk, "rows": rows, "operator_ms_by_inflight": per_op}


def section_e(args) -> dict:
    from laneserve.engine import EngineConfig
    n_req, prompt_len, out_len = (4, 32, 8) if args.dry_run else (64, 512, 128)
    mm = big_model(args)
    rng = random.Random(1)
    vocab = mm.shape["vocab_size"]
    prompts = [[rng.randrange(2, vocab - 1) for _ in range(prompt_len)] for _ in range(n_req)]
    result = {"requests": n_req, "prompt_len": prompt_len, "output_len": out_len}
    # HF generate, one batch (equal lengths: no padding)
    ids = torch.tensor(prompts, device=args.device)
    with torch.no_grad():
        mm.hf.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), do_sample=False, max_new_tokens=4,
                       min_new_tokens=4, eos_token_id=None, pad_token_id=0)
        sync(args.device)
        t0 = time.perf_counter()
        mm.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=out_len,
                       min_new_tokens=out_len, eos_token_id=None, pad_token_id=0)
        sync(args.device)
        hf_s = time.perf_counter() - t0
    result["hf_generate_output_tok_s"] = n_req * out_len / hf_s
    del ids
    cleanup()
    kv_tokens = n_req * (prompt_len + out_len) + 1024
    with mm.engine_loading() as path:
        config = EngineConfig(device=args.device, num_kv_blocks=kv_tokens // 16)    # defaults otherwise
        result["engine_config"] = {"dtype": config.dtype, "cuda_graphs": config.cuda_graphs,
                                   "attention": config.attention}
        llm = engine_llm(path, config)
        llm.generate(prompts[:2], greedy_params(4))                                  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, greedy_params(out_len))
        engine_s = time.perf_counter() - t0
        del llm
    result["engine_default_output_tok_s"] = n_req * out_len / engine_s
    result["engine_over_hf"] = result["engine_default_output_tok_s"] / result["hf_generate_output_tok_s"]
    return result


def mix_trace(n: int, rate: float, long_range, short_range, seed: int = 0):
    from laneserve.core import SLO, RequestSpec
    rng = random.Random(seed)
    t, specs = 0.0, []
    short_slo, long_slo = SLO(ttft=0.15, tpot=1.0), SLO(ttft=3.0, tpot=1.0)
    for i in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < 0.24
        specs.append(RequestSpec(i, t, rng.randint(*long_range) if long else rng.randint(*short_range), 1,
                                 slo=long_slo if long else short_slo, slo_class="long" if long else "short"))
    return specs


def section_f(args) -> dict:
    from engine_models import greedy_requests
    from laneserve.measure.metrics import summarize
    from laneserve.cluster import LocalCluster
    from laneserve.costmodel.fitted import FittedCostModel
    from laneserve.costmodel.profile import save_profile
    from laneserve.engine import EngineConfig
    from laneserve.engine.profiler import FULL, EngineProfiler
    from laneserve.sim import ClusterConfig, Simulator

    dry = args.dry_run
    n = 16 if dry else args.requests
    rate = 4.0 if dry else 9.0
    long_range = (96, 128) if dry else (6144, 8192)
    short_range = (8, 32) if dry else (64, 512)
    kv_tokens = 4096 if dry else 131072      # per instance (prefill and decode): 2 x 17 GB for the 8B shape
    policies = ("fcfs", "cp-edf-2k", "sedf", "adaptive")
    grid = dict(FULL, prefill_lens=(16, 64, 128) if dry else (64, 128, 256, 512, 1024, 2048, 4096, 8192),
                cached=(0, 64) if dry else (0, 2048, 6144), prefill_batches=((2, 16),) if dry else ((4, 256), (8, 128)),
                decode_batches=(1, 2) if dry else (1, 4, 16), decode_ctx=(32, 128) if dry else (512, 2048, 8192))
    ex = big_executor(args, True, kv_tokens, interpreted=False)
    profile = EngineProfiler(ex, repeats=2 if dry else 3).run(grid, model_name="llama-3.1-8b-random",
                                                               device=args.device)
    save_profile(profile, args.out_stem.with_name(args.out_stem.name + "_profile.json"))
    del ex
    cleanup()
    cost = FittedCostModel(profile)
    specs = mix_trace(n, rate, long_range, short_range)
    mm = big_model(args)
    rows = []
    deadline = args.start + args.budget
    with mm.engine_loading() as path:
        config = EngineConfig(device=args.device, attention=engine_attention(args), num_kv_blocks=kv_tokens // 16,
                              max_num_batched_tokens=8192)
        for policy in policies:
            if time.perf_counter() > deadline and not dry:
                rows.append({"policy": policy, "skipped": "time budget spent"})
                continue
            sim = Simulator(ClusterConfig(prefill_policy=policy, prefill_kv_tokens=kv_tokens,
                                          decode_kv_tokens=kv_tokens, kv_link="host"), cost).run(specs)
            sim_s = summarize(sim.requests)["per_class"]
            reqs = greedy_requests(specs, 1, vocab=min(mm.shape["vocab_size"], 32000))
            cluster = LocalCluster(path, prefill_policy=policy, config=config, kv_tokens=kv_tokens)
            for inst in cluster.prefill:
                bind = getattr(inst.scheduler, "bind_cost_model", None)
                if bind is not None:
                    bind(cost)
            done = cluster.run(reqs, timeout=120 if dry else 240)
            per = summarize(done)["per_class"]
            rows.append({"policy": policy,
                         "short_attainment": per["short"]["attainment_ttft"],
                         "sim_short_attainment": sim_s["short"]["attainment_ttft"],
                         "long_attainment": per.get("long", {}).get("attainment_ttft"),
                         "sim_long_attainment": sim_s.get("long", {}).get("attainment_ttft"),
                         "short_p90_ttft_ms": per["short"]["p90_ttft_ms"],
                         "sim_short_p90_ttft_ms": sim_s["short"]["p90_ttft_ms"],
                         "preemptions": getattr(cluster.prefill[0], "preemptions", None)})
            print(rows[-1], flush=True)
            del cluster
            cleanup()
    return {"requests": n, "rate_req_s": rate, "long_prompts": list(long_range), "short_prompts": list(short_range),
            "attention": engine_attention(args), "rows": rows}


QWEN3_30B_A3B_MOE = dict(experts=128, top_k=8, hidden=2048, inter=768, layers=2)
TINY_MOE = dict(experts=8, top_k=2, hidden=64, inter=32, layers=2)


def moe_layers(shape: dict, device: str, dtype: torch.dtype) -> list:
    from laneserve.engine.models.moe import MoEWeights
    g = torch.Generator(device=device).manual_seed(0)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    return [MoEWeights(router=torch.randn(e, h, device=device, generator=g, dtype=dtype),
                       gate_up=torch.randn(e, 2 * i, h, device=device, generator=g, dtype=dtype) / h ** 0.5,
                       down=torch.randn(e, h, i, device=device, generator=g, dtype=dtype) / i ** 0.5,
                       top_k=shape["top_k"], renormalize=True) for _ in range(shape["layers"])]


def time_moe(fn, layers: list, x: torch.Tensor, device: str, reps: int) -> float:
    """Seconds per layer of ``fn(x, layer)``, cycling the layers so no expert stays in cache."""
    for w in layers:
        fn(x, w)
    sync(device)
    t0 = time.perf_counter()
    for r in range(reps):
        fn(x, layers[r % len(layers)])
    sync(device)
    return (time.perf_counter() - t0) / reps


def moe_graph_check(layer, x: torch.Tensor, fused) -> dict:
    """Capture the two MoE operators in one CUDA graph and replay them on new inputs."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(static_x, layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused(static_x, layer)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    err = (static_out.float() - fused(static_x, layer).float()).abs().max().item()
    return {"graph_captured": True, "graph_replay_max_abs_diff": err}


def section_g(args) -> dict:
    from laneserve.engine.models.moe import moe_down, moe_gate_up, reference_moe, route
    shape = TINY_MOE if args.dry_run else QWEN3_30B_A3B_MOE
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    layers = moe_layers(shape, args.device, dtype)
    expert_bytes = 3 * shape["hidden"] * shape["inter"] * layers[0].down.element_size()
    bw = copy_bandwidth(args.device, 0.05 if args.dry_run else 2.0)
    reps = 3 if args.dry_run else 20

    def fused(x, w):
        return moe_down(moe_gate_up(x, w), w)

    rows = []
    with torch.inference_mode():
        for n in (1, 32, 128):
            x = torch.randn(n, shape["hidden"], device=args.device, dtype=dtype)
            touched = torch.topk(x @ layers[0].router.T, shape["top_k"]).indices.unique().numel()
            step = time_moe(fused, layers, x, args.device, reps)
            loop = time_moe(reference_moe, layers, x, args.device, max(2, reps // 4))
            weights, ids = route(x, layers[0])       # the same routing: fp32 could flip near ties
            ref = reference_moe(x.float(), _float_moe(layers[0]), (weights.float(), ids))
            rows.append({"tokens": n, "experts_touched": touched, "step_ms": step * 1e3,
                         "expert_loop_ms": loop * 1e3, "loop_over_fused": loop / step,
                         "expert_gb": touched * expert_bytes / 1e9,
                         "fraction_of_copy_bw": touched * expert_bytes / step / bw,
                         "max_abs_diff_vs_fp32": (fused(x, layers[0]).float() - ref).abs().max().item()})
            print(rows[-1], flush=True)
        graph = (moe_graph_check(layers[0], torch.randn(32, shape["hidden"], device=args.device, dtype=dtype), fused)
                 if args.device.startswith("cuda") else {"graph_captured": None})
    path = "triton grouped GEMM" if args.device.startswith("cuda") else "sorted per-expert GEMMs (CPU)"
    return {"shape": shape, "dtype": str(dtype), "path": path, "copy_bandwidth_gb_s": bw / 1e9, **graph, "rows": rows}


def _float_moe(w):
    from laneserve.engine.models.moe import MoEWeights
    return MoEWeights(w.router.float(), w.gate_up.float(), w.down.float(), w.top_k, w.renormalize)
def _tp_checkpoints(shape: dict, folder: Path) -> dict[str, Path]:
    """The dense Llama model and a Qwen3-MoE one of the same trunk (experts split across ranks)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig
    inter = shape["intermediate_size"]
    configs = {"llama": LlamaConfig(**shape, tie_word_embeddings=False),
               "qwen3-moe": Qwen3MoeConfig(**shape, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=inter // 4, norm_topk_prob=True,
                                           head_dim=shape["hidden_size"] // shape["num_attention_heads"])}
    paths = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        paths[name] = folder / name
        AutoModelForCausalLM.from_config(cfg).save_pretrained(paths[name])
    return paths


def section_h(args) -> dict:
    from laneserve.engine import EngineConfig
    from laneserve.engine.llm import LLM
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus < 2:
        print(f"gpu_check (h): {gpus} GPU visible; the tensor-parallel section needs two or more: skipped")
        return {"skipped": f"{gpus} GPU visible; tensor parallelism needs two or more"}
    degrees = [2] if args.dry_run else [d for d in (2, 4, 8) if d <= gpus]
    shape = TINY if args.dry_run else CHECK_MODEL
    new_tokens = 6 if args.dry_run else 32
    rng = random.Random(1)
    prompts = [[rng.randrange(2, shape["vocab_size"] - 1) for _ in range(n)] for n in (9, 40, 200)]
    config = EngineConfig(device=args.device, dtype="float32", attention="ragged", cuda_graphs=False,
                          num_kv_blocks=256)
    rows = []
    for model, folder in _tp_checkpoints(shape, Path(tempfile.mkdtemp(prefix="gpu-check-tp-"))).items():
        ref = None
        for tp in [1] + degrees:
            llm = LLM(folder, config=config, quiet=True, tensor_parallel_size=tp)
            try:
                llm.generate(prompts[:1], greedy_params(2))                 # warm-up
                sync(args.device)
                t0 = time.perf_counter()
                outs = [o.token_ids for o in llm.generate(prompts, greedy_params(new_tokens))]
                sync(args.device)
                wall = time.perf_counter() - t0
            finally:
                llm.close()
            ref = ref or outs
            same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r))
            rows.append({"model": model, "tp": tp, "identical_to_tp1": same / sum(len(r) for r in ref),
                         "wall_s": wall})
            cleanup()
    return {"model": shape, "gpus": gpus, "new_tokens": new_tokens, "rows": rows,
            "all_identical": all(r["identical_to_tp1"] == 1.0 for r in rows)}


SECTIONS = {
    "a": ("greedy tokens vs HF generate, fp32, every attention path, graphs on/off", section_a),
    "b": ("decode step time, Llama-3.1-8B-shaped, ~1K context, fraction of copy bandwidth", section_b),
    "c": ("prefill TFLOP/s at 2K / 8K tokens", section_c),
    "d": ("preemption latency of an 8K prefill per granularity", section_d),
    "e": ("offline throughput, default settings vs HF generate", section_e),
    "f": ("prefill policies end to end vs the simulator fed this GPU's profile", section_f),
    "g": ("MoE layers (Qwen3-30B-A3B-shaped): step time vs expert bytes, fused vs expert loop", section_g),
    "h": ("tensor parallelism (two or more GPUs): greedy tokens of TP2/TP4 vs TP1, wall time, dense and MoE",
          section_h),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every section on CPU at tiny sizes")
    parser.add_argument("--sections", default="abcdefgh")
    parser.add_argument("--requests", type=int, default=120, help="(f) requests per policy (the issue's mix: 240)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; (f) skips policies past it")
    parser.add_argument("--results-dir", default=str(HERE / "results"))
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured (use --dry-run to exercise the script on CPU)")
        return 0
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:     # the Triton kernels run in Triton's interpreter on CPU tensors
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.start = time.perf_counter()
    if args.dry_run:
        torch.set_num_threads(2)
    name = "gpu_check_dryrun" if args.dry_run else "gpu_check"
    args.out_stem = Path(args.results_dir) / name
    meta = {"machine": f"{platform.node()}, {platform.python_version()}, torch {torch.__version__}",
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)",
            "dry_run": args.dry_run}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        meta["transformers"] = None
    report = Report(args.out_stem, meta)
    for key in args.sections:
        title, fn = SECTIONS[key]
        report.run(key, title, fn, args)
    print(f"gpu_check: wrote {args.out_stem}.json/.md in {time.perf_counter() - args.start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
