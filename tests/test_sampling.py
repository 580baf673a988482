"""The sampler's logits processors on made-up logits: OpenAI's penalties and logit_bias, the grammar
mask, and log-probabilities (the model's own, before any processor)."""

from __future__ import annotations

import math

import torch

from engine_api.sampling import SamplingParams
from local_runner.sampling import Sampler


def test_frequency_and_presence_penalties_push_a_repeated_token_down():
    logits = torch.tensor([3.0, 2.5, 0.0])
    plain = Sampler(SamplingParams(temperature=0))
    assert [plain(logits) for _ in range(3)] == [0, 0, 0]
    frequency = Sampler(SamplingParams(temperature=0, frequency_penalty=1.0))
    assert [frequency(logits) for _ in range(3)] == [0, 1, 0]  # 3-1 < 2.5, then 2.5-1 < 3-1
    presence = Sampler(SamplingParams(temperature=0, presence_penalty=2.0))
    assert [presence(logits) for _ in range(3)] == [0, 1, 0]  # once seen, each is 2 lower: 1 vs 0.5


def test_logit_bias_and_logprobs_of_the_raw_logits():
    logits = torch.tensor([3.0, 1.0, 0.0])
    sampler = Sampler(SamplingParams(temperature=0, logit_bias={2: 10.0}, logprobs=2))
    assert sampler(logits) == 2
    last = sampler.last
    assert last is not None and last.token == 2
    expected = logits - torch.logsumexp(logits, 0)
    assert math.isclose(last.logprob, float(expected[2]), rel_tol=1e-6)
    assert [t for t, _ in last.top] == [0, 1]  # the model's own ranking, not the biased one


def test_a_temperature_too_close_to_zero_to_divide_by_is_its_limit_greedy():
    """A positive temperature so small that the logits divided by it overflow (the fuzz test's
    6.3e-278) picks the most likely token, as temperature 0 does, instead of failing the turn."""
    logits = torch.tensor([1.0, 3.0, -2.0, float("-inf")])
    for temperature in (6.305736898098505e-278, 1e-300):
        assert Sampler(SamplingParams(temperature=temperature, seed=1))(logits) == 1
    negative = torch.tensor([-5.0, -1.0, -3.0])
    assert Sampler(SamplingParams(temperature=1e-300, seed=1))(negative) == 1


def test_top_k_samples_only_among_the_k_likeliest_tokens():
    logits = torch.tensor([2.0, 1.9, 1.8, 1.7, 0.0])
    chosen = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s))(logits) for s in range(40)}
    assert chosen == {0, 1}
    everything = {Sampler(SamplingParams(temperature=1.0, seed=s))(logits) for s in range(40)}
    assert len(everything) > 2  # without top_k the others are drawn too


def test_the_greedy_choice_is_argmax_s_first_of_ties_in_every_dtype():
    """first_max replaced argmax for speed (16-bit rows on a CPU): the same index, the first of equal
    maxima, a NaN where argmax takes it, rows of a step and a lone row alike."""
    from local_runner.sampling import StepLogits, first_max

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows = torch.randn(32, 4096).to(dtype)
        rows[3, 100] = rows[3, 2000] = rows[3].max() + 1  # a tie: the first wins
        rows[5, 7] = float("nan")
        assert torch.equal(first_max(rows), rows.argmax(dim=-1)), dtype
        assert int(first_max(rows[3])) == 100 and int(first_max(rows[5])) == 7
        step = StepLogits(rows)
        assert [step.greedy(i) for i in range(32)] == rows.argmax(dim=-1).tolist()
        assert step.greedy_logprob(3, 2).token == 100
