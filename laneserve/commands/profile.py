"""``laneserve profile``: measure the engine on its device and write a profile JSON that the
simulator's fitted cost model loads (``laneserve sim --cost-model fitted --profile FILE``, or
``--engine laneserve --profile FILE``). ``-tp N`` profiles a tensor-parallel instance of N ranks
(rank 0 here, ranks 1..N-1 spawned, as ``laneserve serve -tp N`` runs it); the profile records the
degree, and the simulator uses it for instances of that degree (``laneserve sim -tp N``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from laneserve.commands.argtypes import MAX_GPUS, at_least


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the engine and write a cost-model profile", description=__doc__)
    p.add_argument("--model", type=Path, help="checkpoint folder (default: the embedded smoke model)")
    p.add_argument("--output", type=Path, default=Path("out/profile.json"), help="profile JSON to write")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, the checkpoint's on CUDA) | float32 | bfloat16 | float16")
    p.add_argument("--attention", default="auto", help="auto (per device) | ragged | padded | paged")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--kv-tokens", type=int, default=65536, help="KV cache size used while profiling")
    p.add_argument("--full", action="store_true", help="the full grid (slower) instead of the quick one")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per point (median)")
    p.add_argument("--tensor-parallel-size", "-tp", type=at_least(1, high=MAX_GPUS), default=1,
                   help="ranks of the profiled instance (one process each; on CUDA --device's GPU and the N-1 after it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from laneserve.costmodel.profile import save_profile
    from laneserve.engine import EngineConfig
    from laneserve.engine.profiler import FULL, QUICK, EngineProfiler
    from laneserve.engine.smoke import smoke_model_path

    path = args.model or smoke_model_path()
    if not Path(path).exists():
        print(f"error: model folder not found: {path}", file=sys.stderr)
        return 2
    try:
        config = EngineConfig(device=args.device, dtype=args.dtype, attention=args.attention,
                              num_threads=args.threads, num_kv_blocks=max(1, args.kv_tokens // 16))
        executor = _executor(path, config, args.tensor_parallel_size)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    grid = dict(FULL if args.full else QUICK)
    repeats = args.repeats or grid["repeats"]
    t0 = time.perf_counter()
    try:
        profiler = EngineProfiler(executor, repeats=repeats, on_sample=lambda s: print("  " + s, file=sys.stderr))
        profile = profiler.run(grid, model_name=Path(path).name, device=args.device)
    finally:
        if args.tensor_parallel_size > 1:
            executor.close()             # stops the rank processes
    if args.tensor_parallel_size > 1:    # the instance's KV: every rank's heads (replicas included)
        profile.kv_bytes_per_token *= args.tensor_parallel_size
        profile.tensor_parallel_size = args.tensor_parallel_size
    save_profile(profile, args.output)
    print(f"wrote {args.output}: {len(profile.prefill)} prefill, {len(profile.decode)} decode, "
          f"{len(profile.kv_copy)} KV-copy samples in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _executor(path, config, world: int):
    """The engine executor to profile: one rank, or rank 0 of a group of ``world`` (TPExecutor)."""
    if world == 1:
        from laneserve.engine import EngineExecutor
        return EngineExecutor.from_pretrained(path, config)
    from laneserve.engine.tp.executor import TPExecutor
    return TPExecutor.start(path, world, config)
