"""The decode path's Triton kernels (export/fused_moe.py's and export/linear.py's), a module of their own:
imported only where Triton is.

In the expert kernels one program computes BLOCK_N outputs of one (token, pick) pair: w[expert, rows, :] @ v
over K in BLOCK_K columns at a time, accumulated in float32. The grid is (pairs, ceil(N / BLOCK_N)). In
`linear` one program computes BLOCK_N outputs of one token.
"""

import triton
import triton.language as tl

next_power_of_2 = triton.next_power_of_2  # the blocks of `route`


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


@triton.jit
def route(logits_ptr, bias_ptr, weight_ptr, expert_ptr, scaling,
          GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
          NORM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """`Gate.route` after the gate's linear, one token a program: logits[T, E] f32, bias[E] ->
    weight[T, TOP_K] f32, expert[T, TOP_K] int64, largest first as torch.topk returns them (equal choices go
    to the lower expert, where torch.topk leaves their order open; a NaN row picks in-range experts). The
    experts lie as [N_GROUP, GROUP_SIZE]; only the TOPK_GROUP groups of the largest top-2 sums take part
    (noaux_tc)."""
    token = tl.program_id(0)
    group = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    col = tl.arange(0, BLOCK_S)[None, :]  # [1, BLOCK_S]
    valid = (group[:, None] < N_GROUP) & (col < GROUP_SIZE)  # [BLOCK_G, BLOCK_S]
    expert = group[:, None] * GROUP_SIZE + col  # [BLOCK_G, BLOCK_S] (padding aliases the next group's)
    logits = tl.load(logits_ptr + token * N_GROUP * GROUP_SIZE + expert, mask=valid, other=0.0)
    scores = tl.where(valid, tl.sigmoid(logits), 0.0)  # [BLOCK_G, BLOCK_S]
    bias = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, scores + bias, float("-inf"))  # [BLOCK_G, BLOCK_S]
    if TOPK_GROUP < N_GROUP:
        first = tl.max(choice, axis=1)  # [BLOCK_G]
        first_at = tl.min(tl.where(choice == first[:, None], col, BLOCK_S), axis=1)  # [BLOCK_G]
        second = tl.max(tl.where(col == first_at[:, None], float("-inf"), choice), axis=1)  # [BLOCK_G]
        group_score = tl.where(group < N_GROUP, first + second, float("-inf"))  # [BLOCK_G]
        keep = group < 0  # [BLOCK_G] all False
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.min(tl.where(group_score == tl.max(group_score, axis=0), group, BLOCK_G), axis=0)
            keep = keep | (group == best)
            group_score = tl.where(group == best, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    k = tl.arange(0, BLOCK_TOPK)  # [BLOCK_TOPK]
    top_w = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    top_idx = tl.zeros([BLOCK_TOPK], dtype=tl.int64)
    for pick in tl.static_range(TOP_K):
        largest = tl.max(tl.max(choice, axis=1), axis=0)
        at = tl.min(tl.min(tl.where(choice == largest, expert, N_GROUP * GROUP_SIZE - 1), axis=1), axis=0)
        w = tl.sum(tl.sum(tl.where(expert == at, scores, 0.0), axis=1), axis=0)
        top_w = tl.where(k == pick, w, top_w)
        top_idx = tl.where(k == pick, at, top_idx)
        choice = tl.where(expert == at, float("-inf"), choice)
    if NORM:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    tl.store(weight_ptr + token * TOP_K + k, top_w * scaling, mask=k < TOP_K)
    tl.store(expert_ptr + token * TOP_K + k, top_idx, mask=k < TOP_K)


@triton.jit
def linear(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N] = w[N, K] @ x[K] for one token, accumulated in float32. The grid is ceil(N / BLOCK_N)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :],
                    mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < N)
