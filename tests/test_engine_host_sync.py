"""Host work per eager step, counted on CPU with a shim: the host-to-device copies (``.to(device)``,
``torch.tensor(..., device=)``, ``pin_memory``) and the synchronising calls (``.item()``,
``.tolist()``, ``bool(tensor)``, ``.cpu()``, ``int()``/``float()`` of a tensor) an ``execute``
makes. A step must make one synchronisation (the sampled tokens) and a fixed number of copies,
whatever the number of layers: a per-layer copy or a second sync fails here.

On CUDA those calls are what ``torch.cuda.set_sync_debug_mode("warn")`` flags (or, for the copies,
what the pinned non-blocking upload keeps off the host's critical path); on CPU they are counted
because they are the same calls."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from engine_support import Driver, _model, make_request, prompts
from laneserve.core.kv import KVCacheManager
from laneserve.engine import EngineConfig, EngineExecutor, LlamaModel
from laneserve.engine.sampler import _row_codes, _unsampleable_rows

SYNC_METHODS = ("item", "tolist", "__bool__", "cpu", "numpy", "__int__", "__float__")


class Counts:
    def __init__(self) -> None:
        self.copies: list[str] = []
        self.syncs: list[str] = []


@contextlib.contextmanager
def counting(monkeypatch):
    counts = Counts()
    active = [False]

    def wrap_sync(name):
        real = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            if active[0]:
                counts.syncs.append(name)
            return real(self, *args, **kwargs)
        return method

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, wrap_sync(name))
    real_to, real_pin, real_tensor = torch.Tensor.to, torch.Tensor.pin_memory, torch.tensor

    def to(self, *args, **kwargs):
        if active[0] and ("device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)):
            counts.copies.append("to")
        return real_to(self, *args, **kwargs)

    def pin_memory(self, *args, **kwargs):
        if active[0]:
            counts.copies.append("pin_memory")
        return real_pin(self, *args, **kwargs)

    def tensor(*args, **kwargs):
        if active[0] and kwargs.get("device") is not None:
            counts.copies.append("tensor(device=)")
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch, "tensor", tensor)

    @contextlib.contextmanager
    def measure():
        counts.copies.clear()
        counts.syncs.clear()
        active[0] = True
        try:
            yield counts
        finally:
            active[0] = False

    yield measure


def _deep_model(layers: int) -> LlamaModel:
    """The tiny qwen3 model with its layers repeated to ``layers`` (weights shared)."""
    base = _model("qwen3")
    reps = layers // base.config.num_layers
    cfg = dataclasses.replace(base.config, num_layers=layers)
    return LlamaModel(cfg, base.embed, base.layers * reps, base.final_norm, base.lm_head, base.tokenizer)


def _executor(model: LlamaModel, attention: str) -> EngineExecutor:
    cfg = EngineConfig(attention=attention, block_size=8, num_kv_blocks=128, max_num_batched_tokens=256, num_threads=1)
    return EngineExecutor(model, KVCacheManager(128, 8), cfg)


def _step_counts(layers: int, attention: str, monkeypatch) -> dict[str, tuple[int, int]]:
    """(copies, syncs) of a mixed prefill step (a chunk on a cached prefix + a fresh prompt), a
    decode step, and a preemptible prefill step, each greedy without logprobs."""
    ex = _executor(_deep_model(layers), attention)
    driver = Driver(ex)
    a, b, c = (make_request(i, p, 3) for i, p in enumerate(prompts([14, 9, 12], seed=4)))
    driver.step([(a, 6)], [])
    out = {}
    with counting(monkeypatch) as measure:
        with measure() as n:
            driver.step([(a, 8), (b, 9)], [])
        out["mixed_prefill"] = (len(n.copies), len(n.syncs))
        with measure() as n:
            driver.step([], [a, b])
        out["decode"] = (len(n.copies), len(n.syncs))
        with measure() as n:
            driver.step([(c, 12)], [a, b], preemptible=True, should_stop=lambda: False)
        out["preemptible_mixed"] = (len(n.copies), len(n.syncs))
    return out


@pytest.mark.parametrize("attention", ["ragged", "padded"])
def test_one_sync_per_step_and_no_per_layer_copy(attention, monkeypatch):
    shallow = _step_counts(2, attention, monkeypatch)
    deep = _step_counts(6, attention, monkeypatch)
    assert shallow == deep, f"host copies or syncs grow with the layers: {shallow} vs {deep}"
    for step, (copies, syncs) in shallow.items():
        assert syncs == 1, f"{step}: {syncs} synchronising calls"
        assert copies <= 2, f"{step}: {copies} host-to-device copies"


def test_shim_catches_an_added_per_layer_copy_and_sync(monkeypatch):
    """The shim sees what it must forbid: a copy and a sync slipped into every layer's attention."""
    from laneserve.engine.attention import RaggedAttention
    real_forward = RaggedAttention.forward

    def leaky(self, q, k_new, v_new, k_cache, v_cache, meta):
        torch.zeros(1).to(q.device)
        bool(q.isfinite().all())
        return real_forward(self, q, k_new, v_new, k_cache, v_cache, meta)

    monkeypatch.setattr(RaggedAttention, "forward", leaky)
    shallow = _step_counts(2, "ragged", monkeypatch)
    deep = _step_counts(6, "ragged", monkeypatch)
    assert shallow != deep
    assert all(syncs > 1 for _c, syncs in shallow.values())


def test_row_codes_match_reasons():
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [float("inf"), 0.0], [float("-inf")] * 2,
                           [float("-inf"), 2.0]])
    assert _row_codes(logits).tolist() == [0, 1, 2, 3, 0]
    assert _unsampleable_rows(logits) == {1: "logits contain NaN", 2: "logits contain +inf", 3: "no finite logit"}
