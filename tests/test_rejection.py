"""Verification of draft tokens (serving/rejection.py): hand-built cases and distribution tests."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_sampling import chi_square_p_value, hf_probs

from triton_mtp.serving.rejection import PAD_ID, verify, verify_greedy
from triton_mtp.serving.sampling import SamplingParams, row_generator, sample, target_probs

V = 10  # vocabulary of the distribution tests
K = 2  # draft slots of the distribution tests


def one_hot(ids: list[int], vocab: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(ids), vocab).float()


def random_probs(*shape: int, seed: int) -> torch.Tensor:
    return F.softmax(2 * torch.rand(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def verify_rows(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor):
    """Verify N independent sampled rows sharing p [K+1, V] and q [K, V]; drafts [N, K]; default generator."""
    n, k = drafts.shape
    torch.manual_seed(1234)
    return verify(
        p.expand(n, k + 1, p.shape[-1]),
        drafts,
        None if q is None else q.expand(n, k, q.shape[-1]),
        torch.full((n,), k),
        torch.zeros(n, dtype=torch.bool),
        [None] * n,
    )


def drafts_from(q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """[n, K] drafts sampled from q [K, V], independently per row."""
    return torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(seed)).T


def test_greedy_perfect_match_emits_every_draft_and_the_bonus():
    p = one_hot([2, 4, 1, 5], 6).unsqueeze(0)  # target argmax at slots 0..3
    drafts = torch.tensor([[2, 4, 1]])
    num_accepted, output_ids = verify(p, drafts, None, torch.tensor([3]), torch.tensor([True]), [None])
    assert num_accepted.tolist() == [3]
    assert output_ids.tolist() == [[2, 4, 1, 5]]


def test_greedy_early_mismatch_emits_the_target_token_there():
    p = one_hot([2, 4, 1, 5], 6).expand(2, 4, 6)
    drafts = torch.tensor([[2, 0, 1], [3, 4, 1]])  # mismatch at slot 1, at slot 0
    num_accepted, output_ids = verify(p, drafts, None, torch.tensor([3, 3]), torch.tensor([True, True]), [None] * 2)
    assert num_accepted.tolist() == [1, 0]
    assert output_ids.tolist() == [[2, 4, PAD_ID, PAD_ID], [2, PAD_ID, PAD_ID, PAD_ID]]


def test_greedy_fast_path_equals_verify_with_every_row_greedy():
    gen = torch.Generator().manual_seed(3)
    B, K, V = 64, 4, 12
    logits = torch.randn(B, K + 1, V, generator=gen)  # [B, K+1, V]
    target_ids = logits.argmax(-1)  # [B, K+1]
    # drafts that often agree with the target for a while, then not
    draft_ids = torch.where(torch.rand(B, K, generator=gen) < 0.7, target_ids[:, :K], torch.randint(0, V, (B, K), generator=gen))
    num_draft = torch.randint(0, K + 1, (B,), generator=gen)  # [B]
    probs = F.one_hot(target_ids, V).float()  # [B, K+1, V]
    expected = verify(probs, draft_ids, None, num_draft, torch.ones(B, dtype=torch.bool), [None] * B)
    got = verify_greedy(target_ids, draft_ids, num_draft)
    for e, g in zip(expected, got):
        assert torch.equal(g, e)
    assert set(got[0].tolist()) > {0}  # some rows accepted drafts


def test_empty_draft_is_plain_decoding_from_the_first_target_distribution():
    p = random_probs(K + 1, V, seed=0)
    n = 20_000
    torch.manual_seed(0)
    num_accepted, output_ids = verify(
        p.expand(n, K + 1, V), torch.full((n, K), PAD_ID), None, torch.zeros(n, dtype=torch.long),
        torch.zeros(n, dtype=torch.bool), [None] * n,
    )
    assert (num_accepted == 0).all()
    assert (output_ids[:, 1:] == PAD_ID).all()
    assert chi_square_p_value(torch.bincount(output_ids[:, 0], minlength=V), p[0]) > 1e-3


def test_mixed_greedy_and_sampled_rows_with_mixed_draft_counts():
    uniform, pair = torch.full((5,), 0.2), torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])
    target = torch.stack([
        one_hot([1, 2, 3, 4], 5),  # greedy, 3 drafts, all match
        torch.stack([uniform, torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5]), uniform, uniform]),  # sampled
        torch.stack([pair, one_hot([4], 5)[0], uniform, uniform]),  # sampled, 1 draft, then bonus 4
        one_hot([0, 0, 0, 0], 5),  # greedy, no drafts (padding equal to the argmax)
        torch.stack([pair, pair, uniform, one_hot([2], 5)[0]]),  # sampled, 3 drafts, then bonus 2
    ])  # [5, 4, 5]
    draft = random_probs(5, 3, 5, seed=13)  # padding and greedy rows' q are ignored
    draft[1, 0], draft[1, 1] = uniform, torch.tensor([0.5, 0.0, 0.0, 0.0, 0.5])  # draft 0 has p = 0
    draft[2, 0] = pair
    draft[4] = torch.stack([pair, pair, uniform])
    draft_ids = torch.tensor([[1, 2, 3], [1, 0, PAD_ID], [2, PAD_ID, PAD_ID], [0, 0, 0], [1, 2, 3]])
    num_draft = torch.tensor([3, 2, 1, 0, 3])
    greedy = torch.tensor([True, False, False, True, False])
    expected = [[1, 2, 3, 4], [1, 3, PAD_ID, PAD_ID], [2, 4, PAD_ID, PAD_ID], [0, PAD_ID, PAD_ID, PAD_ID], [1, 2, 3, 2]]
    for seed in range(20):  # every outcome here has probability one
        generators = [row_generator(seed * 5 + b) for b in range(5)]
        num_accepted, output_ids = verify(target, draft_ids, draft, num_draft, greedy, generators)
        assert num_accepted.tolist() == [3, 1, 1, 0, 3]
        assert output_ids.tolist() == expected


def test_draft_the_drafter_gave_zero_probability_is_still_accepted():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 1.0, 0.0]])  # inconsistent with draft 0, p(0) > 0: accept
    num_accepted, _ = verify_rows(p, q, torch.zeros(1000, 1, dtype=torch.long))
    assert (num_accepted == 1).all()


def test_no_residual_after_a_rejection_falls_back_to_the_target():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.9, 0.9, 0.0, 0.0]])  # q >= p everywhere: max(0, p - q) is all zero
    num_accepted, output_ids = verify_rows(p, q, torch.zeros(2000, 1, dtype=torch.long))
    recovered = output_ids[num_accepted == 0, 0]
    assert set(recovered.tolist()) == {0, 1}


def test_deterministic_drafts_without_draft_probs_keep_the_target_distribution():
    p = random_probs(K + 1, V, seed=1)
    num_accepted, output_ids = verify_rows(p, None, torch.full((50_000, K), 3))
    assert chi_square_p_value(torch.bincount(output_ids[:, 0], minlength=V), p[0]) > 1e-3
    second = output_ids[num_accepted >= 1, 1]
    assert chi_square_p_value(torch.bincount(second, minlength=V), p[1]) > 1e-3


def test_seeded_rows_are_deterministic_and_batch_invariant():
    B, k = 4, 3
    p = random_probs(B, k + 1, V, seed=2)
    q = random_probs(B, k, V, seed=3)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=torch.Generator().manual_seed(4)).view(B, k)
    num_draft, greedy = torch.tensor([3, 1, 3, 0]), torch.tensor([False, False, True, False])

    def run(seeds, rows=slice(None)):
        gens = [row_generator(s) for s in seeds]
        return verify(p[rows], drafts[rows], q[rows], num_draft[rows], greedy[rows], gens)

    alone = run([21], slice(0, 1))
    batched = run([21, 5, None, 7])
    assert torch.equal(batched[0][:1], alone[0]) and torch.equal(batched[1][:1], alone[1])
    again = run([21], slice(0, 1))
    assert torch.equal(again[0], alone[0]) and torch.equal(again[1], alone[1])
    by_seed = {tuple(run([s], slice(0, 1))[1].flatten().tolist()) for s in range(20)}
    assert len(by_seed) > 1


def emitted_distributions_match(p: torch.Tensor, num_accepted: torch.Tensor, output_ids: torch.Tensor) -> None:
    """Token i (emitted when drafts 0..i-1 were accepted) follows p[i]; nothing outside p's support."""
    for i in range(K + 1):
        tokens = output_ids[num_accepted >= i, i]
        counts = torch.bincount(tokens, minlength=V)
        assert counts[p[i] == 0].sum() == 0, f"token {i} outside the target's support"
        assert chi_square_p_value(counts, p[i]) > 1e-3, f"token {i} does not follow the target"


def test_emitted_tokens_follow_the_target_distribution():
    p, q = random_probs(K + 1, V, seed=5), random_probs(K, V, seed=6)
    drafts = drafts_from(q, 100_000, seed=7)
    emitted_distributions_match(p, *verify_rows(p, q, drafts))


def test_rejection_sampling_approximates_target_distribution():
    """vLLM's test: the distance to p falls much faster with the sample size than to random references."""
    p, q = random_probs(V, seed=8), random_probs(V, seed=9)
    references = random_probs(100, V, seed=10)
    to_target, to_reference = [], []
    for n in [10, 100, 1_000, 10_000, 100_000]:
        num_accepted, output_ids = verify_rows(p.expand(K + 1, V), q.expand(K, V), drafts_from(q.expand(K, V), n, n))
        tokens = output_ids[output_ids != PAD_ID]  # every emitted token follows p
        empirical = torch.bincount(tokens, minlength=V).float() / tokens.numel()
        to_target.append(torch.dist(p, empirical).item())
        to_reference.append(torch.dist(references, empirical).item() / references.shape[0])
    assert to_target[0] / to_target[-1] > 20 * to_reference[0] / to_reference[-1]


@pytest.mark.parametrize("filtered_draft", [True, False], ids=["q-filtered", "q-raw"])
def test_emitted_tokens_follow_the_top_k_top_p_target(filtered_draft: bool):
    temperature, top_k, top_p = 0.9, 5, 0.9  # top-k binds at slot 0, top-p (after top-k) at slot 1
    logits = torch.randn(2, K + 1, V, generator=torch.Generator().manual_seed(11))  # target, drafter
    expected = hf_probs(logits[0], temperature, top_k, top_p)  # [K+1, V]
    params = SamplingParams.from_requests([temperature] * 2, [top_k] * 2, [top_p] * 2)
    p = target_probs(logits, params)[0]  # [K+1, V]
    torch.testing.assert_close(p, expected)
    q = target_probs(logits, params)[1, :K] if filtered_draft else (logits[1, :K] / temperature).softmax(-1)
    n = 100_000
    torch.manual_seed(12)
    drafts = sample(q.expand(n, K, V), [None] * n)  # [n, K], as the drafter samples
    assert (expected[:K].gather(-1, drafts.T) == 0).any(), "some drafts fall outside the target's support"
    emitted_distributions_match(expected, *verify_rows(p, q, drafts))


def test_mismatched_shapes_name_the_field():
    p = torch.rand(2, 3, 5).softmax(-1)
    drafts, num_draft, greedy = torch.zeros(2, 2, dtype=torch.long), torch.tensor([2, 2]), torch.tensor([True, False])
    with pytest.raises(ValueError, match="draft_ids"):
        verify(p, drafts[:, :1], None, num_draft, greedy, [None] * 2)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(p, drafts, p, num_draft, greedy, [None] * 2)
    with pytest.raises(ValueError, match="generators"):
        verify(p, drafts, None, num_draft, greedy, [None])
