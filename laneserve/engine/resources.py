"""The engine's side of :func:`~laneserve.runtime.build.build_instance`: what an engine instance
runs on, shared by the three engine drivers (the in-process cluster, an instance process, ``LLM``).

Per instance: a KV manager (prefix caching on for the roles that start from prompts), a host
pool of the spec's size, and an executor: on the one model every single-rank instance of the
driver shares (loaded on first use; weights are read-only), or, for a spec with a tensor-parallel
degree above one, a rank group of its own (rank 0 here, the others processes of their own),
which the driver stops (:meth:`EngineResources.close`). A spec without a KV size gets the
engine's: ``num_kv_blocks``, else what the device's free memory holds (on a CPU at most
:data:`DEFAULT_CPU_KV_TOKENS`); a rank group agrees on it across its ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from laneserve.core.clock import Clock
from laneserve.core.kv import HostKVPool, KVCacheManager
from laneserve.engine.config import EngineConfig
from laneserve.engine.executor import EngineExecutor
from laneserve.engine.instance import EngineInstance, Inbox
from laneserve.engine.kv_cache import make_kv_manager
from laneserve.runtime.build import InstanceResources
from laneserve.runtime.spec import InstanceSpec

#: cap on the CPU KV cache sized from free memory (tokens); set num_kv_blocks to go higher
DEFAULT_CPU_KV_TOKENS = 1 << 17


class EngineResources(InstanceResources):
    """``model_path`` and ``config`` (the engine's settings; a spec's device overrides its
    ``device``); ``clock``: the driver's (None: each instance a wall clock of its own);
    ``stop_checker``: give each instance the model tokenizer's stop checker; ``inbox``: the one
    inbox of a single-instance driver (a worker's receiver thread puts into it);
    ``wrap_executor``: the driver's wrapper around each executor; ``rank_launch``: how a
    tensor-parallel instance starts ranks 1..N-1 ("process", or "ray": actors in its placement group)."""

    def __init__(self, model_path: str | Path, config: EngineConfig, *, clock: Clock | None = None,
                 stop_checker: bool = False, inbox: Inbox | None = None,
                 wrap_executor: Callable[[Any], Any] | None = None, rank_launch: str = "process") -> None:
        self.model_path = model_path
        self.config = config
        self.clock = clock
        self.stop_checker = stop_checker
        self.inbox = inbox
        self.wrap_executor = wrap_executor
        self.rank_launch = rank_launch
        self._model = None
        self._started: Any = None              # a rank group started to size its KV (kv -> instance)
        self.tp_executors: list[Any] = []      # every rank group started: the driver closes them

    def config_for(self, spec: InstanceSpec) -> EngineConfig:
        return self.config if spec.device == self.config.device else dataclasses.replace(self.config, device=spec.device)

    @property
    def model(self):
        """The model the single-rank instances share, loaded on first use."""
        if self._model is None:
            from laneserve.engine.models.loader import load_model
            self._model = load_model(self.model_path, self.config.device, self.config.dtype)
        return self._model

    def kv(self, spec: InstanceSpec) -> KVCacheManager:
        config = self.config_for(spec)
        make = lambda blocks: make_kv_manager(blocks, config, role=spec.role,  # noqa: E731
                                              model_id=str(self.model_path))
        if spec.kv_tokens is not None:
            return make(max(1, spec.kv_tokens // config.block_size))
        if spec.tensor_parallel_size > 1:      # the ranks agree on what fits every one of them
            self._started = self._rank_group(spec, config, make)
            return self._started.kv
        return make(self._blocks_from_memory(config))

    def _blocks_from_memory(self, config: EngineConfig) -> int:
        model = self.model
        blocks = config.resolve_num_kv_blocks(model.config.kv_bytes_per_token(model.embed.element_size()))
        if config.num_kv_blocks is None and config.device == "cpu":
            blocks = min(blocks, DEFAULT_CPU_KV_TOKENS // config.block_size)
        return blocks

    def host_pool(self, spec: InstanceSpec) -> HostKVPool | None:
        bs = self.config.block_size
        return HostKVPool(spec.host_kv_tokens // bs, bs) if spec.host_kv_tokens else None

    def executor(self, spec: InstanceSpec, kv: KVCacheManager, host: HostKVPool | None) -> Any:
        """The executor of ``spec`` over ``kv``: a rank group of its own, or one on the shared model."""
        if spec.tensor_parallel_size == 1:
            return EngineExecutor(self.model, kv, self.config_for(spec), host)
        started, self._started = self._started, None
        if started is not None and started.kv is kv:
            return started
        config = dataclasses.replace(self.config_for(spec), num_kv_blocks=kv.num_blocks)
        return self._rank_group(spec, config, lambda _blocks: kv)

    def _rank_group(self, spec: InstanceSpec, config: EngineConfig, kv_factory: Callable[[int], Any]) -> Any:
        from laneserve.engine.tp.executor import TPExecutor
        executor = TPExecutor.start(self.model_path, spec.tensor_parallel_size, config, kv_factory=kv_factory,
                                    launch=self.rank_launch)
        self.tp_executors.append(executor)
        return executor

    def instance(self, instance_id: int, spec: InstanceSpec, scheduler, kv, host, learner) -> EngineInstance:
        executor = self.executor(spec, kv, host)
        if self.wrap_executor is not None:
            executor = self.wrap_executor(executor)
        stop = None
        if self.stop_checker and executor.model.tokenizer is not None:
            from laneserve.engine.sampler import StopChecker
            stop = StopChecker(executor.model.tokenizer)
        return EngineInstance(scheduler, executor, clock=self.clock, instance_id=instance_id,
                              stop_checker=stop, inbox=self.inbox)

    def close(self) -> None:
        """Stop the rank processes of every tensor-parallel instance built here."""
        for executor in self.tp_executors:
            executor.close()
