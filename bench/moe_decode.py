"""A decode-path MoE that touches only the selected experts' weights (proposed as an option for export/moe.py).

`export.moe.MoE` runs every routed expert on every token: exact and export friendly, but a decode
step then reads all E experts' weights although each token uses top-k of them. `SelectedExpertsMoE`
keeps the same gate and shared experts and runs the routed part as two grouped GEMMs over the
experts' stacked weights (`torch.nn.functional.grouped_mm`, jagged by expert): an expert no token
chose is a group of zero rows and its weights are never read. No host sync, so it captures in a
CUDA graph. Where grouped_mm is unavailable it gathers the chosen experts' weights and uses bmm
(exact too, but the gather copies what it reads).

`stack_experts` allocates the stacked weights and re-points every expert's parameters at views of
them, so both MoE variants share one copy of the weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triton_mtp.export.moe import MoE


def stack_experts(moe: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    """w13[E, 2I, H] (gate ‖ up) and w2[E, H, I] holding the experts' weights; the experts then view them."""
    first = moe.experts[0]
    E, I, H = len(moe.experts), first.gate_proj.out_features, first.gate_proj.in_features
    weight = first.gate_proj.weight
    w13 = torch.empty(E, 2 * I, H, dtype=weight.dtype, device=weight.device)  # [E, 2I, H]
    w2 = torch.empty(E, H, I, dtype=weight.dtype, device=weight.device)  # [E, H, I]
    with torch.no_grad():
        for e, expert in enumerate(moe.experts):
            if not expert.gate_proj.weight.is_meta:
                w13[e, :I].copy_(expert.gate_proj.weight)
                w13[e, I:].copy_(expert.up_proj.weight)
                w2[e].copy_(expert.down_proj.weight)
            expert.gate_proj.weight = nn.Parameter(w13[e, :I], requires_grad=False)
            expert.up_proj.weight = nn.Parameter(w13[e, I:], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
    return w13, w2


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.grouped_mm runs for this device and dtype (bf16 on CUDA sm80+, and on recent CPU builds)."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        a = torch.ones(2, 16, dtype=dtype, device=device)  # [2, 16]
        b = torch.ones(2, 16, 16, dtype=dtype, device=device).transpose(-2, -1)  # [2, 16, 16]
        F.grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


class SelectedExpertsMoE(nn.Module):
    """Same outputs as `moe` (up to rounding), reading only the routed experts the tokens selected."""

    def __init__(self, moe: MoE, use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.top_k, self.num_experts = moe.gate.top_k, moe.gate.num_experts
        self.w13, self.w2 = stack_experts(moe)
        if use_grouped_mm is None:
            use_grouped_mm = grouped_mm_works(self.w13.device, self.w13.dtype)
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        N, K = flat.shape[0], self.top_k
        top_w, top_idx = self.gate(flat).topk(K, dim=-1)  # [N, K] each: the gate's selected experts
        experts = top_idx.reshape(-1)  # [N*K]
        order = experts.argsort(stable=True)  # [N*K] (token, choice) pairs grouped by expert
        rows = order // K  # [N*K] token of each pair
        xs = flat.index_select(0, rows)  # [N*K, H]
        if self.use_grouped_mm:
            counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).scatter_add_(
                0, experts, torch.ones_like(experts, dtype=torch.int32))  # [E] pairs per expert
            offs = counts.cumsum(0).to(torch.int32)  # [E] end of each expert's group
            h = F.grouped_mm(xs, self.w13.transpose(-2, -1), offs=offs)  # [N*K, 2I]
            gate, up = h.chunk(2, dim=-1)  # [N*K, I] each
            y = F.grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs)  # [N*K, H]
        else:
            chosen = experts.index_select(0, order)  # [N*K]
            h = torch.bmm(self.w13.index_select(0, chosen), xs.unsqueeze(-1)).squeeze(-1)  # [N*K, 2I]
            gate, up = h.chunk(2, dim=-1)  # [N*K, I] each
            y = torch.bmm(self.w2.index_select(0, chosen), (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [N*K, H]
        weighted = y.float() * top_w.reshape(-1).index_select(0, order).unsqueeze(-1)  # [N*K, H]
        routed = torch.zeros(N, shape[-1], dtype=torch.float32, device=x.device).index_add_(0, rows, weighted)  # [N, H]
        out = routed.to(x.dtype).view(shape)  # [..., H]
        return out if self.shared_experts is None else out + self.shared_experts(x)


def use_selected_experts(model: nn.Module, use_grouped_mm: bool | None = None) -> list[tuple[nn.Module, MoE]]:
    """Swap every decoder layer's MoE for a SelectedExpertsMoE in place; returns (layer, replaced MoE) pairs.

    The replaced MoE modules still work (their experts view the stacked weights): assigning them back
    to `layer.mlp` restores the dense MoE.
    """
    swapped = []
    for layer in list(model.modules()):
        moe = getattr(layer, "mlp", None)
        if isinstance(moe, MoE):
            layer.mlp = SelectedExpertsMoE(moe, use_grouped_mm)
            swapped.append((layer, moe))
    return swapped
