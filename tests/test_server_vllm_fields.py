"""vLLM's request fields and utility endpoints on a live smoke-model server, with the official
``openai`` client: each field is honoured as vLLM honours it or refused with a 400 naming it
(``min_p``, ``allowed_token_ids``, ``bad_words``, ``stop_reason``, ``include_stop_str_in_output``,
``truncate_prompt_tokens``, ``continue_final_message``, chat ``echo``, optional ``model``;
``spaces_between_special_tokens: false`` refused; the model as vllm serve's positional MODEL,
``--max-model-len``), ``/tokenize`` and
``/detokenize`` round trips, ``/version``, ``/v1/responses`` a clear 404, and random response ids."""

from __future__ import annotations

import re

import httpx
import pytest
from server_support import serving

from laneserve.engine.smoke import smoke_model_path

openai = pytest.importorskip("openai")

MODEL = "smoke-llama"
PROMPT = "serve the model token serve the model token prefill decode serve"


@pytest.fixture(scope="module")
def server():
    with serving(str(smoke_model_path()), "--colocated", "--kv-tokens", "16384", "--max-model-len", "2048",
                 "--served-model-name", MODEL, "smoke-alias") as srv:
        yield srv


def _greedy(client, prompt=PROMPT, n=16, **extra):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return out.choices[0]


def test_stop_reason_and_include_stop_str_in_output(server):
    client = server.client()
    full = _greedy(client)
    assert full.finish_reason == "length" and full.stop_reason is None
    text, toks = full.text, full.model_dump()["token_ids"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = _greedy(client, stop=[stop])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]
    kept = _greedy(client, stop=[stop], include_stop_str_in_output=True)
    assert kept.stop_reason == stop and kept.text == text[:text.index(stop) + len(stop)]
    k = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])       # a token's first appearance
    by_id = _greedy(client, stop_token_ids=[toks[k]])
    assert by_id.finish_reason == "stop" and by_id.stop_reason == toks[k]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
                                          temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason != "stop" or chat.choices[0].model_dump()["stop_reason"] == stop


def test_min_p_cuts_the_unlikely_tokens(server):
    """min_p = 1 keeps only the likeliest token: seeded sampling at temperature 1 becomes greedy;
    without it the same seed samples something else (the smoke model's distribution is flat)."""
    client = server.client()
    greedy = _greedy(client).model_dump()["token_ids"]

    def sampled(**extra):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7,
                                        extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
        return out.choices[0].model_dump()["token_ids"]
    assert sampled(min_p=1.0) == greedy
    assert sampled(min_p=0.0) != greedy
    assert sampled(min_p=0.0) == sampled()                       # 0 is off


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    client = server.client()
    whole = _greedy(client)
    ids = whole.model_dump()["prompt_token_ids"]
    assert len(ids) > 5
    short = _greedy(client, truncate_prompt_tokens=5)
    assert short.model_dump()["prompt_token_ids"] == ids[-5:]
    assert short.model_dump()["token_ids"] == _greedy(client, prompt=ids[-5:]).model_dump()["token_ids"]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert out.usage.prompt_tokens == 5


def test_continue_final_message_and_chat_echo(server):
    client = server.client()
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The answer is"}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                     "return_token_ids": True, "echo": True, "ignore_eos": True})
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": out.choices[0].model_dump()["prompt_token_ids"]},
                        timeout=30).json()["prompt"]
    assert prompt.rstrip().endswith("The answer is")                       # left open, no generation prompt
    assert "<|end|>" not in prompt.split("The answer is")[-1]
    assert out.choices[0].message.content.startswith("The answer is")       # echo: the last assistant message
    plain = client.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=4, temperature=0,
                                           extra_body={"echo": True, "ignore_eos": True})
    assert not plain.choices[0].message.content.startswith("hello")         # the last message is the user's
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"continue_final_message": True, "echo": True,
                                                        "ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed.startswith("The answer is")
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": True})


def test_allowed_token_ids_and_bad_words(server):
    client = server.client()
    greedy = _greedy(client).model_dump()["token_ids"]
    allowed = sorted(set(greedy[5:]))[:3]           # tokens the model does pick, but not first
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True, "return_token_ids": True,
                                                "allowed_token_ids": allowed})
    toks = out.choices[0].model_dump()["token_ids"]
    assert set(toks) <= set(allowed) and len(toks) == 16
    # a bad word of two tokens (greedy[i], greedy[i + 1]): greedy output up to greedy[i], then
    # anything but greedy[i + 1]; as vLLM, the word with a leading space is banned too
    def tokens(text):
        return httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=30).json()["tokens"]

    def detok(ids):
        return httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]

    def occurs(seq, upto):
        return any(greedy[j:j + len(seq)] == seq for j in range(upto - len(seq) + 2))

    for i in range(1, len(greedy) - 1):
        word = detok(greedy[i:i + 2])
        plain, spaced = tokens(word.lstrip()), tokens(" " + word.lstrip())
        if plain == greedy[i:i + 2] and not occurs(plain, i) and not occurs(spaced, i + 1):
            break
    else:
        pytest.fail("no two-token word in the greedy output")
    banned = _greedy(client, bad_words=[word]).model_dump()["token_ids"]
    assert banned[:i + 1] == greedy[:i + 1] and banned[i + 1] != greedy[i + 1]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"allowed_token_ids": [10**7]})
    assert e.value.body["param"] == "allowed_token_ids"


def test_unimplemented_fields_are_refused_by_name(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"spaces_between_special_tokens": False})
    assert e.value.body["param"] == "spaces_between_special_tokens"
    assert "spaces_between_special_tokens" in e.value.body["message"]
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                     extra_body={"spaces_between_special_tokens": True}).choices


def test_optional_model_aliases_and_random_ids(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == MODEL
    client = server.client()
    alias = client.completions.create(model="smoke-alias", prompt=PROMPT, max_tokens=2)
    assert alias.model == MODEL
    ids = {client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1).id
           for _ in range(3)}
    assert len(ids) == 3 and all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in ids)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt=PROMPT, max_tokens=2)


def test_tokenize_detokenize_version_and_responses(server):
    url = server.url
    tok = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 2048 and tok["token_strs"] is None
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 2048   # --max-model-len
    r = httpx.post(url + "/v1/completions", json={"prompt": [7] * 2100, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and "maximum context length is 2048" in r.json()["error"]["message"]
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}, timeout=30).json()
    assert back["prompt"].endswith(PROMPT)
    client = server.client()
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert completion.usage.prompt_tokens == tok["count"]
    msgs = [{"role": "user", "content": PROMPT}]
    chat_tok = httpx.post(url + "/tokenize", json={"messages": msgs, "return_token_strs": True}, timeout=30).json()
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert chat.usage.prompt_tokens == chat_tok["count"] and len(chat_tok["token_strs"]) == chat_tok["count"]
    for path, body, param in (("/tokenize", {"prompt": 3}, "prompt"), ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=30).status_code == 404
    version = httpx.get(url + "/version", timeout=30)
    assert version.status_code == 200 and version.json()["version"]
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi"}, timeout=30)
    assert r.status_code == 404 and "not supported" in r.json()["error"]["message"]
