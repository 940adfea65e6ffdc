"""Lossless verification of draft tokens against the target (speculative sampling).

Follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"), with the
vocabulary of vLLM v1's rejection sampler:

- draft tokens: the tokens the drafter (the MTP layers) proposed for a row, ``num_draft[b]`` of the K
  slots of ``draft_ids``; the rest is padding.
- accepted tokens: the leading draft tokens that survive verification.
- recovered token: at the first rejected position, a token sampled from norm(max(0, p - q)) instead.
- bonus token: when every draft token is accepted, one more token sampled from the target's
  distribution at the position after the last draft.

A verify step emits its accepted tokens plus one recovered-or-bonus token, so a step never emits fewer
tokens than plain decoding. Mean acceptance length = 1 + accepted / drafts, where drafts counts the
verify steps that carried draft tokens: the mean number of tokens a step emits.

Each emitted token is distributed exactly as if sampled from the target's distribution p at its
position (the processed one: temperature, top-k and top-p applied by ``sampling.target_probs``),
whatever the draft distribution q is, provided q is the one the drafts were sampled from.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .sampling import exponential_noise, sample_from, uniform_noise

PAD_ID = -1  # output_ids entries past the emitted tokens


def _check_shapes(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft: torch.Tensor,
    greedy: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> None:
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs: expected shape [B, K+1, V], got {list(target_probs.shape)}")
    B, K1, V = target_probs.shape
    expected = {
        "draft_ids": (draft_ids.shape, (B, K1 - 1)),
        "num_draft": (num_draft.shape, (B,)),
        "greedy": (greedy.shape, (B,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs.shape, (B, K1 - 1, V))
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{name}: expected shape {list(want)} for target_probs {[B, K1, V]}, got {list(got)}")
    if len(generators) != B:
        raise ValueError(f"generators: expected one per row ({B}), got {len(generators)}")


def verify(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft: torch.Tensor,
    greedy: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and emit one recovered or bonus token after it.

    target_probs [B, K+1, V]: p at each draft position and at the bonus position after them.
    draft_ids [B, K] int64: row b's drafts in its first ``num_draft[b]`` slots (padding may hold any id).
    draft_probs [B, K, V]: the q each draft was sampled from; None when the drafter picked its tokens
        deterministically (argmax), i.e. q is the one-hot of the draft.
    num_draft [B] int64: drafts per row, in [0, K]; 0 is plain decoding (sample from p at position 0).
    greedy [B] bool: accept while draft == argmax p, then emit argmax p; draws are made but unused.
    generators: one per row; row b always takes K uniform and (K+1) * V exponential draws.

    Returns num_accepted [B] int64 and output_ids [B, K+1] int64, where
    ``output_ids[b, :num_accepted[b] + 1]`` are the emitted tokens and the rest is PAD_ID.
    """
    _check_shapes(target_probs, draft_ids, draft_probs, num_draft, greedy, generators)
    B, K1, V = target_probs.shape  # rows, draft slots + bonus, vocabulary
    K = K1 - 1
    device = target_probs.device
    p_all = target_probs.float()  # [B, K+1, V]
    p = p_all[:, :K]  # [B, K, V] target distribution at each draft position
    slots = torch.arange(K1, device=device)  # [K+1]
    is_draft = slots[:K] < num_draft.view(B, 1)  # [B, K] real drafts, not padding
    x = draft_ids.clamp(0, V - 1)  # [B, K] padding mapped to a valid index; masked by is_draft
    q = F.one_hot(x, V).float() if draft_probs is None else draft_probs.float()  # [B, K, V]
    p_x = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, K] p(x_i)
    q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, K] q(x_i)

    # Sampled rows: accept x_i with probability min(1, p(x_i) / q(x_i)), i.e. when u < p / q for
    # u ~ U[0, 1). Written u * q < p: no division, q(x_i) = 0 < p(x_i) accepts (a draft sampled
    # from q never has q = 0), and p(x_i) = 0 never accepts.
    u = uniform_noise(generators, (K,), device)  # [B, K]
    accept_sampled = u * q_x < p_x  # [B, K]
    # Greedy rows: accept while the draft is the target's argmax.
    target_argmax = p_all.argmax(-1)  # [B, K+1]
    accept_greedy = draft_ids == target_argmax[:, :K]  # [B, K]
    accept = torch.where(greedy.view(B, 1), accept_greedy, accept_sampled) & is_draft  # [B, K]
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B] length of the leading run of acceptances

    # The token after the accepted drafts. Rejected at i: recovered from norm(max(0, p_i - q_i)).
    # Then P(emit v at i) = q(v) min(1, p(v)/q(v)) + P(reject) r(v) = min(q(v), p(v)) + max(0, p(v) - q(v))
    # = p(v), since P(reject) = sum_v max(0, p(v) - q(v)) is exactly the residual's mass.
    residual = (p - q).clamp_min(0)  # [B, K, V]
    # p == q leaves no residual (a rejection is then impossible in exact arithmetic): fall back to p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # [B, K, V]
    # All num_draft[b] accepted: the bonus token at slot num_draft[b] comes from p there.
    recover_from = torch.where(is_draft.unsqueeze(-1), residual, p)  # [B, K, V]
    next_from = torch.cat([recover_from, p_all[:, K:]], dim=1)  # [B, K+1, V]
    noise = exponential_noise(generators, (K1, V), device)  # [B, K+1, V]
    sampled_next = sample_from(next_from, noise)  # [B, K+1]
    next_ids = torch.where(greedy.view(B, 1), target_argmax, sampled_next)  # [B, K+1]
    next_id = next_ids.gather(1, num_accepted.view(B, 1))  # [B, 1] recovered or bonus token

    padded_drafts = F.pad(draft_ids, (0, 1), value=PAD_ID)  # [B, K+1]
    n = num_accepted.view(B, 1)  # [B, 1]
    output_ids = torch.where(slots < n, padded_drafts, torch.where(slots == n, next_id, PAD_ID))  # [B, K+1]
    return num_accepted, output_ids


def verify_greedy(target_ids: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` for a batch whose rows are all greedy, from the target's argmax alone (no draws).

    target_ids [B, K+1] int64: argmax p at each draft position and at the bonus position.
    draft_ids [B, K], num_draft [B]: as in `verify`. Returns the same num_accepted [B] and
    output_ids [B, K+1] as `verify` with every row greedy.
    """
    B, K1 = target_ids.shape
    slots = torch.arange(K1, device=target_ids.device)  # [K+1]
    accept = (draft_ids == target_ids[:, : K1 - 1]) & (slots[: K1 - 1] < num_draft.view(B, 1))  # [B, K]
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B]
    n = num_accepted.view(B, 1)  # [B, 1]
    next_id = target_ids.gather(1, n)  # [B, 1] the target's token after the accepted drafts
    padded_drafts = F.pad(draft_ids, (0, 1), value=PAD_ID)  # [B, K+1]
    output_ids = torch.where(slots < n, padded_drafts, torch.where(slots == n, next_id, PAD_ID))  # [B, K+1]
    return num_accepted, output_ids
