"""Linear layers whose decode calls run as one Triton kernel where it runs (CUDA).

A decode step multiplies a handful of tokens by each weight: matrix-vector products bound by reading the
weight. cuBLAS runs them as GEMV or split-K kernels, the latter with a reduction kernel after: on the
DeepSeek-V2-Lite-shaped step 139 GEMVs and 82 reductions took 1.03 ms for weights whose bytes take about
0.4 ms (docs/benchmarks.md, run 37). `linear` (export/fused_moe_kernels.py) is one launch a call of up to MAX_TOKENS
tokens: a program reads its rows of the weight for the first token, from the L2 cache for the others, and
accumulates in float32 as cuBLAS does. Calls of more tokens (prompts, wide batches) stay with cuBLAS. A token's output does not depend on the other tokens of its call,
so a verify window's rows equal one-token calls' rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triton_mtp.export import fused_moe

# Tokens of one call through the kernel; outputs and reduced columns one program handles.
MAX_TOKENS = 8
BLOCK_N = 16
BLOCK_K = 128
NUM_WARPS = 4

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """nn.Linear (the checkpoint's names and layout) whose bias-free half-precision calls on CUDA go through
    `decode_linear`. `decode_kernel` False keeps every call on F.linear (bench/realistic.py compares them)."""

    decode_kernel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode_kernel and self.bias is None and x.dtype in KERNEL_DTYPES and fused_moe.runs_on(x.device):
            return decode_linear(x, self.weight)
        return F.linear(x, self.weight, self.bias)


# One opaque op for the dispatch, as `moe.routed_experts`: a compiled step (dynamic shapes) would otherwise guard
# on `tokens <= MAX_TOKENS` and compile each size class on both sides of it. cuBLAS is outside inductor's
# fusions either way.
@torch.library.custom_op("triton_mtp::decode_linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x [..., K], weight [N, K]) -> [..., N], through the kernel for calls of at most MAX_TOKENS tokens."""
    flat = x.reshape(-1, x.shape[-1])  # [T, K]
    (T, K), N = flat.shape, weight.shape[0]
    if T > MAX_TOKENS or T == 0:
        return F.linear(x, weight)
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)  # [T, N]
    fused_moe.KERNELS.linear[((N + BLOCK_N - 1) // BLOCK_N,)](
        flat.contiguous(), weight.contiguous(), out, T, N, K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out.view(*x.shape[:-1], N)


@decode_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])  # [..., N]
