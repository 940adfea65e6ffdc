"""Linear layers whose one-token calls of small weights run as one Triton kernel where it runs (CUDA).

A decode step at batch 1 multiplies one token by each weight: matrix-vector products bound by reading the
weight. For the projections of an attention layer (a few MB each) cuBLAS takes 5 to 6 µs a call on an H100, or
a split-K kernel and its reduction, where the bytes take 1 to 4. `linear` (export/fused_moe_kernels.py) is one
launch that reads each row block of the weight once, accumulating in float32 as cuBLAS does: 4.6 against 5.3 µs
for DeepSeek-V2-Lite's q_proj, 3.8 against 5.7 for kv_a_proj_with_mqa, 1.5 against 2.4-2.5 for the bundled
model's projections (bench/decode_kernels.py, docs/benchmarks.md run 38). Calls of several tokens (it would
read the weight once per token) and large weights stay with cuBLAS: the kernel only matched it on V2-Lite's
420 MB head and lost on a dense MLP's 45 MB weights, too few programs to keep the reads in flight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triton_mtp.export import fused_moe

# The largest weight whose one-token calls take the kernel; outputs and reduced columns a program handles, and its
# warps (the fastest configuration over the measured shapes, bench/decode_kernels.py).
MAX_WEIGHT_BYTES = 16 * 2**20
BLOCK_N = 8
BLOCK_K = 128
NUM_WARPS = 8

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """nn.Linear (the checkpoint's names and layout) whose bias-free half-precision weights of at most
    MAX_WEIGHT_BYTES go through `decode_linear` on CUDA. `decode_kernel` False keeps every call on F.linear
    (bench/realistic.py compares them)."""

    decode_kernel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Where the kernels do not run (the CPU's eager steps, every call) the first test decides.
        if fused_moe.runs_on(x.device) and self.decode_kernel and self.bias is None and x.dtype in KERNEL_DTYPES \
                and self.weight.numel() * self.weight.element_size() <= MAX_WEIGHT_BYTES:
            return decode_linear(x, self.weight)
        return F.linear(x, self.weight, self.bias)


# One opaque op for the dispatch, as `moe.routed_experts`: the compiled steps (dynamic shapes) see one call whatever
# the tokens, and cuBLAS is outside inductor's fusions either way.
@torch.library.custom_op("triton_mtp::decode_linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x [..., K], weight [N, K]) -> [..., N], through the kernel for a call of one token."""
    K, N = x.shape[-1], weight.shape[0]
    if x.numel() != K:
        return F.linear(x, weight)
    out = x.new_empty(*x.shape[:-1], N)  # [..., N]
    fused_moe.KERNELS.linear[((N + BLOCK_N - 1) // BLOCK_N,)](
        x.contiguous(), weight.contiguous(), out, N, K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out


@decode_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])  # [..., N]
