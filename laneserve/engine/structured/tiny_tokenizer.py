"""A small byte-level BPE tokenizer built offline, which can spell any text (JSON included).

The smoke model's word-level tokenizer has no ``{``, ``"``, ``:`` or digits and decodes with
spaces between words, so no constraint can make it write JSON. This tokenizer is the same kind as
Llama 3's and Qwen's (byte-level BPE, GPT-2 byte alphabet, ByteLevel decoder), trained in
milliseconds on a fixed corpus of English words and JSON snippets, with ``<s>``, ``</s>`` and
``<pad>`` as special tokens. ``vocab_size`` is exact, so it fits a model whose logits are that wide
(the smoke model's 1024). Used by the structured-output tests and benchmark.
"""

from __future__ import annotations

import itertools
import json
import random

SPECIAL = ["<s>", "</s>", "<pad>"]
_WORDS = ("the of and to in is that it for on was with as at by be this from or have an are not but had "
          "one all were which their time can there we if more when name age city email tags items id "
          "value type count price true false null weather location unit celsius answer yes no").split()


def training_corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(400):
        words = rng.choices(_WORDS, k=12)
        lines.append(" ".join(words).capitalize() + ".")
        obj = {w: rng.choice([rng.randint(-999, 99999), rng.random() * 100, " ".join(rng.choices(_WORDS, k=3)),
                              rng.choice([True, False, None]), [rng.randint(0, 9) for _ in range(3)]])
               for w in rng.sample(_WORDS, 3)}
        lines.append(json.dumps(obj))
    return lines


def byte_level_tokenizer(vocab_size: int = 1024):
    """A ``transformers.PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens, EOS ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL):
        raise ValueError(f"a byte-level vocabulary needs at least {len(alphabet) + len(SPECIAL)} tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=alphabet,
                                  show_progress=False)
    corpus = training_corpus()
    # the trainer stops early when the corpus has no more pairs; repeat it with more variety until full
    for seed in itertools.count(1):
        tok.train_from_iterator(corpus, trainer)
        if tok.get_vocab_size() >= vocab_size or seed > 8:
            break
        corpus += training_corpus(seed)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
