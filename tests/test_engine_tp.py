"""Tensor parallelism on CPU (gloo): a model sharded over 2, 3 or 4 rank processes answers as the
same checkpoint on one rank — greedy tokens identical and logprobs within 1e-4 — on checkpoints
whose shapes bite (tests/tp_support.py); preempted plans resume on every rank; rank 0 makes one
host sync per step; each rank reads only its slices; shutdown leaves no process and no shared
memory. One rank group per (family, degree), shared by the tests that use it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_support import Driver, make_request, prompts
from laneserve.core.sampling import SamplingParams
from laneserve.engine.config import EngineConfig
from laneserve.engine.llm import LLM
from laneserve.engine.models.config import ModelConfig
from laneserve.engine.tp.layout import RankLayout, TensorParallelError, check_degree
from laneserve.engine.tp.loader import load_shard
from tp_support import VOCAB, tp_checkpoint

GROUPS = [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen2", 4), ("qwen3", 2), ("qwen3", 4), ("llama9", 3)]


def _config() -> EngineConfig:
    # a small token budget: long prompts go in chunks, mixed with other requests' decodes
    return EngineConfig(num_kv_blocks=96, block_size=8, max_num_batched_tokens=24, num_threads=1)


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    ps = [p[:] for p in prompts([5, 41, 12, 3], seed=7)]
    for p in ps:
        p[:] = [min(t, VOCAB - 2) for t in p]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3) for _ in ps]
    params[1] = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    return ps, params


_REFERENCE: dict[str, tuple] = {}


def _reference(family: str):
    """TP1 outputs (and the TP1 LLM, for the executor-level comparisons)."""
    if family not in _REFERENCE:
        llm = LLM(tp_checkpoint(family), config=_config(), quiet=True)
        ps, params = _workload()
        _REFERENCE[family] = (llm, llm.generate(ps, params))
    return _REFERENCE[family]


@pytest.fixture(scope="module", params=GROUPS, ids=[f"{f}-tp{n}" for f, n in GROUPS])
def group(request):
    family, tp = request.param
    llm = LLM(tp_checkpoint(family), config=_config(), quiet=True, tensor_parallel_size=tp)
    yield family, tp, llm
    llm.close()


def _clip(p: list[int]) -> list[int]:
    return [min(t, VOCAB - 2) for t in p]


def _drive(ex, base: int, stop_every: int | None = None):
    """A cached-prefix chunk, then a two-chunk prefill that is preemptible (stopped at every
    ``stop_every``-th boundary, with another request's prefill run while it is parked), then
    batched decodes. Returns the tokens, the step logprobs and the prompt logprobs."""
    driver = Driver(ex)
    a, b, c = (_clip(p) for p in prompts([20, 13, 6], seed=11))
    ra = make_request(base, a, 5, logprobs=3, prompt_logprobs=2)
    rb, rc = make_request(base + 1, b, 5, logprobs=3), make_request(base + 2, c, 5, logprobs=3)
    driver.step([(ra, 9)], [])
    calls = [0]

    def stop() -> bool:
        calls[0] += 1
        return stop_every is not None and calls[0] % stop_every == 0

    plan, result = driver.step([(ra, 11), (rb, 13)], [], preemptible=True, should_stop=stop)
    parks = 0
    while not result.completed:
        parks += 1
        if parks == 1:
            driver.step([(rc, 6)], [])                 # runs while the plan is parked
        plan, result = driver.step([], [], plan=plan, should_stop=stop)
    if rc.num_output_tokens == 0:
        driver.step([(rc, 6)], [])
    for _ in range(4):
        driver.step([], [ra, rb, rc])
    reqs = (ra, rb, rc)
    for r in reqs:
        ex.kv.free(r.request_id)
    return [r.output_token_ids for r in reqs], driver.logprobs, ra.prompt_logprobs, parks


def _close(a, b, path="") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif hasattr(a, "top"):
        assert a.token_id == b.token_id, path
        _close(a.logprob, b.logprob, path)
        _close(a.top, b.top, path)
    elif isinstance(a, float):
        assert abs(a - b) <= 1e-4, (path, a, b)
    else:
        assert a == b, path


def test_greedy_tokens_match_one_rank(group):
    family, tp, llm = group
    assert llm.executor.tensor_parallel_size == tp
    part = -(-VOCAB // tp)                              # the vocab padded to a multiple of the degree
    assert llm.model.lm_head.shape[0] == part and llm.model.vocab_size == VOCAB
    _, ref = _reference(family)
    ps, params = _workload()
    outs = llm.generate(ps, params)
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids
    assert any(len(set(o.token_ids)) > 2 for o in outs)          # not a degenerate echo


def test_logprobs_and_preempted_plans_match_one_rank(group):
    """Step and prompt logprobs within 1e-4 of one rank; a plan whose rank 0 wishes a stop at every
    second operator boundary (the ranks agree where to park: stop_protocol) resumes to the same tokens."""
    family, tp, llm = group
    ref_llm, _ = _reference(family)
    ref_tokens, ref_lp, ref_prompt_lp, _ = _drive(ref_llm.executor, 1000)
    tokens, lp, prompt_lp, parks = _drive(llm.executor, 1000, stop_every=2)
    assert parks >= 2          # a stop lands at the first boundary every rank can still reach
    assert tokens == ref_tokens
    _close(ref_lp, lp)
    _close(ref_prompt_lp, prompt_lp)
    assert not llm.executor.parked_plan_ids


def test_rank0_makes_one_host_sync_per_step(group, monkeypatch):
    from test_engine_host_sync import counting

    _family, _tp, llm = group
    driver = Driver(llm.executor)
    a, b = (_clip(p) for p in prompts([14, 9], seed=4))
    ra, rb = make_request(2000, a, 3), make_request(2001, b, 3)
    driver.step([(ra, 6)], [])
    with counting(monkeypatch) as measure:
        with measure() as mixed:
            driver.step([(ra, 8), (rb, 9)], [])
        with measure() as decode:
            driver.step([], [ra, rb])
    for r in (ra, rb):
        llm.executor.kv.free(r.request_id)
    assert len(mixed.syncs) == 1 and len(decode.syncs) == 1, (mixed.syncs, decode.syncs)
    assert len(mixed.copies) <= 2 and len(decode.copies) <= 2


def test_a_degree_that_does_not_divide_the_heads_is_refused_with_the_numbers():
    nine = ModelConfig.from_folder(tp_checkpoint("llama9"))
    check_degree(nine, 3)                                      # 9 heads, 3 KV heads: fine
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=2 .*9 attention heads"):
        check_degree(nine, 2)
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=4 .*9 attention heads.*3 KV heads"):
        LLM(tp_checkpoint("llama9"), config=_config(), quiet=True, tensor_parallel_size=4)


def test_kv_heads_split_or_replicated_like_gqa_needs():
    llama = ModelConfig.from_folder(tp_checkpoint("llama"))      # 8 heads, 2 KV heads
    qwen2 = ModelConfig.from_folder(tp_checkpoint("qwen2"))      # 4 heads, 1 KV head
    assert [list(RankLayout(llama, r, 2).kv_heads) for r in range(2)] == [[0], [1]]
    assert [list(RankLayout(llama, r, 4).kv_heads) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(RankLayout(qwen2, r, 4).kv_heads) for r in range(4)] == [[0]] * 4
    for cfg, tp in ((llama, 4), (qwen2, 4), (llama, 2)):
        group = cfg.num_heads // cfg.num_kv_heads
        for r in range(tp):
            lay = RankLayout(cfg, r, tp)                      # every query head sees its own KV head
            assert {h // group for h in lay.heads} <= set(lay.kv_heads)
    assert RankLayout(llama, 3, 4).vocab == range(384, 512)          # 509 ids: the last part has 3 padding rows


def test_each_rank_reads_only_its_slices():
    path = tp_checkpoint("llama")
    whole = load_shard(path, 0, 1).elements_read
    parts = [load_shard(path, r, 4).elements_read for r in range(4)]
    cfg = ModelConfig.from_folder(path)
    replicated = cfg.hidden_size * (2 * cfg.num_layers + 1)               # the norms
    kv_copies = 2 * cfg.num_layers * cfg.hidden_size * cfg.head_dim * (4 - cfg.num_kv_heads)
    assert max(parts) < whole / 3
    # everything once, plus the copies of what every rank needs whole (norms) or shares (KV heads
    # at TP4 > 2 KV heads); the vocab padding is zeros, not read
    assert sum(parts) == whole + 3 * replicated + kv_copies


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a zombie is gone as far as the test cares
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except FileNotFoundError:
        return False


def test_two_groups_side_by_side_then_nothing_left():
    path = tp_checkpoint("qwen3")
    ps, params = _workload()
    _, ref = _reference("qwen3")
    first = LLM(path, config=_config(), quiet=True, tensor_parallel_size=2)
    second = LLM(path, config=_config(), quiet=True, tensor_parallel_size=2)
    groups = [first.executor.group, second.executor.group]
    try:
        assert groups[0].channel.path != groups[1].channel.path
        assert groups[0].spec.store_path != groups[1].spec.store_path
        for g in groups:                                # unlinked once every rank had mapped it
            assert not Path(g.channel.path).exists()
        assert [o.token_ids for o in first.generate(ps, params)] == [r.token_ids for r in ref]
        assert [o.token_ids for o in second.generate(ps, params)] == [r.token_ids for r in ref]
        pids = [pid for g in groups for pid in g.pids]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        first.close()
        second.close()
    first.close()                                       # a second close does nothing
    assert not any(_alive(p) for p in pids)
    for g in groups:
        assert not Path(g.spec.store_path).parent.exists()
    mine = (f"laneserve-tp-{os.getpid()}-", f"laneserve-stop-{os.getpid()}-")      # step channel, stop board
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(mine)]


def test_every_rank_makes_one_host_sync_per_step_at_most(monkeypatch):
    """Rank 1 as a thread of this process (the same rank loop), so the shim counts both ranks:
    a step's only sync is rank 0's sampled tokens; rank 1 reads nothing back."""
    from test_engine_host_sync import counting

    from laneserve.engine.tp.executor import TPExecutor

    ex = TPExecutor.start(tp_checkpoint("qwen3"), 2, _config(), launch="thread")
    try:
        assert ex.group.pids == []
        driver = Driver(ex)
        a, b, c = (_clip(p) for p in prompts([14, 9, 12], seed=4))
        ra, rb, rc = make_request(0, a, 3), make_request(1, b, 3), make_request(2, c, 3)
        driver.step([(ra, 6)], [])
        counts = {}
        with counting(monkeypatch) as measure:
            with measure() as n:
                driver.step([(ra, 8), (rb, 9)], [])
            counts["mixed"] = list(n.syncs)
            with measure() as n:
                driver.step([], [ra, rb])
            counts["decode"] = list(n.syncs)
            with measure() as n:
                driver.step([(rc, 12)], [ra, rb], preemptible=True, should_stop=lambda: False)
            counts["preemptible"] = list(n.syncs)
    finally:
        ex.close()
    assert all(len(syncs) == 1 for syncs in counts.values()), counts
    assert not any(t.is_alive() for t in ex.group.procs)


def _prefilled(ex, rid: int, prompt: list[int]):
    req = make_request(rid, prompt, 5)
    Driver(ex).step([(req, len(prompt))], [])
    return req


def _take_over(ex, rid: int, src, payload) -> list[int]:
    """``src``'s request continued on ``ex`` from ``payload``: four decode steps."""
    req = make_request(rid, list(src.prompt_token_ids), 5)
    req.num_computed_tokens = src.num_computed_tokens
    req.record_token(0.0, src.output_token_ids[0])
    ex.kv.allocate(rid, req.context_len)
    ex.import_kv(rid, payload)
    driver = Driver(ex)
    for _ in range(4):
        driver.step([], [req])
    ex.kv.free(rid)
    return list(req.output_token_ids)


def test_kv_hands_off_between_this_degree_and_one_rank(group):
    """A request prefilled on the group continues on one rank from the exported (sharded) KV, and
    one prefilled on one rank continues on the group: both decode the tokens of one rank alone."""
    family, tp, llm = group
    ref_llm, _ = _reference(family)
    one, many = ref_llm.executor, llm.executor
    prompt = _clip(prompts([19], seed=21)[0])
    alone = _prefilled(one, 3000, prompt)
    expected = _take_over(one, 3001, alone, one.export_kv(3000, alone.num_computed_tokens))
    one.kv.free(3000)

    src = _prefilled(many, 3002, prompt)
    payload = many.export_kv(3002, src.num_computed_tokens)
    assert payload.tp == tp and src.output_token_ids == alone.output_token_ids
    assert _take_over(one, 3003, src, payload) == expected              # TP-N -> TP1
    many.kv.free(3002)

    src = _prefilled(one, 3004, prompt)
    assert _take_over(many, 3005, src, one.export_kv(3004, src.num_computed_tokens)) == expected   # TP1 -> TP-N
    one.kv.free(3004)


def test_a_dead_rank_fails_the_next_step_promptly_and_close_still_cleans_up():
    import signal
    import threading

    from laneserve.engine.tp.executor import RankLost, TPExecutor

    ex = TPExecutor.start(tp_checkpoint("llama"), 2, _config())
    try:
        driver = Driver(ex)
        req = make_request(0, _clip(prompts([6], seed=2)[0]), 4)
        driver.step([(req, 6)], [])
        rank1 = ex.group.pids[0]
        os.kill(rank1, signal.SIGKILL)
        outcome: list = []

        def step() -> None:
            try:
                driver.step([], [req])
                outcome.append(None)
            except Exception as exc:       # noqa: BLE001 - which error gloo or the channel raises
                outcome.append(exc)

        t = threading.Thread(target=step, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "a step on a group with a dead rank hangs"
        assert isinstance(outcome[0], RankLost), outcome
        assert f"rank 1 (pid {rank1}) exited with code -9" in str(outcome[0])
    finally:
        ex.close()
    assert not _alive(rank1)


def _group_files() -> set[str]:
    from laneserve.engine.tp.channel import shm_folder
    mine = (f"laneserve-tp-{os.getpid()}-", f"laneserve-stop-{os.getpid()}-")
    return {f.name for f in shm_folder().iterdir() if f.name.startswith(mine)}


@pytest.mark.parametrize("entry", ["exits_before_join", "exits_after_join"])
def test_a_rank_that_fails_at_start_up_fails_the_group_in_one_line_and_leaves_nothing(entry, monkeypatch):
    """Rank 1 dies while the group starts: rank 0 gives up at once (not after the store's timeout)
    with one line naming the rank and its exit code; no rank process and no group file is left."""
    import multiprocessing
    import tempfile

    import tp_fault_support
    from laneserve.engine.tp import executor
    from laneserve.engine.tp.executor import RankLost, TPExecutor

    monkeypatch.setattr(executor, "rank_main", getattr(tp_fault_support, entry))
    code = 3 if entry == "exits_before_join" else 4
    stores = set(Path(tempfile.gettempdir()).glob("laneserve-tp-*"))
    ranks = set(multiprocessing.active_children())     # other tests' groups
    with pytest.raises(RankLost, match=rf"^tensor-parallel group failed to start: rank 1 \(pid \d+\) exited "
                                       rf"with code {code}$"):
        TPExecutor.start(tp_checkpoint("llama"), 2, _config())
    assert not [p for p in set(multiprocessing.active_children()) - ranks if p.name.startswith("laneserve-tp-rank")]
    assert not _group_files()
    assert set(Path(tempfile.gettempdir()).glob("laneserve-tp-*")) <= stores
