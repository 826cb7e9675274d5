"""A deterministic tiny *smoke* checkpoint for demos and end-to-end tests without downloads.

``smoke_model_path()`` builds (once, with a fixed seed) a 2-layer random-weight Llama checkpoint
with an offline byte-level BPE tokenizer (``laneserve.engine.structured.tiny_tokenizer``: it can
spell any text, so structured output can constrain it to JSON) and a simple chat template, in
``$LANESERVE_CACHE/v<SMOKE_VERSION>/smoke-llama`` (default ``~/.cache/laneserve/...``; one folder
per version, so checkouts of different versions sharing a cache never rebuild each other's), and
returns the folder. Its weights are random:
**the text it generates is noise**. The folder holds a README saying so and a
``laneserve_smoke.json`` marker (``{"smoke": true}``) that servers and CLIs can detect with
:func:`is_smoke_model` and print.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

SMOKE_VERSION = 2                  # 2: byte-level BPE tokenizer (was word-level)
MARKER = "laneserve_smoke.json"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
README = """# laneserve smoke model — NOT A REAL MODEL

A tiny (2-layer) Llama-architecture checkpoint with **random weights**, generated deterministically
by `laneserve.engine.smoke.smoke_model_path()` for demos and tests that must run offline.
Everything it generates is noise. Use a real checkpoint for meaningful text.
"""


def default_cache_dir() -> Path:
    root = os.environ.get("LANESERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "laneserve"


def is_smoke_model(path: str | Path) -> bool:
    marker = Path(path) / MARKER
    return marker.is_file() and bool(json.loads(marker.read_text()).get("smoke"))


def smoke_model_path(cache_dir: str | Path | None = None, vocab_size: int = 1024) -> Path:
    """The smoke checkpoint's folder, building it on first use."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = folder / f"v{SMOKE_VERSION}" / "smoke-llama"     # the folder name is the served model name
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
    from transformers import AutoModelForCausalLM, LlamaConfig

    from laneserve.engine.structured.tiny_tokenizer import byte_level_tokenizer

    fast = byte_level_tokenizer(vocab_size)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))

    ids = {t: fast.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>")}
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                      rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(20240601)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(folder))
    (folder / "README.md").write_text(README)
    (folder / MARKER).write_text(json.dumps({"smoke": True, "version": SMOKE_VERSION,
                                             "note": "random weights: generated text is noise"}, indent=1))
