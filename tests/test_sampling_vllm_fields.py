"""vLLM's ``min_p``, ``allowed_token_ids`` and ``bad_words`` in the sampler: ``min_p`` drops,
after temperature, tokens less likely than ``min_p`` times the likeliest one (0 is off);
``allowed_token_ids`` masks every other token; a bad word's last token is masked where the output
ends with the rest of it. Out-of-range values are refused at construction and on the wire."""

from __future__ import annotations

import math

import pytest
import torch

from laneserve.cluster.messages import sampling_from_dict, sampling_to_dict
from laneserve.core.sampling import SamplingParams
from laneserve.engine.sampler import Sampler, TokenHistory


def _seen(logits: torch.Tensor, outputs=(), **params) -> set[int]:
    sampler = Sampler(0)
    seen = set()
    for i in range(300):
        p = SamplingParams(seed=i, **params)
        h = TokenHistory(None, p, [1], logits.shape[-1], logits.device, [4]) if p.shapes_logits else None
        if h is not None:
            h.extend(list(outputs))
        seen.add(sampler.sample(logits, [p], [len(outputs)], [h])[0][0])
    return seen


def test_min_p_keeps_tokens_within_its_share_of_the_likeliest():
    # probabilities relative to the top token: 1, e^-0.5 (0.61), e^-1 (0.37), e^-2, e^-3
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0]])
    assert _seen(logits, temperature=1.0, min_p=0.0) == {0, 1, 2, 3, 4}
    assert _seen(logits, temperature=1.0, min_p=0.5) == {0, 1}
    assert _seen(logits, temperature=1.0, min_p=0.3) == {0, 1, 2}
    assert _seen(logits, temperature=2.0, min_p=0.5) == {0, 1, 2}       # after temperature: e^-0.5 > 0.5
    assert _seen(logits, temperature=1.0, min_p=1.0) == {0}
    assert math.exp(-1) < 0.5 < math.exp(-0.25)


def test_allowed_token_ids_and_bad_words_mask_tokens():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0]])
    assert _seen(logits, temperature=1.0, allowed_token_ids=(2, 4)) == {2, 4}
    assert _seen(logits, temperature=0.0, allowed_token_ids=(3, 4)) == {3}            # greedy within them
    assert _seen(logits, temperature=0.0, bad_words_ids=((0,),)) == {1}               # a one-token word
    # a two-token word (3, 0): token 0 is banned only right after a 3
    assert _seen(logits, temperature=0.0, bad_words_ids=((3, 0),), outputs=[2, 3]) == {1}
    assert _seen(logits, temperature=0.0, bad_words_ids=((3, 0),), outputs=[3, 2]) == {0}
    assert _seen(logits, temperature=0.0, bad_words_ids=((2, 3, 0),), outputs=[2, 3]) == {1}
    assert _seen(logits, temperature=0.0, bad_words_ids=((2, 3, 0),), outputs=[3]) == {0}


def test_the_fields_are_checked_and_cross_the_wire():
    for bad in ({"min_p": -0.1}, {"min_p": 1.5}, {"min_p": float("nan")}, {"allowed_token_ids": [1]},
                {"allowed_token_ids": (-1,)}, {"bad_words_ids": ((),)}, {"bad_words_ids": ((1, -2),)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    p = SamplingParams(temperature=0.7, min_p=0.25, allowed_token_ids=(1, 5), bad_words_ids=((3,), (4, 5)))
    assert sampling_from_dict(sampling_to_dict(p)) == p


def test_bad_words_become_token_sequences_as_vllm_spells_them():
    from laneserve.engine.structured.tiny_tokenizer import byte_level_tokenizer
    from laneserve.server.protocol import BadRequest, _bad_words
    tok = byte_level_tokenizer(1024)
    enc = lambda s: tuple(tok.encode(s, add_special_tokens=False))  # noqa: E731
    seqs = _bad_words(["  weather", "the"], tok, 1024)
    assert enc("weather") in seqs and enc("the") in seqs           # leading spaces dropped
    for word in ("weather", "the"):                                # the spaced spelling where vLLM adds it
        plain, spaced = enc(word), enc(" " + word)
        assert (spaced in seqs) == (spaced[:1] != plain[:1] and len(spaced) == len(plain))
    assert _bad_words(None, None, 1024) == ()
    with pytest.raises(BadRequest, match="needs a tokenizer"):
        _bad_words(["x"], None, 1024)
