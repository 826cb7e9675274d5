"""The engine's executor: ``result = executor.execute(plan)`` on tensors (docs/design.md, "The central
contract"). The simulator implements the same call with a cost model.

The executor never changes request counters; ``scheduler.update(plan, result, now)`` does. It
writes KV into the paged cache, performs the plan's swaps (host pool, AlignedServe §3), runs the
forward and samples one token per sequence that needs one (a chunk completing its prompt: the first
output token; a decode: the next token). A recompute chunk (prompt + earlier outputs after a
preemption by recompute, ending before the newest output token) samples nothing: see runner.py.

Preemptible plans (FlowPrefill §4): the forward is a generator yielding after every operator. At
each boundary allowed by ``plan.preempt_granularity`` — "operator": after each of
``LAYER_OPERATORS``; "layer": after each layer; "chunk": none inside a step (the scheduler preempts
between chunk-sized steps) — the executor calls ``should_stop()``; when it returns True the
generator is parked under ``plan.plan_id``, ``plan.ops_done`` is set (operators finished, out of
``num_layers * 5``) and ``StepResult(completed=False)`` returned. Executing the same plan object
again resumes it with identical results. The KV blocks of a parked plan must stay allocated and
unmoved until it resumes (or :meth:`EngineExecutor.discard` drops it). Operators are launched on a
:class:`~laneserve.engine.device_stream.DeviceStream`: on an asynchronous device (CUDA) the check
waits until at most ``EngineConfig.preempt_max_inflight`` launched operators are unfinished, so it
sees completed work, and a stop returns only once the device has finished what was launched.

One synchronisation per step: the sampled tokens (and the per-row checks of the sampler) come to
the host together; a step that samples nothing waits for the device explicitly.

With ``EngineConfig.cuda_graphs``, a step the runner maps to a shape bucket (non-preemptible
decode-only steps, fresh short prefills with a ``padded_shape``; ``engine/graphs.py``) runs there
in one go — a CUDA graph replay on CUDA, the same static path eagerly elsewhere — and reports
``plan.ops_done = num_operators``; every other step takes the generator path above.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from laneserve.core.kv import BlockCopy, HostKVPool, KVCacheManager
from laneserve.core.plan import StepPlan, StepResult
from laneserve.engine.attention import sdpa_backends
from laneserve.engine.config import EngineConfig
from laneserve.engine.device_stream import DeviceStream, make_device_stream
from laneserve.engine.kv_cache import KVPayload, PagedKVCache
from laneserve.engine.models.llama import LlamaModel
from laneserve.engine.runner import ModelRunner, SeqInput, plan_sequences, prompt_logprob_rows
from laneserve.engine.sampler import GREEDY, Sampler, TokenHistory, TokenLogprobs, UnsampleableRows, token_stops
from laneserve.engine.structured import ConstraintState, ConstraintViolation, UnsupportedSpec, compile_constraint


@dataclass(slots=True)
class EngineStepResult(StepResult):
    """``StepResult`` plus the engine-only outputs: ``logprobs[req_id]`` for requests that asked
    for them (``SamplingParams.logprobs``), and ``failed[req_id]`` = why a request's row could not
    be sampled (non-finite logits): its token is a placeholder and the instance fails it."""

    logprobs: dict[int, TokenLogprobs] | None = None
    failed: dict[int, str] | None = None
    # n-sample requests that sampled their first tokens: rid -> [(token, logprobs)] of samples 1..n-1
    # (sample 0 is the request's own token in ``sampled``)
    forks: dict[int, list[tuple[int, TokenLogprobs | None]]] | None = None


@dataclass(slots=True)
class _Parked:
    plan: StepPlan
    forward: object            # the suspended generator
    seqs: list[SeqInput]


class EngineExecutor:
    def __init__(self, model: LlamaModel, kv: KVCacheManager, config: EngineConfig,
                 host_pool: HostKVPool | None = None) -> None:
        if config.num_threads is not None and model.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.model = model
        self.kv = kv
        self.config = config
        self.runner = ModelRunner(model, kv, config)
        #: where the resumable forward launches its operators (tests swap in an emulated device)
        self.stream: DeviceStream = make_device_stream(model.device)
        self.host_pool = host_pool
        self.host_cache: PagedKVCache | None = None
        if host_pool is not None:
            if host_pool.block_size != kv.block_size:
                raise ValueError("host pool and device KV must share a block size")
            cfg = model.config
            self.host_cache = PagedKVCache(cfg.num_layers, host_pool.num_blocks, host_pool.block_size,
                                           cfg.num_kv_heads, cfg.head_dim, model.dtype, "cpu",
                                           pin_memory=model.device.type == "cuda")
        self.sampler = Sampler(config.seed)
        eos = set(model.config.eos_token_ids)
        tok_eos = getattr(model.tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int):
            eos.add(tok_eos)
        self.eos_token_ids = frozenset(eos)
        self._parked: dict[int, _Parked] = {}
        # per-request token statistics for logit shaping (penalties, logit_bias, min_tokens): kept
        # while the request holds KV here, rebuilt from its tokens if it comes back without
        self._histories: dict[int, TokenHistory] = {}
        # per-request structured-output states (request object, state), kept and dropped like histories
        self._constraints: dict[int, tuple[object, ConstraintState]] = {}

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> EngineExecutor:
        """Load a checkpoint and size the device KV (``config.num_kv_blocks`` or the memory
        fraction) and the host pool (``config.num_host_blocks``)."""
        from laneserve.engine.models.loader import load_model

        config = config or EngineConfig()
        model = load_model(path, config.device, config.dtype)
        per_token = model.config.kv_bytes_per_token(model.embed.element_size())
        kv = KVCacheManager(config.resolve_num_kv_blocks(per_token), config.block_size)
        host = HostKVPool(config.num_host_blocks, config.block_size) if config.num_host_blocks else None
        return cls(model, kv, config, host)

    @property
    def num_operators(self) -> int:
        return self.model.num_operators

    @property
    def parked_plan_ids(self) -> list[int]:
        return list(self._parked)

    # ---- the step --------------------------------------------------------------------------
    def execute(self, plan: StepPlan, should_stop: Callable[[], bool] | None = None) -> EngineStepResult:
        t0 = time.perf_counter()
        with torch.inference_mode(), sdpa_backends(self.model.device):   # SDPA kernels chosen, not dispatched
            parked = self._parked.pop(plan.plan_id, None)
            if parked is None:
                if plan.ops_done:
                    raise ValueError(f"plan {plan.plan_id} has ops_done={plan.ops_done} but nothing is parked for it")
                self._swap(plan)
                seqs = plan_sequences(plan, self.kv)
                if not seqs:
                    self._sync()
                    return EngineStepResult(time.perf_counter() - t0, True, {}, set())
                asked = prompt_logprob_rows(seqs)
                # prompt logprobs need more logit rows than a shape bucket returns
                bucket = None if asked else self.runner.select_bucket(plan, seqs)
                if bucket is None:
                    forward = self.runner.forward(self.runner.prepare(seqs, plan.padded_shape, asked))
            else:
                if parked.plan is not plan:
                    raise ValueError(f"plan {plan.plan_id} resumed with a different plan object")
                seqs, forward, bucket = parked.seqs, parked.forward, None
                asked = prompt_logprob_rows(seqs)
            if bucket is not None:     # a shape bucket: not preemptible, no operator boundaries
                logits = self.runner.run_bucket(bucket, seqs)
                plan.ops_done = self.model.num_operators
            else:
                logits = self._advance(plan, forward, seqs, should_stop, t0)
                if logits is None:
                    self._sync()
                    return EngineStepResult(time.perf_counter() - t0, completed=False)
            if asked:
                n_sampled = sum(1 for s in seqs if s.sample)
                self._prompt_logprobs(asked, logits[n_sampled:])
                logits = logits[:n_sampled]
            sampled, stop_hit, logprobs, failed, forks = self._sample(seqs, logits)
        if not sampled:            # bringing sampled tokens to the host already waited for the step
            self._sync()
        return EngineStepResult(time.perf_counter() - t0, True, sampled, stop_hit, logprobs or None, failed or None,
                                forks or None)

    def _advance(self, plan: StepPlan, forward, seqs: list[SeqInput],
                 should_stop: Callable[[], bool] | None, t0: float) -> torch.Tensor | None:
        """Run the generator to its end (returns the logits) or to an accepted stop (parks it, returns None).

        Each operator is launched on :attr:`stream`. At every boundary where a stop may be taken,
        the host first waits until at most ``config.preempt_max_inflight - 1`` launched operators
        are still running on the device, so ``should_stop()`` is asked with the device at most
        that many operators behind the launches; an accepted stop then waits for those operators
        (the device is idle again when the plan is parked), which bounds the acknowledgement by
        ``preempt_max_inflight`` operators' execution. ``preempt_max_inflight = 0`` checks at launch
        time without waiting (on an asynchronous device the stop then lands only when the launched
        work drains). Non-preemptible steps never wait."""
        total = self.model.num_operators
        granularity = plan.preempt_granularity
        if granularity not in ("operator", "layer", "chunk"):
            raise ValueError(f"unknown preempt_granularity {granularity!r}")
        check = plan.preemptible and should_stop is not None and granularity != "chunk"
        timed = plan.preemptible or self.config.record_op_times
        if timed and plan.op_times is None:
            plan.op_times = []
        stream = self.stream
        bound = self.config.preempt_max_inflight if check else 0
        sync_each = timed and stream.asynchronous and self.config.record_op_times
        result: list[torch.Tensor] = []

        def operator() -> None:
            try:
                next(forward)
            except StopIteration as done:
                result.append(done.value)

        inflight: deque = deque(maxlen=max(bound, 1))     # markers of the newest launched operators
        last = t0
        while plan.ops_done < total:
            stream.launch(operator)
            plan.ops_done += 1
            boundary = check and plan.ops_done < total and (granularity == "operator" or plan.ops_done % 5 == 0)
            if bound:
                inflight.append(stream.record())
                if boundary:
                    while len(inflight) > bound - 1:      # the device is at most bound - 1 behind
                        stream.wait(inflight.popleft())
            if sync_each:
                stream.wait(stream.record())
            if timed:
                now = time.perf_counter()
                plan.op_times.append(now - last)  # type: ignore[union-attr]
                last = now
            if boundary and should_stop():  # type: ignore[misc]
                stream.wait(stream.record())              # drain: the device is free when we return
                self._parked[plan.plan_id] = _Parked(plan, forward, seqs)
                return None
        stream.launch(operator)                           # the generator's return: the logits
        if not result:                                    # launched but not yet run (emulated device)
            stream.synchronize()
        return result[0]

    @staticmethod
    def _prompt_logprobs(asked: list[tuple[SeqInput, int, int]], logits: torch.Tensor) -> None:
        """Record the prompt logprobs these rows give (the raw model distribution, as vLLM's
        ``prompt_logprobs``): entry ``i`` of ``req.prompt_logprobs`` is prompt token ``i + 1``'s
        ``[logprob, top-k, rank]`` (rank: 1 + the tokens more likely than it). Positions already recorded (a recompute) are skipped."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        row = 0
        for s, first, count in asked:
            req = s.request
            k = req.sampling.prompt_logprobs
            have = req.prompt_logprobs if req.prompt_logprobs is not None else []
            skip = max(0, len(have) - first)
            if skip < count:
                block = lp[row + skip:row + count]
                targets = torch.tensor(req.prompt_token_ids[first + 1 + skip:first + 1 + count],
                                       dtype=torch.long, device=block.device)
                chosen_t = block.gather(1, targets[:, None])
                ranks = ((block > chosen_t).sum(dim=1) + 1).tolist()      # vLLM's rank: 1 + tokens above it
                chosen = chosen_t[:, 0].tolist()
                if k:
                    top_v, top_i = torch.topk(block, k, dim=-1)
                    tops = [[[int(t), float(v)] for t, v in zip(ti, tv)]
                            for ti, tv in zip(top_i.tolist(), top_v.tolist())]
                else:
                    tops = [[] for _ in chosen]
                have.extend([float(c), top, int(r)] for c, top, r in zip(chosen, tops, ranks))
            req.prompt_logprobs = have
            row += count

    def _sample(self, seqs: list[SeqInput], logits: torch.Tensor):
        sampled_seqs = [s for s in seqs if s.sample]
        if not sampled_seqs:
            return {}, set(), {}, {}, {}
        params = [s.request.sampling or GREEDY for s in sampled_seqs]
        self._drop_departed()
        histories = self._token_histories(sampled_seqs, params, logits)
        failed: dict[int, str] = {}
        states = self._constraint_states(sampled_seqs, params, failed)
        output_index = [s.request.num_output_tokens for s in sampled_seqs]
        rows = len(sampled_seqs)
        logits, extra = self._sample_rows(logits, sampled_seqs, params, output_index, histories, states)
        try:
            tokens, logprobs = self.sampler.sample(logits, params, output_index, histories, states)
        except UnsampleableRows as exc:          # the other rows' tokens are valid
            tokens, logprobs = exc.tokens, exc.logprobs
            failed |= {sampled_seqs[row if row < rows else extra[row - rows]].request.request_id: why
                       for row, why in exc.rows.items()}
        sampled: dict[int, int] = {}
        stop_hit: set[int] = set()
        lp_out: dict[int, TokenLogprobs] = {}
        for s, p, tok, lp in zip(sampled_seqs, params, tokens, logprobs):
            rid = s.request.request_id
            sampled[rid] = tok
            # the first token of an n-sample request ends only its sample 0, not the request: the
            # instance finishes sample 0 after the other samples took the prompt's KV
            if token_stops(tok, p, self.eos_token_ids) and not (p.n > 1 and s.request.num_output_tokens == 0):
                stop_hit.add(rid)
            if lp is not None:
                lp_out[rid] = lp
        forks: dict[int, list[tuple[int, TokenLogprobs | None]]] = {}
        for k, row in enumerate(extra):
            forks.setdefault(sampled_seqs[row].request.request_id, []).append(
                (tokens[rows + k], logprobs[rows + k]))
        return sampled, stop_hit, lp_out, failed, forks

    @staticmethod
    def _sample_rows(logits: torch.Tensor, seqs: list[SeqInput], params: list, output_index: list[int],
                     histories: list, states: list | None) -> tuple[torch.Tensor, list[int]]:
        """The rows to sample: one per sequence, plus samples 1..n-1 of each n-sample request at its
        first token (the same logits row, the sample's own seed). Extends the per-row lists in place;
        returns the logits and, for each extra row, the row of its request."""
        extra = [row for row, (s, p) in enumerate(zip(seqs, params)) if p.n > 1 and s.request.num_output_tokens == 0
                 for _ in range(p.n - 1)]
        if not extra:
            return logits, extra
        index = {row: 0 for row in extra}
        for row in extra:
            index[row] += 1
            params.append(params[row].sample(index[row]))
            output_index.append(0)
            histories.append(histories[row])
            if states is not None:
                states.append(states[row])
        rows = torch.tensor(list(range(len(seqs))) + extra, device=logits.device)
        return logits.index_select(0, rows), extra

    def _drop_departed(self) -> None:
        """Drop the histories and constraint states of requests that no longer hold KV on this
        instance (finished, aborted, handed off, preempted by recompute), so the maps never
        outgrow the requests resident here."""
        for per_request in (self._histories, self._constraints):
            if per_request:
                host = self.host_pool.tables if self.host_pool is not None else {}
                for rid in [r for r in per_request if r not in self.kv.tables and r not in host]:
                    del per_request[rid]

    def _constraint_states(self, seqs: list[SeqInput], params: list, failed: dict[int, str]
                           ) -> list[ConstraintState | None] | None:
        """Each constrained row's :class:`ConstraintState`, synced with the request's output tokens
        (on a decode instance the first sync replays the token the prefill instance sampled). A
        spec that cannot be compiled or a state the tokens violate fails only that request."""
        if not any(p.structured is not None for p in params):
            return None
        out: list[ConstraintState | None] = []
        for s, p in zip(seqs, params):
            req = s.request
            if p.structured is None:
                out.append(None)
                continue
            entry = self._constraints.get(req.request_id)
            try:
                if entry is None or entry[0] is not req:
                    if self.model.tokenizer is None:
                        raise UnsupportedSpec("structured output needs the model's tokenizer")
                    state = compile_constraint(p.structured, self.model.tokenizer,
                                               eos_token_ids=sorted(self.eos_token_ids)).new_state()
                    entry = self._constraints[req.request_id] = (req, state)
                state = entry[1].sync(req.output_token_ids or [])
                state.fill_mask()          # before the forward: a constraint over budget fails here, alone
                out.append(state)
            except (UnsupportedSpec, ConstraintViolation) as exc:
                self._constraints.pop(req.request_id, None)
                failed[req.request_id] = f"structured output: {exc}"
                out.append(None)
        return out

    def _token_histories(self, seqs: list[SeqInput], params: list, logits: torch.Tensor) -> list[TokenHistory | None]:
        """Each shaped row's :class:`TokenHistory`, extended by its new output tokens."""
        hist = self._histories
        out: list[TokenHistory | None] = []
        for s, p in zip(seqs, params):
            if not p.shapes_logits:
                out.append(None)
                continue
            req = s.request
            h = hist.get(req.request_id)
            if h is None or h.request is not req:
                h = hist[req.request_id] = TokenHistory(req, p, req.prompt_token_ids or (), logits.shape[-1],
                                                        logits.device, self.eos_token_ids)
            h.extend(req.output_token_ids or ())
            out.append(h)
        return out

    @property
    def num_token_histories(self) -> int:
        return len(self._histories)

    def discard(self, plan: StepPlan) -> bool:
        """Drop a parked plan (its request was aborted or will be recomputed); True if one was parked."""
        return self._parked.pop(plan.plan_id, None) is not None

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- KV movement -----------------------------------------------------------------------
    def _swap(self, plan: StepPlan) -> None:
        """Swap-outs first: the core frees their device blocks at planning time, so a swap-in of
        the same plan may already reuse them."""
        if not (plan.swap_out or plan.swap_in):
            return
        if self.host_cache is None:
            raise ValueError("plan has swaps but the executor has no host pool")
        for copy in plan.swap_out:
            self.runner.cache.apply_copy(self.host_cache, copy)
        for copy in plan.swap_in:
            self.host_cache.apply_copy(self.runner.cache, copy)

    def _tier(self, host: bool) -> tuple[KVCacheManager, PagedKVCache]:
        if not host:
            return self.kv, self.runner.cache
        if self.host_pool is None or self.host_cache is None:
            raise ValueError("the executor has no host pool")
        return self.host_pool, self.host_cache

    def export_kv(self, request_id: int, num_tokens: int | None = None, *, from_host: bool = False) -> KVPayload:
        """A request's first ``num_tokens`` KV entries (default: every allocated slot) as a CPU
        tensor bundle, for prefill -> decode transfer."""
        manager, cache = self._tier(from_host)
        table = manager.table(request_id)
        if not table:
            raise KeyError(f"request {request_id} holds no KV blocks")
        if num_tokens is None:
            num_tokens = len(table) * manager.block_size
        self._sync()
        return cache.export_tokens(table, num_tokens)

    def copy_block(self, copy: BlockCopy) -> None:
        """Perform a device-to-device block copy (the partial last block of a forked table)."""
        with torch.inference_mode():
            self.runner.cache.apply_copy(self.runner.cache, copy)

    def import_kv(self, request_id: int, payload: KVPayload, *, into_host: bool = False) -> None:
        """Write ``payload`` into the blocks already allocated for ``request_id`` (device KV, or
        the host pool with ``into_host``)."""
        manager, cache = self._tier(into_host)
        if hasattr(payload, "for_rank"):           # a tensor-parallel group's shards: all heads here
            payload = payload.for_rank(1, 0)
        with torch.inference_mode():
            cache.import_tokens(manager.table(request_id), payload)
