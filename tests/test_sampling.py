"""Temperature / top-k / top-p processing and per-row seeded sampling (serving/sampling.py)."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from triton_mtp.serving.sampling import SamplingParams, row_generator, sample, target_probs


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of ``counts`` to ``probs`` over the support of ``probs``."""
    support = probs > 0
    observed = counts[support].double()
    expected = probs[support].double() * counts.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(support.sum().item() - 1, dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, statistic / 2).item()


def params(temperature, top_k, top_p) -> SamplingParams:
    return SamplingParams.from_requests(temperature, top_k, top_p)


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference: Hugging Face's warpers, in generation order, for one row [T, V]."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


def test_greedy_rows_are_one_hot_of_argmax_whatever_top_k_top_p():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    probs = target_probs(logits, params([0.0, 0.0], [0, 2], [1.0, 0.1]))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())
    assert torch.equal(sample(probs, [None, row_generator(3)]), logits.argmax(-1))


def test_mixed_rows_match_hugging_face_warpers():
    rows = [(0.7, 0, 1.0), (1.0, 4, 1.0), (1.3, 0, 0.6), (0.5, 5, 0.8), (1.0, 40, 0.999)]
    logits = 3 * torch.randn(len(rows), 4, 16, generator=torch.Generator().manual_seed(1))
    probs = target_probs(logits, params(*zip(*rows)))
    for b, (temperature, top_k, top_p) in enumerate(rows):
        torch.testing.assert_close(probs[b], hf_probs(logits[b], temperature, top_k, top_p))
    assert torch.allclose(probs.sum(-1), torch.ones(len(rows), 4))


def test_top_k_and_top_p_on_a_hand_built_distribution():
    logits = torch.tensor([0.5, 0.3, 0.2, 0.0]).log().expand(4, 1, 4)  # token 3 has probability 0
    probs = target_probs(logits, params([1.0] * 4, [2, 0, 0, 2], [1.0, 0.5, 0.7, 0.55]))
    torch.testing.assert_close(probs[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # top-2
    torch.testing.assert_close(probs[1, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))  # 0.5 reached by token 0
    torch.testing.assert_close(probs[2, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.8 >= 0.7
    torch.testing.assert_close(probs[3, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))  # top-2 first: 0.625 >= 0.55


def test_tiny_top_p_keeps_the_top_token():
    logits = torch.randn(1, 5, 9, generator=torch.Generator().manual_seed(2))
    probs = target_probs(logits, params([1.0], [0], [1e-6]))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 9).float())


def test_bad_request_knobs_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        params([-0.5], [0], [1.0])
    with pytest.raises(ValueError, match="top_k"):
        params([1.0], [-1], [1.0])
    with pytest.raises(ValueError, match="top_p"):
        params([1.0], [0], [0.0])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(3))


def test_same_seed_same_tokens_other_seed_other_tokens():
    probs = torch.full((1, 64, 50), 1 / 50)
    first = sample(probs, [row_generator(7)])
    assert torch.equal(first, sample(probs, [row_generator(7)]))
    assert not torch.equal(first, sample(probs, [row_generator(8)]))


def test_a_row_samples_the_same_alone_or_batched():
    probs = torch.rand(4, 6, 30, generator=torch.Generator().manual_seed(3)).softmax(-1)
    alone = sample(probs[2:3], [row_generator(11)])
    batched = sample(probs, [row_generator(5), None, row_generator(11), row_generator(12)])
    assert torch.equal(batched[2:3], alone)


def test_sampled_frequencies_match_probs_and_skip_zero_probability_tokens():
    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.5])
    tokens = sample(probs.expand(1, 20_000, 6), [row_generator(0)])
    counts = torch.bincount(tokens.flatten(), minlength=6)
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts, probs) > 1e-3
