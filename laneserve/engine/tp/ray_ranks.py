"""Ranks 1..N-1 of a tensor-parallel instance as Ray actors, in the instance's placement group.

On Ray (``laneserve serve --ray-address``) a TP instance gets one placement group of N bundles,
one device each (a GPU on CUDA, a CPU elsewhere), packed on one node (``STRICT_PACK``: the ranks
share the step channel and the stop board in ``/dev/shm`` and a file store, as spawned ranks do).
The instance actor runs in bundle 0 and is rank 0, holding the runtime and the scheduler as it
does locally; ``RankGroup(launch="ray")`` starts rank r as a :class:`RankHost` actor in bundle r,
running the same ``rank_main`` as a spawned rank process. :class:`RayRank` gives that actor the
``multiprocessing.Process`` surface the group uses (``start``, ``is_alive``, ``join``, ``kill``,
``pid``, ``exitcode``), so joining, the per-step liveness check and the faults are unchanged.

Ray is imported here only: nothing else of the engine needs it. The channel's semaphores are
named POSIX semaphores; ``multiprocessing`` pickles them only while it spawns a process, so they
cross to the actor as that same pickle (:func:`_dumps`), reopened there by name.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import context, reduction

from laneserve.engine.tp.channel import pid_alive

#: how long a rank actor may take to be placed and start (its bundle is reserved already)
START_TIMEOUT_S = 120.0
#: how often :meth:`RayRank.is_alive` also asks Ray (~50 us a call) besides its pid check (~1 us)
RAY_POLL_S = 0.5


def device_resource(device: str) -> dict[str, float]:
    """The Ray resources of one rank on ``device``: one GPU on CUDA, one CPU elsewhere."""
    return {"GPU": 1.0} if str(device).startswith("cuda") else {"CPU": 1.0}


def actor_resources(device: str) -> dict[str, float]:
    """``num_cpus``/``num_gpus`` options taking one rank's bundle share (:func:`device_resource`)."""
    res = device_resource(device)
    return {"num_gpus": res["GPU"], "num_cpus": 0} if "GPU" in res else {"num_cpus": res["CPU"]}


def instance_placement_group(world: int, device: str, role_resource: dict[str, float], name: str):
    """A placement group of ``world`` bundles of one device each, packed on one node; bundle 0 (rank 0,
    the instance actor) also holds ``role_resource`` (the node resource placing the instance)."""
    from ray.util.placement_group import placement_group
    one = device_resource(device)
    bundles = [{**one, **role_resource}] + [dict(one) for _ in range(world - 1)]
    return placement_group(bundles, strategy="STRICT_PACK", name=name)


def in_bundle(pg, index: int) -> dict:
    """The actor options placing an actor in bundle ``index`` of ``pg``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}


class RankHost:
    """The body of a rank actor: ``run`` is the rank loop until it stops."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, blob: bytes) -> int:
        target, args = pickle.loads(blob)
        try:
            target(*args)
        except SystemExit as exc:          # the rank loop's exit (its writer is gone): the actor stays
            return int(exc.code or 0)
        except BaseException:              # as a spawned rank would: the process ends, rank 0 sees its pid gone
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        return 0


def _dumps(obj: object) -> bytes:
    """``obj`` pickled as for a spawned process (its semaphores by name)."""
    context.set_spawning_popen(object())      # only the "is a process being spawned" check reads it
    try:
        return bytes(reduction.ForkingPickler.dumps(obj))
    finally:
        context.set_spawning_popen(None)


class RayRank:
    """Rank ``args[1]`` of ``target(*args)`` as an actor in bundle ``args[1]`` of the current
    placement group (the instance actor's), with the ``Process`` surface ``RankGroup`` uses."""

    def __init__(self, target: Callable, args: tuple, name: str, daemon: bool = True) -> None:
        import ray
        self.target, self.args, self.name = target, args, name
        self.rank = int(args[1])
        self.pg = ray.util.get_current_placement_group()
        self.actor = None
        self.done = None
        self.pid: int | None = None
        self.ident: int | None = None
        self._exitcode: int | None = None
        self._polled = 0.0

    def start(self) -> None:
        import ray
        if self.pg is None:
            raise RuntimeError("ranks launched on Ray run in the bundles of the instance actor's placement "
                               "group; this process runs in none")
        device = self.args[0].config.device
        cls = ray.remote(RankHost).options(name=None, max_restarts=0, max_concurrency=2,
                                           **actor_resources(device), **in_bundle(self.pg, self.rank))
        self.actor = cls.remote()
        self.pid = ray.get(self.actor.pid.remote(), timeout=START_TIMEOUT_S)
        self.ident = self.pid
        self.done = self.actor.run.remote(_dumps((self.target, self.args)))

    def is_alive(self) -> bool:
        """Rank 0 asks before every step: a pid check (the actor runs on this node), and Ray's word
        on the rank loop every ``RAY_POLL_S`` (a loop that ended with its process still there)."""
        if self.done is None or self._exitcode is not None:
            return False
        if not pid_alive(self.pid):
            self._settle(wait_s=2.0)
            return False
        now = time.monotonic()
        if now - self._polled < RAY_POLL_S:
            return True
        import ray
        self._polled = now
        ready, _ = ray.wait([self.done], timeout=0)
        if ready:
            self._settle()
        return not ready

    @property
    def exitcode(self) -> int | None:
        """The rank loop's exit code; -9 when its actor process died (killed, or crashed)."""
        self.is_alive()
        return self._exitcode

    def _settle(self, wait_s: float = 0.0) -> None:
        """The rank loop ended: record how, and free the actor (its bundle stays the group's)."""
        import ray
        ready, _ = ray.wait([self.done], timeout=wait_s)
        try:
            self._exitcode = int(ray.get(self.done)) if ready else -9
        except ray.exceptions.RayError:
            self._exitcode = -9
        ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        if self.done is None:
            return
        import ray
        ready, _ = ray.wait([self.done], timeout=timeout)
        if ready and self._exitcode is None:
            self._settle()

    def kill(self) -> None:
        if self.actor is not None:
            import ray
            ray.kill(self.actor, no_restart=True)
