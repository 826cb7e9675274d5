"""A deterministic tiny *smoke* checkpoint for demos and end-to-end tests without downloads.

``smoke_model_path()`` builds (once, with a fixed seed) a 2-layer random-weight Llama checkpoint
with an offline word-level tokenizer and a simple chat template, in ``$LANESERVE_CACHE/smoke-llama``
(default ``~/.cache/laneserve/smoke-llama``), and returns the folder. Its weights are random:
**the text it generates is noise**. The folder holds a README saying so and a
``laneserve_smoke.json`` marker (``{"smoke": true}``) that servers and CLIs can detect with
:func:`is_smoke_model` and print.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOKE_VERSION = 1
MARKER = "laneserve_smoke.json"
_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
_WORDS = (
    "the of and to in is that it for on was with as at by be this from or have an are not but had "
    "one all were which their time can there we if more when some so would what out up about into "
    "than other then them these its two may only new first any like could people see our over "
    "after also most way many well where much just through back good very year use make how work "
    "long day life even know take part place system number world same small large great old own "
    "serve token prompt decode prefill cache block lane queue batch request slack deadline model "
    "i you me my your he she they we us hello hi yes no please thanks question answer short long fast slow next last left right . , ? !"
).split()
_SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "vo", "pe", "zu", "ha", "do"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
README = """# laneserve smoke model — NOT A REAL MODEL

A tiny (2-layer) Llama-architecture checkpoint with **random weights**, generated deterministically
by `laneserve.engine.smoke.smoke_model_path()` for demos and tests that must run offline.
Everything it generates is noise. Use a real checkpoint for meaningful text.
"""


def _vocabulary(size: int) -> list[str]:
    words = list(dict.fromkeys(_SPECIAL + _WORDS))
    for a, b, c in itertools.product(_SYLLABLES, repeat=3):
        if len(words) >= size:
            break
        words.append(a + b + c)
    return words[:size]


def default_cache_dir() -> Path:
    root = os.environ.get("LANESERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "laneserve"


def is_smoke_model(path: str | Path) -> bool:
    marker = Path(path) / MARKER
    return marker.is_file() and bool(json.loads(marker.read_text()).get("smoke"))


def smoke_model_path(cache_dir: str | Path | None = None, vocab_size: int = 1024) -> Path:
    """The smoke checkpoint's folder, building it on first use."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = folder / "smoke-llama"
    marker = folder / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("version") == SMOKE_VERSION:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smoke-llama-", dir=folder.parent))
    try:
        _build(staging, vocab_size)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _build(folder: Path, vocab_size: int) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = _vocabulary(vocab_size)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(_SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))

    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=vocab.index("<s>"), eos_token_id=vocab.index("</s>"),
                      pad_token_id=vocab.index("<pad>"), rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(20240601)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(folder))
    (folder / "README.md").write_text(README)
    (folder / MARKER).write_text(json.dumps({"smoke": True, "version": SMOKE_VERSION,
                                             "note": "random weights: generated text is noise"}, indent=1))
