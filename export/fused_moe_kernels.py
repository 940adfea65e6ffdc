"""The decode path's Triton kernels (export/fused_moe.py's, export/linear.py's and export/latent_attention.py's), a
module of their own: imported only where Triton is.

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


@triton.jit
def absorb_query(q_ptr, w_ptr, out_ptr, N, heads, DN, DV, R, stride_qn, stride_qh, BLOCK_DN: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """out[N, h, R] = q[N, h, DN] @ w_uk[h]: the nope query (strides stride_qn, stride_qh, 1) into the latent,
    w_uk[h] = w[h, :DN, :] of w[h, DN + DV, R] (kv_b_proj's weight), accumulated in float32. The grid is
    (h, ceil(R / BLOCK_R)); a program reads its weight tile once for all N tokens."""
    head, block = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_DN)  # [BLOCK_DN]
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    w = tl.load(w_ptr + (head * (DN + DV) + d[:, None]) * R + r[None, :],
                mask=(d[:, None] < DN) & (r[None, :] < R), other=0.0).to(tl.float32)  # [BLOCK_DN, BLOCK_R]
    for n in range(N):
        q = tl.load(q_ptr + n * stride_qn + head * stride_qh + d, mask=d < DN, other=0.0).to(tl.float32)
        out = tl.sum(w * q[:, None], axis=0)  # [BLOCK_R]
        tl.store(out_ptr + (n * heads + head) * R + r, out.to(out_ptr.dtype.element_ty), mask=r < R)


@triton.jit
def latent_attention_chunk(q_ptr, qpe_ptr, cache_ptr, rows_ptr, positions_ptr, m_ptr, l_ptr, acc_ptr, T, heads,
                           seq, chunks, scale, stride_pn, stride_ph, R: tl.constexpr, DR: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_DR: tl.constexpr):
    """Absorbed MLA of BLOCK_H heads of one token over the CHUNK cache positions of one chunk, with an online
    softmax, the heads' scores and weighted latents as tensor-core dots (each position read once for all of them;
    chunks past the token's position are left unwritten): q[N, h, R] (latent queries), qpe[N, h, DR] (roped
    queries, strides stride_pn, stride_ph, 1), cache[rows, seq, R + DR], rows[B] (each row's pool row),
    positions[N] (N = B·T tokens; a token sees the positions up to its own, at least 0) -> m[N, h, chunks]
    (largest score), l[N, h, chunks] (sum of exp(score - m)), acc[N, h, chunks, R] (latents weighted by
    exp(score - m)), float32. The grid is (N, chunks, ceil(h / BLOCK_H)). Scores round where the eager step's
    ops do (each dot, their sum, the scaled sum)."""
    token, chunk, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    position = tl.maximum(tl.load(positions_ptr + token), 0)
    row = tl.load(rows_ptr + token // T).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    h = block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    d = tl.arange(0, BLOCK_DR)  # [BLOCK_DR]
    query = token * heads + h  # [BLOCK_H]
    # A chunk past the token's position (the pool's length sets the grid) reads and writes nothing.
    held = h < tl.where(chunk * CHUNK <= position, heads, 0)  # [BLOCK_H]
    q = tl.load(q_ptr + query[:, None] * R + r[None, :], mask=held[:, None] & (r[None, :] < R),
                other=0.0)  # [BLOCK_H, BLOCK_R]
    qpe = tl.load(qpe_ptr + token * stride_pn + h[:, None] * stride_ph + d[None, :],
                  mask=held[:, None] & (d[None, :] < DR), other=0.0)  # [BLOCK_H, BLOCK_DR]
    m = tl.zeros([BLOCK_H], dtype=tl.float32) - 1e30  # below any score, finite: exp(m - m_next) needs no guard
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    end = tl.minimum(chunk * CHUNK + CHUNK, position + 1)  # nothing past the token's position is read
    for s0 in range(chunk * CHUNK, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        visible = s < end
        at = cache_ptr + (row * seq + s[:, None]) * (R + DR)  # [BLOCK_S, 1]
        c = tl.load(at + r[None, :], mask=visible[:, None] & (r[None, :] < R), other=0.0)  # [BLOCK_S, BLOCK_R]
        pe = tl.load(at + R + d[None, :], mask=visible[:, None] & (d[None, :] < DR), other=0.0)  # [BLOCK_S, BLOCK_DR]
        score = tl.dot(q, tl.trans(c)).to(dtype).to(tl.float32) \
            + tl.dot(qpe, tl.trans(pe)).to(dtype).to(tl.float32)  # [BLOCK_H, BLOCK_S]
        score = (score.to(dtype).to(tl.float32) * scale).to(dtype).to(tl.float32)
        score = tl.where(visible[None, :], score, float("-inf"))
        m_next = tl.maximum(m, tl.max(score, axis=1))  # [BLOCK_H]
        keep = tl.exp(m - m_next)  # [BLOCK_H]
        p = tl.exp(score - m_next[:, None])  # [BLOCK_H, BLOCK_S], 0 where not visible
        l = l * keep + tl.sum(p, axis=1)
        acc = acc * keep[:, None] + tl.dot(p.to(dtype), c)  # [BLOCK_H, BLOCK_R]
        m = m_next
    part = query * chunks + chunk  # [BLOCK_H]
    tl.store(m_ptr + part, m, mask=held)
    tl.store(l_ptr + part, l, mask=held)
    tl.store(acc_ptr + part[:, None] * R + r[None, :], acc, mask=held[:, None] & (r[None, :] < R))


@triton.jit
def latent_attention_out(m_ptr, l_ptr, acc_ptr, positions_ptr, w_ptr, out_ptr, heads, chunks, DN, DV,
                         R: tl.constexpr, CHUNK: tl.constexpr, STEP_C: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    """A query's (token, head) softmax-weighted latent from its chunks' (m, l, acc) of `latent_attention_chunk`
    (only the chunks its position reaches, STEP_C at a time), rounded to out's dtype as the eager step's, then
    out[N, h, DV] = latent @ w_uv[h]^T for BLOCK_V values, w_uv[h] = w[h, DN:, :] of w[h, DN + DV, R]. The grid
    is (N·h, ceil(DV / BLOCK_V))."""
    query, block = tl.program_id(0), tl.program_id(1)
    head = query % heads
    used = tl.maximum(tl.load(positions_ptr + query // heads), 0) // CHUNK + 1  # chunks that saw a position
    top = tl.zeros([STEP_C], dtype=tl.float32) - 1e30
    for c0 in range(0, used, STEP_C):
        i = c0 + tl.arange(0, STEP_C)  # [STEP_C]
        top = tl.maximum(top, tl.load(m_ptr + query * chunks + i, mask=i < used, other=-1e30))
    top_m = tl.max(top, axis=0)
    r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    total = tl.zeros([], dtype=tl.float32)
    latent = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, used, STEP_C):
        i = c0 + tl.arange(0, STEP_C)  # [STEP_C]
        w = tl.exp(tl.load(m_ptr + query * chunks + i, mask=i < used, other=-1e30) - top_m)  # [STEP_C]
        w = tl.where(i < used, w, 0.0)
        total += tl.sum(w * tl.load(l_ptr + query * chunks + i, mask=i < used, other=0.0), axis=0)
        acc = tl.load(acc_ptr + (query * chunks + i[:, None]) * R + r[None, :],
                      mask=(i[:, None] < used) & (r[None, :] < R), other=0.0)  # [STEP_C, BLOCK_R]
        latent += tl.sum(acc * w[:, None], axis=0)
    latent = (latent / total).to(out_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_R]
    v = block * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    w_uv = tl.load(w_ptr + (head * (DN + DV) + DN + v[:, None]) * R + r[None, :],
                   mask=(v[:, None] < DV) & (r[None, :] < R), other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_R]
    out = tl.sum(w_uv * latent[None, :], axis=1)  # [BLOCK_V]
    tl.store(out_ptr + query * DV + v, out.to(out_ptr.dtype.element_ty), mask=v < DV)
