"""RMSNorm and Multi-head Latent Attention (MLA) over a slot/position KV pool.

The cache holds, per layer and token, only the compressed latent `kv_a_layernorm(c_kv)` followed by the
roped shared key `k_pe`. For DeepSeek-V3 that is (512 + 64) × 61 layers × 2 bytes in bf16 = 70,272 bytes
per token. Attention runs in the absorbed form: `kv_b_proj` is folded into the query (for keys) and into
the output (for values), so the latent is never expanded to per-head keys and values.
"""

from __future__ import annotations

import torch
from torch import nn

from triton_mtp.export import latent_attention
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.linear import Linear
from triton_mtp.export.rope import apply_rotary, softmax_scale


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, as in DeepSeek-V3."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # [..., dim]
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., dim]
        return self.weight * x32.to(x.dtype)


class MLAttention(nn.Module):
    """DeepSeek-V3 attention; parameter names follow the checkpoint (`self_attn.*`). With `decode_kernel` True,
    calls of few tokens attend through export/latent_attention.py's kernels where they run. False by default until
    they are measured on a GPU: `export --decode-kernels` names them (export/kernel_choice.py), and
    bench/realistic.py's grouped variants other than fused-eager-attention and fused-cublas turn them on
    (bench/decode_kernels.py calls the op itself)."""

    decode_kernel = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.scale = softmax_scale(config)
        self.interleave = config.rope_interleave
        q_out = self.num_heads * config.qk_head_dim
        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank)
            self.q_b_proj = Linear(config.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(config.hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, config.cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = Linear(config.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, config.hidden_size, bias=False)
        self.fused_qkv_a_proj: Linear | None = None  # `fuse_input_projections`

    def fuse_input_projections(self) -> None:
        """q_proj (q_a_proj under q-LoRA) and kv_a_proj_with_mqa, which both read the hidden state, as one Linear
        `fused_qkv_a_proj` whose output splits into the two, as vLLM's: one launch where there were two. The two
        checkpoint names are gone afterwards, as the grouped experts' are, so tensor-parallel sharding
        (export/parallel.py, which reads q_proj) comes first. Once only: fused, it does nothing."""
        if self.fused_qkv_a_proj is not None:
            return
        first = self.q_a_proj if self.q_lora else self.q_proj
        weight = torch.cat([first.weight, self.kv_a_proj_with_mqa.weight])  # [q + r + dr, H]
        self.fused_qkv_a_proj = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.fused_qkv_a_proj.weight = nn.Parameter(weight, requires_grad=first.weight.requires_grad)
        del self.kv_a_proj_with_mqa
        if self.q_lora:
            del self.q_a_proj
        else:
            del self.q_proj

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        cache: torch.Tensor,
        layer: int | torch.Tensor,
    ) -> torch.Tensor:
        """x[B, T, H] -> [B, T, H]; writes this call's latents into `cache[layer]` first, then attends. `layer` is an
        int or a 0-d int64 tensor (an MTP layer step's: its graph is then the same for every layer)."""
        B, T, _ = x.shape
        if self.fused_qkv_a_proj is None:
            q = self.q_a_proj(x) if self.q_lora else self.q_proj(x)  # [B, T, q_lora_rank or h*dqk]
            kv = self.kv_a_proj_with_mqa(x)  # [B, T, r + dr]
        else:
            cache_dim = self.kv_lora_rank + self.rope_dim
            q, kv = torch.split(self.fused_qkv_a_proj(x), [self.fused_qkv_a_proj.out_features - cache_dim, cache_dim],
                                dim=-1)  # [B, T, q_lora_rank or h*dqk], [B, T, r + dr]
        q = self.q_b_proj(self.q_a_layernorm(q)) if self.q_lora else q  # [B, T, h*dqk]
        q = q.view(B, T, self.num_heads, self.nope_dim + self.rope_dim)  # [B, T, h, dqk]
        q_nope, q_pe = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)  # [B, T, h, dn], [B, T, h, dr]
        q_pe = apply_rotary(q_pe, cos, sin, self.interleave)  # [B, T, h, dr]

        c_kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.rope_dim], dim=-1)  # [B, T, r], [B, T, dr]
        latent = torch.cat([self.kv_a_layernorm(c_kv), apply_rotary(k_pe, cos, sin, self.interleave)], dim=-1)
        self._write(cache, layer, latent, positions, slot_ids)

        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        if self.decode_kernel and latent_attention.takes_kernels(q_nope):  # the pool's rows of this layer's slots
            out = latent_attention.latent_attention(
                q_nope, q_pe, w_kv, cache, layer * cache.shape[1] + slot_ids, positions, self.scale)  # [B, T, h, dv]
        else:  # an int layer reads the view cache[layer]; a 0-d tensor (an MTP layer step's) the flattened rows
            kv_all = cache[layer].index_select(0, slot_ids) if isinstance(layer, int) else \
                cache.flatten(0, 1).index_select(0, layer * cache.shape[1] + slot_ids)  # [B, S+1, r + dr]
            out = latent_attention.attend(q_nope, q_pe, w_kv, kv_all, positions, self.scale)  # [B, T, h, dv]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim))  # [B, T, H]

    @staticmethod
    def _write(
        cache: torch.Tensor, layer: int | torch.Tensor, latent: torch.Tensor, positions: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> None:
        """Write latent[B, T, D] at (layer, slot, position); padding (position -1) writes the scratch position."""
        _, num_slots, seq_plus_one, dim = cache.shape
        write_pos = torch.where(positions >= 0, positions, torch.full_like(positions, seq_plus_one - 1))  # [B, T]
        flat = (layer * num_slots + slot_ids[:, None]) * seq_plus_one + write_pos  # [B, T]
        cache.view(-1, dim).index_copy_(0, flat.reshape(-1), latent.reshape(-1, dim).to(cache.dtype))
