"""The two Triton kernels of export/fused_moe.py, a module of their own: imported only where Triton is.

One program computes BLOCK_N outputs of one (token, pick) pair: w[expert, rows, :] @ v over K in
BLOCK_K columns at a time, accumulated in float32. The grid is (pairs, ceil(N / BLOCK_N)).
"""

import triton
import triton.language as tl


@triton.jit
def gate_up(x_ptr, w_ptr, expert_ptr, out_ptr, picks_per_token, N, K,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, :N] = w[expert(pair)] @ x[pair // picks_per_token]: x[T, K], w[E, N, K], out[P, N]."""
    pair, block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pair).to(tl.int64)
    token = pair // picks_per_token
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
def down(h_ptr, w_ptr, expert_ptr, weight_ptr, out_ptr, N, K,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, :N] = weight[pair] * (w[expert(pair)] @ (silu(gate) * up)) in float32, where
    h[pair] = gate ‖ up: h[P, 2K] (the activation dtype), w[E, N, K], weight[P] f32, out[P, N] f32."""
    pair, block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pair).to(tl.int64)
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
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * tl.load(weight_ptr + pair)
    tl.store(out_ptr + pair * N + rows, y, mask=rows < N)
