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


#: GGUF architecture -> (transformers config class, model class, extra config)
_HF = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
       "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
       # transformers reads no head_dim from a qwen3 GGUF file (Qwen3Config's default, 128, applies)
       "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 128})}


@functools.cache
def hf_model(arch: str = "llama"):
    import transformers

    config_cls, model_cls, extra = _HF[arch]
    cfg = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, **extra)
    torch.manual_seed(7)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():              # sharper logits than the default init: greedy far from ties
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.shape[0] != VOCAB:
                p.mul_(2.5)
            elif name.endswith("bias"):                      # zeros at init: nothing would test them
                p.normal_(0.0, 0.5)
            elif "q_norm" in name or "k_norm" in name:       # ones at init: as little
                p.uniform_(0.5, 1.5)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's two halves of rows interleaved in pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _gguf_tensors(model, permute_qk: bool) -> dict[str, np.ndarray]:
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
            if permute_qk and key in ("attn_q", "attn_k"):
                w = _permute(w, HEADS if key == "attn_q" else KV_HEADS)
            out[f"blk.{i}.{key}.{rest[-1]}"] = w
    return out


def write_gguf(path: Path, *, arch: str = "llama", quantized: tuple[str, ...] = ("ffn_up", "attn_q.weight"),
               raw: dict[str, Q] | None = None, context: int = 256, value_length: int | None = None) -> Path:
    """The tiny model of ``arch`` (the Llama one for an architecture the tests have no model of) as
    llama.cpp's converter writes it: Q/K rows permuted for ``llama`` only (its converter leaves
    Qwen2/Qwen3 unpermuted, and transformers reads them so). Tensors whose name holds one of
    ``quantized`` are Q8_0; ``raw`` names tensors written as that type with zero bytes (for types
    nobody can dequantize)."""
    model = hf_model(arch if arch in _HF else "llama")
    head_dim = getattr(model.config, "head_dim", None) or HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(head_dim)
    w.add_value_length(value_length or head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(VOCAB)
    w.add_eos_token_id(VOCAB - 1)
    for name, t in _gguf_tensors(model, permute_qk=arch == "llama").items():
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
def tiny_gguf(arch: str = "llama") -> Path:
    return write_gguf(Path(_TMP.name) / f"tiny-{arch}.gguf", arch=arch)


def _transformers_model_of(path: Path):
    """The model ``transformers`` reads from the GGUF file: its config mapping, tensor names,
    Q/K un-permutation (or none) and dequantization (its GGUF loader without ``accelerate``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=True)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_greedy_equals_transformers_reading_the_same_file(arch):
    llm = LLM(tiny_gguf(arch), config=EngineConfig(num_kv_blocks=32, block_size=8, num_threads=1), quiet=True)
    cfg = llm.model.config
    assert llm.tokenizer is None and cfg.architecture == _HF[arch][1] and cfg.model_type == arch
    assert cfg.eos_token_ids == (VOCAB - 1,) and not cfg.tie_word_embeddings
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == {"llama": (False, False, False), "qwen2": (True, False, False),
                                                       "qwen3": (False, False, True)}[arch]
    assert cfg.head_dim == (128 if arch == "qwen3" else HIDDEN // HEADS)    # qwen3: key_length, not hidden/heads
    ref = _transformers_model_of(tiny_gguf(arch))
    assert type(ref).__name__ == cfg.architecture
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 19)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == want[0, len(prompt):].tolist()


def test_q_k_rows_are_unpermuted_for_llama_files_only(tmp_path):
    """All-F32 files: the loaded Q and K rows are the Hugging Face ones for both architectures,
    though only the llama file stores them permuted (the greedy test alone could miss a
    permutation that happens to change no greedy token)."""
    from laneserve.engine.models.gguf import load_gguf_model

    for arch in ("llama", "qwen2"):
        attn = hf_model(arch).model.layers[1].self_attn
        want = torch.cat([attn.q_proj.weight, attn.k_proj.weight]).detach()
        loaded = load_gguf_model(write_gguf(tmp_path / f"{arch}.gguf", arch=arch, quantized=()),
                                 load_tokenizer_too=False)
        assert torch.equal(loaded.layers[1].qkv[: want.shape[0]], want), arch
    assert not np.array_equal(_permute(want.numpy(), HEADS), want.numpy())


def test_the_context_length_comes_from_the_file(tmp_path):
    from laneserve.cli import build_parser
    from laneserve.commands.vllm_flags import apply_vllm_flags

    path = write_gguf(tmp_path / "ctx.gguf", arch="qwen2", context=48)
    llm = LLM(path, config=EngineConfig(num_kv_blocks=32, block_size=8, num_threads=1), quiet=True)
    assert llm.max_model_len == 48
    with pytest.raises(ValueError, match="exceeds the model's context length 48"):
        llm.generate([[1] * 40], SamplingParams(max_tokens=9, temperature=0))
    assert len(llm.generate([[1] * 40], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids) == 8

    def flags(n: int):
        args = build_parser().parse_args(["serve", str(path), "--max-model-len", str(n)])
        apply_vllm_flags(args, lambda s: None)
        return args

    with pytest.raises(ValueError, match=r"--max-model-len 49 is more than the model's GGUF context_length \(48\)"):
        flags(49)
    assert flags(48).max_model_len == 48


def test_a_type_the_package_cannot_dequantize_is_named_in_one_error(tmp_path):
    path = write_gguf(tmp_path / "q81.gguf", raw={"blk.0.ffn_down.weight": Q.Q8_1, "blk.1.ffn_down.weight": Q.Q8_1})
    with pytest.raises(UnsupportedModelError, match=r"cannot dequantize: Q8_1 \(2 tensors, e\.g\. blk\.0\.ffn_down"):
        load_model(path)


def test_unsupported_files_get_clear_errors(tmp_path):
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(write_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'qwen3moe' is not supported; supported: "
                                                    "llama, qwen2, qwen3"):
        load_model(write_gguf(tmp_path / "moe.gguf", arch="qwen3moe"))
    with pytest.raises(UnsupportedModelError, match="value heads of 32 dimensions with key heads of 128"):
        load_model(write_gguf(tmp_path / "v.gguf", arch="qwen3", value_length=32))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ValueError, match="is a file but not a GGUF file"):
        load_model(not_gguf)
    with pytest.raises(UnsupportedModelError, match="tensor parallelism needs a safetensors folder"):
        LLM(tiny_gguf(), config=EngineConfig(num_kv_blocks=32, block_size=8), quiet=True, tensor_parallel_size=2)
