"""Defaults right for each device, the attention path on a non-contiguous SDPA output (what CUDA's
SDPA returns in fp32), SDPA held to chosen kernels on CUDA, and CUDA-graph capture in thread-local
mode (so one instance thread capturing cannot break another's synchronising calls)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from engine_support import Driver, _model, make_executor, make_request, prompts
from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import StepPlan
from laneserve.engine import EngineConfig, EngineExecutor
from laneserve.engine import attention as attention_module
from laneserve.engine import graphs as graphs_module
from laneserve.engine.config import default_attention
from laneserve.engine.graphs import DECODE, BucketKey
from laneserve.engine.runner import plan_sequences


def test_cpu_defaults_unchanged():
    cfg = EngineConfig()
    assert (cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.attention) == ("cpu", "float32", False, "ragged")


def test_cuda_defaults_checkpoint_dtype_graphs_explicit_attention():
    cfg = EngineConfig(device="cuda")
    assert cfg.dtype == "auto"              # the loader takes the checkpoint's dtype (bf16 for real ones)
    assert cfg.cuda_graphs is True
    assert cfg.attention in ("paged", "ragged") and cfg.attention == default_attention("cuda")
    explicit = EngineConfig(device="cuda:0", dtype="float32", cuda_graphs=False, attention="padded")
    assert (explicit.dtype, explicit.cuda_graphs, explicit.attention) == ("float32", False, "padded")


def test_default_attention_per_device():
    assert default_attention("cpu") == "ragged"
    try:
        import triton  # noqa: F401
        expected = "paged"
    except ImportError:
        expected = "ragged"
    assert default_attention("cuda") == expected


def _non_contiguous_sdpa(monkeypatch):
    """SDPA returning its (correct) output with the strides CUDA's kernels give: heads and
    sequence swapped in memory, so ``.view`` across them fails."""
    real = F.scaled_dot_product_attention
    calls = [0]

    def sdpa(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if out.dim() == 4:
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
            assert not out.is_contiguous() or out.shape[1] == 1 or out.shape[2] == 1
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls


def _decode_tokens(attention: str) -> tuple[dict, dict]:
    ex = make_executor("qwen3", attention)
    driver = Driver(ex)
    reqs = [make_request(i, p, 4, logprobs=2) for i, p in enumerate(prompts([11, 6, 17], seed=8))]
    driver.step([(reqs[0], 5)], [])
    driver.step([(reqs[0], 6), (reqs[1], 6), (reqs[2], 17)], [])     # one chunk on a cached prefix
    for _ in range(3):
        driver.step([], reqs)
    return {r.request_id: list(r.output_token_ids) for r in reqs}, driver.logprobs


@pytest.mark.parametrize("attention", ["ragged", "padded"])
def test_fp32_non_contiguous_attention_output(monkeypatch, attention):
    ref_tokens, ref_lp = _decode_tokens(attention)
    calls = _non_contiguous_sdpa(monkeypatch)
    tokens, lp = _decode_tokens(attention)
    assert calls[0] > 0
    assert tokens == ref_tokens and lp == ref_lp


def test_sdpa_backends_context_per_device():
    assert isinstance(attention_module.sdpa_backends(torch.device("cpu")), contextlib.nullcontext)
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    with attention_module.sdpa_backends(torch.device("cuda")):      # flags only: no device needed
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
    backends = attention_module.CUDA_SDPA_BACKENDS
    assert backends[0] == torch.nn.attention.SDPBackend.FLASH_ATTENTION
    assert backends[1] == torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in backends


class _FakeCuda:
    """Enough of ``torch.cuda`` for ``BucketRunner._capture`` to run its warm-up and capture calls
    on CPU; records the keyword arguments of every ``torch.cuda.graph`` call."""

    def __init__(self):
        self.graph_kwargs: list[dict] = []

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

    class CUDAGraph:
        def pool(self):
            return "pool"

        def replay(self):
            pass

    def current_stream(self, device=None):
        return self.Stream()

    @contextlib.contextmanager
    def stream(self, s):
        yield

    def graph(self, graph, **kwargs):
        self.graph_kwargs.append(kwargs)
        return contextlib.nullcontext()


def test_graph_capture_is_thread_local(monkeypatch):
    cfg = EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=256, num_threads=1, cuda_graphs=True,
                       graph_max_batch=4, graph_max_context=32, graph_max_prefill_len=16, graph_max_prefill_batch=2)
    ex = EngineExecutor(_model("qwen3"), KVCacheManager(64, 8), cfg)
    runner = ex.runner.graphs
    fake = _FakeCuda()
    for name in ("Stream", "CUDAGraph", "current_stream", "stream", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    req = make_request(0, prompts([9], seed=2)[0], 2)
    ex.kv.allocate(0, 10)
    req.num_computed_tokens = 9
    req.record_token(0.0, 5)
    seqs = plan_sequences(StepPlan(decodes=[req]), ex.kv)
    key = BucketKey(DECODE, 1, 16)
    bucket = runner._make(key)
    runner._fill(bucket, seqs, [ex.kv.table(0)])
    with torch.inference_mode():
        runner._capture(bucket)
    assert fake.graph_kwargs and all(kw.get("capture_error_mode") == "thread_local" for kw in fake.graph_kwargs)
    assert graphs_module.CAPTURE_ERROR_MODE == "thread_local"
    assert bucket.graph is not None and bucket.output is not None


def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path, monkeypatch, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would measure")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--results-dir", str(tmp_path)])
    assert module.main() == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
