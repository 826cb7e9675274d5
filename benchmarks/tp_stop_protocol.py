"""Cost of the cross-rank stop protocol (laneserve/engine/tp/stop_protocol.py) per stoppable
boundary when no stop is pending, against the alternative it was chosen over: agreeing at every
boundary with an all-reduce of a stop flag (gloo, CPU), and against a call to a plain
``should_stop`` closure (the TP1 executor's check). Two spawned ranks, the board in shared memory,
everything measured in the same ranks.

    python benchmarks/tp_stop_protocol.py      # writes benchmarks/results/tp_stop_protocol.{json,md}
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"
WORLD = 2
N = 20000            # boundaries per timing
REPEATS = 5


def _best(fn) -> float:
    """Best of REPEATS timings of N calls, microseconds per call."""
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / N * 1e6


def _rank(rank: int, board_name: str, store: str, out) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from laneserve.engine.tp.stop_protocol import StopBoard, StopProtocol
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    board = StopBoard.attach(board_name, WORLD)
    proto = StopProtocol(board, rank)
    flag = torch.zeros(1)

    def closure() -> None:
        should_stop = bool
        for _ in range(N):
            should_stop()

    def published() -> None:
        proto.begin(N)
        boundary = proto.boundary
        for i in range(N):
            boundary(i)

    def agreed() -> None:
        for _ in range(N // 10):          # 10x fewer: each one is a network round trip
            dist.all_reduce(flag)

    row = {}
    dist.barrier()
    row["closure_us"] = _best(closure)
    dist.barrier()
    row["published_us"] = _best(published)
    dist.barrier()
    row["allreduce_us"] = _best(agreed) * 10
    out.put((rank, row))
    board.close()
    dist.destroy_process_group()


def main() -> int:
    from laneserve.engine.tp.stop_protocol import StopBoard
    board = StopBoard.create(WORLD)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, board.name, f"{tmp}/store", out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        try:
            rows = dict(out.get(timeout=600) for _ in range(WORLD))
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
            board.close()
    r0 = rows[0]
    result = {"world": WORLD, "boundaries": N, "per_rank": rows,
              "published_over_closure": r0["published_us"] / r0["closure_us"],
              "allreduce_over_published": r0["allreduce_us"] / r0["published_us"]}
    OUT.mkdir(exist_ok=True)
    (OUT / "tp_stop_protocol.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# tp_stop_protocol", "", "Command: `python benchmarks/tp_stop_protocol.py`  ",
             f"Machine: {platform.machine()}, Python {platform.python_version()}, {WORLD} spawned ranks (gloo, CPU), "
             f"best of {REPEATS} timings of {N} boundaries", "",
             "Per stoppable boundary with no stop pending (rank 0 / rank 1):", "",
             "| check | rank 0 (us) | rank 1 (us) |", "|---|---|---|"]
    for key, what in (("closure_us", "plain `should_stop()` closure (TP1)"),
                      ("published_us", "`StopProtocol.boundary` (publish + read the stop word)"),
                      ("allreduce_us", "agreement: all-reduce of a stop flag")):
        lines.append(f"| {what} | {rows[0][key]:.2f} | {rows[1][key]:.2f} |")
    lines += ["", f"Published protocol over the plain closure: {result['published_over_closure']:.1f}x; "
              f"the per-boundary all-reduce over the published protocol: {result['allreduce_over_published']:.0f}x."]
    (OUT / "tp_stop_protocol.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
