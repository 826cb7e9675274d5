"""Sampling behaviour: seeded determinism (independent of batching), top-k=1 and tiny top-p equal
greedy, temperature changes outcomes, stop token ids and EOS, StopChecker for stop strings; and the
hostile cases (non-finite parameters refused at construction, extreme seeds, tiny
temperatures, unsampleable logits rows failing alone)."""

from __future__ import annotations

import pytest
import torch

from engine_support import Driver, OutputPenalty, make_executor, make_request, prompts
from laneserve.core.sampling import SamplingParams
from laneserve.engine.sampler import PLACEHOLDER_TOKEN, Sampler, StopChecker, UnsampleableRows, token_stops

FAMILY = "qwen2"
VOCAB_EOS = 511            # the tiny checkpoints' eos_token_id (VOCAB - 1)
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


# ---- hostile parameters and logits: the sampler fails a row, never the process ----------
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

# ---- logit shaping: penalties, logit_bias, min_tokens against transformers -----------------------
def _hf_greedy_processed(prompt: list[int], n: int, processors: list) -> list[int]:
    """transformers' greedy ``generate`` with extra logits processors, EOS ignored."""
    from transformers import LogitsProcessorList

    from engine_support import hf_model
    with torch.no_grad():
        out = hf_model(FAMILY).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                        do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                                        pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


M = 16
# a prompt that repeats itself, so that prompt tokens are likely continuations
REPEATING = prompts([6], seed=11)[0] * 3


def test_repetition_penalty_matches_hf_processor():
    from transformers import RepetitionPenaltyLogitsProcessor
    plain = _run([make_request(0, REPEATING, M)])[0]
    changed = False
    for penalty in (1.8, 0.5):
        ours = _run([make_request(0, REPEATING, M, repetition_penalty=penalty)])[0]
        assert ours == _hf_greedy_processed(REPEATING, M, [RepetitionPenaltyLogitsProcessor(penalty)]), penalty
        changed |= ours != plain
    assert changed, "the penalty never changed the greedy output: the test cannot tell"


def test_presence_and_frequency_penalties_match_the_formula():
    plain = _run([make_request(0, REPEATING, M)])[0]
    changed = False
    for presence, frequency in ((2.0, 0.0), (0.0, 1.5), (-1.0, 0.7)):
        ours = _run([make_request(0, REPEATING, M, presence_penalty=presence, frequency_penalty=frequency)])[0]
        ref = _hf_greedy_processed(REPEATING, M, [OutputPenalty(len(REPEATING), presence, frequency)])
        assert ours == ref, (presence, frequency)
        changed |= ours != plain
    assert changed


def test_logit_bias_matches_hf_sequence_bias():
    from transformers import SequenceBiasLogitsProcessor
    p = prompts([10], seed=12)[0]
    plain = _run([make_request(0, p, M)])[0]
    forced = 77
    assert _run([make_request(0, p, M, logit_bias=((forced, 100.0),))])[0] == [forced] * M
    bias = tuple({5: 2.0, plain[1]: 3.5, plain[0]: -100.0}.items())
    ours = _run([make_request(0, p, M, logit_bias=bias)])[0]
    assert ours[0] != plain[0] and plain[0] not in ours
    ref = _hf_greedy_processed(p, M, [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])])
    assert ours == ref


def test_min_tokens_masks_eos_and_stop_ids_like_hf():
    from transformers import MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor
    p = prompts([9], seed=13)[0]
    ex = make_executor(FAMILY)
    eos, stop = VOCAB_EOS, 40
    assert eos in ex.eos_token_ids
    req = make_request(0, p, 8, ignore_eos=False, stop_token_ids=(stop,), min_tokens=5,
                       logit_bias=((eos, 60.0), (stop, 50.0)))
    driver = Driver(ex)
    stopped_at = None
    driver.step([(req, req.prompt_len)], [])
    while req.num_output_tokens < 8:
        _, result = driver.step([], [req])
        if 0 in result.stop_hit and stopped_at is None:
            stopped_at = req.num_output_tokens
    out = req.output_token_ids
    assert eos not in out[:5] and stop not in out[:5] and out[5] == eos and stopped_at == 6
    ref = _hf_greedy_processed(p, 8, [SequenceBiasLogitsProcessor([[[eos], 60.0], [[stop], 50.0]]),
                                      MinNewTokensLengthLogitsProcessor(len(p), 5, [eos, stop])])
    assert out == ref


def test_shaped_rows_are_batch_independent_and_histories_are_freed():
    a, b, c = REPEATING, prompts([13], seed=14)[0], prompts([7], seed=15)[0]
    specs = [dict(repetition_penalty=1.8), dict(), dict(presence_penalty=1.0, frequency_penalty=0.5,
                                                         logit_bias=((9, 4.0),))]
    alone = [_run([make_request(0, pr, M, **kw)])[0] for pr, kw in zip((a, b, c), specs)]
    ex = make_executor(FAMILY)
    reqs = [make_request(i, pr, M, **kw) for i, (pr, kw) in enumerate(zip((a, b, c), specs))]
    # chunked prefill: the history starts when the last chunk samples the first token
    assert Driver(ex).run(reqs, chunk_size=5) == alone
    assert ex.num_token_histories == 2
    for r in reqs:                             # the requests end: their KV is freed
        ex.kv.free(r.request_id)
    late = make_request(7, b, 2, repetition_penalty=1.2)
    Driver(ex).run([late])
    assert ex.num_token_histories == 1         # only the live request's history is left


def test_history_is_rebuilt_for_a_request_that_arrives_with_outputs():
    """A decode instance receives a prefilled request (prompt + first token) and samples its next
    tokens: the history it builds then counts the first token too (PD disaggregation)."""
    kw = dict(repetition_penalty=1.8, presence_penalty=0.5)
    whole = _run([make_request(0, REPEATING, M, **kw)])[0]
    pre = make_request(0, REPEATING, M, **kw)
    Driver(make_executor(FAMILY)).step([(pre, pre.prompt_len)], [])
    dec = make_request(0, REPEATING, M, **kw)           # a new Request object on a new executor
    dec.output_token_ids, dec.num_output_tokens = list(pre.output_token_ids), 1
    ex = make_executor(FAMILY)
    Driver(ex).step([(dec, dec.prompt_len)], [])        # recompute the prompt's KV, no sampling
    dec.num_computed_tokens = dec.prompt_len
    Driver(ex).run([dec])
    assert dec.output_token_ids == whole


def test_stop_strings_wait_for_min_tokens():
    class WordTokenizer:
        words = ["alpha", "END", "beta", "gamma"]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(self.words[i] for i in ids)

    checker = StopChecker(WordTokenizer())
    out = [0, 1, 2, 1, 3]                     # alpha END beta END gamma
    plain = SamplingParams(stop=("END",))
    late = SamplingParams(stop=("END",), min_tokens=3)
    assert checker.check(out[:2], plain) == len("alpha ")
    assert [checker.check(out[:n], late) for n in (2, 3)] == [None, None]
    assert checker.check(out[:4], late) == len("alpha END beta ")   # the first END came too early
