"""Routed experts of a few tokens as two Triton kernels over the picked experts (the decode path).

A decode step routes a handful of tokens: at batch 1 with top-6 of 64 experts, six (token, pick) pairs.
The grouped path (export/moe.py) sorts the pairs by expert, gathers them, counts and offsets the groups,
runs two grouped GEMMs and puts the outputs back in token order: about a dozen kernels per MoE layer
where the two GEMMs read 6 of 64 experts. Here each pair is one row of a matrix-vector product against
its own expert's weights, read in place, so the routed part is two kernels (as vLLM's fused_moe does for
small batches, without its sort):

- `gate_up`: h13[p] = w13[e(p)] @ x[token(p)] for every pair p, [P, 2I];
- `down`: y[p] = weight(p) * (w2[e(p)] @ (silu(gate[p]) * up[p])), [P, H] float32, summed over
  the picks outside.

The shared experts folded into the stack (`MoE.fold_shared_experts`) are pairs too: each token's last S
picks, their experts and weight 1 set in the kernels, so the shared MLP costs no launches of its own.

Each pair reads its expert's weights, so the pairs cost more bytes than a grouped call where experts
repeat: `moe.MoE` takes this path only while the pairs are no more than the experts it holds, or their
reads fit in REREAD_BYTES (small experts, as the bundled model's: a repeated expert comes from the L2
cache, and the grouped path's dozen launches cost more than the bytes). The kernels round where the
grouped path's bf16 ops round (h13, the activation, the product, y), so the two paths differ only in
summation order. On CUDA they run where Triton does, captured in CUDA graphs; a compiled step calls the expert
kernels through `moe.routed_experts` (an opaque op) and traces `route` (a user-defined Triton kernel); on CPU they
run only under Triton's interpreter
(`TRITON_INTERPRET=1` when the kernels' module is imported: the tests).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from triton_mtp.export.moe import Gate

# Rows of the weight matrix and columns of the reduction one program handles (bench/fused_moe.py).
BLOCK_N = 16
BLOCK_K = 128


# Pairs beyond the experts held still take the kernels while their weight reads fit in this (about two thirds
# of an H100's 50 MB L2 cache). 32 MiB admits 455 pairs of the bundled model's experts and one of DeepSeek-V2-Lite's.
REREAD_BYTES = 32 * 2**20

# export/fused_moe_kernels.py once `load_kernels` ran where Triton is installed, else None.
KERNELS: ModuleType | None = None


def load_kernels() -> None:
    """Import the kernels where Triton is installed (`MoE.group_experts` does, outside any traced code)."""
    global KERNELS
    if KERNELS is None and importlib.util.find_spec("triton") is not None:
        from triton_mtp.export import fused_moe_kernels

        KERNELS = fused_moe_kernels


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on `device`: CUDA, with the kernels loaded."""
    return device.type == "cuda" and KERNELS is not None


def max_tokens(picks: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
    """The most tokens of `picks` (token, pick) pairs each over experts w13[E, 2I, H], w2[E, H, I] that go
    through the kernels: their pairs no more than the experts, or their weight reads within REREAD_BYTES.
    One bound from the weights' static shapes, compared inside `moe.routed_experts`."""
    expert_bytes = (w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2]) * w13.element_size()
    return max(w13.shape[0] // picks, REREAD_BYTES // (picks * expert_bytes))


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_w: torch.Tensor, top_idx: torch.Tensor, shared: int
) -> torch.Tensor:
    """x[N, H], w13[E + S, 2I, H], w2[E + S, H, I], top_w[N, K] f32, top_idx[N, K] (local expert ids), with the
    last `shared` (S) experts picked by every token at weight 1 -> each pick's weighted output [N, K + S, H] f32."""
    (N, K), (held, two_i, H) = top_idx.shape, w13.shape
    picks = K + shared
    pairs = N * picks
    h13 = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)  # [P, 2I]
    top_idx, top_w = top_idx.contiguous(), top_w.contiguous()
    KERNELS.gate_up[(pairs, (two_i + BLOCK_N - 1) // BLOCK_N)](
        x.contiguous(), w13.contiguous(), top_idx, h13, K, picks, held - shared, two_i, H,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    y = torch.empty(pairs, H, dtype=torch.float32, device=x.device)  # [P, H]
    KERNELS.down[(pairs, (H + BLOCK_N - 1) // BLOCK_N)](
        h13, w2.contiguous(), top_idx, top_w, y, K, picks, held - shared, H, two_i // 2,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y.view(N, picks, H)  # [N, K+S, H]


def route(gate: Gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gate.route(x)` with everything after the gate's linear in one kernel: x[N, H] -> (routing weights
    [N, K] float32, expert ids [N, K])."""
    logits = gate.logits(x)  # [N, E]
    N, K, G = x.shape[0], gate.top_k, gate.n_group
    top_w = torch.empty(N, K, dtype=torch.float32, device=x.device)  # [N, K]
    top_idx = torch.empty(N, K, dtype=torch.int64, device=x.device)  # [N, K]
    size = gate.num_experts // G
    KERNELS.route[(N,)](
        logits, gate.e_score_correction_bias, top_w, top_idx, gate.scaling, GROUP_SIZE=size, N_GROUP=G,
        TOPK_GROUP=gate.topk_group, TOP_K=K, NORM=gate.norm_topk_prob, BLOCK_G=KERNELS.next_power_of_2(G),
        BLOCK_S=KERNELS.next_power_of_2(size), BLOCK_TOPK=KERNELS.next_power_of_2(K))
    return top_w, top_idx
