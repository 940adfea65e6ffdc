"""Rotary position embedding with DeepSeek-V3's YaRN scaling.

Follows transformers' DeepseekV3 (`_compute_yarn_parameters`, `apply_rotary_pos_emb_interleave`):
with `rope_interleave` the rotary dims are pairs (x0, x1), (x2, x3), ... and the rotated output is laid
out de-interleaved (all rotated evens, then all rotated odds), identically for queries and keys.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from triton_mtp.export.config import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention-temperature factor."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN."""
    scale = config.qk_head_dim ** -0.5
    rs = config.rope_scaling
    if rs is not None and rs.get("mscale_all_dim"):
        scale *= yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    return scale


def _yarn_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    dim, base, rs = config.qk_rope_head_dim, config.rope_theta, config.rope_scaling
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim/2]
    if rs is None:
        return 1.0 / pos_freqs, 1.0
    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or config.max_position_embeddings / original
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    extrapolation = 1 - ramp  # [dim/2], 1 keeps the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions.

    `inv_freq` stays a float32 constant rather than a buffer, so `.to(torch.bfloat16)` of the model
    does not round the frequencies.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq, self.attention_scaling = _yarn_inv_freq(config)  # [rope_dim/2] float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [B, T, rope_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, rope_dim]
        cos = (emb.cos() * self.attention_scaling).to(dtype)  # [B, T, rope_dim]
        sin = (emb.sin() * self.attention_scaling).to(dtype)  # [B, T, rope_dim]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x[B, T, (heads,) rope_dim]; cos/sin are [B, T, rope_dim]."""
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, rope_dim]
    if interleave:
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]  # [..., rope_dim/2]
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [..., rope_dim/2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [..., rope_dim]
    return x * cos + rotated * sin
