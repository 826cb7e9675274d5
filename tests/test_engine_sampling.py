"""Sampling behaviour: seeded determinism (independent of batching), top-k=1 and tiny top-p equal
greedy, temperature changes outcomes, stop token ids and EOS, StopChecker for stop strings; and the
hostile cases of issue 11 (non-finite parameters refused at construction, extreme seeds, tiny
temperatures, unsampleable logits rows failing alone)."""

from __future__ import annotations

import pytest
import torch

from engine_support import Driver, make_executor, make_request, prompts
from laneserve.core.sampling import SamplingParams
from laneserve.engine.sampler import PLACEHOLDER_TOKEN, Sampler, StopChecker, UnsampleableRows, token_stops

FAMILY = "qwen2"
N = 10


def _run(reqs, batch=True):
    return Driver(make_executor(FAMILY)).run(reqs, decode_batch=batch)


def test_seeded_sampling_is_deterministic_and_batch_independent():
    p, q = prompts([9, 14], seed=2)
    alone = _run([make_request(0, p, N, temperature=1.0, seed=42)])[0]
    again = _run([make_request(0, p, N, temperature=1.0, seed=42)])[0]
    batched = _run([make_request(3, q, N, temperature=0.8, seed=1), make_request(0, p, N, temperature=1.0, seed=42)])[1]
    assert alone == again == batched
    others = [_run([make_request(0, p, N, temperature=1.0, seed=s)])[0] for s in (7, 8, 9)]
    assert any(o != alone for o in others)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    p = prompts([12], seed=5)[0]
    greedy = _run([make_request(0, p, N)])[0]
    assert _run([make_request(0, p, N, temperature=1.5, top_k=1)])[0] == greedy
    assert _run([make_request(0, p, N, temperature=1.0, top_p=1e-6, seed=3)])[0] == greedy


def test_sampler_truncation_respects_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    sampler = Sampler(0)
    seen_k, seen_p = set(), set()
    for i in range(200):
        tok, _ = sampler.sample(logits, [SamplingParams(temperature=2.0, top_k=2, seed=i)], [0])
        seen_k.add(tok[0])
        tok, _ = sampler.sample(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=i)], [0])
        seen_p.add(tok[0])
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}       # p(0) ~ 0.64 < 0.7, so token 1 completes the nucleus


def test_stop_token_ids_and_eos():
    p = prompts([8], seed=9)[0]
    greedy = _run([make_request(0, p, N)])[0]
    stop_tok = greedy[3]
    ex = make_executor(FAMILY)
    driver = Driver(ex)
    req = make_request(0, p, N, stop_token_ids=(stop_tok,))
    hits = []
    while stop_tok not in (req.output_token_ids or []):   # a scheduler would finish it on stop_hit
        _plan, result = driver.step([(req, req.prompt_len)] if not req.prefill_done else [], [req] if req.prefill_done else [])
        hits.append(0 in result.stop_hit)
    assert hits[-1] and not any(hits[:-1]) and req.output_token_ids == greedy[:greedy.index(stop_tok) + 1]
    eos = {stop_tok}
    assert token_stops(stop_tok, SamplingParams(), eos)
    assert not token_stops(stop_tok, SamplingParams(ignore_eos=True), eos)
    ex.eos_token_ids = frozenset(eos)
    req2 = make_request(1, p, N, ignore_eos=False)
    driver.step([(req2, req2.prompt_len)], [])
    results = [driver.step([], [req2])[1] for _ in range(3)]
    assert 1 in results[-1].stop_hit and not any(1 in r.stop_hit for r in results[:-1])


def test_stop_checker_finds_new_stop_strings():
    class WordTokenizer:
        words = ["alpha", "beta", "gamma", "END", "delta"]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(self.words[i] for i in ids)

    checker = StopChecker(WordTokenizer())
    params = SamplingParams(stop=("gamma END",))
    out: list[int] = []
    positions = []
    for tok in [0, 1, 2, 3, 4]:
        out.append(tok)
        positions.append(checker.check(out, params))
    assert positions[:3] == [None, None, None]
    assert positions[3] == len("alpha beta ")
    assert checker.check([0], SamplingParams()) is None


# ---- hostile parameters and logits (issue 11): the sampler fails a row, never the process ----------
def test_sampling_params_reject_non_finite_and_out_of_range_values():
    for bad in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
                dict(top_p=float("inf")), dict(max_tokens=True), dict(seed=2 ** 63), dict(seed=-(2 ** 63) - 1),
                dict(top_k=2 ** 63), dict(stop_token_ids=(-1,)), dict(stop_token_ids=[1]), dict(stop=("",)),
                dict(logprobs=21), dict(ignore_eos=None)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(temperature=9e-6).greedy and not SamplingParams(temperature=1e-5).greedy


def test_extreme_seeds_sample_deterministically():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    for seed in (19_000_000_000_000, 2 ** 63 - 1, -(2 ** 63), -1, 0):
        p = SamplingParams(temperature=1.0, seed=seed)
        draws = [Sampler(0).sample(logits, [p], [i])[0][0] for i in range(20)]
        assert draws == [Sampler(5).sample(logits, [p], [i])[0][0] for i in range(20)]   # seed, not engine state
        assert len(set(draws)) > 1                     # the output index still varies the draw


def test_tiny_temperature_and_huge_logits_do_not_overflow():
    logits = torch.tensor([[3e38, 1e38, -3e38, 0.0], [1.0, 1.0 + 1e-3, 0.5, 0.0]])
    p = SamplingParams(temperature=1e-5, seed=1)
    for _ in range(20):
        tokens, _ = Sampler(0).sample(logits, [p, p], [0, 0])
        assert tokens == [0, 1]                        # probability ~1 on the largest logit
    tokens, lps = Sampler(0).sample(logits[:, :3], [SamplingParams(temperature=1.0, logprobs=20)] * 2, [0, 0])
    assert [len(lp.top) for lp in lps] == [3, 3]       # logprobs capped at the vocabulary


def test_unsampleable_rows_fail_alone():
    good = torch.randn(64, generator=torch.Generator().manual_seed(2))
    nan, pos_inf, all_neg_inf = good.clone(), good.clone(), torch.full((64,), float("-inf"))
    nan[7] = float("nan")
    pos_inf[3] = float("inf")
    masked = good.clone()
    masked[:10] = float("-inf")                        # -inf entries alone are fine
    logits = torch.stack([good, nan, masked, pos_inf, all_neg_inf, good])
    params = [SamplingParams(temperature=0.8, seed=4, logprobs=2), SamplingParams(temperature=0.8, seed=4),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, logprobs=1)]
    with pytest.raises(UnsampleableRows) as e:
        Sampler(0).sample(logits, params, [0] * 6)
    err = e.value
    assert err.rows == {1: "logits contain NaN", 3: "logits contain +inf", 4: "no finite logit"}
    alone, alone_lp = Sampler(0).sample(logits[[0, 2, 5]], [params[0], params[2], params[5]], [0, 0, 0])
    assert [err.tokens[r] for r in (0, 2, 5)] == alone and err.tokens[2] >= 10
    assert all(err.tokens[r] == PLACEHOLDER_TOKEN and err.logprobs[r] is None for r in err.rows)
    assert err.logprobs[0].top == alone_lp[0].top and err.logprobs[5].top == alone_lp[2].top
