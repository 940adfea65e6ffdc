"""The two Triton kernels of export/fused_moe.py, a module of their own: imported only where Triton is.

One program computes BLOCK_N outputs of one (token, pick) pair: w[expert, rows, :] @ v over K in
BLOCK_K columns at a time, accumulated in float32. The grid is (pairs, ceil(N / BLOCK_N)).
"""

import triton
import triton.language as tl


@triton.jit
def _pick(pair, picks_ptr, routed, picks, first_shared):
    """The (token, expert) of a pair: a token's first `routed` picks come from picks[T, routed], the
    rest are the shared experts first_shared, first_shared + 1, ..."""
    token, pick = pair // picks, pair % picks
    is_routed = pick < routed
    expert = tl.load(picks_ptr + token * routed + pick, mask=is_routed, other=0)
    return token, tl.where(is_routed, expert, first_shared + pick - routed).to(tl.int64)


@triton.jit
def gate_up(x_ptr, w_ptr, picks_ptr, out_ptr, routed, picks, first_shared, N, K,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, :N] = w[expert(pair)] @ x[token(pair)]: x[T, K], w[E + S, N, K], out[P, N]."""
    pair, block = tl.program_id(0), tl.program_id(1)
    token, expert = _pick(pair, picks_ptr, routed, picks, first_shared)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        x = tl.load(x_ptr + token * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + expert * N * K + rows[:, None] * K + cols[None, :],
                    mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + pair * N + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def down(h_ptr, w_ptr, picks_ptr, weight_ptr, out_ptr, routed, picks, first_shared, N, K,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, :N] = weight(pair) * (w[expert(pair)] @ (silu(gate) * up)) in float32, where
    h[pair] = gate ‖ up: h[P, 2K] (the activation dtype), w[E + S, N, K], weight[T, routed] f32 (1 for the
    shared experts), out[P, N] f32."""
    pair, block = tl.program_id(0), tl.program_id(1)
    token, expert = _pick(pair, picks_ptr, routed, picks, first_shared)
    pick = pair % picks
    weight = tl.load(weight_ptr + token * routed + pick, mask=pick < routed, other=1.0)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        gate = tl.load(h_ptr + pair * 2 * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + pair * 2 * K + K + cols, mask=cols < K, other=0.0).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(h_ptr.dtype.element_ty).to(tl.float32)  # silu, rounded as F.silu
        a = (act * up).to(h_ptr.dtype.element_ty).to(tl.float32)  # rounded as the product is
        w = tl.load(w_ptr + expert * N * K + rows[:, None] * K + cols[None, :],
                    mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], axis=1)
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out_ptr + pair * N + rows, y, mask=rows < N)
