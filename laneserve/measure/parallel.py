"""Independent simulations across worker processes (``laneserve sim --jobs N``).

:func:`map_jobs` runs ``fn(*args)`` for each task, in a pool of ``jobs`` processes, and returns the
results in task order, so a parallel sweep writes exactly what a serial one does (the simulator
is deterministic). Workers start with ``spawn`` — a fork of a process with threads (a progress
bar's monitor, say) can deadlock — and each task ships its workload and cost model by pickle,
which costs milliseconds beside a simulation. ``jobs == 1`` runs in this process, no pool.

``jobs`` may also be :class:`RayWorkers` (``laneserve sim --ray-address``): each task is then a
Ray task on the cluster (one CPU each), every distinct argument object (the workload, the cost
model) is put into the object store once and shared by the tasks that use it, and the results
come back in task order as well — the same results, byte for byte, as one process.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class RayWorkers:
    """Run :func:`map_jobs` tasks on the Ray cluster at ``address`` (``auto``: the local one)."""

    address: str

    def __str__(self) -> str:
        return f"Ray cluster {self.address}"


def default_jobs() -> int:
    """All cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                      # not Linux
        return max(1, os.cpu_count() or 1)


def workers(jobs: int | None, ray_address: str | None) -> int | RayWorkers:
    """What ``--jobs`` / ``--ray-address`` ask for: Ray tasks, or processes (default: every core)."""
    if ray_address:
        return RayWorkers(ray_address)
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError("--jobs must be >= 1")
    return jobs


def map_jobs(fn: Callable[..., Any], tasks: Sequence[tuple], jobs: int | RayWorkers,
             on_done: Callable[[int], None] | None = None) -> list[Any]:
    """``[fn(*t) for t in tasks]``, over ``jobs`` processes (or Ray tasks); ``on_done(i)`` after task
    ``i`` ends (in completion order, for progress). ``fn`` must be importable (a module-level function)."""
    if isinstance(jobs, RayWorkers):
        return _map_ray(fn, tasks, jobs, on_done)
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


def _map_ray(fn: Callable[..., Any], tasks: Sequence[tuple], workers: RayWorkers,
             on_done: Callable[[int], None] | None) -> list[Any]:
    import ray
    if not ray.is_initialized():
        ray.init(address=workers.address, logging_level="warning")
    remote = ray.remote(num_cpus=1, max_retries=0)(fn)
    shared: dict[int, Any] = {}               # id(argument) -> its ObjectRef, one put per object

    def ref(arg: Any) -> Any:
        if isinstance(arg, (int, float, str, bool, type(None))):
            return arg
        if id(arg) not in shared:
            shared[id(arg)] = ray.put(arg)
        return shared[id(arg)]
    futures = [remote.remote(*(ref(a) for a in t)) for t in tasks]
    index = {f: i for i, f in enumerate(futures)}
    pending = list(futures)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        if on_done is not None:
            on_done(index[done[0]])
    return ray.get(futures)
