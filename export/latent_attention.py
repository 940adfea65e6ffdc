"""The absorbed MLA's attention from the nope query to the per-head values: eager ops, or three Triton kernels.

Eager (`attend`), a call absorbs kv_b_proj's key half into the nope query (a batched GEMM), gathers its rows of
the pool [B, seq, r + dr] over the pool's whole length, scores the latent and roped queries against them (two
batched GEMMs), masks and softmaxes, weights the latents (a batched GEMM) and expands them by the value half
(another). On the DeepSeek-V2-Lite-shaped step these were about 22 µs a layer, launch-bound: the weights they
read take about 1.4 µs (docs/benchmarks.md, run 38). Where Triton runs (CUDA), calls of few tokens instead run
(export/fused_moe_kernels.py):

- `absorb_query`: the latent query, one program per (head, block of the rank) reading its weight tile once;
- `latent_attention_chunk`: flash-decoding's split with a token's heads in one program, as FlashMLA has them:
  one program per (token, chunk of CHUNK positions, block of 16 heads) reads its positions of the pool in place,
  up to the token's own, once for all its heads, scores them and weights the latents as tensor-core dots, and
  keeps an online softmax (FlashMLA also packs a sequence's tokens into the program: here each token of a verify
  window reads the positions again);
- `latent_attention_out`: one program per (token, head, block of values) weights the chunks that saw a
  position and expands the latent by the value half (each value block combines the chunks again, and each token
  reads the value half again).

Scores and the weighted latent round where eager's bf16 ops round; the probabilities are rounded before they
weight the latents unnormalised (eager rounds them normalised), so the two differ by about that rounding. A
token's output does not depend on the other tokens of its call.
"""

from __future__ import annotations

import torch

from triton_mtp.export import fused_moe
from triton_mtp.export.linear import KERNEL_DTYPES
# Tokens of one call through the kernels, and the bound on their partial results (tokens × heads × chunks × r
# floats); positions a program reads, and at a time; heads a program scores (tensor-core dots take 16 rows or
# more); chunks the output program weights at a time; its values; the attention program's warps.
MAX_TOKENS = 64
MAX_PARTIAL_BYTES = 32 * 2**20
CHUNK = 64
BLOCK_S = 32
BLOCK_H = 16
STEP_C = 8
BLOCK_R_ABSORB = 64
BLOCK_V = 16
NUM_WARPS = 4


def attend(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q_nope [B, T, h, dn], q_pe [B, T, h, dr], w_kv [h, dn + dv, r] (kv_b_proj's weight), kv [B, seq, r + dr]
    (the rows' pool), positions [B, T] (-1: padding, which sees position 0) -> the heads' values [B, T, h, dv]."""
    dn, r = q_nope.shape[-1], w_kv.shape[-1]
    w_uk, w_uv = torch.split(w_kv, [dn, w_kv.shape[1] - dn], dim=1)  # [h, dn, r], [h, dv, r]
    q_latent = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)  # [B, T, h, r]
    kv = kv.to(q_latent.dtype)
    c_all, pe_all = torch.split(kv, [r, kv.shape[-1] - r], dim=-1)  # [B, seq, r], [B, seq, dr]
    scores = torch.einsum("bthr,bsr->bhts", q_latent, c_all)  # [B, h, T, seq]
    scores = (scores + torch.einsum("bthd,bsd->bhts", q_pe, pe_all)) * scale  # [B, h, T, seq]
    cache_pos = torch.arange(kv.shape[1], device=kv.device)  # [seq]
    visible = cache_pos[None, None, :] <= positions.clamp(min=0)[:, :, None]  # [B, T, seq]
    scores = scores.masked_fill(~visible[:, None], torch.finfo(scores.dtype).min)  # [B, h, T, seq]
    probs = torch.softmax(scores.float(), dim=-1).to(q_latent.dtype)  # [B, h, T, seq]
    out_latent = torch.einsum("bhts,bsr->bthr", probs, c_all)  # [B, T, h, r]
    return torch.einsum("bthr,hvr->bthv", out_latent, w_uv)  # [B, T, h, dv]


def takes_kernels(q_nope: torch.Tensor) -> bool:
    """Whether a call with this query may take the kernels (`latent_attention` still bounds the tokens)."""
    return fused_moe.runs_on(q_nope.device) and q_nope.dtype in KERNEL_DTYPES


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself where its last dimension is contiguous (the step's views of the query projection), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


# One opaque op for the dispatch, as `moe.routed_experts`: a compiled step (dynamic shapes) would otherwise guard on
# the bound and compile each size class on both sides of it. Past the bound `attend` runs eagerly here.
@torch.library.custom_op("triton_mtp::latent_attention", mutates_args=())
def latent_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor, cache: torch.Tensor,
                     rows: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend` over cache [L, S, seq, r + dr] at pool rows [B] (layer · S + slot), through the kernels for calls of
    at most MAX_TOKENS tokens whose partial results fit MAX_PARTIAL_BYTES (sized by the pool's length: with 128
    heads and no tensor parallelism, a pool past about 8k positions stays eager), where the query, the weight and
    the contiguous pool share one dtype. Past those bounds `attend` runs eagerly here, outside inductor's fusions
    (the prefill's mask and softmax among them)."""
    (B, T, heads, dn), dr, r, seq = q_nope.shape, q_pe.shape[-1], w_kv.shape[2], cache.shape[2]
    dv = w_kv.shape[1] - dn
    pool = cache.flatten(0, 1)  # [L·S, seq, r + dr]
    N, chunks = B * T, (seq + CHUNK - 1) // CHUNK
    if not 0 < N <= MAX_TOKENS or N * heads * chunks * (r + 2) * 4 > MAX_PARTIAL_BYTES \
            or not q_pe.dtype == w_kv.dtype == cache.dtype == q_nope.dtype or not cache.is_contiguous():
        return attend(q_nope, q_pe, w_kv, pool.index_select(0, rows), positions, scale).contiguous()
    kernels, w_kv, positions = fused_moe.KERNELS, w_kv.contiguous(), positions.contiguous()
    q_nope, q_pe = last_dim_contiguous(q_nope.reshape(N, heads, dn)), last_dim_contiguous(q_pe.reshape(N, heads, dr))
    block_r = max(16, kernels.next_power_of_2(r))  # a dot's sizes are 16 or more
    q_latent = q_nope.new_empty(B, T, heads, r)  # [B, T, h, r]
    kernels.absorb_query[(heads, (r + BLOCK_R_ABSORB - 1) // BLOCK_R_ABSORB)](
        q_nope, w_kv, q_latent, N, heads, dn, dv, r, *q_nope.stride()[:2], BLOCK_DN=kernels.next_power_of_2(dn),
        BLOCK_R=BLOCK_R_ABSORB)
    m = torch.empty(N, heads, chunks, dtype=torch.float32, device=cache.device)  # [N, h, chunks]
    l = torch.empty_like(m)  # [N, h, chunks]
    acc = torch.empty(N, heads, chunks, r, dtype=torch.float32, device=cache.device)  # [N, h, chunks, r]
    kernels.latent_attention_chunk[(N, chunks, (heads + BLOCK_H - 1) // BLOCK_H)](
        q_latent, q_pe, pool, rows.contiguous(), positions, m, l, acc, T, heads, seq, chunks, scale,
        *q_pe.stride()[:2], R=r, DR=dr, CHUNK=CHUNK, BLOCK_H=BLOCK_H, BLOCK_S=BLOCK_S, BLOCK_R=block_r,
        BLOCK_DR=max(16, kernels.next_power_of_2(dr)), num_warps=NUM_WARPS)
    out = q_latent.new_empty(B, T, heads, dv)  # [B, T, h, dv]
    kernels.latent_attention_out[(N * heads, (dv + BLOCK_V - 1) // BLOCK_V)](
        m, l, acc, positions, w_kv, out, heads, chunks, dn, dv, R=r, CHUNK=CHUNK, STEP_C=STEP_C, BLOCK_R=block_r,
        BLOCK_V=BLOCK_V)
    return out


@latent_attention.register_fake
def _(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
      positions: torch.Tensor, scale: float) -> torch.Tensor:
    return q_nope.new_empty(*q_nope.shape[:-1], w_kv.shape[1] - q_nope.shape[-1])  # [B, T, h, dv], contiguous
