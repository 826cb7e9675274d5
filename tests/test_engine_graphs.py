"""The static shape-bucket path behind ``EngineConfig.cuda_graphs`` (``engine/graphs.py``), on CPU,
where the very same static-buffer forward that CUDA captures runs eagerly: greedy tokens equal the
eager path and HF, padding rows write only the scratch slot and read nothing real, buckets are the
nearest covering shapes, unfit steps fall back, and the forward never reads a tensor on the host
and runs the same ops on the same shapes for every step of a bucket (what capture requires)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine_support import Driver, _model, hf_greedy, make_executor, make_request, prompts
from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import PrefillChunk, StepPlan
from laneserve.engine import EngineConfig, EngineExecutor
from laneserve.engine.graphs import DECODE, PREFILL, BucketGrid, BucketKey
from laneserve.engine.runner import plan_sequences

BLOCK = 8
GRID = dict(graph_max_batch=8, graph_max_context=64, graph_max_prefill_len=32, graph_max_prefill_batch=8)
DECODE_LENGTHS = [3, 9, 14, 30, 45]      # + 12 new tokens: contexts cross the 16 / 32 / 64 buckets
NEW_TOKENS = 12


def graph_executor(family: str = "qwen3", num_blocks: int = 128, **overrides) -> EngineExecutor:
    cfg = EngineConfig(block_size=BLOCK, num_kv_blocks=num_blocks, max_num_batched_tokens=256, num_threads=1,
                       cuda_graphs=True, **(GRID | overrides))
    return EngineExecutor(_model(family), KVCacheManager(num_blocks, BLOCK), cfg)


def eager_executor(family: str = "qwen3") -> EngineExecutor:
    return make_executor(family, "ragged", num_blocks=128, block_size=BLOCK)


def decode_in_varying_batches(driver: Driver, reqs, sizes: list[int]) -> None:
    """Decode until done; step i takes ``sizes[i % len]`` live requests starting at a rotating offset."""
    i = 0
    while live := [r for r in reqs if r.num_output_tokens < r.max_output_tokens]:
        k = i % len(live)
        driver.step([], (live[k:] + live[:k])[:sizes[i % len(sizes)]])
        i += 1


def run_mixed_decodes(ex: EngineExecutor, ps: list[list[int]]) -> list[list[int]]:
    driver = Driver(ex)
    reqs = [make_request(i, p, NEW_TOKENS) for i, p in enumerate(ps)]
    driver.step([(r, r.prompt_len) for r in reqs], [])           # unpadded prefill: eager fallback
    decode_in_varying_batches(driver, reqs, [5, 1, 2, 3, 4])
    return [list(r.output_token_ids) for r in reqs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_decode_buckets_match_eager_and_hf(family):
    ps = prompts(DECODE_LENGTHS, seed=5)
    ex = graph_executor(family)
    out = run_mixed_decodes(ex, ps)
    assert out == run_mixed_decodes(eager_executor(family), ps)
    assert out == [hf_greedy(family, p, NEW_TOKENS) for p in ps]
    stats = ex.runner.graphs.stats
    keys = set(stats.runs)
    assert all(k.kind == DECODE for k in keys)
    assert {k.batch for k in keys} >= {1, 2, 4, 8} and {k.length for k in keys} >= {16, 32, 64}
    assert stats.fallbacks == 1 and stats.static_eager == sum(stats.runs.values()) and stats.captures == 0


def laps_plan(ex: EngineExecutor, reqs, shape: tuple[int, int] | None) -> StepPlan:
    for r in reqs:
        ex.kv.allocate(r.request_id, r.prompt_len)
    return StepPlan(prefills=[PrefillChunk(r, 0, r.prompt_len) for r in reqs], padded_shape=shape)


def test_laps_prefill_buckets_with_padding_rows():
    """LAPS batches with padding tokens and padding sequences: (32, 4) with 3 prompts, an off-grid
    (24, 3) that rounds up to (32, 4), and (8, 2) with one prompt; then decode to the end."""
    family = "qwen3"
    ps = prompts([5, 23, 1, 12, 17, 8, 6], seed=7)
    groups = [([0, 1, 2], (32, 4)), ([3, 4], (24, 3)), ([5], (8, 2)), ([6], (8, 1))]
    ex, ref_ex = graph_executor(family), eager_executor(family)
    reqs = [make_request(i, p, 6) for i, p in enumerate(ps)]
    ref_reqs = [make_request(i, p, 6) for i, p in enumerate(ps)]
    driver = Driver(ex)
    for idx, shape in groups:
        _plan, result = driver.step([], [], plan=laps_plan(ex, [reqs[i] for i in idx], shape))
        ref = ref_ex.execute(laps_plan(ref_ex, [ref_reqs[i] for i in idx], shape))
        assert result.sampled == ref.sampled
    keys = list(ex.runner.graphs.stats.runs)
    assert keys == [BucketKey(PREFILL, 4, 32), BucketKey(PREFILL, 2, 8), BucketKey(PREFILL, 1, 8)]
    assert ex.runner.graphs.stats.runs[BucketKey(PREFILL, 4, 32)] == 2
    decode_in_varying_batches(driver, reqs, [7, 3])
    assert [r.output_token_ids for r in reqs] == [hf_greedy(family, p, 6) for p in ps]


def test_fallback_steps_interleaved_with_buckets():
    """Mixed prefill + decode steps, a chunked prompt whose later chunks sit on cached tokens,
    preemptible plans and a LAPS bucket whose chunk samples nothing, all in one run."""
    family = "llama"
    ps = prompts([6, 19, 11, 27], seed=3)

    def run(ex: EngineExecutor) -> list[list[int]]:
        driver = Driver(ex)
        reqs = [make_request(i, p, 8) for i, p in enumerate(ps)]
        a, b, c, d = reqs
        driver.step([(a, a.prompt_len)], [])                       # fresh, no padded_shape: eager
        driver.step([(b, b.prompt_len)], [a])                      # mixed: eager
        driver.step([], [a, b], preemptible=True)                  # preemptible decode: eager
        driver.step([], [a, b])                                    # decode bucket
        ex.kv.allocate(c.request_id, 8)                            # first chunk of c in a LAPS bucket
        driver.step([], [], plan=StepPlan(prefills=[PrefillChunk(c, 0, 8)], padded_shape=(8, 1)))
        ex.kv.allocate(c.request_id, c.prompt_len)                 # rest of c on cached tokens: eager
        driver.step([], [], plan=StepPlan(prefills=[PrefillChunk(c, 8, c.prompt_len - 8)], padded_shape=(8, 1)))
        driver.step([(d, d.prompt_len)], [a, b, c])                # mixed: eager
        decode_in_varying_batches(driver, reqs, [4, 2])            # decode buckets
        return [list(r.output_token_ids) for r in reqs]

    ex = graph_executor(family)
    out = run(ex)
    assert out == run(eager_executor(family))
    assert out == [hf_greedy(family, p, 8) for p in ps]
    stats = ex.runner.graphs.stats
    assert stats.fallbacks == 5
    assert stats.runs[BucketKey(PREFILL, 1, 8)] == 1
    assert {(k.batch, k.length) for k in stats.runs if k.kind == DECODE} >= {(2, 32), (4, 32), (2, 64)}


def test_steps_beyond_the_grid_fall_back():
    family = "qwen2"
    ps = prompts([3, 10, 14], seed=9)
    ex = graph_executor(family, graph_max_batch=2, graph_max_context=16)
    driver = Driver(ex)
    reqs = [make_request(i, p, 8) for i, p in enumerate(ps)]
    driver.step([(r, r.prompt_len) for r in reqs], [])
    runs_before = sum(ex.runner.graphs.stats.runs.values())
    driver.step([], reqs)                                          # 3 > max batch 2
    assert sum(ex.runner.graphs.stats.runs.values()) == runs_before
    decode_in_varying_batches(driver, reqs, [2, 1])                # contexts outgrow 16 on the way
    assert [r.output_token_ids for r in reqs] == [hf_greedy(family, p, 8) for p in ps]
    stats = ex.runner.graphs.stats
    assert {k.length for k in stats.runs} == {16} and stats.fallbacks >= 3
    assert all(k.batch <= 2 for k in stats.runs)


def test_bucket_selection_is_nearest_covering_shape():
    grid = BucketGrid.from_config(EngineConfig(**GRID))
    assert grid.decode_batches == (1, 2, 4, 8) and grid.decode_contexts == (16, 32, 64)
    assert grid.prefill_lengths == (8, 16, 32) and grid.prefill_batches == (1, 2, 4, 8)
    assert grid.decode(3, 17) == BucketKey(DECODE, 4, 32)
    assert grid.decode(4, 16) == BucketKey(DECODE, 4, 16)
    assert grid.decode(1, 1) == BucketKey(DECODE, 1, 16)
    assert grid.decode(8, 64) == BucketKey(DECODE, 8, 64)
    assert grid.decode(9, 10) is None and grid.decode(2, 65) is None
    assert grid.prefill(24, 3) == BucketKey(PREFILL, 4, 32)
    assert grid.prefill(32, 4) == BucketKey(PREFILL, 4, 32)
    assert grid.prefill(5, 1) == BucketKey(PREFILL, 1, 8)
    assert grid.prefill(33, 1) is None and grid.prefill(8, 9) is None

    ex = graph_executor()
    timed = graph_executor(record_op_times=True)
    ps = prompts([5, 17, 9], seed=1)
    reqs = [make_request(i, p, 4) for i, p in enumerate(ps)]
    for e in (ex, timed):
        for r in reqs:
            e.kv.allocate(r.request_id, r.prompt_len + 4)

    def select(plan: StepPlan, e: EngineExecutor = ex):
        return e.runner.select_bucket(plan, plan_sequences(plan, e.kv))

    fresh = [PrefillChunk(r, 0, r.prompt_len) for r in reqs]
    assert select(StepPlan(prefills=fresh, padded_shape=(16, 3))) == BucketKey(PREFILL, 4, 32)   # 17 > 16
    assert select(StepPlan(prefills=fresh[:1], padded_shape=(8, 1))) == BucketKey(PREFILL, 1, 8)
    assert select(StepPlan(prefills=fresh)) is None                                   # no padded_shape
    assert select(StepPlan(prefills=fresh, padded_shape=(64, 4))) is None            # beyond the grid
    assert select(StepPlan(prefills=[PrefillChunk(reqs[1], 8, 9)], padded_shape=(16, 1))) is None  # cached prefix
    assert select(StepPlan(prefills=fresh, padded_shape=(32, 4), preemptible=True)) is None
    for r in reqs:      # make them decodable: prompt done, one output token
        r.num_computed_tokens = r.prompt_len
        r.record_token(0.0, 7)
    assert select(StepPlan(decodes=reqs)) == BucketKey(DECODE, 4, 32)                # contexts 6, 18, 10
    assert select(StepPlan(decodes=reqs[:1])) == BucketKey(DECODE, 1, 16)
    assert select(StepPlan(decodes=reqs, preemptible=True)) is None
    assert select(StepPlan(prefills=fresh[:1], decodes=reqs[1:])) is None             # mixed
    assert select(StepPlan(decodes=reqs), timed) is None                              # op times need boundaries


def _token_slots(ex: EngineExecutor, req) -> list[int]:
    table = ex.kv.table(req.request_id)
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(req.num_computed_tokens)]


def test_padding_rows_touch_only_the_scratch_slot():
    """Every KV slot that holds no real token (free blocks, the unwritten tail of owned blocks) is
    poisoned with NaN: bucketed decode and prefill steps with padding rows and padding context
    columns must neither write nor read them — tokens stay equal to the eager path and the KV of
    real tokens equals the eager path's — while the scratch block absorbs the padding writes."""
    family = "qwen3"
    ps = prompts([5, 13, 21, 7], seed=13)
    ex, ref_ex = graph_executor(family), eager_executor(family)
    drivers = Driver(ex), Driver(ref_ex)
    all_reqs = [[make_request(i, p, 6) for i, p in enumerate(ps)] for _ in range(2)]
    for driver, reqs in zip(drivers, all_reqs):
        driver.step([(r, r.prompt_len) for r in reqs[:3]], [])
    cache = ex.runner.cache
    flat = cache.data.view(cache.num_layers, 2, -1, cache.num_kv_heads, cache.head_dim)
    scratch = range(cache.scratch_block * BLOCK, (cache.scratch_block + 1) * BLOCK)
    assert cache.data.shape[2] == ex.kv.num_blocks + 1

    def real_slots() -> set[int]:
        return {s for r in all_reqs[0] if r.num_computed_tokens for s in _token_slots(ex, r)}

    real = real_slots()
    poison = torch.tensor([s for s in range(flat.shape[2]) if s not in real and s not in scratch])
    flat[:, :, poison] = math.nan

    def check() -> None:
        real = real_slots()
        untouched = torch.tensor([s for s in poison.tolist() if s not in real])
        assert torch.isnan(flat[:, :, untouched]).all()
        assert torch.isfinite(flat[:, :, sorted(real)]).all()
        for r, ref in zip(all_reqs[0], all_reqs[1]):
            assert r.output_token_ids == ref.output_token_ids
            if r.num_computed_tokens:
                ours = flat[:, :, _token_slots(ex, r)]
                ref_flat = ref_ex.runner.cache.data.view(*flat.shape[:2], -1, *flat.shape[3:])
                assert torch.allclose(ours, ref_flat[:, :, _token_slots(ref_ex, ref)], atol=1e-5, rtol=1e-5)

    for driver, reqs in zip(drivers, all_reqs):       # B=4 bucket, one padding row, context columns padded
        driver.step([], reqs[:3])
    check()
    assert torch.isfinite(flat[:, :, list(scratch)]).all() and flat[:, :, scratch[0]].abs().sum() > 0
    for driver, reqs in zip(drivers, all_reqs):       # a LAPS (8, 2) bucket: padding tokens and a padding sequence
        driver.step([], [], plan=laps_plan(driver.ex, [reqs[3]], (8, 2)))
    check()
    for driver, reqs in zip(drivers, all_reqs):
        decode_in_varying_batches(driver, reqs, [4, 3, 1])
    check()
    assert ex.runner.graphs.stats.fallbacks == 1 and ex.runner.graphs.stats.static_eager > 5


# ops that read tensor data on the host (a sync, and a capture error on CUDA)
_HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.is_nonzero",
               "aten.equal", "aten.unique", "aten._unique", "aten.repeat_interleave.Tensor",
               "aten.repeat_interleave.self_Tensor")


class _OpTrace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves, _ = tree_flatten((args, kwargs or {}))
        shapes = tuple(tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def test_static_forward_is_capture_safe():
    """What a CUDA graph capture needs, checked on CPU: inside the forward no op reads a tensor on
    the host, and every run of a bucket issues the same ops on the same shapes (so one capture is
    valid for every later fill)."""
    ex = graph_executor("llama")
    runner = ex.runner.graphs
    traces: dict[BucketKey, list[list]] = {}
    forward = runner._forward

    def traced(bucket):
        with _OpTrace() as trace:
            out = forward(bucket)
        traces.setdefault(bucket.key, []).append(trace.ops)
        return out

    runner._forward = traced
    ps = prompts([4, 7, 2, 6, 9], seed=21)
    reqs = [make_request(i, p, 5) for i, p in enumerate(ps)]
    driver = Driver(ex)
    driver.step([], [], plan=laps_plan(ex, reqs[:3], (8, 4)))
    driver.step([], [], plan=laps_plan(ex, reqs[3:], (16, 4)))
    driver.step([], [], plan=laps_plan(ex, [make_request(9, ps[0], 1)], (16, 4)))
    decode_in_varying_batches(driver, reqs, [5, 3])
    assert len(traces) >= 3 and any(len(v) >= 2 for v in traces.values())
    for key, runs in traces.items():
        reads = {name for name, _ in runs[0] if name.startswith(_HOST_READS)}
        assert not reads, (key, reads)
        assert all(run == runs[0] for run in runs), key


def test_cpu_never_touches_cuda_graph_capture(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("CUDA graph API used on CPU")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", boom)
    monkeypatch.setattr(torch.cuda, "graph", boom)
    monkeypatch.setattr(torch.cuda, "Stream", boom)
    ex = graph_executor("qwen2")
    out = Driver(ex).run([make_request(0, prompts([9], seed=2)[0], 4)])
    stats = ex.runner.graphs.stats
    assert len(out[0]) == 4 and stats.captures == stats.replays == 0 and stats.static_eager == 3


class _FakeCuda:
    """Just enough of ``torch.cuda`` to drive ``BucketRunner._capture`` on CPU with graph semantics:
    a forward run inside ``graph(...)`` becomes the graph's body; ``replay`` re-runs that body on the
    (refilled) static buffers and writes into the tensor the capture returned, as a real replay does."""

    def __init__(self) -> None:
        self.capturing = None
        self.captures: list[tuple[object, object]] = []     # (pool, stream) per capture
        self.events: list[str] = []
        self.capture_modes: list[str] = []

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    def current_stream(self, device=None):
        return _FakeCuda.Stream()

    def stream(self, s):
        import contextlib
        return contextlib.nullcontext()

    def CUDAGraph(self):  # noqa: N802
        fake = self

        class Graph:
            body = out = None

            def pool(self):
                return ("pool", id(fake))

            def replay(self):
                fake.events.append("replay")
                self.out.copy_(self.body())
        return Graph()

    def graph(self, g, pool=None, stream=None, capture_error_mode="global"):
        import contextlib
        fake = self
        fake.capture_modes.append(capture_error_mode)

        @contextlib.contextmanager
        def capture():
            fake.captures.append((pool, stream))
            fake.events.append("capture")
            fake.capturing = g
            yield
            fake.capturing = None
        return capture()


def test_capture_and_replay_control_flow_with_emulated_graphs(monkeypatch):
    """The CUDA branch of the runner, driven on CPU by :class:`_FakeCuda`: each bucket is warmed up
    and captured once (sharing the first graph's pool and one side stream), later steps only replay,
    and greedy tokens stay identical to the eager path although every replay rewrites the same
    output tensor."""
    ex = graph_executor("qwen3")          # built first: loading the model must see the real torch.cuda
    fake = _FakeCuda()
    for name in ("Stream", "current_stream", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    runner = ex.runner.graphs
    runner._capture_graphs = True
    real_forward = runner._forward

    def forward(bucket):
        out = real_forward(bucket)
        if fake.capturing is not None:
            fake.capturing.body, fake.capturing.out = (lambda: real_forward(bucket)), out
        else:
            fake.events.append("warmup")
        return out

    runner._forward = forward
    ps = prompts(DECODE_LENGTHS, seed=5)
    assert run_mixed_decodes(ex, ps) == run_mixed_decodes(eager_executor("qwen3"), ps)
    stats = runner.stats
    assert stats.captures == len(stats.runs) == len(fake.captures) >= 4
    assert stats.replays == sum(stats.runs.values()) and stats.static_eager == 0
    pools = [pool for pool, _ in fake.captures]
    assert pools[0] is None and all(p == ("pool", id(fake)) for p in pools[1:])
    assert len({id(stream) for _, stream in fake.captures}) == 1
    # capture cannot disturb other instance threads of the process
    assert fake.capture_modes and set(fake.capture_modes) == {"thread_local"}
    text = " ".join(fake.events)
    assert text.count("warmup warmup capture replay") == stats.captures
    assert text.count("replay") == stats.replays


def test_default_config_keeps_the_eager_engine():
    assert EngineConfig().cuda_graphs is False
    ex = make_executor("qwen3")
    assert ex.runner.graphs is None and ex.runner.cache.scratch_blocks == 0
    assert ex.runner.cache.data.shape[2] == ex.kv.num_blocks
    for bad in (dict(graph_max_batch=3), dict(graph_max_context=8), dict(graph_max_prefill_len=4),
                dict(graph_max_prefill_batch=0), dict(graph_max_context=100)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
