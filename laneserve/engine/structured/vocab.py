"""The bytes each token id stands for, as the grammar engine needs them.

llguidance matches grammars over *bytes*, so every token id must map to the exact bytes it adds
to the decoded text. Hugging Face tokenizers store tokens in one of three spellings, told apart
by the tokenizer's decoder:

- byte-level BPE (GPT-2, Llama 3, Qwen): each byte is written as one printable character of the
  GPT-2 ``bytes_to_unicode`` table; the table is inverted here;
- SentencePiece style (Llama 2, Mistral): ``▁`` stands for a space and ``<0xNN>`` for a raw byte;
- plain (a decoder that concatenates tokens, or none on a char-level vocabulary): the token's UTF-8.

Special tokens (BOS, EOS, chat markers) are never text: EOS is allowed exactly when the constraint
accepts, the others never. :func:`token_vocabulary` checks the result against the tokenizer's own
``decode`` and refuses a tokenizer whose decoded text is not the concatenation of its tokens (a
word-level vocabulary whose decode joins words with spaces, like the smoke model's): a constraint
on such a tokenizer would be enforced on a text the client never sees.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

_SPIECE_SPACE = "\u2581"
_CHECK_TOKENS = 64


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character table: printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100 upwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_DECODER = _gpt2_byte_decoder()


@dataclass(slots=True, eq=False)
class TokenVocabulary:
    """``token_bytes[i]``: the bytes token ``i`` adds to the text, or ``None`` for a token that is
    never generated as text (special tokens, EOS included). Every EOS id is allowed exactly when
    the constraint accepts. ``encode``: text bytes -> token ids (the tokenizer's own; the grammar
    engine tokenizes the literal text it forces); without one, greedy longest match."""

    token_bytes: list[bytes | None]
    eos_token_ids: tuple[int, ...]
    fingerprint: str = ""
    encode: Callable[[bytes], list[int]] | None = field(default=None, repr=False)
    _llg: Any = field(default=None, repr=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("a constrained vocabulary needs at least one EOS token id")
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr(self.eos_token_ids).encode())
        for tok in self.token_bytes:
            digest.update(b"\xff" if tok is None else len(tok).to_bytes(4, "little") + tok)
        self.fingerprint = digest.hexdigest()

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def llg_tokenizer(self):
        """The ``llguidance.LLTokenizer`` over these bytes (built once, milliseconds)."""
        with self._lock:
            if self._llg is None:
                from llguidance import LLTokenizer, TokenizerWrapper

                self._llg = LLTokenizer(TokenizerWrapper(_Wrapped(self)), eos_token=list(self.eos_token_ids))
            return self._llg


class _Wrapped:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, EOS, special ids, and a tokenizer."""

    def __init__(self, vocab: TokenVocabulary) -> None:
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = None
        self.tokens = [b if b is not None else b"" for b in vocab.token_bytes]
        self.special_token_ids = [i for i, b in enumerate(vocab.token_bytes) if b is None]
        self._encode = vocab.encode or _greedy(vocab.token_bytes)

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text if isinstance(text, bytes) else str(text).encode())


def _greedy(token_bytes: list[bytes | None]) -> Callable[[bytes], list[int]]:
    ids: dict[bytes, int] = {}
    for tid, tok in enumerate(token_bytes):
        if tok:
            ids.setdefault(tok, tid)
    longest = max((len(t) for t in ids), default=1)

    def encode(text: bytes) -> list[int]:
        out, pos = [], 0
        while pos < len(text):
            for size in range(min(longest, len(text) - pos), 0, -1):
                tid = ids.get(text[pos:pos + size])
                if tid is not None:
                    out.append(tid)
                    pos += size
                    break
            else:
                raise ValueError(f"byte {text[pos]!r} has no token")
        return out
    return encode


_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], TokenVocabulary]] = weakref.WeakKeyDictionary()


def token_vocabulary(tokenizer: Any, extra_eos_ids: Iterable[int] = ()) -> TokenVocabulary:
    """The :class:`TokenVocabulary` of a Hugging Face fast tokenizer (cached per tokenizer object).
    ``extra_eos_ids``: further ids that end generation (a ``generation_config`` EOS list)."""
    extra = tuple(sorted(set(extra_eos_ids)))
    per_tok = _BY_TOKENIZER.setdefault(tokenizer, {})
    if extra not in per_tok:
        per_tok[extra] = _from_tokenizer(tokenizer, extra)
    return per_tok[extra]


def _from_tokenizer(tokenizer: Any, extra_eos: tuple[int, ...]) -> TokenVocabulary:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    eos += [t for t in extra_eos if t not in eos]
    special = set(tokenizer.all_special_ids) | set(eos)
    special |= {tid for tid, added in tokenizer.added_tokens_decoder.items() if added.special}
    added = {tid for tid in tokenizer.added_tokens_decoder}
    spelling = _spelling(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    token_bytes: list[bytes | None] = []
    for tid, tok in enumerate(tokens):
        if tid in special or tok is None:
            token_bytes.append(None)
        elif tid in added:          # added (non-special) tokens decode to their content verbatim
            token_bytes.append(tok.encode())
        else:
            token_bytes.append(_token_bytes(tok, spelling))
    vocab = TokenVocabulary(token_bytes, tuple(eos), encode=_hf_encoder(tokenizer, token_bytes))
    _check_concatenation(tokenizer, vocab)
    return vocab


def _hf_encoder(tokenizer: Any, token_bytes: list[bytes | None]) -> Callable[[bytes], list[int]]:
    """The tokenizer's own encoding where its tokens spell exactly the text, else greedy longest
    match (a SentencePiece tokenizer prefixes a space, which the grammar engine must not see)."""
    ref = weakref.ref(tokenizer)        # the vocabulary is cached per tokenizer: no cycle back to it
    greedy = _greedy(token_bytes)

    def encode(text: bytes) -> list[int]:
        tok = ref()
        if tok is not None:
            ids = tok.encode(text.decode("utf-8", "replace"), add_special_tokens=False)
            if all(0 <= i < len(token_bytes) and token_bytes[i] is not None for i in ids) \
                    and b"".join(token_bytes[i] for i in ids) == text:
                return ids
        return greedy(text)
    return encode


def _spelling(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast (tokenizers-backed) tokenizer")
    decoder = json.loads(backend.to_str()).get("decoder")
    kinds: set[str] = set()
    stack = [decoder]
    while stack:
        d = stack.pop()
        if d:
            kinds.add(d.get("type", ""))
            stack.extend(d.get("decoders") or [])
            if d.get("type") == "Replace" and _SPIECE_SPACE in json.dumps(d.get("pattern")):
                kinds.add("Metaspace")
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"Metaspace", "ByteFallback"}:
        return "sentencepiece"
    return "plain"


def _token_bytes(tok: str, spelling: str) -> bytes:
    if spelling == "byte_level":
        try:
            return bytes(_BYTE_DECODER[ch] for ch in tok)
        except KeyError:
            return tok.encode()
    if spelling == "sentencepiece":
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            return bytes([int(tok[3:5], 16)])
        return tok.replace(_SPIECE_SPACE, " ").encode()
    return tok.encode()


def _check_concatenation(tokenizer: Any, vocab: TokenVocabulary) -> None:
    """Decoding a run of tokens must give the concatenation of their bytes (after a leading token,
    so a SentencePiece decoder's strip of the first space does not count)."""
    texts = [(tid, b.decode()) for tid, b in enumerate(vocab.token_bytes) if b and _utf8(b)]
    if len(texts) < 2:
        raise ValueError("the tokenizer has fewer than two text tokens")
    lead = next((tid for tid, t in texts if t.isalnum()), texts[0][0])
    step = max(1, len(texts) // _CHECK_TOKENS)
    sample = [tid for tid, _ in texts[::step]][:_CHECK_TOKENS]
    expected = vocab.token_bytes[lead].decode() + "".join(vocab.token_bytes[t].decode() for t in sample)
    got = tokenizer.decode([lead, *sample], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if got != expected:
        raise ValueError("this tokenizer's decode is not the concatenation of its tokens (e.g. a word-level "
                         f"vocabulary joined with spaces): expected {expected[:60]!r}, decoded {got[:60]!r}")


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True

