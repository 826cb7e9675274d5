"""GGUF loading on tiny hand-written files (``gguf.GGUFWriter``): a random 2-layer Llama written
as llama.cpp's converter writes it (Q/K rows permuted, some tensors Q8_0-quantized) gives the
greedy tokens of ``transformers`` on the same dequantized weights; what the loader does not
support gets one clear error (a tensor type the gguf package cannot dequantize, by name).
The real model is in test_real_model.py."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF loading needs the gguf package (the models extra)")

from laneserve.core import SamplingParams  # noqa: E402
from laneserve.engine import EngineConfig  # noqa: E402
from laneserve.engine.llm import LLM  # noqa: E402
from laneserve.engine.models.config import UnsupportedModelError  # noqa: E402
from laneserve.engine.models.loader import load_model  # noqa: E402

Q = gguf.GGMLQuantizationType
VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 64, 128, 4, 2, 2
_TMP = tempfile.TemporaryDirectory(prefix="laneserve-gguf-tests-")


@functools.cache
def hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():              # sharper logits than the default init: greedy far from ties
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] != VOCAB:
                p.mul_(2.5)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's two halves of rows interleaved in pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    out = {}
    for name, t in model.state_dict().items():
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            out["output.weight"] = w
        else:
            _, _, i, *rest = name.split(".")
            key = _NAMES[".".join(rest[:-1])]
            if key in ("attn_q", "attn_k"):
                w = _permute(w, HEADS if key == "attn_q" else KV_HEADS)
            out[f"blk.{i}.{key}.weight"] = w
    return out


def write_gguf(path: Path, *, arch: str = "llama", quantized: tuple[str, ...] = ("ffn_up", "attn_q"),
               raw: dict[str, Q] | None = None) -> Path:
    """The tiny model as a GGUF file; tensors whose name holds one of ``quantized`` are Q8_0, and
    ``raw`` names tensors written as that type with zero bytes (for types nobody can dequantize)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(VOCAB)
    w.add_eos_token_id(VOCAB - 1)
    for name, t in _gguf_tensors(hf_model()).items():
        if raw and name in raw:
            block, size = gguf.GGML_QUANT_SIZES[raw[name]]
            rows = np.zeros((t.shape[0], t.shape[1] // block * size), np.uint8)      # the byte shape
            w.add_tensor(name, rows, raw_dtype=raw[name])
        elif any(q in name for q in quantized):
            w.add_tensor(name, gguf.quantize(t, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@functools.cache
def tiny_gguf() -> Path:
    return write_gguf(Path(_TMP.name) / "tiny.gguf")


def _dequantized_hf_model():
    """The transformers model with the weights the file holds (Q8_0 round trip where quantized)."""
    model = hf_model()
    ref = type(model)(model.config).eval()
    state = {}
    for name, t in model.state_dict().items():
        if any(k in name for k in ("mlp.up_proj", "self_attn.q_proj")):
            q = gguf.quantize(t.numpy(), Q.Q8_0)
            t = torch.from_numpy(gguf.dequantize(q, Q.Q8_0).reshape(t.shape).copy())
        state[name] = t
    ref.load_state_dict(state)
    return ref


def test_tiny_gguf_greedy_equals_transformers_on_the_dequantized_weights():
    llm = LLM(tiny_gguf(), config=EngineConfig(num_kv_blocks=32, block_size=8, num_threads=1), quiet=True)
    assert llm.tokenizer is None and llm.model.config.architecture == "LlamaForCausalLM"
    assert llm.model.config.eos_token_ids == (VOCAB - 1,) and not llm.model.config.tie_word_embeddings
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 19)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ref = _dequantized_hf_model()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == want[0, len(prompt):].tolist()


def test_a_type_the_package_cannot_dequantize_is_named_in_one_error(tmp_path):
    path = write_gguf(tmp_path / "q81.gguf", raw={"blk.0.ffn_down.weight": Q.Q8_1, "blk.1.ffn_down.weight": Q.Q8_1})
    with pytest.raises(UnsupportedModelError, match=r"cannot dequantize: Q8_1 \(2 tensors, e\.g\. blk\.0\.ffn_down"):
        load_model(path)


def test_unsupported_files_get_clear_errors(tmp_path):
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(write_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ValueError, match="is a file but not a GGUF file"):
        load_model(not_gguf)
    with pytest.raises(UnsupportedModelError, match="tensor parallelism needs a safetensors folder"):
        LLM(tiny_gguf(), config=EngineConfig(num_kv_blocks=32, block_size=8), quiet=True, tensor_parallel_size=2)
