"""Independent simulations across worker processes (``laneserve sim --jobs N``).

:func:`map_jobs` runs ``fn(*args)`` for each task, in a pool of ``jobs`` processes, and returns the
results in task order, so a parallel sweep writes exactly what a serial one does (the simulator
is deterministic). Workers start with ``spawn`` — a fork of a process with threads (a progress
bar's monitor, say) can deadlock — and each task ships its workload and cost model by pickle,
which costs milliseconds beside a simulation. ``jobs == 1`` runs in this process, no pool.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any


def default_jobs() -> int:
    """All cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                      # not Linux
        return max(1, os.cpu_count() or 1)


def map_jobs(fn: Callable[..., Any], tasks: Sequence[tuple], jobs: int,
             on_done: Callable[[int], None] | None = None) -> list[Any]:
    """``[fn(*t) for t in tasks]``, over ``jobs`` processes; ``on_done(i)`` after task ``i`` ends
    (in completion order, for progress). ``fn`` must be importable (a module-level function)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if jobs == 1 or len(tasks) <= 1:
        out = []
        for i, t in enumerate(tasks):
            out.append(fn(*t))
            if on_done is not None:
                on_done(i)
        return out
    results: list[Any] = [None] * len(tasks)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx) as pool:
        futures = {pool.submit(fn, *t): i for i, t in enumerate(tasks)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if on_done is not None:
                on_done(i)
    return results
