"""The absorbed MLA's attention over the latent cache: eager ops, or two Triton kernels for decode calls.

Eager (`attend`), a call gathers its rows of the pool [B, seq, r + dr], then scores the latent and roped queries
against them, masks, softmaxes and weights the latents: a gather, two batched GEMMs for the scores, one for the
values, and the softmax between them, over the whole pool's length. On the DeepSeek-V2-Lite-shaped step the
CUTLASS batched GEMMs alone were 81 launches and 0.36 ms (docs/benchmarks.md, run 37). Where Triton runs
(CUDA), calls of up to MAX_TOKENS tokens instead run flash-decoding's split (export/fused_moe_kernels.py):

- `latent_attention_chunk`: one program per (token, head, chunk of CHUNK positions) reads its positions of the
  pool in place, up to the token's own, and keeps an online softmax: the chunk's largest score, the sum of the
  exponentials and the weighted latents;
- `latent_attention_combine`: one program per (token, head) weights the chunks that saw a position.

Scores round where eager's bf16 ops round; the probabilities stay float32 (eager rounds them to bf16 before
the values' GEMM), so the two differ by about that rounding. A token's output does not depend on the other
tokens of its call.
"""

from __future__ import annotations

import torch

from triton_mtp.export import fused_moe

# Tokens of one call through the kernels (their partial results are tokens × heads × chunks × r floats);
# positions a program reads, and at a time; chunks the combining program weights at a time.
MAX_TOKENS = 16
CHUNK = 64
BLOCK_S = 16
STEP_C = 8
NUM_WARPS = 4


def attend(q_latent: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q_latent [B, T, h, r], q_pe [B, T, h, dr], kv [B, seq, r + dr] (the rows' pool), positions [B, T] (-1:
    padding, which sees position 0) -> the softmax-weighted latents [B, T, h, r]."""
    r = q_latent.shape[-1]
    kv = kv.to(q_latent.dtype)
    c_all, pe_all = torch.split(kv, [r, kv.shape[-1] - r], dim=-1)  # [B, seq, r], [B, seq, dr]
    scores = torch.einsum("bthr,bsr->bhts", q_latent, c_all)  # [B, h, T, seq]
    scores = (scores + torch.einsum("bthd,bsd->bhts", q_pe, pe_all)) * scale  # [B, h, T, seq]
    cache_pos = torch.arange(kv.shape[1], device=kv.device)  # [seq]
    visible = cache_pos[None, None, :] <= positions.clamp(min=0)[:, :, None]  # [B, T, seq]
    scores = scores.masked_fill(~visible[:, None], torch.finfo(scores.dtype).min)  # [B, h, T, seq]
    probs = torch.softmax(scores.float(), dim=-1).to(q_latent.dtype)  # [B, h, T, seq]
    return torch.einsum("bhts,bsr->bthr", probs, c_all)  # [B, T, h, r]


# One opaque op for the dispatch, as `moe.routed_experts`: a compiled step (dynamic shapes) would otherwise guard on
# the bound and compile each size class on both sides of it. Past the bound `attend` runs eagerly here.
@torch.library.custom_op("triton_mtp::latent_attention", mutates_args=())
def latent_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                     positions: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend` over cache [L, S, seq, r + dr] at pool rows [B] (layer · S + slot), through the kernels for calls of
    at most MAX_TOKENS tokens."""
    (B, T, heads, r), dr, seq = q_latent.shape, q_pe.shape[-1], cache.shape[2]
    pool = cache.flatten(0, 1)  # [L·S, seq, r + dr]
    if B * T > MAX_TOKENS or B * T == 0:
        return attend(q_latent, q_pe, pool.index_select(0, rows), positions, scale).contiguous()
    kernels, queries, chunks = fused_moe.KERNELS, B * T * heads, (seq + CHUNK - 1) // CHUNK
    m = torch.empty(queries, chunks, dtype=torch.float32, device=cache.device)  # [N·h, chunks]
    l = torch.empty_like(m)  # [N·h, chunks]
    acc = torch.empty(queries, chunks, r, dtype=torch.float32, device=cache.device)  # [N·h, chunks, r]
    positions = positions.contiguous()
    kernels.latent_attention_chunk[(queries, chunks)](
        q_latent.contiguous(), q_pe.contiguous(), pool, rows.contiguous(), positions, m, l, acc, T, heads, seq,
        chunks, scale, R=r, DR=dr, CHUNK=CHUNK, BLOCK_S=BLOCK_S, BLOCK_R=kernels.next_power_of_2(r),
        BLOCK_DR=kernels.next_power_of_2(dr), num_warps=NUM_WARPS)
    out = torch.empty(B, T, heads, r, dtype=q_latent.dtype, device=cache.device)  # [B, T, h, r]
    kernels.latent_attention_combine[(queries,)](
        m, l, acc, positions, out, heads, chunks, R=r, CHUNK=CHUNK, BLOCK_C=kernels.next_power_of_2(chunks),
        STEP_C=STEP_C, BLOCK_R=kernels.next_power_of_2(r))
    return out


@latent_attention.register_fake
def _(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
      scale: float) -> torch.Tensor:
    return q_latent.new_empty(q_latent.shape)  # [B, T, h, r], contiguous as the op's result
