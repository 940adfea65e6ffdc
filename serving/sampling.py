"""Sampling for the target and the drafter: temperature, top-k, top-p, and per-row seeded draws.

Follows gpt-fast's generate.py (a draw is ``argmax(probs / Exponential(1))``, never
``torch.multinomial``, so it never waits on the host) and the processing order of Hugging Face's
logits warpers and vLLM's sampler: temperature, then top-k, then top-p, over one sort.

Every row (live sequence) has its own ``torch.Generator`` seeded by its request, on the device of the
tensors. Each call draws a number of random numbers per row that depends only on the call's shape,
so a request's stream of random numbers, and so its tokens, does not depend on which other rows share
the batch. Rows without a generator draw from torch's default generator.

The drafter processes the MTP logits with the same ``target_probs`` and the same parameters, so the
draft distribution q is also temperature-scaled, top-k and top-p filtered. Verification is lossless
either way, as long as the q handed to ``verify`` is the one the drafts were sampled from.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS)


def validate(temperature: float, top_k: int, top_p: float) -> None:
    """Check one request's sampling knobs; raise ValueError naming the bad field."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


@dataclass
class SamplingParams:
    """Sampling knobs of every row in a batch, one entry per row."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1 = off

    def __post_init__(self) -> None:
        rows = self.temperature.shape[:1]
        for name in ("temperature", "top_k", "top_p"):
            shape = getattr(self, name).shape
            if len(shape) != 1 or shape != rows:
                raise ValueError(f"SamplingParams.{name}: expected shape {list(rows)} (one per row), got {list(shape)}")

    @classmethod
    def from_requests(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        device: torch.device | str | None = None,
    ) -> SamplingParams:
        """Validate per-request knobs on the host and stack them into per-row tensors."""
        if not len(temperature) == len(top_k) == len(top_p):
            counts = f"{len(temperature)}, {len(top_k)}, {len(top_p)}"
            raise ValueError(f"temperature, top_k, top_p: expected one entry per row, got {counts}")
        for row in zip(temperature, top_k, top_p):
            validate(*row)
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        )

    @property
    def greedy(self) -> torch.Tensor:
        """[B] bool: rows that decode greedily."""
        return greedy_rows(self.temperature)


def greedy_rows(temperature: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows whose temperature [B] decodes greedily."""
    return temperature < GREEDY_TEMPERATURE


def row_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A request's generator on ``device``; None (torch's default generator) when it has no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities to sample from: temperature, then top-k, then top-p, renormalised.

    logits [B, T, V] -> probs [B, T, V] float32. Greedy rows get the one-hot of the argmax.
    """
    B, T, V = logits.shape  # rows, positions, vocabulary
    logits = logits.float()  # [B, T, V]
    greedy = params.greedy.view(B, 1, 1)  # [B, 1, 1]
    temperature = torch.where(greedy, 1.0, params.temperature.view(B, 1, 1))  # [B, 1, 1]
    probs = _top_k_top_p(logits / temperature, params.top_k, params.top_p).softmax(-1)  # [B, T, V]
    one_hot = F.one_hot(logits.argmax(-1), V).to(probs.dtype)  # [B, T, V]
    return torch.where(greedy, one_hot, probs)  # [B, T, V]


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k, then outside its top-p nucleus."""
    B, T, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, T, V]
    # top-k: drop logits below the k-th largest (ties with it stay, as in Hugging Face's warper).
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).view(B, 1, 1).expand(B, T, 1)  # [B, T, 1]
    kth = sorted_logits.gather(-1, k - 1)  # [B, T, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)  # [B, T, V]
    # top-p: keep the shortest prefix of the sorted distribution whose mass reaches p, i.e. drop a
    # token once the mass before it is >= p; the top token always stays. Rows at p = 1 keep all.
    sorted_probs = sorted_logits.softmax(-1)  # [B, T, V]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [B, T, V]
    top_p = top_p.view(B, 1, 1)  # [B, 1, 1]
    drop = (mass_before >= top_p) & (top_p < 1)  # [B, T, V]
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)  # [B, T, V]
    return logits.scatter(-1, order, sorted_logits)  # [B, T, V] back in vocabulary order


def _per_row(
    generators: Sequence[torch.Generator | None],
    shape: tuple[int, ...],
    device: torch.device,
    fill: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor],
) -> torch.Tensor:
    """A [B, *shape] float32 tensor, row b filled in place by ``fill(row, generators[b])``."""
    out = torch.empty((len(generators), *shape), dtype=torch.float32, device=device)  # [B, *shape]
    if any(g is None for g in generators):
        fill(out, None)  # unseeded rows share one call to the default generator
    for b, generator in enumerate(generators):
        if generator is not None:
            fill(out[b], generator)
    return out


def uniform_noise(
    generators: Sequence[torch.Generator | None], shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """[B, *shape] draws from U[0, 1), ``prod(shape)`` per row from that row's generator."""
    return _per_row(generators, shape, device, lambda t, g: t.uniform_(generator=g))


def exponential_noise(
    generators: Sequence[torch.Generator | None], shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """[B, *shape] draws from Exponential(1), ``prod(shape)`` per row, kept > 0 so ``w / noise`` is never 0/0."""
    tiny = torch.finfo(torch.float32).tiny
    return _per_row(generators, shape, device, lambda t, g: t.exponential_(generator=g).clamp_min_(tiny))


def sample_from(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Token ids [...] drawn from ``weights / weights.sum(-1)`` ([..., V], non-negative, need not sum to 1).

    With E_v ~ Exponential(1), E_v / w_v ~ Exponential(w_v), so the argmin of E_v / w_v (the argmax of
    w_v / E_v) is v with probability w_v / sum(w): a draw with no host sync (gpt-fast).
    """
    return (weights / noise).argmax(-1)


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row and position: probs [B, T, V] -> ids [B, T] int64.

    ``generators[b]`` (or the default generator when None) supplies exactly T * V draws for row b.
    """
    B, T, V = probs.shape
    if len(generators) != B:
        raise ValueError(f"generators: expected one per row ({B}), got {len(generators)}")
    noise = exponential_noise(generators, (T, V), probs.device)  # [B, T, V]
    return sample_from(probs, noise)  # [B, T]
